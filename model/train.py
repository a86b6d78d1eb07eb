"""The training engine: one loop for the AR teacher and the PaDIR student.

The model is anything with the small interface of model/models.py (`init(rng, batch)`,
`loss_fn(params, batch, rng, *, deterministic) -> (loss, metric sums)`), and the dev
evaluation decodes with the `predict` function its caller gives (a search of
model/decoding/, which this engine does not import); the optimizer, the sharding and the
checkpoints stay here.
A student's run also has its phase's loss settings (`RunSpec.loss_settings`, model/losses.py
`student_loss_settings`), which the steps give `model.loss_fn` as `settings`; the AR
models' loss has none.

A run is `train(model, data, run, mesh)`: what it reads (`TrainData`), what it is asked to
do (`RunSpec`: steps, optimizer, cadences, checkpoint directory, seed), and the mesh;
`train_teacher` (the AR models: the teacher and the AR student) and `train_student` build
the `RunSpec`s of the training stages.

Steps are pure module-level functions (`train_step`, `eval_step`) compiled once per batch
shape with explicit shardings (`jit_*` handles; the state is donated). The per-step RNG is
`fold_in(state.rng, state.step)`, and checkpoints carry the state, the RNG and the data
position, so a resumed run continues bit for bit where the interrupted one stopped.

Data contract (`TrainData`): `batches(start_position)` returns an iterator of `(position_after, batch)`,
where `batch` is this process's slice of a global batch, a dict of numpy arrays
`{"source": int32[B, S], "target": int32[B, T]}` (B = global rows / process_count), and
`position_after` resumes the stream right after that batch. Positions count global batches of
`batch_sizes` rows (one size per length bucket); checkpoints record those sizes, so a resume
under other sizes is refused rather than continued elsewhere. Dev batches follow the same
layout; a row whose source is all PAD is padding (it fills the last batch to a static
shape) and has no reference.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import math
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from components.config import (
    MeshConfig,
    OptimizerConfig,
    StudentConfig,
    TeacherConfig,
    TrainLoopConfig,
)
from components import training_artifact
from components.metrics import corpus_bleu, tokenized_lowercased_bleu
from components.tokenizer import EOS_ID, PAD_ID
from model import checkpoints, sharding
from model.losses import LossSettings, student_loss_settings

log = logging.getLogger(__name__)

Batch = Mapping[str, np.ndarray]
BatchSource = Callable[[int], Iterator[tuple[int, Batch]]]
# Metrics a train step reports per step (averaged over steps); all others are sums.
STEP_MEANS = ("grad_norm", "objective")


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


# --- state and optimizer -------------------------------------------------------------------


@struct.dataclass
class TrainState:
    """Everything a step changes. `rng` is the run's base key; step keys fold in the step."""

    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2] raw key (plain array: checkpoints as is)
    ema_params: Any = None  # the parameters' moving average (optimizer.ema_decay), else None

    @property
    def eval_params(self) -> Any:
        """What is evaluated, checkpointed for readers and published: the average if kept."""
        return self.params if self.ema_params is None else self.ema_params

    def start_from(self, params: Any) -> "TrainState":
        """This fresh state with `params` (a warm start or an init checkpoint's) trained on
        and, if an average is kept, averaged from: a copy, since the step donates both."""
        return self.replace(params=params, ema_params=None if self.ema_params is None
                            else jax.tree.map(lambda x: x.copy(), params))


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to the peak over `warmup_steps`, then rsqrt or cosine decay.

    The value at optax count c is the rate of update c + 1, so the first update is not 0.
    """
    warmup = max(cfg.warmup_steps, 1)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        rate = cfg.learning_rate * jnp.minimum(1.0, step / warmup)
        if cfg.decay == "rsqrt":
            return rate * jnp.sqrt(warmup / jnp.maximum(step, warmup))
        progress = jnp.clip((step - warmup) / max(total_steps - warmup, 1), 0.0, 1.0)
        return rate * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))

    return schedule


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (decay on matrices only) after global-norm clipping; and its schedule."""
    schedule = learning_rate_schedule(cfg, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )
    return tx, schedule


def init_state(rng: jax.Array, batch: Batch, *, model: Any, tx: optax.GradientTransformation,
               ema: bool = False):
    """A fresh TrainState whose params, and the optimizer moments and average that mirror
    them, are boxed with the model's logical axis names (`sharding.init_sharded` lays them
    out and unboxes). `ema`: keep a moving average of the parameters, starting at them."""
    init_rng, train_rng = jax.random.split(rng)
    params = sharding.box(model.init(init_rng, batch), model.logical_axes(batch))
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=train_rng,
        ema_params=params if ema else None,
    )


def update_average(average: Any, params: Any, step: jax.Array, decay: float) -> Any:
    """One step of the parameters' exponential moving average. The decay ramps up as
    (1 + step) / (10 + step) to `decay`, so that early steps, far from where training ends,
    are forgotten fast (the warm start of TensorFlow's ExponentialMovingAverage)."""
    step = step.astype(jnp.float32)
    rate = jnp.minimum(decay, (1.0 + step) / (10.0 + step))
    return jax.tree.map(lambda a, p: rate * a + (1.0 - rate) * p, average, params)


def example_batch(model: Any) -> dict[str, jax.Array]:
    """A one-row batch of the model's maximal shapes (init only reads shapes)."""
    cfg = model.config
    return {
        "source": jnp.zeros((1, cfg.max_source_len), jnp.int32),
        "target": jnp.zeros((1, cfg.max_target_len), jnp.int32),
    }


# --- steps ---------------------------------------------------------------------------------


def _loss_fn(model: Any, settings: Optional[LossSettings]) -> Callable:
    """`model.loss_fn` with a student's loss settings bound; an AR model's (None) as it is."""
    if settings is None:
        return model.loss_fn
    return functools.partial(model.loss_fn, settings=settings)


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    model: Any,
    tx: optax.GradientTransformation,
    ema_decay: Optional[float] = None,
    loss_settings: Optional[LossSettings] = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update (and of the parameters' average, if the state keeps one).
    Returns the new state and the step's metric sums (plus the loss it optimised,
    `objective`, and the gradient norm before clipping)."""
    rng = jax.random.fold_in(state.rng, state.step)

    def loss_fn(params):
        return _loss_fn(model, loss_settings)(params, batch, rng)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, objective=loss, grad_norm=optax.tree.norm(grads))
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    if state.ema_params is not None:
        new_state = new_state.replace(
            ema_params=update_average(state.ema_params, params, state.step, ema_decay))
    return new_state, metrics


def eval_step(
    params: Any,
    batch: Batch,
    rng: jax.Array,
    *,
    model: Any,
    loss_settings: Optional[LossSettings] = None,
) -> dict[str, jax.Array]:
    """Metric sums of one dev batch: no dropout, and a fixed `rng` for the noise, so that
    evaluations are comparable."""
    _, metrics = _loss_fn(model, loss_settings)(params, batch, rng, deterministic=True)
    return metrics


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
    """The jitted steps of one run, with explicit shardings."""

    train: Callable[[TrainState, Any], tuple[TrainState, dict]]
    eval: Callable[[Any, Any, jax.Array], dict]
    predict: Callable[[Any, Any], jax.Array]


def compile_steps(
    model: Any,
    tx: optax.GradientTransformation,
    state_shardings: TrainState,
    batch_sharding: NamedSharding,
    ema_decay: Optional[float] = None,
    predict: Optional[Callable[[Any, Batch], jax.Array]] = None,
    loss_settings: Optional[LossSettings] = None,
) -> CompiledSteps:
    """`jit_train_step` (donates the state), `jit_eval_step` and `jit_predict` (of `predict`,
    default `model.predict_batch`) with explicit shardings: state as laid out, batches split
    over their mesh axes, metrics replicated. Each compiles once per distinct batch shape
    (one per length bucket)."""
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    jit_train_step = jax.jit(
        functools.partial(train_step, model=model, tx=tx, ema_decay=ema_decay,
                          loss_settings=loss_settings),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    jit_eval_step = jax.jit(
        functools.partial(eval_step, model=model, loss_settings=loss_settings),
        in_shardings=(state_shardings.params, batch_sharding, replicated),
        out_shardings=replicated,
    )
    jit_predict = jax.jit(
        predict or model.predict_batch,
        in_shardings=(state_shardings.params, batch_sharding),
        out_shardings=batch_sharding,
    )
    return CompiledSteps(train=jit_train_step, eval=jit_eval_step, predict=jit_predict)


# --- metrics and cadence -------------------------------------------------------------------


def every(step: int, n: int, last_step: int) -> bool:
    """True every `n` steps and always at `last_step`."""
    return step == last_step or step % n == 0


def _is_count(name: str) -> bool:
    return name in ("tokens", "examples") or name.startswith("weights")


def _denominator(name: str, sums: Mapping[str, float]) -> str:
    if name.startswith("length_"):
        return "examples"
    suffix = name[name.index("_pass"):] if "_pass" in name else ""
    return f"weights{suffix}" if f"weights{suffix}" in sums else "tokens"


def summarize(sums: Mapping[str, float], steps: int = 1) -> dict[str, float]:
    """Means from metric sums (model/losses.py's convention): `length_*` per example,
    `x_pass{k}` per `weights_pass{k}`, others per `weights` (else per token); per-step
    values (`STEP_MEANS`) per step; counts stay counts."""
    out = {}
    for name, value in sums.items():
        if _is_count(name):
            out[name] = value
        elif name in STEP_MEANS:
            out[name] = value / max(steps, 1)
        else:
            out[name] = value / max(sums.get(_denominator(name, sums), 1.0), 1.0)
    return out


class _Accumulator:
    """Host-side sums of step metrics; fetches each step's metrics one step late, so the
    host never waits for the step it just dispatched, yet a NaN is reported with its step."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.steps = 0
        self._pending: Optional[tuple[int, dict]] = None

    def push(self, step: int, metrics: dict) -> None:
        self.flush()
        self._pending = (step, metrics)

    def flush(self) -> None:
        if self._pending is None:
            return
        step, metrics = self._pending
        self._pending = None
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not math.isfinite(values["objective"]):
            raise NonFiniteLossError(f"training loss is {values['objective']} at step {step}")
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        self.steps += 1

    def take(self) -> tuple[dict[str, float], int]:
        """The means since the last take, and over how many steps."""
        self.flush()
        out, steps = summarize(self.sums, self.steps), self.steps
        self.sums, self.steps = {}, 0
        return out, steps


# --- evaluation ------------------------------------------------------------------------------


def _to_host(x: jax.Array) -> np.ndarray:
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@dataclasses.dataclass(frozen=True)
class DevSet:
    """What an evaluation reads.

    Attributes:
      batches: dev batches (a re-iterable).
      rng: the noise key of every evaluation, so that evaluations are comparable.
      detokenize: ids of one hypothesis, cut before its first EOS -> text (for BLEU).
      references: raw reference texts, one per non-padding dev row, in order (for BLEU).
      target_lang: the references' language, which picks BLEU's tokeniser.
    """

    batches: Sequence[Batch]
    rng: jax.Array
    detokenize: Optional[Callable[[Sequence[int]], str]] = None
    references: Optional[Sequence[str]] = None
    target_lang: str = ""


def evaluate(steps: CompiledSteps, params: Any, dev: DevSet,
             batch_sharding: NamedSharding) -> dict[str, float]:
    """Dev loss and token accuracy (per token), and BLEU (`components.metrics`, the one the
    reports quote; and its tokenised lowercased variant) of `predict_batch` output when
    `dev` has references."""
    sums: dict[str, float] = {}
    hypotheses: list[str] = []
    detokenize, references, target_lang = dev.detokenize, dev.references, dev.target_lang
    for batch in dev.batches:
        device_batch = sharding.shard_batch(batch, batch_sharding)
        for name, value in jax.device_get(steps.eval(params, device_batch, dev.rng)).items():
            sums[name] = sums.get(name, 0.0) + float(value)
        if references is not None:
            predicted = _to_host(steps.predict(params, device_batch))
            source = _to_host(device_batch["source"])
            for row, ids in zip(source, predicted):
                if np.all(row == PAD_ID):
                    continue
                ids = ids.tolist()
                hypotheses.append(detokenize(ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids))
    metrics = summarize(sums)
    if references is not None:
        if len(hypotheses) != len(references):
            raise ValueError(
                f"dev set: {len(hypotheses)} non-padding rows but {len(references)} references"
            )
        metrics["bleu"] = corpus_bleu(hypotheses, references, target_lang).score
        # The published Multi30k figures' metric, beside ours (components/metrics.py).
        metrics["bleu_tok_lc"] = tokenized_lowercased_bleu(hypotheses, references).score
    return metrics


# --- the loop ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainResult:
    state: TrainState
    position: int  # data position after the last step taken
    completed: bool  # reached num_steps (else stopped by SIGTERM or the time budget)
    stop_reason: Optional[str]
    dev_metrics: Optional[dict[str, float]]  # of the last evaluation, if any


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's state and batches live: the mesh, its rules, and the shardings."""

    mesh: Mesh
    rules: sharding.LogicalRules
    batch_sharding: NamedSharding
    state_shardings: TrainState  # of NamedShardings
    abstract_state: TrainState  # of ShapeDtypeStructs carrying those shardings
    init_fn: Callable[[jax.Array], TrainState]  # rng -> TrainState, boxed

    def create_state(self, seed: int) -> TrainState:
        """A fresh state, initialised in place (`sharding.init_sharded`)."""
        state, _ = sharding.init_sharded(
            self.init_fn, jax.random.PRNGKey(seed), mesh=self.mesh, rules=self.rules
        )
        return state


def place(
    model: Any,
    tx: optax.GradientTransformation,
    mesh: MeshConfig,
    devices: Optional[Sequence[jax.Device]] = None,
    ema: bool = False,
) -> Placement:
    """The mesh from `mesh` over `devices` (default: all), and the state's layout on it,
    derived by shape only. `ema`: the state keeps a moving average of the parameters."""
    device_mesh = sharding.make_mesh(mesh, devices)
    rules = sharding.flax_rules(mesh)
    init = functools.partial(init_state, batch=example_batch(model), model=model, tx=tx,
                             ema=ema)
    # No mesh context (`jax.set_mesh`): placement is explicit at the jit boundaries, and a
    # global mesh would make Linen apply the boxes' logical names as constraints inside
    # init, where DenseGeneral unboxes a kernel flattened to another rank than its names.
    boxed = jax.eval_shape(init, jax.random.PRNGKey(0))
    state_shardings = sharding.logical_shardings(boxed, device_mesh, rules)
    return Placement(
        mesh=device_mesh,
        rules=rules,
        batch_sharding=sharding.batch_sharding(device_mesh, rules),
        state_shardings=state_shardings,
        abstract_state=sharding.abstract_like(boxed, state_shardings),
        init_fn=init,
    )


@dataclasses.dataclass(frozen=True)
class TrainData:
    """What a run reads (the data contract of the module docstring).

    Attributes:
      batches: the resumable training stream.
      batch_sizes: the global rows per bucket of `batches` (what data positions count).
      dev_batches: dev batches (a re-iterable); None: no evaluation.
      references: raw dev targets, one per non-padding dev row, in row order; and
      detokenize: ids of one hypothesis, cut before its first EOS -> text. Both for dev
        BLEU, or neither.
    """

    batches: BatchSource
    batch_sizes: tuple[int, ...]
    dev_batches: Optional[Sequence[Batch]] = None
    references: Optional[Sequence[str]] = None
    detokenize: Optional[Callable[[Sequence[int]], str]] = None
    target_lang: str = ""  # of the references: picks BLEU's tokeniser (components.metrics)

    def __post_init__(self):
        if (self.references is None) != (self.detokenize is None):
            raise ValueError("give both references and detokenize, or neither")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of the loop: how long, how, and where its checkpoints live.

    Attributes:
      num_steps: the optimizer step to reach (a resumed run counts the restored ones).
      checkpoint_dir: this run's checkpoints, which a rerun resumes from.
      seed: of a fresh state (parameters, dropout and noise keys).
      loss_settings: a student's loss in this phase (module docstring); None: an AR model.
      init_checkpoint: a finished run's directory to start from (its parameters and data
        position) when this run has no checkpoint of its own.
      warm_start: fresh parameters -> the parameters to start from, when this run has no
        checkpoint of its own and no `init_checkpoint` (e.g. the teacher's where they fit,
        model/warm_start.py).
      predict: (params, dev batch) -> int32[B, T] ids, the decoding whose dev BLEU is
        reported and selects the best checkpoint; None: `model.predict_batch`.
      log_dir: TensorBoard event files (process 0 only); None: none.
      deadline: a `time.monotonic()` value: past it, the run checkpoints and stops.
    """

    num_steps: int
    optimizer: OptimizerConfig
    loop: TrainLoopConfig
    checkpoint_dir: str
    seed: int
    loss_settings: Optional[LossSettings] = None
    init_checkpoint: Optional[str] = None
    warm_start: Optional[Callable[[Any], Any]] = None
    predict: Optional[Callable[[Any, Batch], jax.Array]] = None
    log_dir: Optional[str] = None
    deadline: Optional[float] = None


def train(model: Any, data: TrainData, run: RunSpec, mesh: MeshConfig,
          devices: Optional[Sequence[jax.Device]] = None) -> TrainResult:
    """Trains `model` to `run.num_steps` optimizer steps, resuming from `run.checkpoint_dir`.

    Restore order (model/checkpoints.py): this run's own checkpoints, else the latest step of
    `run.init_checkpoint` (params and data position), else scratch from `run.seed`. Every
    `loop.eval_every` steps (and at the last) the dev set is evaluated and checkpointed with
    its metrics; every `loop.checkpoint_every` steps (and at the last) a checkpoint is saved.
    SIGTERM, or passing `run.deadline`, checkpoints the current step and returns early.
    Only process 0 logs to TensorBoard and shows progress. `devices`: of the mesh
    (default: all).

    Raises:
      NonFiniteLossError: the loss became NaN or infinite (the message names the step).
      checkpoints.CheckpointError: the run has checkpoints but cannot resume from them
        (none readable, another state structure, other batch sizes, failing storage).
    """
    sharding.initialize_distributed(mesh)
    if data.dev_batches is not None and run.loop.best_metric == "bleu" and data.references is None:
        raise ValueError("loop.best_metric is 'bleu': give references and detokenize for dev BLEU")
    tx, schedule = make_optimizer(run.optimizer, run.num_steps)
    placement = place(model, tx, mesh, devices, ema=run.optimizer.ema_decay is not None)
    for i, batch in enumerate(data.dev_batches or ()):
        sharding.check_batch_size(len(batch["source"]) * jax.process_count(),
                                  placement.batch_sharding, f"dev batch {i}")
    manager = checkpoints.open_manager(
        run.checkpoint_dir, keep=run.loop.keep_checkpoints,
        best_metric=run.loop.best_metric if data.dev_batches is not None else None)
    # SIGTERM from here on is deferred to the next step boundary (even during compilation).
    with checkpoints.StopSignal() as stop_signal:
        try:
            state, position = _restore_or_init(manager, placement, run, data.batch_sizes)
            context = RunContext(
                run=run, data=data, dev=_dev_set(data, state),
                steps=compile_steps(model, tx, placement.state_shardings,
                                    placement.batch_sharding, ema_decay=run.optimizer.ema_decay,
                                    predict=run.predict, loss_settings=run.loss_settings),
                batch_sharding=placement.batch_sharding, schedule=schedule, manager=manager,
                stop_signal=stop_signal, is_main=jax.process_index() == 0)
            return _run(context, state, position)
        finally:
            manager.wait_until_finished()
            manager.close()


def _restore_or_init(manager, placement: Placement, run: RunSpec,
                     batch_sizes: Sequence[int]) -> tuple[TrainState, int]:
    """The restore order of model/checkpoints.py: own checkpoints, init checkpoint, scratch."""
    restored = checkpoints.restore_latest(manager, placement.abstract_state)
    if restored is not None:
        where = f"step {restored.step} of {manager.directory}"
        position = restored.position.resume_at(batch_sizes, where)
        log.info("resuming from %s", where)
        return restored.state, position
    state = placement.create_state(run.seed)
    if run.init_checkpoint is None and run.warm_start is not None:
        return state.start_from(run.warm_start(state.params)), 0
    if run.init_checkpoint is None:
        log.info("training from scratch")
        return state, 0
    params, saved_position, step = checkpoints.restore_params(
        run.init_checkpoint, placement.abstract_state.params
    )
    position = saved_position.resume_at(batch_sizes, f"step {step} of {run.init_checkpoint}")
    log.info("initialised from step %d of %s (data position %d)",
             step, run.init_checkpoint, position)
    return state.start_from(params), position


def _dev_set(data: TrainData, state: TrainState) -> Optional[DevSet]:
    """What evaluations read, with a noise key that no step uses."""
    if data.dev_batches is None:
        return None
    rng = jax.random.fold_in(state.rng, np.iinfo(np.int32).max)
    return DevSet(data.dev_batches, rng, detokenize=data.detokenize, references=data.references,
                  target_lang=data.target_lang)


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What the loop of one run reads and never changes (`train` builds it)."""

    run: RunSpec  # num_steps, the loop's cadences, log_dir, deadline
    data: TrainData
    steps: CompiledSteps
    batch_sharding: NamedSharding
    schedule: optax.Schedule
    manager: Any  # checkpoints.open_manager's
    stop_signal: checkpoints.StopSignal
    is_main: bool  # process 0: logs to TensorBoard and shows progress
    dev: Optional[DevSet]  # None: no evaluation


class _Monitor:
    """Host-side reporting of one run: metric means to TensorBoard and the progress bar
    at the log cadence, with throughput over the interval (evaluation time excluded)."""

    def __init__(self, context: RunContext, step: int):
        self.context = context
        self.writer = _summary_writer(context.run.log_dir) if context.is_main else None
        self.bar = _progress_bar(step, context.run.num_steps, disable=not context.is_main)
        self.accumulator = _Accumulator()
        self.interval_start, self.interval_tokens = time.monotonic(), 0

    def record(self, step: int, metrics: dict, batch: Batch) -> None:
        self.accumulator.push(step, metrics)
        self.interval_tokens += int(np.count_nonzero(batch["target"])) * jax.process_count()
        self.bar.update(1)

    def log(self, step: int) -> None:
        elapsed = time.monotonic() - self.interval_start
        summary, n_steps = self.accumulator.take()
        summary["learning_rate"] = float(self.context.schedule(step - 1))
        summary["steps_per_s"] = n_steps / elapsed
        summary["target_tokens_per_s"] = self.interval_tokens / elapsed
        _write(self.writer, training_artifact.TRAIN, summary, step)
        postfix = {"loss": f"{summary.get('loss', summary['objective']):.3f}",
                   "tok_s": f"{summary['target_tokens_per_s']:.0f}"}
        deadline = self.context.run.deadline
        if deadline is not None:  # the bar's ETA counts all steps; a budget ends sooner
            postfix["budget_left"] = f"{max(0.0, deadline - time.monotonic()) / 60:.1f}min"
        self.bar.set_postfix(postfix)
        self.interval_start, self.interval_tokens = time.monotonic(), 0

    def log_dev(self, step: int, metrics: Mapping[str, float], seconds: float) -> None:
        self.interval_start += seconds  # evaluation is not training throughput
        _write(self.writer, training_artifact.DEV, metrics, step)
        if self.context.is_main:
            log.info("step %d dev %s", step, _format(metrics))

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _run(ctx: RunContext, state: TrainState, position: int) -> TrainResult:
    """Steps to `num_steps`; after each, at their cadences: logging, the stop agreement,
    evaluation and a checkpoint. A stop (SIGTERM, the time budget) checkpoints and returns."""
    run, loop = ctx.run, ctx.run.loop
    step = last_saved = int(state.step)
    dev_metrics = stop_reason = None
    if step >= run.num_steps:  # e.g. killed during publication: the last evaluation stands
        log.info("already trained: step %d of %d", step, run.num_steps)
        return TrainResult(state, position, True, None, ctx.manager.metrics(step))
    monitor = _Monitor(ctx, step)
    stream = ctx.data.batches(position)
    try:
        while step < run.num_steps:
            try:
                next_position, batch = next(stream)
            except StopIteration:
                raise RuntimeError(f"the data source ended at position {position}") from None
            batch_on_devices = sharding.shard_batch(batch, ctx.batch_sharding)
            state, metrics = ctx.steps.train(state, batch_on_devices)
            step, position = step + 1, next_position
            monitor.record(step, metrics, batch)
            logged = every(step, loop.log_every, run.num_steps)
            if logged:
                monitor.log(step)
            stop = _stop_agreed(ctx, logged)
            evaluated = _evaluation_due(ctx, step, stop)
            if evaluated:
                monitor.accumulator.flush()  # never evaluate or save a state that went NaN
                started = time.monotonic()
                dev_metrics = evaluate(ctx.steps, state.eval_params, ctx.dev, ctx.batch_sharding)
                monitor.log_dev(step, dev_metrics, time.monotonic() - started)
            if evaluated or stop or every(step, loop.checkpoint_every, run.num_steps):
                monitor.accumulator.flush()
                checkpoints.save(
                    ctx.manager, state, position=position, batch_sizes=ctx.data.batch_sizes,
                    metrics=_checkpoint_metrics(dev_metrics) if evaluated else None,
                )
                last_saved = step
            if stop:
                stop_reason = "SIGTERM" if ctx.stop_signal.received is not None else "time budget"
                log.warning("stopping at step %d of %d (%s); checkpoint saved",
                            step, run.num_steps, stop_reason)
                break
        monitor.accumulator.flush()
    finally:
        monitor.close()
    assert last_saved == step, (last_saved, step)
    return TrainResult(state, position, step >= run.num_steps, stop_reason, dev_metrics)


def _stop_agreed(ctx: RunContext, logged: bool) -> bool:
    """Whether to stop after this step: SIGTERM or past the deadline, in any process."""
    stop = ctx.stop_signal.received is not None or (
        ctx.run.deadline is not None and time.monotonic() > ctx.run.deadline
    )
    if jax.process_count() > 1:
        # Processes must stop at the same step; agreeing costs a host round trip, so they
        # agree at the log cadence only.
        stop = logged and checkpoints.any_process(stop)
    return stop


def _evaluation_due(ctx: RunContext, step: int, stop: bool) -> bool:
    """At the eval cadence; and when the time budget stops the run, so that the best
    checkpoint is known (SIGTERM, a preemption, saves at once without evaluating)."""
    return ctx.dev is not None and (
        every(step, ctx.run.loop.eval_every, ctx.run.num_steps)
        or (stop and ctx.stop_signal.received is None)
    )


def _checkpoint_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Every dev metric, saved with its step: a rerun that finds training finished
    publishes the same metrics as the run that was killed after its last evaluation."""
    return {k: float(v) for k, v in metrics.items()}


def _format(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


def _summary_writer(log_dir: Optional[str]):
    """TensorBoard event files via tensorboardX: no TensorFlow import in the training loop
    (flax.metrics.tensorboard needs TF, heavy and a second claimant of accelerators); on
    gs:// through fsspec (`_BucketEventFile`)."""
    if log_dir is None:
        return None
    from tensorboardX import SummaryWriter, record_writer

    record_writer.register_writer_factory("gs", _BucketEventFile)
    return SummaryWriter(log_dir)


class _BucketEventFile:
    """An event file on a bucket, for tensorboardX: the whole file uploaded through fsspec
    at every flush (what was logged outlives a killed run), and nothing once closed.
    tensorboardX's own GCS writer uploads once more when garbage-collected, into an
    artifact's temporary folder that by then has been published (or a server long gone)."""

    def __init__(self, path: str):
        self.path, self.buffer = path, io.BytesIO()

    @classmethod
    def open(cls, path: str) -> "_BucketEventFile":  # the writer-factory interface
        return cls(path)

    @staticmethod
    def directory_check(path: str) -> None:  # objects need no folders
        pass

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        if self.buffer is not None:
            import fsspec

            fs, path = fsspec.core.url_to_fs(self.path)
            fs.pipe_file(path, self.buffer.getvalue())

    def close(self) -> None:
        self.flush()
        self.buffer = None


def _write(writer, group: str, metrics: Mapping[str, float], step: int) -> None:
    if writer is None:
        return
    for name, value in metrics.items():
        writer.add_scalar(training_artifact.tag(group, name), value, step)
    writer.flush()


def _progress_bar(step: int, total: int, disable: bool):
    from tqdm.auto import tqdm

    # tqdm shows steps/s and the ETA; tokens/s goes in the postfix at each log step. Into a
    # log file (scheduled runs) it writes a line a minute rather than one per step.
    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=step, unit="step", disable=disable, dynamic_ncols=True,
                mininterval=0.1 if interactive else 60.0)


# --- the stages that train -----------------------------------------------------------------


def _deadline(loop: TrainLoopConfig) -> Optional[float]:
    return None if loop.max_minutes is None else time.monotonic() + 60.0 * loop.max_minutes


def train_teacher(model: Any, data: TrainData, cfg: TeacherConfig, mesh: MeshConfig, *,
                  checkpoint_dir: str, seed: int,
                  predict: Callable[[Any, Batch], jax.Array],
                  log_dir: Optional[str] = None,
                  warm_start: Optional[Callable[[Any], Any]] = None) -> TrainResult:
    """A single-stage model (the teacher, the AR student, the drafter: their configs are
    `TeacherConfig`s): one run of `cfg.steps` steps, dev BLEU of `predict` (RunSpec).

    Label smoothing (`cfg.label_smoothing`) is part of the teacher's loss: the caller builds
    `model` with it; the engine only optimises what `model.loss_fn` returns. `warm_start`
    (RunSpec) starts the AR student from the teacher.
    """
    run = RunSpec(num_steps=cfg.steps, optimizer=cfg.optimizer, loop=cfg.loop,
                  checkpoint_dir=checkpoint_dir, seed=seed, log_dir=log_dir,
                  deadline=_deadline(cfg.loop), warm_start=warm_start, predict=predict)
    return train(model, data, run, mesh)


def train_student(model: Any, data: TrainData, cfg: StudentConfig, mesh: MeshConfig, *,
                  checkpoint_dir: str, seed: int,
                  predict: Callable[[Any, Batch], jax.Array],
                  log_dir: Optional[str] = None,
                  warm_start: Optional[Callable[[Any], Any]] = None) -> TrainResult:
    """The PaDIR student: phase 1 (single-pass loss), then phase 2 (`cfg.num_passes`
    unrolled stages) initialised from phase 1's last step, each in its folder of
    `checkpoint_dir` and `log_dir` (components/training_artifact.py `phase`).

    Each phase resumes on its own; a finished phase 1 is not retrained. Phase 2 has its own
    seed (seed + 1), so its noise and dropout differ from phase 1's. `loop.max_minutes`
    budgets both phases together. As for the teacher, the caller builds `model` with
    `cfg.label_smoothing`. `warm_start` (RunSpec) starts phase 1, e.g. from the teacher.
    Dev BLEU is of `predict` in both phases (the stage's: `refinement.dev_predict`).
    """
    first = RunSpec(
        num_steps=cfg.phase1_steps, optimizer=cfg.optimizer, loop=cfg.loop,
        checkpoint_dir=training_artifact.phase(checkpoint_dir, 1), seed=seed,
        loss_settings=student_loss_settings(cfg, phase=1),
        log_dir=log_dir and training_artifact.phase(log_dir, 1),
        deadline=_deadline(cfg.loop), warm_start=warm_start, predict=predict)
    result = train(model, data, first, mesh)
    if not result.completed or cfg.phase2_steps == 0:
        return result
    second = dataclasses.replace(
        first, num_steps=cfg.phase2_steps,
        checkpoint_dir=training_artifact.phase(checkpoint_dir, 2),
        seed=seed + 1, init_checkpoint=first.checkpoint_dir, warm_start=None,
        loss_settings=student_loss_settings(cfg, phase=2),
        log_dir=log_dir and training_artifact.phase(log_dir, 2))
    return train(model, data, second, mesh)
