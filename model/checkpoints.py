"""Checkpoints of training runs: the one module that reads and writes them (orbax).

Layout, one directory per run (`<dir>/<step>/`), three items per step:
  params/  the model parameters (StandardSave; all the decode stages need),
  train/   step, optimizer state and the base RNG key (StandardSave),
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
A latest step that cannot be read, or whose arrays do not match the fingerprint written with
them, is logged as an error naming the step, moved aside to `<dir>/corrupt-<step>-<time>`,
and the previous step is restored instead; if no step is readable the restore fails.
Arrays are restored onto the shardings of the abstract target, so a checkpoint written on
one mesh restores on another.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from typing import Any, Optional

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
    return state.params, {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}


def save(
    manager: ocp.CheckpointManager,
    state: Any,
    *,
    position: int,
    metrics: Optional[dict[str, float]] = None,
) -> None:
    """Starts an asynchronous save of `state` (a TrainState) at its step.

    Args:
      position: the data position after this step (where a resumed run continues).
      metrics: dev metrics of this step, if it was evaluated (for best-checkpoint retention).
    """
    step = int(state.step)
    params, train = _split(state)
    data = {"step": step, "position": int(position), "fingerprint": fingerprint((params, train))}
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
class Restored:
    state: Any
    position: int
    step: int


def restore_latest(manager: ocp.CheckpointManager, abstract_state: Any) -> Optional[Restored]:
    """The latest readable step of `manager`'s run, or None if the run has no checkpoint.

    Args:
      abstract_state: a TrainState of ShapeDtypeStructs carrying the target shardings.

    Raises:
      CheckpointError: steps exist but none of them is readable.
    """
    params, train = _split(abstract_state)
    tried = []
    for step in sorted(manager.all_steps(), reverse=True):
        tried.append(step)
        try:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        PARAMS: ocp.args.StandardRestore(params),
                        TRAIN: ocp.args.StandardRestore(train),
                        DATA: ocp.args.JsonRestore(),
                    }
                ),
            )
            data = restored[DATA]
            got = fingerprint((restored[PARAMS], restored[TRAIN]))
            if data["step"] != step or int(restored[TRAIN]["step"]) != step:
                raise CheckpointError(f"step mismatch: data says {data['step']}")
            if got != data["fingerprint"]:
                raise CheckpointError(
                    f"array contents do not match their fingerprint "
                    f"({got} != {data['fingerprint']})"
                )
        except Exception as e:  # noqa: BLE001 - any failure to read means: use an older step
            log.error(
                "checkpoint at step %d in %s is corrupted or unreadable (%s: %s); "
                "falling back to the previous checkpoint",
                step, manager.directory, type(e).__name__, str(e)[:500],
            )
            _quarantine(manager, step)
            continue
        state = abstract_state.replace(
            step=restored[TRAIN]["step"],
            params=restored[PARAMS],
            opt_state=restored[TRAIN]["opt_state"],
            rng=restored[TRAIN]["rng"],
        )
        return Restored(state=state, position=int(data["position"]), step=step)
    if tried:
        raise CheckpointError(f"no readable checkpoint in {manager.directory}: tried steps {tried}")
    return None


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
    return restored[PARAMS], int(restored[DATA]["position"]), step


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
