"""Training throughput of the AR teacher and the PaDIR student (phase 1 and phase 2 losses).

Runs the engine's own jitted train step (model/train.py: placement, donation, shardings) on
synthetic full-length batches and prints, per model: step time (best and median of the
timed steps), tokens/s and achieved FLOP/s at the best step, and that as a fraction of the
FLOP/s of a 2048^3 float32 matmul (best of 5) measured in the same process right after (the
practical ceiling here). The machine may be shared: compare fractions, not raw rates.

FLOPs per step, counted on the padded shapes (the synthetic batches have no padding):
  6 x (N_enc x B x S' + (N_dec + V x D) x B x T x K)      matmuls, forward + backward
  + 12 x B x D x sum over attention modules of (Lq x Lk)  QK^T and AV, forward + backward
N_enc/N_dec: encoder/decoder parameters without position tables; V x D: the tied output
projection; S' = S (+1 for PaDIR's [LENGTH] token); K: the unrolled decoder passes;
decoder attention per layer: T x T self, T x S' cross, and PaDIR's T x T positional attention.

    python -m benchmarks.train_throughput [--batch 64 --length 32 --steps 6 --vocab 8000]
    python -m benchmarks.train_throughput --config configs/multi30k_en_de.yaml --models teacher

With `--config` (and `--set` overrides) the models, vocabulary size and batch are the
config's: its teacher and student shapes, `vocab.size`, and `loop.tokens_per_batch` padded
tokens per step at `--length`; the student's phases train their loss as the config sets it
(model/losses.py `student_loss_settings`).
The ceiling is then also measured at the model's own matmul shapes (a batch's rows times the
attention/MLP/output-projection weights), the ceiling the step can reach in principle.

With `--ops`, a profiler trace of a few more steps says where the step's time goes, by XLA
operation: matrix products, elementwise work on [..., V] arrays (the logits, the loss and
their gradients) and everything else, each with its largest operations.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from components import config as config_lib
from components.config import MeshConfig, ModelConfig, OptimizerConfig, StudentConfig
from model import sharding, train
from model.losses import student_loss_settings
from model.models import ARModel, PaDIRModel

FIRST_REAL_ID = 6


def _best_seconds(matmul, a, b, reps: int) -> float:
    """Best of `reps` timed calls, after a compiling one."""
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def _operands(m: int, k: int, n: int) -> tuple[jax.Array, jax.Array]:
    return (jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32),
            jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32))


def matmul_flops_per_s(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an n x n float32 matmul (best of `reps`, after a compiling call)."""
    return 2 * n**3 / _best_seconds(jax.jit(jnp.matmul), *_operands(n, n, n), reps)


def model_shapes_flops_per_s(rows: int, cfg: ModelConfig, vocab: int, reps: int = 5) -> float:
    """FLOP/s of the step's own matmuls: `rows` activations times the projection, MLP and
    output weights (forward shapes; best of `reps` each), weighted by their FLOPs."""
    shapes = [(cfg.d_model, cfg.d_model), (cfg.d_model, cfg.mlp_dim),
              (cfg.mlp_dim, cfg.d_model), (cfg.d_model, vocab)]
    matmul = jax.jit(jnp.matmul)
    flops = sum(2 * rows * k * n for k, n in shapes)
    seconds = sum(_best_seconds(matmul, *_operands(rows, k, n), reps) for k, n in shapes)
    return flops / seconds


def _count(tree, skip=()) -> int:
    return sum(
        int(np.prod(leaf.shape))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if not any(name in jax.tree_util.keystr(path) for name in skip)
    )


def step_flops(params, cfg: ModelConfig, vocab: int, batch: int, src: int, tgt: int,
               padir: bool, passes: int) -> tuple[float, float, int]:
    """(FLOPs of one train step, of which attention's QK^T and AV, parameter count); see
    the module docstring."""
    n_enc = _count(params["encoder"], skip=("pos_embedding",))
    n_dec = _count(params["decoder"], skip=("pos_embedding",))
    src_len = src + 1 if padir else src
    matmuls = 6 * (n_enc * batch * src_len + (n_dec + vocab * cfg.d_model) * batch * tgt * passes)
    pairs = cfg.num_encoder_layers * src_len * src_len
    per_decoder_pass = cfg.num_decoder_layers * (tgt * tgt + tgt * src_len)
    if padir and cfg.positional_attention:
        per_decoder_pass += cfg.num_decoder_layers * tgt * tgt
    pairs += per_decoder_pass * passes
    attention = 12 * batch * cfg.d_model * pairs
    return float(matmuls + attention), float(attention), _count(params)


def synthetic_batch(rng: np.random.Generator, vocab: int, batch: int, src: int, tgt: int):
    """Full-length rows of random real pieces, each ending in EOS (id 1)."""
    source = rng.integers(FIRST_REAL_ID, vocab, size=(batch, src), dtype=np.int32)
    target = rng.integers(FIRST_REAL_ID, vocab, size=(batch, tgt), dtype=np.int32)
    source[:, -1] = target[:, -1] = 1
    return {"source": source, "target": target}


def _hlo_operations(hlo: str) -> dict[str, tuple[str, bool]]:
    """Compiled HLO text -> {instruction name: (output shape, whether it is a matmul)}; a
    fusion is a matmul when the computation it calls holds a dot."""
    computations = {}
    for match in re.finditer(r"^%([\w.\-]+) .*?\{\n(.*?)^\}", hlo, re.M | re.S):
        computations[match.group(1)] = match.group(2)
    operations = {}
    for match in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+?\[[^\]]*\])(.*)$", hlo, re.M):
        name, shape, rest = match.groups()
        called = re.search(r"calls=%([\w.\-]+)", rest)
        body = computations.get(called.group(1), "") if called else ""
        is_matmul = bool(re.match(r"\S*\s+dot\(", rest) or " dot(" in body)
        operations.setdefault(name, (shape, is_matmul))
    return operations


def operation_breakdown(step, state, batch, vocab: int, steps: int = 3) -> tuple[list, dict]:
    """Milliseconds per step by kind of XLA operation, from a profiler trace of `steps` calls
    of `step` (jitted; donates `state`). Kinds: matmul or elementwise, on [..., vocab] arrays
    or others. Returns (rows of (kind, ms per step), {kind: its 3 largest (ms, op, shape)}).
    The cores run some operations side by side: the kinds add up to more than the wall time."""
    operations = _hlo_operations(step.lower(state, batch).compile().as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(steps):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        (trace_file,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
        with gzip.open(trace_file) as f:
            events = json.load(f)["traceEvents"]
    by_op = collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event["name"] in operations:
            by_op[event["name"]] += event["dur"] / 1000 / steps
    totals, largest = collections.Counter(), collections.defaultdict(list)
    for name, ms in by_op.most_common():
        shape, is_matmul = operations[name]
        over_vocab = re.search(rf"[\[,]{vocab}[\],]", shape) is not None
        kind = ("matmul" if is_matmul else "elementwise") + (" on [..., V]" if over_vocab else "")
        totals[kind] += ms
        if len(largest[kind]) < 3:
            largest[kind].append((round(ms, 1), name, shape))
    return [(kind, round(ms, 1)) for kind, ms in totals.most_common()], dict(largest)


def measure(name, model, loss_settings, args, rng) -> dict:
    """One model's step; `loss_settings`: the student's in one phase, None for the AR model."""
    cfg = model.config
    padir = isinstance(model, PaDIRModel)
    num_passes = 1 if loss_settings is None else loss_settings.num_passes
    tx, _ = train.make_optimizer(OptimizerConfig(), total_steps=1000)
    placement = train.place(model, tx, MeshConfig())
    steps = train.compile_steps(model, tx, placement.state_shardings, placement.batch_sharding,
                                loss_settings=loss_settings)
    state = placement.create_state(seed=0)
    batch = sharding.shard_batch(
        synthetic_batch(rng, args.vocab, args.batch, args.length, args.length),
        placement.batch_sharding,
    )
    flops, _, num_params = step_flops(state.params, cfg, args.vocab, args.batch, args.length,
                                   args.length, padir, num_passes)
    start = time.perf_counter()
    for _ in range(2):  # compile + one warm step
        state, metrics = steps.train(state, batch)
    jax.block_until_ready(state)
    warmup = time.perf_counter() - start
    times = []
    for _ in range(args.steps):  # each step timed alone: the machine is shared
        start = time.perf_counter()
        state, metrics = steps.train(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    if args.ops:
        kinds, largest = operation_breakdown(steps.train, state, batch, args.vocab)
        print(f"{name}: ms per step by kind of operation: {kinds}")
        for kind, ops in largest.items():
            print(f"  largest {kind}: {ops}")
    ceiling = matmul_flops_per_s()
    own_ceiling = model_shapes_flops_per_s(args.batch * args.length, cfg, args.vocab)
    seconds = min(times)  # least disturbed by other processes, like the ceiling's best-of
    target_tokens = args.batch * args.length
    return {
        "model": name,
        "params_M": round(num_params / 1e6, 2),
        "step_s": round(seconds, 4),
        "median_step_s": round(float(np.median(times)), 4),
        "target_tokens_per_s": round(target_tokens / seconds),
        "all_tokens_per_s": round(2 * target_tokens / seconds),
        "step_GFLOP": round(flops / 1e9, 1),
        "achieved_GFLOP_per_s": round(flops / seconds / 1e9, 1),
        "matmul_GFLOP_per_s": round(ceiling / 1e9, 1),
        "fraction_of_matmul": round(flops / seconds / ceiling, 3),
        "own_shapes_GFLOP_per_s": round(own_ceiling / 1e9, 1),
        "fraction_of_own_shapes": round(flops / seconds / own_ceiling, 3),
        "compile_and_warmup_s": round(warmup, 1),
        "loss": round(float(metrics["objective"]), 3),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=32, help="source and target length")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--config", help="measure this config's models at its batch size")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ops", action="store_true",
                        help="also trace steps and print their time by kind of operation")
    parser.add_argument("--models", default="teacher,phase1,phase2",
                        help="comma-separated subset of teacher,phase1,phase2")
    args = parser.parse_args(argv)
    teacher_cfg = ModelConfig()  # the small default: d_model 256, 3+3 layers
    student = StudentConfig()  # the same model, and the default loss of each phase
    label_smoothing = 0.1
    if args.config:
        config = config_lib.load(args.config, args.set)
        teacher_cfg, student = config.teacher.model, config.student
        label_smoothing = config.teacher.label_smoothing
        args.vocab = config.vocab.size
        args.batch = max(1, config.teacher.loop.tokens_per_batch // args.length)
    rng = np.random.default_rng(0)
    print(f"devices: {jax.devices()}  batch {args.batch} x length {args.length}, "
          f"vocab {args.vocab}", flush=True)
    def make_student():
        return PaDIRModel(student.model, args.vocab, FIRST_REAL_ID,
                          label_smoothing=student.label_smoothing)

    runs = {
        "teacher": ("teacher (AR)", lambda: ARModel(teacher_cfg, args.vocab, label_smoothing),
                    None),
        "phase1": ("PaDIR phase 1 (K=1)", make_student, student_loss_settings(student, 1)),
        "phase2": (f"PaDIR phase 2 (K={student.num_passes})", make_student,
                   student_loss_settings(student, 2)),
    }
    for key in args.models.split(","):
        name, make_model, loss_settings = runs[key]
        print(json.dumps(measure(name, make_model(), loss_settings, args, rng)), flush=True)


if __name__ == "__main__":
    main()
