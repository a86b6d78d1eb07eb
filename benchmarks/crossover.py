"""Where PaDIR's passes overtake an AR search, by model size (the sizes this machine cannot
train): models of the project's own code with random parameters, every output length fixed.

    python -m benchmarks.crossover [--shapes 128x4,256x6,512x6,1024x6] [--vocabs 8000,32000] \\
        [--length 20] [--sentences 20] [--batch-size 64] [--dtypes float32] \\
        [--json crossover.json] [--plot crossover.png]

A shape `DxN` is d_model D with N encoder and N decoder layers, MLP 4D (the benchmark's
128x4 keeps its MLP of 256), D/64 heads (at least 4). Every source has `--length` ids (EOS
last) and every output `--length` tokens counting EOS, so that an untrained model does a
trained one's work: our AR greedy's EOS can never win (its embedding row is zero, a logit
of 0 against the best of thousands of random ones), CTranslate2 decodes between its
minimum and maximum decoding length, PaDIR is given the length.

Rows per shape, at batch 1 (median and p99 over `--sentences` sources, interleaved) and
batched (`--batch-size` rows, sentences/s):
* `floor AR` and `floor PaDIR-k` (benchmarks/floors.py): the plain network work;
* `JAX greedy`: `beam_search.greedy`, as the Translator runs it (encoder call, then the search);
* `JAX PaDIR-k` for k in 1, 2, 4: `refinement.refine` on the given length (its early stop
  included: `passes` says how many it ran);
* `CT2 greedy` in float32 and int8, of the teacher's shape and of the AR student's (the
  same encoder, one decoder layer), exported with model/decoding/ctranslate2_export.py and run in a
  process of its own (model/decoding/ctranslate2_worker.py; on CUDA where JAX runs on a GPU) at
  the thread setting that its sweep's grid finds fastest for the regime on this shape.

The plot draws each PaDIR row's speedup over the fastest AR row of its shape and regime;
the summary names the smallest shape where a PaDIR row is faster (the crossover), or says
there is none up to the largest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import floors as floors_lib
from components.config import ModelConfig
from components.tokenizer import EOS_ID, NUM_RESERVED, RESERVED_PIECES
from model.decoding import (beam_search, ctranslate2_export, ctranslate2_search,
                            ctranslate2_sweep, refinement)
from model.models import ARModel, PaDIRModel
from model.transformer import NON_TARGET_IDS

SHAPES, VOCABS = "128x4,256x6,512x6,1024x6", "8000,32000"
LENGTH, SENTENCES = 20, 20  # source and output tokens; batch-1 sources
PADIR_PASSES = (1, 2, 4)
CT2_TYPES = ("float32", "int8")
AR = "AR"  # the kind of a row that a PaDIR row is compared with


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Transformer of `layers` encoder and decoder layers at width `d_model`."""

    d_model: int
    layers: int
    vocab: int

    @property
    def name(self) -> str:
        return f"{self.d_model}x{self.layers}, V {self.vocab:,}"

    @classmethod
    def parse(cls, name: str) -> "Shape":
        """The shape of a `name` ("128x4, V 8,000")."""
        size, vocab = name.split(", V ")
        d_model, layers = size.split("x")
        return cls(int(d_model), int(layers), int(vocab.replace(",", "")))

    def config(self, length: int, *, decoder_layers: Optional[int] = None,
               dtype: str = "float32") -> ModelConfig:
        mlp = 256 if (self.d_model, self.layers) == (128, 4) else 4 * self.d_model
        return ModelConfig(d_model=self.d_model, num_heads=max(4, self.d_model // 64),
                           num_encoder_layers=self.layers,
                           num_decoder_layers=decoder_layers or self.layers, mlp_dim=mlp,
                           dropout_rate=0.0, max_source_len=length, max_target_len=length,
                           dtype=dtype)


@dataclasses.dataclass
class Row:
    """One method on one shape: batch-1 seconds per sentence, batched sentences/s."""

    shape: str
    parameters: int
    method: str
    kind: str  # AR or PaDIR
    latency_s: list[float]
    sentences_per_s: float
    passes: Optional[float] = None  # sequential decoder calls per sentence

    def summary(self) -> dict:
        ordered = sorted(self.latency_s)
        return {"shape": self.shape, "parameters": self.parameters, "method": self.method,
                "kind": self.kind, "median_ms": 1e3 * statistics.median(ordered),
                "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
                "sentences_per_s": self.sentences_per_s, "passes": self.passes}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--vocabs", default=VOCABS)
    parser.add_argument("--length", type=int, default=LENGTH, help="source and output tokens")
    parser.add_argument("--sentences", type=int, default=SENTENCES, help="batch-1 sources")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dtypes", default="float32", help="of our JAX rows, e.g. "
                        "float32,bfloat16")
    parser.add_argument("--no-ctranslate2", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH")
    return parser.parse_args(argv)


def shapes(spec: str, vocabs: str) -> list[Shape]:
    out = []
    for vocab in (int(v) for v in vocabs.split(",")):
        for item in spec.split(","):
            d_model, layers = (int(x) for x in item.split("x"))
            out.append(Shape(d_model, layers, vocab))
    return out


def sources(count: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    """int32[count, length]: random real pieces, EOS last."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(NUM_RESERVED, vocab, size=(count, length)).astype(np.int32)
    ids[:, -1] = EOS_ID
    return ids


def random_params(model: Any, length: int, seed: int) -> Any:
    """Random parameters, stored in the model's compute type (a bfloat16 model reads half
    the bytes), EOS's embedding row zero."""
    batch = {"source": jnp.ones((1, length), jnp.int32),
             "target": jnp.ones((1, length), jnp.int32)}
    params = jax.jit(model.init)(jax.random.key(seed), batch)
    table = params["token_embedding"]["embedding"]  # EOS can never win: its logit is 0
    params["token_embedding"]["embedding"] = table.at[EOS_ID].set(0.0)
    return jax.tree.map(lambda x: x.astype(model.config.dtype), params)


def _count(params: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


class JaxMethods:
    """Our AR greedy and PaDIR-k on one shape, each as the Translator runs it: the encoder
    call, then the search call (compiled before they are timed)."""

    def __init__(self, shape: Shape, length: int, dtype: str, seed: int = 0):
        self.length = length
        self.ar = ARModel(shape.config(length, dtype=dtype), shape.vocab)
        self.padir = PaDIRModel(shape.config(length, dtype=dtype), shape.vocab, NUM_RESERVED)
        self.ar_params = random_params(self.ar, length, seed)
        self.padir_params = random_params(self.padir, length, seed)
        self.ar_floors = floors_lib.Floors(self.ar, self.ar_params)
        self.padir_floors = floors_lib.Floors(self.padir, self.padir_params)
        self._ar_encode = jax.jit(self.ar.encode)
        self._greedy = jax.jit(lambda p, e, m: beam_search.greedy(self.ar, p, e, m, length))
        self._padir_encode = jax.jit(self.padir.encode)
        self._refine = {k: jax.jit(_refiner(self.padir, length, k)) for k in PADIR_PASSES}

    def greedy(self, source: np.ndarray) -> tuple[float, int]:
        """(seconds, tokens before EOS or the cap) of a batch."""
        started = time.perf_counter()
        encoded, memory_mask = self._ar_encode(self.ar_params, source)
        tokens = jax.block_until_ready(self._greedy(self.ar_params, encoded, memory_mask))
        seconds = time.perf_counter() - started
        return seconds, int(np.min(np.sum(np.asarray(tokens) != 0, axis=1)))

    def refine(self, source: np.ndarray, passes: int) -> tuple[float, float]:
        """(seconds, mean passes run) of a batch decoded at the given length."""
        started = time.perf_counter()
        encoded, memory_mask = self._padir_encode(self.padir_params, source)
        lengths = jnp.full((source.shape[0], 1), self.length, jnp.int32)
        result = jax.block_until_ready(self._refine[passes](
            self.padir_params, refinement.Candidates(encoded, memory_mask, lengths)))
        return time.perf_counter() - started, float(np.mean(np.asarray(result.passes)))


def _refiner(model: PaDIRModel, width: int, passes: int) -> Callable:
    """`refinement.refine` of candidates `width` long, at most `passes` passes."""
    def run(params, candidates):
        return refinement.refine(model, params, candidates, width=width,
                                 max_iterations=passes)
    return run


def pieces(vocab: int) -> list[str]:
    """A vocabulary of `vocab` pieces for a random model: the reserved ones, then w6, w7, ..."""
    return list(RESERVED_PIECES) + [f"w{i}" for i in range(NUM_RESERVED, vocab)]


def _ct2_dirs(shape: Shape, length: int, params: dict[str, Any], root: str) -> dict[str, str]:
    """The teacher's and the AR student's random models as CTranslate2 directories."""
    return {name: ctranslate2_export.export(config, params[name], pieces(shape.vocab),
                                            f"{root}/{name}")
            for name, config in (("teacher", shape.config(length)),
                                 ("AR student", shape.config(length, decoder_layers=1)))}


def _ct2_options(length: int, pieces_of: Sequence[str]) -> dict:
    return dict(beam_size=1, min_decoding_length=length, max_decoding_length=length,
                return_end_token=True, suppress_sequences=[[pieces_of[i]] for i in NON_TARGET_IDS])


def ct2_rows(shape: Shape, length: int, source: np.ndarray, batch: np.ndarray,
             parameters: dict[str, int], params: dict[str, Any]) -> list[Row]:
    """CTranslate2 greedy of both AR shapes in both compute types, each in its own worker
    at the fastest setting of the sweep's grid for the regime (timed on 5 sentences)."""
    vocabulary = pieces(shape.vocab)
    options = _ct2_options(length, vocabulary)
    as_rows = [[vocabulary[i] for i in row] for row in source]
    batch_rows = [[vocabulary[i] for i in row] for row in batch]
    out = []
    cpus = ctranslate2_search.cpus()
    with tempfile.TemporaryDirectory(prefix="padir-crossover-") as root:
        for name, model_dir in _ct2_dirs(shape, length, params, root).items():
            for compute_type in CT2_TYPES:
                best = {}
                for regime in (ctranslate2_sweep.LATENCY, ctranslate2_sweep.BATCHED):
                    timings = {}
                    for threads in ctranslate2_sweep.grid(regime, cpus):
                        worker = ctranslate2_search.Worker(
                            model_dir, device=ctranslate2_search.device(),
                            compute_type=compute_type, threads=threads)
                        try:
                            if regime == ctranslate2_sweep.LATENCY:
                                worker.translate(as_rows[:1], options)  # warm
                                times = [worker.translate([row], options)[2]
                                         for row in as_rows]
                            else:
                                worker.translate(batch_rows, dict(options,
                                                 max_batch_size=len(batch_rows)))
                                times = [worker.translate(batch_rows, dict(
                                    options, max_batch_size=-(-len(batch_rows)
                                                              // threads.inter_threads)))[2]
                                    for _ in range(3)]
                        finally:
                            worker.close()
                        timings[threads] = times
                    fastest = min(timings, key=lambda t: statistics.median(timings[t]))
                    best[regime] = (fastest, timings[fastest])
                latency_threads, latency = best[ctranslate2_sweep.LATENCY]
                batched_threads, batched = best[ctranslate2_sweep.BATCHED]
                out.append(Row(shape.name, parameters[name],
                               f"CT2 greedy {compute_type}, {name} ({latency_threads} / "
                               f"{batched_threads})", AR, latency,
                               len(batch_rows) / statistics.median(batched),
                               passes=float(length)))
    return out


def measure(shape: Shape, *, length: int, sentences: int, batch_size: int, dtype: str,
            ctranslate2: bool) -> list[Row]:
    """Every row of one shape (see the module docstring)."""
    source = sources(sentences, length, shape.vocab)
    batch = sources(batch_size, length, shape.vocab, seed=1)
    jax_methods = JaxMethods(shape, length, dtype)
    suffix = "" if dtype == "float32" else f" {dtype}"
    ar_count, padir_count = _count(jax_methods.ar_params), _count(jax_methods.padir_params)
    calls: dict[str, tuple[str, int, Callable[[np.ndarray], tuple[float, Any]]]] = {
        f"floor AR{suffix}": (AR, ar_count, lambda s: (
            jax_methods.ar_floors.greedy(list(s[0]), source_width=length,
                                         steps=length).seconds, length)),
        f"JAX greedy{suffix}": (AR, ar_count, jax_methods.greedy),
    }
    for k in PADIR_PASSES:
        calls[f"floor PaDIR-{k}{suffix}"] = ("PaDIR", padir_count, lambda s, k=k: (
            jax_methods.padir_floors.padir(list(s[0]), source_width=length, length=length,
                                           passes=k).seconds, k))
        calls[f"JAX PaDIR-{k}{suffix}"] = ("PaDIR", padir_count,
                                           lambda s, k=k: jax_methods.refine(s, k))
    latency: dict[str, list[float]] = {name: [] for name in calls}
    passes: dict[str, list[float]] = {name: [] for name in calls}
    for name, (_, _, call) in calls.items():
        if not name.startswith("floor"):
            call(source[:1])  # compile
    for i in range(len(source)):  # interleaved, the order rotating
        names = list(calls)
        for name in names[i % len(names):] + names[:i % len(names)]:
            seconds, ran = calls[name][2](source[i:i + 1])
            latency[name].append(seconds)
            passes[name].append(ran)
    rows = []
    for name, (kind, count, call) in calls.items():
        if name.startswith("floor"):
            batched = None
        else:
            call(batch)  # compile
            batched = statistics.median(call(batch)[0] for _ in range(3))
        rows.append(Row(shape.name, count, name, kind, latency[name],
                        len(batch) / batched if batched else float("nan"),
                        passes=float(np.mean(passes[name]))))
    if ctranslate2 and dtype == "float32":
        student = ARModel(shape.config(length, decoder_layers=1), shape.vocab)
        student_params = random_params(student, length, seed=1)
        rows += ct2_rows(shape, length, source, batch,
                         {"teacher": ar_count, "AR student": _count(student_params)},
                         {"teacher": jax_methods.ar_params, "AR student": student_params})
    return rows


def speedups(rows: Sequence[dict]) -> list[dict]:
    """Each PaDIR method's speedup over the fastest AR method (floors left out) of its
    shape, at batch 1 (median) and batched."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ar = [r for r in rows if r["shape"] == shape and r["kind"] == AR
              and not r["method"].startswith("floor")]
        padir = [r for r in rows if r["shape"] == shape and r["kind"] != AR
                 and not r["method"].startswith("floor")]
        fastest = min(ar, key=lambda r: r["median_ms"])
        highest = max(ar, key=lambda r: r["sentences_per_s"])
        for r in padir:
            out.append({"shape": shape, "parameters": r["parameters"], "method": r["method"],
                        "batch1": fastest["median_ms"] / r["median_ms"],
                        "batch1_against": fastest["method"],
                        "batched": r["sentences_per_s"] / highest["sentences_per_s"],
                        "batched_against": highest["method"]})
    return out


def crossover(speedup_rows: Sequence[dict], regime: str) -> str:
    """The smallest shape where a PaDIR row beats the fastest AR row, in words."""
    for row in speedup_rows:
        if row[regime] > 1.0:
            return (f"{regime}: {row['method']} overtakes {row[regime + '_against']} at "
                    f"{row['shape']} ({row[regime]:.2f}x)")
    best = max(speedup_rows, key=lambda r: r[regime])
    return (f"{regime}: no crossover up to the largest shape; the closest is {best['method']} "
            f"at {best['shape']}, {best[regime]:.2f}x {best[regime + '_against']}")


def table(rows: Sequence[dict]) -> str:
    lines = ["| shape | parameters | method | passes | median ms | p99 ms | sent/s |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        throughput = "-" if r["sentences_per_s"] != r["sentences_per_s"] \
            else f"{r['sentences_per_s']:,.1f}"
        lines.append(f"| {r['shape']} | {r['parameters'] / 1e6:.1f}M | {r['method']} | "
                     f"{r['passes']:.1f} | {r['median_ms']:.2f} | {r['p99_ms']:.2f} | "
                     f"{throughput} |")
    return "\n".join(lines)


def plot(speedup_rows: Sequence[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, regime, title in ((axes[0], "batch1", "batch 1 (median latency)"),
                              (axes[1], "batched", "batched (throughput)")):
        vocabs = list(dict.fromkeys(Shape.parse(r["shape"]).vocab for r in speedup_rows))
        for color, method in enumerate(dict.fromkeys(r["method"] for r in speedup_rows)):
            for style, vocab in zip(("-", "--", ":"), vocabs):
                points = [r for r in speedup_rows if r["method"] == method
                          and Shape.parse(r["shape"]).vocab == vocab]
                ax.plot([r["parameters"] / 1e6 for r in points], [r[regime] for r in points],
                        marker="o", ls=style, color=f"C{color}",
                        label=f"{method}, V {vocab:,}")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_title(title)
    axes[0].set_ylabel("speedup over the fastest AR row")
    axes[0].legend(fontsize=8)
    fig.suptitle("PaDIR against the fastest AR search, random models of each shape")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sweep(shape_list: Sequence[Shape], *, length: int, sentences: int, batch_size: int,
          dtypes: Sequence[str] = ("float32",), ctranslate2: bool = True) -> dict:
    """Every row of every shape, printed shape by shape, then the crossover in each regime:
    {"length", "devices", "rows", "speedups", "crossover"} (what --json writes)."""
    print(f"devices {jax.devices()}; length {length}; {sentences} sentences at batch 1, "
          f"{batch_size} batched", flush=True)
    rows = []
    for shape in shape_list:
        for dtype in dtypes:
            started = time.time()
            measured = [r.summary() for r in measure(
                shape, length=length, sentences=sentences, batch_size=batch_size, dtype=dtype,
                ctranslate2=ctranslate2)]
            rows += measured
            print(f"\n{shape.name} ({dtype}, {time.time() - started:.0f} s)\n"
                  f"{table(measured)}", flush=True)
    found = speedups(rows)
    lines = [crossover(found, regime) for regime in ("batch1", "batched")]
    print("\n" + "\n".join(lines), flush=True)
    return {"length": length, "devices": [str(d) for d in jax.devices()], "rows": rows,
            "speedups": found, "crossover": lines}


def main(argv=None) -> int:
    args = parse_args(argv)
    figures = sweep(shapes(args.shapes, args.vocabs), length=args.length,
                    sentences=args.sentences, batch_size=args.batch_size,
                    dtypes=args.dtypes.split(","), ctranslate2=not args.no_ctranslate2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    if args.plot:
        plot(figures["speedups"], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
