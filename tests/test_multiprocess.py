"""Two JAX processes train together for real: `jax.distributed.initialize` with a loopback
coordinator, one CPU device each, gloo collectives, data parallel over both, checkpoints
written by both through orbax. The toy model of tests/toy_training.py stands in for the
teacher (a step takes milliseconds; the stage's Transformer would not fit a test's time).

Each process runs `tests/toy_training.py --coordinator 127.0.0.1:PORT --num-processes 2
--process-id I`, the command the README gives for hosts that JAX cannot detect itself.
"""

import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import toy_training as toy

STEPS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(workdir, cache_dir, *extra, processes=2):
    """Starts the processes of one run (or one process with two devices when processes=1)."""
    cmd = [sys.executable, toy.SCRIPT, "--workdir", str(workdir), "--steps", str(STEPS),
           *map(str, extra)]
    if processes == 1:
        return [subprocess.Popen(cmd, env=toy.subprocess_env(cache_dir, devices=2),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    port = _free_port()
    return [subprocess.Popen(cmd + ["--coordinator", f"127.0.0.1:{port}", "--num-processes",
                                    str(processes), "--process-id", str(i)],
                             env=toy.subprocess_env(cache_dir, devices=1),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(processes)]


def _finish(procs, timeout=240):
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out[-4000:]
        outputs.append(out)
    return outputs


def _params(path):
    return dict(np.load(path))


def _assert_bitwise_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache_dir):
    """The reference: one process, two devices, the same global batches."""
    workdir = tmp_path_factory.mktemp("one")
    started = time.monotonic()
    _finish(_launch(workdir, cache_dir, "--out", workdir / "params.npz", processes=1))
    print(f"1 process x 2 devices, {STEPS} steps: {time.monotonic() - started:.1f} s")
    return _params(workdir / "params.npz")


def test_two_processes_train_as_one_process_does(tmp_path, cache_dir, one_process):
    """Bitwise equal: the gradient all-reduce sums the same two per-device values (the same
    shards of the same global batch) in both runs, and a sum of two is order-free."""
    started = time.monotonic()
    outputs = _finish(_launch(tmp_path, cache_dir, "--out", tmp_path / "params.npz"))
    print(f"2 processes x 1 device, {STEPS} steps: {time.monotonic() - started:.1f} s")
    for out in outputs:
        assert f"RESULT step={STEPS} completed=True" in out, out[-2000:]
    _assert_bitwise_equal(_params(tmp_path / "params.npz"), one_process)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [10, 15, 20]  # one orbax checkpoint, written by both processes


def test_sigkill_of_one_process_then_both_restart_and_resume_exactly(
        tmp_path, cache_dir, one_process):
    ckpt_dir = tmp_path / "checkpoints"
    procs = _launch(tmp_path, cache_dir, "--sleep", 0.25)
    deadline = time.monotonic() + 240
    while not (ckpt_dir / "10").is_dir():
        assert all(p.poll() is None for p in procs), [p.communicate()[0][-2000:] for p in procs]
        assert time.monotonic() < deadline, "no checkpoint at step 10"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    killed = time.monotonic()
    try:  # the survivor fails at its next collective, or at the coordinator's heartbeat
        procs[0].wait(timeout=30)
        print(f"survivor exited by itself after {time.monotonic() - killed:.1f} s "
              f"(rc {procs[0].returncode})")
    except subprocess.TimeoutExpired:
        procs[0].kill()
        print("survivor still blocked after 30 s: killed")
    procs[0].communicate()
    saved = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
    assert 10 in saved and max(saved) < STEPS

    outputs = _finish(_launch(tmp_path, cache_dir, "--out", tmp_path / "params.npz"))
    for out in outputs:
        assert f"resuming from step {max(saved)}" in out, out[-2000:]
        assert f"RESULT step={STEPS} completed=True" in out
    _assert_bitwise_equal(_params(tmp_path / "params.npz"), one_process)
