"""Two JAX processes run the teacher stage together for real: `jax.distributed.initialize`
with a loopback coordinator, one CPU device each, gloo collectives, data parallel over both,
orbax checkpoints written by both, the lease, manifest and publication by process 0 only.

Each process runs docs/running.md's command for hosts that JAX cannot detect itself:
    padir stage teacher tiny.yaml --set mesh.distributed=true \\
        --set mesh.coordinator_address=127.0.0.1:PORT --set mesh.num_processes=2 \\
        --set mesh.process_id=I
on the tiny Multi30k experiment (tests/tiny_experiment.py), against one process with two
devices on the same global batches. Each run gets its own workdir whose input stages are
the session's (symlinked), so that every run publishes its own teacher.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import toy_training as toy
from components import artifacts, dag
from components import config as config_lib
from model import sharding
from tiny_experiment import ensure, tiny_config

pytestmark = pytest.mark.slow  # 2 to 5 minutes on 2 cores: five launches of the teacher stage

PADIR = os.path.join(os.path.dirname(sys.executable), "padir")
STEPS = 12
# One length bucket: every program compiles once, not once per bucket.
TEACHER = ("encode.bucket_boundaries=[64]", f"teacher.steps={STEPS}",
           "teacher.loop={tokens_per_batch: 512, log_every: 4, eval_every: 12, "
           "checkpoint_every: 3}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def config(tiny_workdir):
    config = tiny_config(tiny_workdir, "distill.enabled=false", *TEACHER)
    ensure(config, "prepare", "vocab", "encode")
    return config


def _workdir(config, path) -> tuple[config_lib.Config, str]:
    """`config` in a fresh workdir holding the session's input stages; and its YAML."""
    for stage in ("prepare", "vocab", "encode"):
        os.symlink(os.path.join(config.workdir, stage), path / stage)
    own = config.replace(workdir=str(path))
    (path / "tiny.yaml").write_text(config_lib.dump(own))
    return own, str(path / "tiny.yaml")


def _launch(config_path, cache_dir, processes=2):
    """The processes of one run (or one process with two devices when processes=1)."""
    cmd = [PADIR, "stage", "teacher", config_path]
    options = dict(cwd=toy.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if processes == 1:
        return [subprocess.Popen(cmd, env=toy.subprocess_env(cache_dir, devices=2), **options)]
    port = _free_port()
    return [subprocess.Popen(
        cmd + ["--set", "mesh.distributed=true",
               "--set", f"mesh.coordinator_address=127.0.0.1:{port}",
               "--set", f"mesh.num_processes={processes}", "--set", f"mesh.process_id={i}"],
        env=toy.subprocess_env(cache_dir, devices=1), **options) for i in range(processes)]


def _finish(procs, timeout=600) -> list[str]:
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out[-4000:]
        outputs.append(out)
    return outputs


def _final_params(config) -> dict[str, np.ndarray]:
    """The published teacher's parameters at its last step, as numpy arrays."""
    import jax
    import orbax.checkpoint as ocp

    path = artifacts.join(dag.output_uri(config, "teacher"), "checkpoints", str(STEPS), "params")
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return toy.flat_params(checkpointer.restore(path, restore_args=as_numpy))


def _assert_bitwise_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.fixture(scope="module")
def one_process(config, tmp_path_factory, cache_dir):
    """The reference: one process with two devices, the same global batches."""
    own, path = _workdir(config, tmp_path_factory.mktemp("one"))
    started = time.monotonic()
    _finish(_launch(path, cache_dir, processes=1))
    print(f"teacher, 1 process x 2 devices, {STEPS} steps: {time.monotonic() - started:.1f} s")
    return _final_params(own), artifacts.read(dag.output_uri(own, "teacher")).manifest


def test_two_processes_train_the_teacher_as_one_process_does(config, tmp_path, cache_dir,
                                                            one_process):
    """Bitwise equal: each device computes on the same shard of the same global batch in
    both runs, and the gradient all-reduce adds two values, which is order-free."""
    want, reference = one_process
    own, path = _workdir(config, tmp_path)
    started = time.monotonic()
    outputs = _finish(_launch(path, cache_dir))
    print(f"teacher, 2 processes x 1 device, {STEPS} steps: {time.monotonic() - started:.1f} s")
    uri = dag.output_uri(own, "teacher")
    for out in outputs:
        assert f"teacher: {uri}" in out, out[-2000:]
    _assert_bitwise_equal(_final_params(own), want)
    manifest = artifacts.read(uri).manifest
    assert manifest["counts"] == reference["counts"]
    assert manifest["metrics"]["dev"] == reference["metrics"]["dev"]
    assert manifest["metrics"]["dev_final"] == reference["metrics"]["dev_final"]
    assert os.listdir(tmp_path / "teacher") == [os.path.basename(uri)]  # no partial, no lease


def test_sigkill_of_one_process_then_both_restart_and_resume_exactly(
        config, tmp_path, cache_dir, one_process):
    """Process 0 dies (the coordinator and lease holder): process 1 is not left waiting, and
    a restart of both takes the dead holder's lease over and resumes bit for bit."""
    own, path = _workdir(config, tmp_path)
    key = dag.stage_key(own, "teacher")
    first = tmp_path / "teacher" / f".partial-{key}" / "checkpoints" / "3"
    procs = _launch(path, cache_dir)
    deadline = time.monotonic() + 300
    while not first.is_dir():
        assert all(p.poll() is None for p in procs), [p.communicate()[0][-2000:] for p in procs]
        assert time.monotonic() < deadline, "no checkpoint at step 3"
        time.sleep(0.05)
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    killed = time.monotonic()
    procs[1].communicate(timeout=sharding.HEARTBEAT_TIMEOUT_S + 60)
    print(f"survivor ended by itself after {time.monotonic() - killed:.1f} s "
          f"(rc {procs[1].returncode})")
    assert procs[1].returncode != 0
    assert not artifacts.is_complete(dag.output_uri(own, "teacher"))
    saved = sorted(int(p.name) for p in first.parent.iterdir() if p.name.isdigit())
    assert 3 in saved and max(saved) < STEPS

    outputs = _finish(_launch(path, cache_dir))
    assert "taking over the lease of a run that died" in outputs[0], outputs[0][-2000:]
    for out in outputs:
        assert f"resuming from step {max(saved)}" in out, out[-2000:]
    _assert_bitwise_equal(_final_params(own), one_process[0])


def test_a_held_lease_ends_both_processes_at_once(config, tmp_path, cache_dir):
    """Process 0 cannot take the lease: it tells process 1, and both exit with the holder
    named, instead of process 1 waiting for a partner in its first collective."""
    own, path = _workdir(config, tmp_path)
    with artifacts.lease(own.workdir, "teacher", dag.stage_key(own, "teacher")):
        procs = _launch(path, cache_dir)
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 2, out[-2000:]
        error = "padir: error: " + ("" if i == 0 else "process 0: ") + "teacher/"
        assert error in out and "is being written by another run" in out, out[-2000:]
    assert not (tmp_path / "teacher" / f".partial-{dag.stage_key(own, 'teacher')}").exists()


AGREE = """
import sys
import jax
from components.config import MeshConfig
from model import sharding

port, process, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sharding.initialize_distributed(MeshConfig(
    distributed=True, coordinator_address=f"127.0.0.1:{port}", num_processes=2,
    process_id=process))
with sharding.agreement("fine"):
    pass
try:
    with sharding.agreement("set up", timeout_s=timeout):
        if process == 1:
            raise ValueError("no data here")
except Exception as e:
    print(f"{type(e).__name__}: {e}", flush=True)
if process == 0:  # process 1 never comes to this one
    try:
        with sharding.agreement("lonely", timeout_s=2):
            pass
    except sharding.PeerFailedError as e:
        print(f"{type(e).__name__}: {e}", flush=True)
"""


def test_an_agreement_ends_every_process_when_one_fails_or_never_comes(cache_dir):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", AGREE, str(port), str(i), "60"],
                              cwd=toy.REPO, env=toy.subprocess_env(cache_dir),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    first, second = (proc.communicate(timeout=120)[0] for proc in procs)
    assert "PeerFailedError: set up: process 1 failed: ValueError: no data here" in first, first
    assert "ValueError: no data here" in second, second
    assert "PeerFailedError: lonely: process 1 did not get there within 2 s" in first, first
