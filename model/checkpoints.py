"""Checkpoints of training runs: the one module that reads and writes them (orbax).

Layout, one directory per run (`<dir>/<step>/`), three items per step:
  params/  the parameters readers use (StandardSave; all the decode stages need): the
           moving average when the run keeps one (`optimizer.ema_decay`),
  train/   step, optimizer state, the base RNG key, and then the raw parameters (StandardSave),
  data/    JSON: step, data position after this step, and a fingerprint of the arrays.
Saving is asynchronous (the arrays are copied off the devices before `save` returns, so the
next, donating train step is safe). Retention: the latest `keep` steps plus the single best
by a dev metric (orbax `AnyPreservationPolicy(LatestN, BestN)`: `max_to_keep` with `best_fn`
would keep the best N instead, dropping the latest). Only process 0 writes metadata files
(orbax's handlers do this); every process calls save and restore.

Restore order, used by `model.train.train`:
  1. the run's own directory (a resumed run): its latest readable step: params, optimizer
     state, step, RNG and data position, so the run continues exactly;
  2. else an explicit init checkpoint (phase 2 starts from phase 1): its latest step's
     params and data position only; step, optimizer state and RNG start fresh;
  3. else scratch.
Restore failures are told apart, and all processes agree on each verdict:
  - a transient storage error (a timeout, UNAVAILABLE) is retried, and if it persists is
    an error: the checkpoints are fine, the storage is not;
  - a state structure other than this run's (the model or optimizer config changed) is an
    error naming both structures, before any array is read;
  - only a step that fails its own integrity check (files that do not decode, arrays that do
    not match the fingerprint written with them) is corrupt: it is logged as an error naming
    the step, and once an older step restored, moved aside to `<dir>/corrupt-<step>-<time>`.
    If no step is readable the restore fails and nothing is moved, so a run never silently
    starts from scratch.
The data position is saved with the global batch sizes it counts in and the process count;
a run with other batch sizes refuses to continue from it (`Position.resume_at`).
Arrays are restored onto the shardings of the abstract target, so a checkpoint written on
one mesh restores on another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import signal
import threading
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

log = logging.getLogger(__name__)

PARAMS, TRAIN, DATA = "params", "train", "data"
BEST_MODES = {"bleu": "max", "loss": "min"}


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was required."""


TRANSIENT_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED")
RETRY_DELAYS = (1.0, 4.0, 16.0)  # seconds before each retry of a transient storage error
OK, CORRUPT, STORAGE = 0, 1, 2  # a process's verdict on one step (the worst one wins)


def open_manager(
    directory: str,
    *,
    keep: int = 2,
    best_metric: Optional[str] = None,
    read_only: bool = False,
) -> ocp.CheckpointManager:
    """A manager for one run's directory (local path or gs://).

    Args:
      keep: how many of the latest steps to keep.
      best_metric: a dev metric name in BEST_MODES; the best step by it is kept as well.
        Steps saved with metrics must then carry it.
      read_only: open for restoring only (a later stage reading a finished run).
    """
    keep_policies: list[Any] = [policies.LatestN(n=keep)]
    best_options = {}
    if best_metric is not None:
        mode = BEST_MODES[best_metric]
        best_fn = lambda metrics: float(metrics[best_metric])  # noqa: E731
        keep_policies.append(
            policies.BestN(
                get_metric_fn=best_fn,
                reverse=(mode == "min"),
                n=1,
                keep_checkpoints_without_metrics=False,
            )
        )
        best_options = dict(best_fn=best_fn, best_mode=mode)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policies.AnyPreservationPolicy(keep_policies),
        enable_async_checkpointing=True,
        cleanup_tmp_directories=not read_only,  # a save killed half-way leaves a tmp dir
        read_only=read_only,
        create=not read_only,
        **best_options,
    )
    return ocp.CheckpointManager(
        epath.Path(directory), options=options, item_names=(PARAMS, TRAIN, DATA)
    )


def fingerprint(tree: Any) -> int:
    """An exact, sharding-independent 32-bit checksum of the bits of every array in `tree`.

    Sums of the raw bits as uint32 wrap modulo 2**32, so the result does not depend on the
    order of the reduction (and hence not on the mesh). It catches silently corrupted
    array files, which do not always fail to decode.
    """
    leaves = jax.tree.leaves(tree)
    return int(_fingerprint(leaves))


@jax.jit
def _fingerprint(leaves: list[jax.Array]) -> jax.Array:
    total = jnp.uint32(0)
    for i, leaf in enumerate(leaves):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
            leaf = jax.random.key_data(leaf)
        if leaf.dtype == jnp.bool_:
            leaf = leaf.astype(jnp.uint8)
        bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]
        raw = jax.lax.bitcast_convert_type(leaf, bits).astype(jnp.uint32)
        total = total + jnp.sum(raw, dtype=jnp.uint32) * jnp.uint32(2 * i + 1)
    return total


def _split(state: Any) -> tuple[Any, dict[str, Any]]:
    """(what a reader restores, what only a resumed run needs). A run that keeps a moving
    average of its parameters gives readers the average; its raw parameters train on."""
    train = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
    if state.ema_params is None:
        return state.params, train
    return state.ema_params, dict(train, params=state.params)


def _join(abstract_state: Any, params: Any, train: dict[str, Any]) -> Any:
    """The TrainState that `_split` took apart."""
    state = abstract_state.replace(step=train["step"], opt_state=train["opt_state"],
                                   rng=train["rng"])
    if abstract_state.ema_params is None:
        return state.replace(params=params)
    return state.replace(params=train["params"], ema_params=params)


def structure(tree: Any) -> dict[str, Any]:
    """A summary of a state's structure: array count, parameter count and a digest of every
    array's path, shape and dtype (what a restore needs to match)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    described = [(jax.tree_util.keystr(path), tuple(leaf.shape), str(leaf.dtype))
                 for path, leaf in leaves]
    return {
        "arrays": len(described),
        "values": int(sum(np.prod(shape, dtype=np.int64) for _, shape, _ in described)),
        "digest": hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16],
    }


def save(
    manager: ocp.CheckpointManager,
    state: Any,
    *,
    position: int,
    batch_sizes: Optional[Sequence[int]] = None,
    metrics: Optional[dict[str, float]] = None,
) -> None:
    """Starts an asynchronous save of `state` (a TrainState) at its step.

    Args:
      position: the data position after this step (where a resumed run continues).
      batch_sizes: the global rows per bucket that `position` counts batches of.
      metrics: dev metrics of this step, if it was evaluated (for best-checkpoint retention).
    """
    step = int(state.step)
    params, train = _split(state)
    data = {
        "step": step,
        "position": int(position),
        "batch_sizes": None if batch_sizes is None else [int(b) for b in batch_sizes],
        "process_count": jax.process_count(),
        "fingerprint": fingerprint((params, train)),
        "structure": structure((params, train)),
    }
    manager.save(
        step,
        args=ocp.args.Composite(
            **{
                PARAMS: ocp.args.StandardSave(params),
                TRAIN: ocp.args.StandardSave(train),
                DATA: ocp.args.JsonSave(data),
            }
        ),
        metrics=metrics,
        force=True,
    )


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a run's data stream continues: `batches` global batches in, of `batch_sizes`
    rows per bucket, read by `process_count` processes (None: an older checkpoint)."""

    batches: int
    batch_sizes: Optional[tuple[int, ...]]
    process_count: Optional[int]

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> "Position":
        sizes = data.get("batch_sizes")
        return cls(int(data["position"]), None if sizes is None else tuple(sizes),
                   data.get("process_count"))

    def resume_at(self, batch_sizes: Sequence[int], where: str) -> int:
        """The position to continue at with global batches of `batch_sizes` rows.

        The stream's order depends on the global batch sizes only: another process count
        with the same global batches continues exactly; other batch sizes would continue
        elsewhere in another order, so they are refused.
        """
        batch_sizes = tuple(int(b) for b in batch_sizes)
        if self.batch_sizes is None:
            log.warning("%s: data position %d has no recorded batch sizes; assuming %s",
                        where, self.batches, batch_sizes)
        elif self.batch_sizes != batch_sizes:
            raise CheckpointError(
                f"{where}: its data position {self.batches} counts global batches of "
                f"{list(self.batch_sizes)} rows per bucket ({self.process_count} processes), "
                f"this run batches {list(batch_sizes)} rows ({jax.process_count()} processes): "
                "the position would point elsewhere in another order. Resume with the same "
                "global batch sizes (loop.tokens_per_batch, and a device count they divide "
                "by), or start a fresh run in another workdir"
            )
        return self.batches


@dataclasses.dataclass(frozen=True)
class Restored:
    state: Any
    position: Position
    step: int


def restore_latest(manager: ocp.CheckpointManager, abstract_state: Any) -> Optional[Restored]:
    """The latest readable step of `manager`'s run, or None if the run has no checkpoint.

    Args:
      abstract_state: a TrainState of ShapeDtypeStructs carrying the target shardings.

    Raises:
      CheckpointError: the state structure differs, the storage keeps failing, or steps
        exist but none of them is readable (see the module docstring).
    """
    params, train = _split(abstract_state)
    expected = structure((params, train))
    corrupt: dict[int, str] = {}
    for step in sorted(manager.all_steps(), reverse=True):
        verdict, data = _agree_on(
            manager, step, lambda: manager.restore(step, args=ocp.args.Composite(
                **{DATA: ocp.args.JsonRestore()}))[DATA])
        if verdict == CORRUPT:
            corrupt[step] = _corrupted(manager, step, data)
            continue
        saved = data.get("structure")
        if saved is not None and saved != expected:
            raise CheckpointError(
                f"step {step} in {manager.directory} holds another state structure than this "
                f"run's ({saved['arrays']} arrays, {saved['values']} values there; "
                f"{expected['arrays']} arrays, {expected['values']} values here): the model or "
                "optimizer config changed. Restore that config, or train in a fresh workdir"
            )
        verdict, restored = _agree_on(
            manager, step, lambda: manager.restore(step, args=ocp.args.Composite(
                **{PARAMS: ocp.args.StandardRestore(params),
                   TRAIN: ocp.args.StandardRestore(train)})))
        if verdict == OK:
            got = fingerprint((restored[PARAMS], restored[TRAIN]))  # all processes, together
            if data["step"] != step or int(restored[TRAIN]["step"]) != step:
                verdict, restored = CORRUPT, f"step mismatch: data says {data['step']}"
            elif got != data["fingerprint"]:
                verdict, restored = CORRUPT, (f"array contents do not match their fingerprint "
                                              f"({got} != {data['fingerprint']})")
        if verdict == CORRUPT:
            corrupt[step] = _corrupted(manager, step, restored)
            continue
        for bad in corrupt:
            _quarantine(manager, bad)
        state = _join(abstract_state, restored[PARAMS], restored[TRAIN])
        return Restored(state=state, position=Position.from_data(data), step=step)
    if corrupt:
        raise CheckpointError(
            f"no readable checkpoint in {manager.directory} (none was moved aside): "
            + "; ".join(f"step {step}: {why}" for step, why in corrupt.items())
        )
    return None


def _corrupted(manager: ocp.CheckpointManager, step: int, why: str) -> str:
    log.error("checkpoint at step %d in %s is corrupted (%s); trying the previous one",
              step, manager.directory, why)
    return why


def _agree_on(
    manager: ocp.CheckpointManager, step: int, read: Callable[[], Any]
) -> tuple[int, Any]:
    """(OK, what `read` returned) or (CORRUPT, why), the same verdict on every process.

    Transient storage errors are retried (`RETRY_DELAYS`); one that persists on any
    process is a CheckpointError on all of them, never a verdict of corruption.
    """
    verdict, result = OK, None
    for delay in (*RETRY_DELAYS, None):
        try:
            result = read()
            verdict = OK
            break
        except Exception as e:  # noqa: BLE001 - classified below; the cause is kept
            why = f"{type(e).__name__}: {str(e)[:500]}"
            if not _is_transient(e):
                verdict, result = CORRUPT, why
                break
            verdict, result = STORAGE, why
            if delay is not None:
                log.warning("step %d in %s: transient storage error (%s); retrying in %.0f s",
                            step, manager.directory, why, delay)
                time.sleep(delay)
    worst = _worst(verdict)
    if worst == STORAGE:
        raise CheckpointError(
            f"cannot read step {step} in {manager.directory}: the storage keeps failing "
            f"({result if verdict == STORAGE else 'on another process'}); the checkpoint "
            "itself may be fine: retry when the storage recovers"
        )
    if worst == CORRUPT and verdict == OK:
        return CORRUPT, "unreadable on another process"
    return worst, result


def _is_transient(e: Exception) -> bool:
    return isinstance(e, (ConnectionError, TimeoutError)) or any(
        status in str(e) for status in TRANSIENT_STATUSES)


def _worst(verdict: int) -> int:
    """The worst verdict over all processes."""
    if jax.process_count() == 1:
        return verdict
    return int(np.max(multihost_utils.process_allgather(np.asarray(verdict, dtype=np.int32))))


def _quarantine(manager: ocp.CheckpointManager, step: int) -> None:
    """Moves a bad step aside (kept for inspection), so that the run can save that step again."""
    if jax.process_index() == 0:
        source = manager.directory / str(step)
        target = manager.directory / f"corrupt-{step}-{int(time.time())}"
        try:
            source.rename(target)
            log.error("moved the corrupted checkpoint to %s", target)
        except OSError as e:
            log.error("could not move %s aside (%s); deleting it", source, e)
            manager.delete(step)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"quarantine checkpoint {step}")
    manager.reload()


def restore_params(
    directory: str,
    abstract_params: Any,
    *,
    step: Optional[int] = None,
    best_metric: Optional[str] = None,
) -> tuple[Any, int, int]:
    """Parameters (and data position) of a finished or running run, read-only.

    Args:
      abstract_params: ShapeDtypeStructs carrying the target shardings.
      step: a given step; default: the best step by `best_metric` if given, else the latest.

    Returns:
      (params, data position, step).
    """
    manager = open_manager(directory, best_metric=best_metric, read_only=True)
    try:
        if step is None:
            step = manager.best_step() if best_metric else manager.latest_step()
        if step is None:
            raise CheckpointError(f"no checkpoint in {directory}")
        try:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        PARAMS: ocp.args.StandardRestore(abstract_params),
                        DATA: ocp.args.JsonRestore(),
                    }
                ),
            )
        except Exception as e:  # noqa: BLE001 - name the checkpoint, keep the cause
            raise CheckpointError(
                f"cannot read the parameters of step {step} in {directory}: "
                f"{type(e).__name__}: {str(e)[:500]}"
            ) from e
    finally:
        manager.close()
    return restored[PARAMS], Position.from_data(restored[DATA]), step


class StopSignal:
    """SIGTERM (preemption) sets a flag; the loop checkpoints at the next step boundary.

    A context manager: installs the handler on entry (main thread only: Python delivers
    signals there) and restores the previous one on exit.
    """

    def __init__(self):
        self.received: Optional[int] = None
        self._previous: Any = None

    def _handle(self, signum, frame):
        del frame
        self.received = signum
        log.warning("received signal %d: checkpointing at the next step boundary", signum)

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def any_process(flag: bool) -> bool:
    """True if `flag` is set on any process (all processes must stop at the same step)."""
    if jax.process_count() == 1:
        return flag
    flags = multihost_utils.process_allgather(np.asarray(flag, dtype=np.int32))
    return bool(np.any(flags))
