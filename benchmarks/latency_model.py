"""A latency model of AR greedy and PaDIR-k at batch 1: the work each does, counted from the
compiled programs, over this machine's measured rates, checked against the floors that
benchmarks/crossover.py measured; then the same counts over an accelerator's published
figures, as a projection.

    python -m benchmarks.latency_model --crossover crossover.json [--json model.json]

Counted, per shape of the crossover run (its random models, batch 1, its length L), from
XLA's cost analysis of five programs: the encoder call, one cached AR step, one PaDIR
pass over L positions, one block drafter pass (the shape's encoder, one decoder layer,
`DRAFT_BLOCK` tokens after a prefix, over L positions) and one teacher pass over a block
of `DRAFT_BLOCK` + 1 positions over its cache: FLOPs, bytes accessed, and operations (the
instructions of the compiled program outside fusions: each is a kernel the runtime
dispatches). A sentence is AR greedy = encoder + L steps, PaDIR-k = encoder + k passes,
draft and verify = both encoders + L / t rounds of a drafter pass and a teacher block, at
t output tokens a round (`--tokens-per-round`: what a drafter reaches on dev,
benchmarks/drafter_study.py, and the issue's goal of 6).

The model of one call: max(FLOPs / matmul rate, bytes / bandwidth) + operations x the cost
of one operation. Measured here, per model: the matmul rate of a chain of MLP matmuls over
L rows and as many distinct weights as the model has bytes, and the read bandwidth of a
working set that size (a small model stays in the caches); the cost of one operation, from
a loop of small matmuls that cannot fuse. The prediction is checked against crossover's
`floor AR` and `floor PaDIR-k` rows (the same work, timed).

Projection rows (never a measurement): the same counts, bytes halved (bfloat16), on an H100
SXM (989 TFLOP/s dense bf16, 3.35 TB/s) and a TPU v3 core pair as the paper ran (123
TFLOP/s bf16, 900 GB/s), with an assumed cost per operation (`ACCELERATORS`).
`benchmarks/device_check.py --crossover` measures on a GPU what would replace them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from benchmarks import crossover
from components.tokenizer import NUM_RESERVED
from model.models import ARModel, DrafterModel, PaDIRModel, masked_hypothesis

BF16_BYTES = 0.5  # bytes read by a bfloat16 program relative to float32
DRAFT_BLOCK = 8  # the configs' drafter.block

@dataclasses.dataclass(frozen=True)
class Rates:
    """What a machine does per second, and what one operation costs it.

    `flops_per_s(d_model, working_set)`: the rate of a call's matmuls over L rows for a
    model of that width whose parameters take `working_set` bytes; `bytes_per_s
    (working_set)`: the rate at which it reads them (a step, one row, is bound by it)."""

    name: str
    flops_per_s: Callable[[int, float], float]
    bytes_per_s: Callable[[float], float]
    seconds_per_op: float
    measured: bool  # False: a projection from published figures


# Published peak figures; the cost per operation is an assumption (a kernel launch on a
# GPU, a step of the TPU's program), stated here because nothing on this machine measures it.
ACCELERATORS = (
    Rates("H100 SXM, bf16 (projection)", lambda *_: 989e12, lambda _: 3.35e12, 4e-6, False),
    Rates("TPU v3, bf16 (projection)", lambda *_: 123e12, lambda _: 900e9, 1e-6, False),
)


@dataclasses.dataclass(frozen=True)
class Work:
    """One call's work, from the compiled program."""

    flops: float
    bytes: float
    ops: int

    def seconds(self, rates: Rates, d_model: int, working_set: float,
                scale_bytes: float = 1.0) -> float:
        return (max(self.flops / rates.flops_per_s(d_model, working_set),
                    scale_bytes * self.bytes / rates.bytes_per_s(working_set))
                + self.ops * rates.seconds_per_op)


_SKIPPED = ("parameter(", "constant(", "get-tuple-element(", "tuple(", "bitcast(")


def count_ops(hlo: str) -> int:
    """Instructions of the entry computation and of loop bodies (parameters, constants,
    tuples and bitcasts left out): what XLA's runtime runs one by one."""
    count, inside = 0, False
    for line in hlo.splitlines():
        if line and not line.startswith(" "):
            inside = line.startswith("ENTRY") or "arg_tuple" in line.split("->")[0]
            continue
        if inside and " = " in line and not any(s in line for s in _SKIPPED):
            count += 1
    return count


def work(fn: Callable, *args) -> Work:
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return Work(float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
                count_ops(compiled.as_text()))


def shape_work(shape: crossover.Shape, length: int) -> dict[str, Any]:
    """The encoder's, one AR step's and one PaDIR pass's work at batch 1, and the
    parameters' bytes (the working set of a step or pass)."""
    ar = ARModel(shape.config(length), shape.vocab)
    padir = PaDIRModel(shape.config(length), shape.vocab, NUM_RESERVED)
    ar_params = crossover.random_params(ar, length, 0)
    padir_params = crossover.random_params(padir, length, 0)
    source = jnp.asarray(crossover.sources(1, length, shape.vocab))
    encoded, memory_mask = jax.jit(ar.encode)(ar_params, source)
    memory = jax.jit(ar.memory)(ar_params, encoded, memory_mask)  # once a sentence
    cache = ar.init_cache(ar_params, encoded, memory_mask, length)
    ids = jnp.ones((1, 1), jnp.int32)

    def step(p, memory, m, cache, ids):
        return ar.make_tokens_to_logits(p, memory, m)(ids, cache)

    p_encoded, p_mask = jax.jit(padir.encode)(padir_params, source)
    hypothesis = masked_hypothesis(jnp.full((1,), length, jnp.int32), length)

    p_memory = jax.jit(padir.decoder_memory)(padir_params, p_encoded, p_mask, hypothesis != 0)

    def padir_encode(p, s):
        e, m = padir.encode(p, s)
        return e, m, padir.length_logits(p, e), padir.memory(p, e, m)

    drafter = DrafterModel(shape.config(length, decoder_layers=1), shape.vocab, DRAFT_BLOCK)
    drafter_params = crossover.random_params(drafter, length, 0)
    d_encoded, d_mask = jax.jit(drafter.encode)(drafter_params, source)
    d_memory = jax.jit(drafter.memory)(drafter_params, d_encoded, d_mask)
    prefix = jnp.full((1,), length // 2, jnp.int32)  # the shapes do not depend on it
    block_cache = ar.init_block_cache(ar_params, encoded, memory_mask, length + DRAFT_BLOCK + 1)
    block = jnp.ones((1, DRAFT_BLOCK + 1), jnp.int32)

    def with_memory(model):  # an encoder call, and its keys and values for the decoder
        def encode(p, s):
            e, m = model.encode(p, s)
            return e, m, model.memory(p, e, m)
        return encode

    nbytes = sum(x.nbytes for x in jax.tree.leaves(ar_params))
    return {"encode_ar": work(with_memory(ar), ar_params, source),
            "step": work(step, ar_params, memory, memory_mask, cache, ids),
            "encode_padir": work(padir_encode, padir_params, source),
            "pass": work(padir.pass_logits, padir_params, p_memory, hypothesis),
            "encode_drafter": work(with_memory(drafter), drafter_params, source),
            "draft": work(drafter.draft, drafter_params, d_memory, d_mask,
                          jnp.ones((1, length), jnp.int32), prefix),
            "verify": work(ar.block_logits, ar_params, memory, memory_mask, block, prefix,
                           block_cache),
            "parameter_bytes": nbytes}


def _median_seconds(fn: Callable, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_rates(models: Sequence[tuple[int, float]], rows: int) -> Rates:
    """This machine: for each (d_model, parameter bytes), the rate of a chain of MLP
    matmuls ([rows, D] x [D, 4D] x [4D, D]) over as many distinct weights as the model has
    bytes, and the read bandwidth of a working set of those bytes (a sum over them); the
    cost of one operation, from a loop of 200 small matmuls that cannot fuse, less one of
    100."""
    flops, bandwidth = {}, {}
    for d_model, nbytes in models:
        layers = max(1, round(nbytes / (32 * d_model**2)))
        up = jnp.full((layers, d_model, 4 * d_model), 0.01, jnp.float32)
        down = jnp.full((layers, 4 * d_model, d_model), 0.01, jnp.float32)

        def chain(x, up, down):
            return jax.lax.fori_loop(0, up.shape[0],
                                     lambda i, x: jnp.tanh(x @ up[i]) @ down[i], x)

        x = jnp.ones((rows, d_model), jnp.float32)
        flops[d_model, nbytes] = (2 * rows * 8 * d_model**2 * layers
                                  / _median_seconds(jax.jit(chain), x, up, down))
        data = jnp.ones((max(1, int(nbytes // 4)),), jnp.float32)
        bandwidth[nbytes] = data.nbytes / _median_seconds(jax.jit(jnp.sum), data)

    def small(n):
        def run(x, w):
            return jax.lax.fori_loop(0, n, lambda _, x: (x @ w) @ w, x)
        return jax.jit(run)

    x, w = jnp.ones((1, 64)), jnp.full((64, 64), 0.01)
    per_op = (_median_seconds(small(200), x, w) - _median_seconds(small(100), x, w)) / 200
    return Rates("this CPU (measured)", lambda d, n: flops[d, n], lambda n: bandwidth[n],
                 per_op, True)


def predict(counts: dict[str, Any], length: int, d_model: int, rates: Rates,
            scale_bytes: float = 1.0, tokens_per_round: Sequence[float] = ()
            ) -> dict[str, float]:
    """Seconds per sentence of each method (AR greedy; PaDIR-k; draft and verify at each
    of `tokens_per_round`) from the counts."""
    working_set = counts["parameter_bytes"]

    def seconds(name: str) -> float:
        return counts[name].seconds(rates, d_model, working_set, scale_bytes)

    out = {"AR greedy": seconds("encode_ar") + length * seconds("step")}
    for k in crossover.PADIR_PASSES:
        out[f"PaDIR-{k}"] = seconds("encode_padir") + k * seconds("pass")
    for t in tokens_per_round:
        out[draft_verify_name(t)] = (seconds("encode_ar") + seconds("encode_drafter")
                                     + length / t * (seconds("draft") + seconds("verify")))
    return out


def draft_verify_name(tokens_per_round: float) -> str:
    return f"draft and verify, {tokens_per_round:g} tok/round"


def repeated_work(counts: dict[str, Any], length: int, tokens_per_round: Sequence[float]
                  ) -> dict[str, tuple[float, Work, int]]:
    """Per method, what it repeats a sentence: (how many times, the work of one, the
    sequential calls in one): AR greedy's steps, PaDIR-k's passes, draft and verify's
    rounds (a drafter pass and a teacher block)."""
    round_work = Work(*(getattr(counts["draft"], f) + getattr(counts["verify"], f)
                        for f in ("flops", "bytes", "ops")))
    return {"AR greedy": (length, counts["step"], 1),
            **{f"PaDIR-{k}": (k, counts["pass"], 1) for k in crossover.PADIR_PASSES},
            **{draft_verify_name(t): (length / t, round_work, 2) for t in tokens_per_round}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crossover", required=True, help="benchmarks/crossover.py's --json")
    parser.add_argument("--tokens-per-round", default="2,6",
                        help="draft and verify's output tokens a round to model: what a "
                             "drafter reaches (benchmarks/drafter_study.py) and the goal")
    parser.add_argument("--json", metavar="PATH")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with open(args.crossover) as f:
        run = json.load(f)
    measured, length = run["rows"], run["length"]
    per_round = [float(t) for t in args.tokens_per_round.split(",")]
    names = list(dict.fromkeys(r["shape"] for r in measured))
    shapes = {name: crossover.Shape.parse(name) for name in names}
    counts = {name: shape_work(shapes[name], length) for name in names}
    rates = measure_rates([(shapes[n].d_model, counts[n]["parameter_bytes"]) for n in names],
                          length)
    print(f"this CPU, per shape: the matmul rate over {length} rows streaming the model's "
          "bytes, and the read bandwidth of them: " + ", ".join(
              f"{n}: {rates.flops_per_s(shapes[n].d_model, c['parameter_bytes']) / 1e9:.0f} "
              f"GFLOP/s, {rates.bytes_per_s(c['parameter_bytes']) / 1e9:.0f} GB/s"
              for n, c in counts.items())
          + f"; {1e6 * rates.seconds_per_op:.2f} us an operation\n")
    floors = {(r["shape"], r["method"]): r["median_ms"] for r in measured
              if r["method"].startswith("floor")}
    lines = ["| shape | method | MFLOP | MB | ops | calls | predicted ms | measured floor ms "
             "| error |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    projection = ["| shape | method | " + " | ".join(r.name for r in ACCELERATORS)
                  + " | speedup over AR greedy |", "|---|---|" + "---:|" *
                  (len(ACCELERATORS) + 1)]
    out = []
    for name in names:
        c = counts[name]
        d_model = shapes[name].d_model
        predicted = predict(c, length, d_model, rates, tokens_per_round=per_round)
        projected = [predict(c, length, d_model, r, BF16_BYTES, per_round)
                     for r in ACCELERATORS]
        for method, seconds in predicted.items():
            floor_name = "floor AR" if method == "AR greedy" else f"floor {method}"
            real = floors.get((name, floor_name))
            rounds, unit, calls_each = repeated_work(c, length, per_round)[method]
            calls = rounds * calls_each
            error = None if real is None else 1e3 * seconds / real - 1
            lines.append(f"| {name} | {method} | {rounds * unit.flops / 1e6:.0f} | "
                         f"{rounds * unit.bytes / 1e6:.0f} | {rounds * unit.ops:.0f} | "
                         f"{calls:.1f} | "
                         f"{1e3 * seconds:.2f} | {'-' if real is None else f'{real:.2f}'} | "
                         f"{'-' if error is None else f'{100 * error:+.0f}%'} |")
            speedup = ", ".join(f"{p['AR greedy'] / p[method]:.2f}x" for p in projected) \
                if method != "AR greedy" else "-"
            projection.append(f"| {name} | {method} | " + " | ".join(
                f"{1e3 * p[method]:.3f}" for p in projected) + f" | {speedup} |")
            out.append({"shape": name, "method": method, "predicted_ms": 1e3 * seconds,
                        "measured_floor_ms": real,
                        "projected_ms": {r.name: 1e3 * p[method]
                                         for r, p in zip(ACCELERATORS, projected)}})
    print("\n".join(lines))
    print("\nprojection (published peak figures, bf16; not a measurement), ms per sentence:\n")
    print("\n".join(projection))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
