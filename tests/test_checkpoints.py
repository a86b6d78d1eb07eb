"""Checkpoints: exact resume after SIGKILL, corruption fallback, SIGTERM, retention, re-meshing.

Training that is killed runs in fresh interpreters (tests/toy_training.py), never in a fork
of this process.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import toy_training as toy
from components.config import MeshConfig
from model import checkpoints, train

STEPS = 20


def _train_cmd(workdir, *extra):
    return [sys.executable, toy.SCRIPT, "--workdir", str(workdir), *map(str, extra)]


def _run(cmd, cache_dir, timeout=300):
    proc = subprocess.run(
        cmd, env=toy.subprocess_env(cache_dir), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir):
    """A 20-step run (checkpoints every 5 steps) and its final parameters."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    _run(_train_cmd(workdir, "--steps", STEPS, "--out", workdir / "params.npz"), cache_dir)
    return workdir, dict(np.load(workdir / "params.npz"))


def _wait_for(predicate, proc, timeout=180.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"training exited early ({proc.returncode}): {out[-2000:]}{err[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out waiting for the training subprocess")
        time.sleep(0.05)


def _assert_bitwise_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.slow  # two child interpreters: one SIGKILLed, one resuming
def test_resume_after_sigkill_is_bitwise_exact(tmp_path, cache_dir, uninterrupted):
    _, want = uninterrupted
    ckpt_dir = tmp_path / "checkpoints"
    # Slow batches, so that the kill lands mid-run (after step 10's checkpoint).
    proc = subprocess.Popen(
        _train_cmd(tmp_path, "--steps", STEPS, "--sleep", 0.25),
        env=toy.subprocess_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: (ckpt_dir / "10").is_dir(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    steps = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
    assert 10 in steps and max(steps) < STEPS

    resumed = _run(_train_cmd(tmp_path, "--steps", STEPS, "--out", tmp_path / "params.npz"),
                   cache_dir)
    assert f"resuming from step {max(steps)}" in resumed.stdout
    _assert_bitwise_equal(dict(np.load(tmp_path / "params.npz")), want)


@pytest.mark.slow  # a child interpreter
def test_sigterm_checkpoints_the_current_step(tmp_path, cache_dir):
    progress = tmp_path / "progress"
    proc = subprocess.Popen(
        _train_cmd(tmp_path, "--steps", 500, "--sleep", 0.1, "--checkpoint-every", 1000,
                   "--progress-file", progress),
        env=toy.subprocess_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: progress.exists() and progress.read_text() not in ("", "1", "2"), proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    result = [line for line in out.splitlines() if line.startswith("RESULT")][-1]
    assert "completed=False stop_reason=SIGTERM" in result
    step = int(result.split("step=")[1].split()[0])
    assert 3 <= step < 500
    saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert saved == [step]  # nothing else was due: the SIGTERM save is the current step
    data = json.loads((tmp_path / "checkpoints" / str(step) / "data" / "metadata").read_text())
    assert data["position"] == step  # the toy stream advances one position per step


def test_corrupted_latest_checkpoint_falls_back_to_previous(tmp_path, uninterrupted, caplog):
    source, want = uninterrupted
    workdir = tmp_path / "run"
    shutil.copytree(source / "checkpoints", workdir)
    for root, _, files in os.walk(workdir / str(STEPS)):  # truncate every file of the latest
        for name in files:
            path = os.path.join(root, name)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)

    with caplog.at_level(logging.INFO, logger="model"):
        result = train.train(
            toy.ToyModel(), toy.data(toy.make_batches(seed=0, batch_size=toy.BATCH_SIZE)),
            toy.run_spec(workdir, STEPS), MeshConfig(),
        )
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(f"checkpoint at step {STEPS}" in m and "corrupted" in m for m in errors), errors
    assert f"resuming from step {STEPS - 5}" in caplog.text
    assert any(p.name.startswith(f"corrupt-{STEPS}-") for p in workdir.iterdir())
    assert result.completed and int(result.state.step) == STEPS
    _assert_bitwise_equal(toy.flat_params(result.state.params), want)


def _placement():
    tx, _ = train.make_optimizer(toy.OPTIMIZER, 10)
    return train.place(toy.ToyModel(), tx, MeshConfig())


def test_fingerprint_mismatch_counts_as_corruption(tmp_path, uninterrupted):
    """Array files that decode but hold other bits are caught by the saved fingerprint."""
    source, _ = uninterrupted
    shutil.copytree(source / "checkpoints", tmp_path / "run")
    meta = tmp_path / "run" / str(STEPS) / "data" / "metadata"
    data = json.loads(meta.read_text())
    data["fingerprint"] = (data["fingerprint"] + 1) % 2**32
    meta.write_text(json.dumps(data))
    manager = checkpoints.open_manager(str(tmp_path / "run"), keep=3)
    try:
        restored = checkpoints.restore_latest(manager, _placement().abstract_state)
    finally:
        manager.close()
    assert restored.step == STEPS - 5 and restored.position.batches == STEPS - 5


def test_no_readable_checkpoint_is_an_error(tmp_path, uninterrupted):
    source, _ = uninterrupted
    shutil.copytree(source / "checkpoints", tmp_path / "run")
    for step_dir in (tmp_path / "run").iterdir():
        shutil.rmtree(step_dir / "train")
    manager = checkpoints.open_manager(str(tmp_path / "run"), keep=3)
    try:
        with pytest.raises(checkpoints.CheckpointError, match="no readable checkpoint"):
            checkpoints.restore_latest(manager, _placement().abstract_state)
    finally:
        manager.close()


def test_retention_keeps_latest_and_best(tmp_path):
    state = train.TrainState(
        step=jnp.zeros((), jnp.int32), params={"w": jnp.arange(4.0)}, opt_state={},
        rng=jax.random.PRNGKey(0),
    )
    dev_losses = {2: 3.0, 4: 1.0, 6: 4.0, 8: 5.0, 10: 6.0}
    manager = checkpoints.open_manager(str(tmp_path), keep=2, best_metric="loss")
    for step in range(1, 11):
        metrics = {"loss": dev_losses[step]} if step in dev_losses else None
        state = state.replace(step=jnp.asarray(step, jnp.int32),
                              params={"w": jnp.arange(4.0) + step})
        checkpoints.save(manager, state, position=100 + step, metrics=metrics)
    manager.wait_until_finished()
    assert sorted(manager.all_steps()) == [4, 9, 10]  # best (lowest dev loss) + latest 2
    manager.close()

    abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    params, position, step = checkpoints.restore_params(str(tmp_path), abstract,
                                                        best_metric="loss")
    assert (step, position.batches) == (4, 104)
    np.testing.assert_array_equal(params["w"], np.arange(4.0) + 4)
    _, position, step = checkpoints.restore_params(str(tmp_path), abstract)
    assert (step, position.batches) == (10, 110)


CROSS_MESH = """
import jax, numpy as np
from jax.sharding import PartitionSpec as P
import toy_training as toy
from components.config import MeshConfig
from model import checkpoints, train

assert jax.device_count() == 8
tx, _ = train.make_optimizer(toy.OPTIMIZER, 10)
batches = toy.make_batches(seed=0, batch_size=toy.BATCH_SIZE)
saved = train.train(toy.ToyModel(), toy.data(batches), toy.run_spec({dir!r}, 5),
                    MeshConfig(data=4, fsdp=2))
embed = saved.state.params["embed"]
assert embed.sharding.spec == P("fsdp", None), embed.sharding.spec  # vocab over fsdp
want = jax.tree.map(np.asarray, saved.state)

for mesh, devices in [(MeshConfig(data=8, fsdp=1), None),
                      (MeshConfig(data=1, fsdp=1), jax.devices()[:1])]:
    placement = train.place(toy.ToyModel(), tx, mesh, devices)
    manager = checkpoints.open_manager({dir!r}, keep=3)
    restored = checkpoints.restore_latest(manager, placement.abstract_state)
    manager.close()
    assert restored.step == 5 and restored.position.batches == 5
    for got, target, ref in zip(jax.tree.leaves(restored.state),
                                jax.tree.leaves(placement.state_shardings),
                                jax.tree.leaves(want)):
        assert got.sharding == target, (got.sharding, target)
        np.testing.assert_array_equal(np.asarray(got), ref)
    print("RESTORED", dict(placement.mesh.shape), restored.state.params["embed"].sharding.spec)

# and training continues on the new mesh
more = train.train(toy.ToyModel(), toy.data(batches), toy.run_spec({dir!r}, 8),
                   MeshConfig(data=8, fsdp=1))
assert int(more.state.step) == 8
print("OK")
"""


@pytest.mark.slow  # a child interpreter with 8 host devices
def test_checkpoint_restores_on_another_mesh(tmp_path, cache_dir):
    code = CROSS_MESH.format(dir=str(tmp_path / "checkpoints"))
    proc = toy.run_python(code, cache_dir, devices=8)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout


# --- restore failures told apart --------------------------------------------------------------


def _steps(directory):
    return sorted(p.name for p in directory.iterdir())


def _restore(directory, placement=None):
    manager = checkpoints.open_manager(str(directory), keep=3)
    try:
        return checkpoints.restore_latest(manager, (placement or _placement()).abstract_state)
    finally:
        manager.close()


def test_no_readable_checkpoint_moves_nothing_aside(tmp_path, uninterrupted):
    """Were every step set aside, the next run would silently train from scratch."""
    source, _ = uninterrupted
    shutil.copytree(source / "checkpoints", tmp_path / "run")
    for step_dir in (tmp_path / "run").iterdir():
        shutil.rmtree(step_dir / "train")
    before = _steps(tmp_path / "run")
    with pytest.raises(checkpoints.CheckpointError, match="none was moved aside.*step 20: "):
        _restore(tmp_path / "run")
    assert _steps(tmp_path / "run") == before


@pytest.mark.parametrize("failures", [1, 10])
def test_a_transient_storage_error_is_retried_never_corruption(
        tmp_path, uninterrupted, monkeypatch, failures):
    source, want = uninterrupted
    shutil.copytree(source / "checkpoints", tmp_path / "run")
    monkeypatch.setattr(checkpoints, "RETRY_DELAYS", (0.0, 0.0, 0.0))
    restore = ocp.CheckpointManager.restore
    calls = []

    def flaky(self, step, args=None):
        calls.append(step)
        if len(calls) <= failures:
            raise ValueError("UNAVAILABLE: gcs backend timed out")  # as tensorstore reports
        return restore(self, step, args=args)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", flaky)
    before = _steps(tmp_path / "run")
    if failures > len(checkpoints.RETRY_DELAYS):
        with pytest.raises(checkpoints.CheckpointError, match="storage keeps failing"):
            _restore(tmp_path / "run")
    else:
        restored = _restore(tmp_path / "run")
        assert restored.step == STEPS
        _assert_bitwise_equal(toy.flat_params(restored.state.params), want)
    assert _steps(tmp_path / "run") == before  # nothing set aside either way


def test_another_state_structure_is_an_error_naming_it(tmp_path, uninterrupted):
    source, _ = uninterrupted
    shutil.copytree(source / "checkpoints", tmp_path / "run")
    tx, _ = train.make_optimizer(toy.OPTIMIZER, 10)
    bigger = train.place(toy.ToyModel(config=toy.ToyConfig(d_model=24)), tx, MeshConfig())
    before = _steps(tmp_path / "run")
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"step 20 .* another state structure .*model or optimizer config"):
        _restore(tmp_path / "run", bigger)
    assert _steps(tmp_path / "run") == before


def test_resume_under_other_batch_sizes_is_refused(tmp_path, uninterrupted):
    """Another device count gives other global batch sizes (input_pipeline rounds them to a
    multiple of it): the saved position would point elsewhere, so the run refuses."""
    source, _ = uninterrupted
    shutil.copytree(source / "checkpoints", tmp_path / "run")
    with pytest.raises(checkpoints.CheckpointError,
                       match=r"position 20 counts global batches of \[8\] rows per bucket "
                             r"\(1 processes\), this run batches \[16\] rows"):
        train.train(
            toy.ToyModel(), toy.data(toy.make_batches(seed=0, batch_size=16), (16,)),
            toy.run_spec(tmp_path / "run", STEPS + 5), MeshConfig(),
        )


def test_the_position_maps_across_process_counts_with_the_same_global_batches():
    saved = checkpoints.Position(batches=40, batch_sizes=(64, 32), process_count=4)
    assert saved.resume_at([64, 32], "here") == 40
