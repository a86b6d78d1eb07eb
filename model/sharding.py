"""Named sharding: the mesh from `MeshConfig`, logical axis rules, placement of state and batches.

The model names the axes of its parameters with logical names ("vocab", "embed", "mlp",
"heads", "kv", "length", "position") through `nn.with_logical_partitioning`; the rule table
in `MeshConfig.logical_axis_rules` (config data) maps them onto the mesh axes ("data",
"fsdp"). State is initialised by shape first (`jax.eval_shape`), its shardings derived from
the logical names, and only then materialised in place (`jax.jit(init, out_shardings=...)`),
so no device ever holds the whole unsharded state.

Batches are global: their leading axis ("batch") splits over ("data", "fsdp"). With several
hosts each process feeds its own contiguous slice of the global batch.

Several processes also have to agree on where a run stands (`agreement`): a failure on one
of them (a held lease, a missing input) must end all of them, not leave the others waiting
in a collective that the failed one will never join.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from components.config import MeshConfig

MESH_AXES = ("data", "fsdp")
BATCH = "batch"

LogicalRules = tuple[tuple[str, Any], ...]


# A process that stops sending heartbeats (killed, its VM lost) is declared dead after
# HEARTBEAT_TIMEOUT_S, and every other process then aborts instead of waiting for it. At exit
# every process waits for the others at most SHUTDOWN_TIMEOUT_S: a run that succeeded gets
# there together (`agreement`), so only a process that failed alone waits that long.
HEARTBEAT_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 60
# How long a process waits at an agreement for the others (a publication that copies the
# checkpoints on GCS takes minutes); past it, a process that never came is an error.
AGREEMENT_TIMEOUT_S = 1800


class PeerFailedError(RuntimeError):
    """Another process of a multi-process run failed, or never reached an agreement."""


def initialize_distributed(cfg: MeshConfig) -> None:
    """`jax.distributed.initialize()` when the config asks for it.

    Must run before anything initialises the backend (`jax.devices()`, `process_index()`,
    the first array): the backend is created once, and only a backend created after this
    call spans all processes. Values the config leaves None JAX detects (TPU VMs); on CPU
    the processes reduce over gloo, JAX's default CPU collectives.
    """
    if cfg.distributed and not jax.distributed.is_initialized():
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
            shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
        )


_agreements = itertools.count()  # every process opens its agreements in the same order


@contextlib.contextmanager
def agreement(name: str, shared: Sequence[type[Exception]] = (),
              timeout_s: float = AGREEMENT_TIMEOUT_S) -> Iterator[None]:
    """Runs the body on every process, then makes every process agree that it succeeded.

    A process whose body raised tells the others (through the coordination service's
    key-value store, not a device collective, so that waiting can time out) and re-raises;
    a process whose body succeeded waits for every other's outcome and raises if one
    failed: an error of a type in `shared` as that type (a held lease is a user error on
    every process), any other as PeerFailedError naming the process and its error. One
    process alone is its own agreement.

    Raises:
      PeerFailedError: another process failed, or did not arrive within `timeout_s`.
    """
    if jax.process_count() == 1:
        yield
        return
    from orbax.checkpoint import multihost  # the client of jax.distributed, exposed

    client = multihost.get_jax_distributed_client()
    prefix = f"padir/agreement/{next(_agreements)}"
    try:
        yield
    except BaseException as e:
        client.key_value_set(f"{prefix}/{jax.process_index()}",
                             f"{type(e).__name__}\n{str(e)[:2000]}")
        raise
    client.key_value_set(f"{prefix}/{jax.process_index()}", "")
    deadline = time.monotonic() + timeout_s
    for process in range(jax.process_count()):
        try:
            outcome = client.blocking_key_value_get(
                f"{prefix}/{process}", max(1, int(1000 * (deadline - time.monotonic()))))
        except Exception as e:  # noqa: BLE001 - the service's timeout error, kept as cause
            raise PeerFailedError(
                f"{name}: process {process} did not get there within {timeout_s:.0f} s") from e
        if outcome:
            kind, message = outcome.split("\n", 1)
            known = {cls.__name__: cls for cls in shared}
            if kind in known:
                raise known[kind](f"process {process}: {message}")
            raise PeerFailedError(f"{name}: process {process} failed: {kind}: {message}")


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int]:
    """(data, fsdp) sizes for `num_devices`; `data: -1` takes the devices `fsdp` leaves."""
    if num_devices % cfg.fsdp:
        raise ValueError(f"mesh.fsdp={cfg.fsdp} does not divide the {num_devices} devices")
    data = num_devices // cfg.fsdp if cfg.data == -1 else cfg.data
    if data * cfg.fsdp > num_devices:
        raise ValueError(
            f"mesh data={data} x fsdp={cfg.fsdp} needs {data * cfg.fsdp} devices, "
            f"only {num_devices} are available"
        )
    return data, cfg.fsdp


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """The ("data", "fsdp") mesh over `devices` (default: all devices of all processes).

    Axis types are Auto: the compiler propagates shardings from the jit boundaries, as the
    model code (Linen, logical constraints) expects.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    return jax.make_mesh(
        shape,
        MESH_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
        devices=devices[: math.prod(shape)],
    )


def flax_rules(cfg: MeshConfig) -> LogicalRules:
    """The config's rule table in flax's form: () -> None, (a,) -> "a", (a, b) -> (a, b)."""

    def mesh_axes(axes: tuple[str, ...]) -> Any:
        if not axes:
            return None
        return axes[0] if len(axes) == 1 else tuple(axes)

    return tuple((logical, mesh_axes(axes)) for logical, axes in cfg.logical_axis_rules)


def _axis_size(mesh: Mesh, axes: Any) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in names)


def mesh_axes_for(
    names: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh, rules: LogicalRules
) -> PartitionSpec:
    """The PartitionSpec of one array from its logical dimension names.

    Flax's priority semantics (`nn.logical_to_mesh_axes`: rules in order, a dimension takes
    the first rule whose mesh axes are still free in this array), except that a rule whose
    mesh axes do not divide the dimension is skipped (jit needs even shards), so a later
    rule, or replication, applies instead.
    """
    assigned: list[Any] = [None] * len(shape)
    used: set[str] = set()
    for logical, axes in rules:
        if axes is None or logical not in names:
            continue
        dim = list(names).index(logical)
        group = {axes} if isinstance(axes, str) else set(axes)
        if assigned[dim] is not None or used & group or shape[dim] % _axis_size(mesh, axes):
            continue
        assigned[dim] = axes
        used |= group
    return PartitionSpec(*assigned)


def logical_shardings(boxed_abstract: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """NamedShardings for a tree whose leaves may carry logical names (`nn.Partitioned` boxes).

    The result has the structure of the *unboxed* tree (`unbox(boxed_abstract)`). Unnamed
    leaves (step counters, RNG keys) are replicated.
    """

    def leaf_sharding(leaf):
        if isinstance(leaf, nn.Partitioned):
            shape = leaf.value.shape
            names = tuple(leaf.names) + (None,) * (len(shape) - len(leaf.names))
            return NamedSharding(mesh, mesh_axes_for(names, shape, mesh, rules))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(
        leaf_sharding, boxed_abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )


def init_sharded(
    init_fn: Callable[..., Any], *args: Any, mesh: Mesh, rules: LogicalRules
) -> tuple[Any, Any]:
    """Initialises by shape, derives shardings, then materialises in place.

    Args:
      init_fn: a pure function of `args` returning a tree of arrays, those with logical
        axis names boxed (`box`).
      args: its arguments (an RNG key, ...), replicated.

    Returns:
      (tree, shardings): the unboxed tree laid out on `mesh`, and its shardings.
    """
    boxed_abstract = jax.eval_shape(init_fn, *args)
    shardings = logical_shardings(boxed_abstract, mesh, rules)
    tree = jax.jit(lambda *a: unbox(init_fn(*a)), out_shardings=shardings)(*args)
    return tree, shardings


def box(tree: Any, logical_axes: Any) -> Any:
    """`tree` with each leaf boxed in `nn.Partitioned` with its logical axis names.

    Args:
      logical_axes: a tree of PartitionSpecs of logical names shaped like `tree` (None: no
        names, the leaf stays bare), e.g. `model.logical_axes(batch)`.
    """

    def box_leaf(names, leaf):
        if names is None:
            return leaf
        names = tuple(names) + (None,) * (leaf.ndim - len(names))
        return nn.Partitioned(leaf, names=names)

    return jax.tree.map(
        box_leaf, logical_axes, tree,
        is_leaf=lambda x: x is None or isinstance(x, PartitionSpec),
    )


def unbox(tree: Any) -> Any:
    """Strips `nn.Partitioned` boxes, without sharding constraints (placement is the job of
    the jit boundaries; box names are logical, not mesh axes)."""
    return jax.tree.map(
        lambda x: x.value if isinstance(x, nn.Partitioned) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )


def abstract_like(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying target shardings (what a checkpoint restores onto)."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        unbox(abstract),
        shardings,
    )


def batch_sharding(mesh: Mesh, rules: LogicalRules) -> NamedSharding:
    """The sharding of a [batch, length] array: batch by the "batch" rule, length whole."""
    return NamedSharding(mesh, nn.logical_to_mesh_axes((BATCH, None), rules))


def check_batch_size(batch_size: int, sharding: NamedSharding, where: str = "batch") -> None:
    """A clear error when the global batch does not split evenly over its mesh axes."""
    shards = _axis_size(sharding.mesh, sharding.spec[0]) if len(sharding.spec) else 1
    if batch_size % shards or batch_size % jax.process_count():
        raise ValueError(
            f"{where} size {batch_size} must be divisible by the {shards} batch shards "
            f"(mesh axes {sharding.spec[0]}) and by the {jax.process_count()} processes"
        )


def shard_batch(batch: Mapping[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Global jax.Arrays from this process's slice of a batch of [B_local, L] numpy arrays."""
    return {
        name: jax.make_array_from_process_local_data(sharding, np.asarray(value))
        for name, value in batch.items()
    }
