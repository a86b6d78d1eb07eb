"""Decoding quality and speed on a test set: every method of a config, in one process.

With the trained models of an experiment (its `teacher` and `student` artifacts), decodes the
test set (Multi30k test2016 for configs/multi30k_en_de.yaml) with each method of the
config's `decode` section and prints, per method: sacreBLEU, chrF, mean decoder passes,
latency per sentence at batch 1 (median, p99), batched throughput, and the speedups over
AR greedy and AR beam search (components/report.py defines them), then the headline: the
focus method (PaDIR at 4 iterations) against both, and where a sentence's time goes at
batch 1 (medians): the encoder call (PaDIR: encoder + length head), the search (passes or
AR steps), the host between the two (PaDIR: reading the lengths, choosing the width), the
passes or steps, the cost of one, and the output width. With `--pass-profile`, one PaDIR pass
and one AR greedy step part by part (`pass_profile`, `ar_step_profile`): the network (split
into attention, MLP and the output projection), the reading of the logits, acceptance and
loop bookkeeping, on the sentence of the median output width.

Measurement: model/decoding/translator.py's Translator (jitted, static shapes; every shape is run
once untimed before it is timed; the time is the jitted call until block_until_ready).
CTranslate2 runs in a process of its own with the threads the decode stage's sweep chose
per regime (timed now if this machine has not timed it before), as the stage runs it. The
batch-1 pass is interleaved: sentence by sentence, every method decodes it in turn (the
order rotating per sentence), so that a change in the machine's load affects all methods
alike; the batched pass then runs method after method over the whole set. The figures are
decode time only, on whatever this machine is doing besides: compare ratios, not rates.
Methods whose artifact does not exist yet (e.g. the student while it trains) are skipped
with a note.

    PADIR_DATA_ROOT=/path/to/data python -m benchmarks.decode_speed \\
        [--config configs/multi30k_en_de.yaml] [--set k=v ...] [--max-sentences 20] \\
        [--methods ar_greedy,ar_beam4,padir_4] [--focus padir_4] [--batch-size 64] \\
        [--json report.json] [--pass-profile]

Other models or settings through `--set`: `--set workdir=/elsewhere` reads the artifacts
of another run of the config; `--set 'decode.methods=[{"name": "p", "kind": "refine",
"length_offsets": [0]}, ...]'` measures other decoding settings on the same checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from apache_beam.ml.inference.base import PredictionResult

from benchmarks import floors as floors_lib
from components import artifacts, corpus, dag, report
from components import config as config_lib
from components import records as records_lib
from components.tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID
from model import trained_model, transformer
from model.decoding import (beam_search, ctranslate2_search, ctranslate2_sweep, refinement,
                            translator)
from model.decoding.ctranslate2_sweep import BATCHED, LATENCY
from model.models import PaDIRModel, masked_hypothesis
from pipelines import decode


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/multi30k_en_de.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--test-set", help="a prepared test split (default: the first)")
    parser.add_argument("--max-sentences", type=int, help="the first N sentences by id")
    parser.add_argument("--methods", help="comma-separated method names (default: all)")
    parser.add_argument("--focus", default="padir_4", help="the method of the headline")
    parser.add_argument("--batch-size", type=int,
                        help="of the throughput pass (default: decode.throughput_batch_size)")
    parser.add_argument("--json", metavar="PATH", help="also write the report JSON here")
    parser.add_argument("--pass-profile", action="store_true",
                        help="also time one PaDIR pass and one AR greedy step part by part")
    parser.add_argument("--floor", action="store_true",
                        help="also time each PaDIR, AR greedy and draft and verify "
                             "method's floor beside it, "
                             "sentence by sentence (benchmarks/floors.py)")
    parser.add_argument("--profile-calls", type=int, default=30,
                        help="timed calls per part of --pass-profile (medians)")
    return parser.parse_args(argv)


def _records(pairs, translations) -> list[dict]:
    return [decode.to_record(pair, PredictionResult(pair["source"], t.as_record()))
            for pair, t in zip(pairs, translations)]


def _fmt(value, digits=2, suffix="") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def print_table(entry: dict, focus: str) -> None:
    bases = list(entry["baselines"].values())
    header = f"{'method':18} {'BLEU':>6} {'chrF':>6} {'stut.':>6} {'passes':>6} " \
             f"{'med ms':>8} {'p99 ms':>8} {'sent/s':>8}" + "".join(f"  {'vs ' + b + ' med/p99/thr':>26}" for b in bases)
    print(header)
    print("-" * len(header))
    for m in entry["methods"]:
        line = (f"{m['method']:18} {m['bleu']['score']:6.2f} {m['chrf']['score']:6.2f} "
                f"{m['stutter']['per_100_words']:6.2f} {m['mean_passes']:6.1f} {1e3 * m['latency_s']['median']:8.2f} "
                f"{1e3 * m['latency_s']['p99']:8.2f} "
                f"{_fmt(m['throughput'].get('sentences_per_s'), 1):>8}")
        for b in bases:
            s = m["speedup"][f"vs_{b}"]
            line += f"  {_fmt(s['median'], 2, 'x'):>8}/{_fmt(s['p99'], 2, 'x'):>8}/" \
                    f"{_fmt(s['throughput'], 2, 'x'):>8}"
        print(line)
    chosen = [m for m in entry["methods"] if m["method"] == focus]
    if chosen:
        m = chosen[0]
        print(f"\n{focus}: BLEU {m['bleu']['score']:.2f}, {m['mean_passes']:.1f} passes")
        for b in bases:
            s = m["speedup"][f"vs_{b}"]
            print(f"  speedup over {b}: median {_fmt(s['median'], 2, 'x')}, "
                  f"p99 {_fmt(s['p99'], 2, 'x')}, throughput {_fmt(s['throughput'], 2, 'x')}")
    print(f"\nsignature: {entry['methods'][0]['bleu']['signature']}; stut. = stutter per 100 "
          "words")


def print_breakdown(translations: dict[str, list]) -> None:
    """Where a sentence's time goes at batch 1: medians over the sentences (model/decoding/translator.py
    `Translation`); host = total - encode - search."""
    header = f"{'method':18} {'total ms':>9} {'encode':>8} {'search':>8} {'host':>8} " \
             f"{'passes':>7} {'ms/pass':>8} {'width':>6}"
    print("\nbatch 1, medians (AR: passes = steps):")
    print(header)
    print("-" * len(header))
    for name, done in translations.items():
        def median(values):
            return statistics.median(values)
        line = (f"{name:18} {1e3 * median([t.batch_seconds for t in done]):9.2f} "
                f"{1e3 * median([t.encode_seconds for t in done]):8.2f} "
                f"{1e3 * median([t.search_seconds for t in done]):8.2f} "
                f"{1e3 * median([t.batch_seconds - t.encode_seconds - t.search_seconds for t in done]):8.3f} "
                f"{median([t.passes for t in done]):7.1f} "
                f"{1e3 * median([t.search_seconds / max(t.passes, 1) for t in done]):8.3f} "
                f"{median([t.width for t in done]):6.0f}")
        print(line)


# --- one pass, part by part (--pass-profile) ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Part:
    """One row of a profile.

    `seconds`: the median of a jitted call less the median of an empty jitted call with the
    same arguments (its dispatch), divided by what the call repeats (applications, steps),
    or, for a `residual` row, a difference of such times (its name says which).
    `call_seconds`: the call's median as measured, divided alike (None for a residual).
    `level` 0 rows add up to the whole; level 1 rows split the level 0 row above.
    """

    name: str
    seconds: float
    call_seconds: Optional[float] = None
    mflop: Optional[float] = None  # XLA's flop count of the call, where it reports one
    level: int = 0
    residual: bool = False


@dataclasses.dataclass(frozen=True)
class Profile:
    """A pass (or step) part by part: `parts` add up to `whole` at level 0."""

    title: str
    unit: str  # "pass" or "step": the share column is of one
    parts: list[Part]
    whole: Part
    dispatch_seconds: float  # an empty jitted call with the whole's arguments
    notes: list[str]


def _empty(*args):
    return jnp.zeros((), jnp.int32)


_EMPTY = jax.jit(_empty, keep_unused=True)  # dispatch only: the same arguments, no work


def _median_calls(calls: dict[str, tuple[Callable, tuple]], repeats: int) -> dict[str, float]:
    """Median seconds of each jitted call until `block_until_ready`, after one untimed call
    that compiles it; interleaved call by call, round after round, so that a change in the
    machine's load touches every part alike."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            started = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def _mflop(fn: Callable, args: tuple) -> Optional[float]:
    """XLA's flop count of a jitted call (a while loop's body counted once), in millions."""
    try:
        cost = fn.lower(*args).compile().cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: no figure
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return None if flops is None or flops < 0 else flops / 1e6


def _measure(calls: dict[str, tuple[Callable, tuple]], repeats: int
             ) -> tuple[dict[str, Part], dict[str, float]]:
    """Each call and an empty call with its arguments, interleaved: (name -> Part, named by
    its key for now; name -> the median of its empty call)."""
    timed = dict(calls)
    for name, (_, args) in calls.items():
        timed[f"{name}/empty"] = (_EMPTY, args)
    medians = _median_calls(timed, repeats)
    parts = {name: Part(name, medians[name] - medians[f"{name}/empty"], medians[name],
                        _mflop(fn, args))
             for name, (fn, args) in calls.items()}
    return parts, {name: medians[f"{name}/empty"] for name in calls}


def _renamed(part: Part, name: str, *, level: int = 0, times: int = 1) -> Part:
    return dataclasses.replace(
        part, name=name, level=level, seconds=times * part.seconds,
        call_seconds=None if part.call_seconds is None else times * part.call_seconds,
        mflop=None if part.mflop is None else times * part.mflop)


CHAIN = 8  # applications of a sub-block per timed call (`_chained`)
SPLIT = ("self_attention", "positional_attention", "cross_attention", "mlp", "projection")


def _chained(apply: Callable, chain: int = CHAIN) -> Callable:
    """`apply(p, x, *rest)` run `chain` times in one jitted loop, each application on the
    previous one's output (or, where the output has another shape, on x shifted by one of
    its values) and with its other float inputs shifted by that value: nothing in it stays
    fixed across applications, so the loop computes everything every time (as one pass
    does), and the fixed cost of a call is shared by `chain` applications."""
    def run(p, x, *rest):
        out = jax.eval_shape(apply, p, x, *rest)

        def body(_, carry):
            x, rest, _ = carry
            out = apply(p, x, *rest)
            shift = out[(0,) * out.ndim].astype(x.dtype)
            rest = tuple(r + shift.astype(r.dtype) if jnp.issubdtype(r.dtype, jnp.floating)
                         else r for r in rest)
            return (out if out.shape == x.shape else x + shift), rest, out

        start = (x, tuple(rest), jnp.zeros(out.shape, out.dtype))
        return jax.lax.fori_loop(0, chain, body, start)[2]  # the last output: all are live

    return jax.jit(run)


def _network_split(model: PaDIRModel, params: Any, encoded: jax.Array, memory_mask: jax.Array,
                   valid: jax.Array) -> dict[str, tuple[Callable, tuple]]:
    """The sub-blocks of the decoder, each the model's own Flax module on the parameters of
    decoder layer 0 (every layer has the same shapes), applied `CHAIN` times in one call
    (`_chained`): its attention sublayers (their key and value projections included), its
    MLP, and the tied output projection."""
    cfg = model.config
    rows, width = valid.shape
    layer = params["decoder"]["layer_0"]
    x = jax.random.normal(jax.random.key(0), (rows, width, cfg.d_model)).astype(cfg.dtype)
    table = params["decoder"]["pos_embedding"][:width].astype(cfg.dtype)
    positions = jnp.broadcast_to(table, (rows, width, cfg.d_model))
    self_mask = nn.make_attention_mask(valid, valid)  # [N, 1, T, T]
    cross_mask = nn.make_attention_mask(valid, memory_mask)  # [N, 1, T, S]

    def attention(name, inputs):  # inputs(x, other) -> (query, key, value)
        module = transformer._attention(cfg, name)

        def apply(p, x, other, mask):
            q, k, v = inputs(x, other)
            return module.apply({"params": p}, q, inputs_k=k, inputs_v=v, mask=mask)

        return _chained(apply)

    calls = {"self_attention": (attention("self_attention", lambda x, _: (x, x, x)),
                                (layer["self_attention"], x, x, self_mask))}
    if "positional_attention" in layer:  # where to read by position, what to read the tokens
        calls["positional_attention"] = (
            attention("positional_attention", lambda x, pos: (pos, pos, x)),
            (layer["positional_attention"], x, positions, self_mask))
    calls["cross_attention"] = (
        attention("cross_attention", lambda x, memory: (x, memory, memory)),
        (layer["cross_attention"], x, encoded, cross_mask))
    mlp = transformer.MlpBlock(cfg)
    calls["mlp"] = (_chained(lambda p, h: mlp.apply({"params": p}, h, True)), (layer["mlp"], x))

    def projection(embedding, y):  # transformer._output_logits
        logits = jnp.dot(y, embedding.T.astype(y.dtype)) * cfg.d_model**-0.5
        return logits.astype(jnp.float32)

    calls["projection"] = (_chained(projection),
                           (params["token_embedding"]["embedding"], x))
    return calls


def pass_profile(model: refinement.NARModel, params: Any, source: Any, *, max_len: int,
                 num_length_candidates: int = 1, length_offsets: Sequence[int] = (0,),
                 repeats: int = 30) -> Profile:
    """One PaDIR refinement pass over a batch's candidates, part by part.

    The batch (`source` int32[B, S]) is encoded and its candidates picked as
    `refinement.predict_candidates` does; the width is `refinement.output_width` of them. Then,
    each as its own jitted call on the first pass's inputs (the all-[MASK] hypothesis):
    the network (`model.pass_logits` on `model.decoder_memory`), the reading of its logits
    (`refinement.read_logits`), the acceptance (`refinement.accept_predictions`), the loop
    (`refinement.refine_loop` for one pass on the given logits), and `refinement.refine` at one
    pass, the whole. What the loop has beyond reading and acceptance is the state update and
    the while loop; what `refine` has beyond network and loop is its set-up (candidate rows,
    initial hypothesis) and the choice of a candidate. For a `PaDIRModel`, the network is
    split by timing decoder layer 0's attention sublayers and MLP (times the layers) and
    the output projection, each alone and per application (`_chained`); the rest
    (embedding, norms, residuals, masks, and the fixed cost of a call that an empty call
    does not have) is what the network has beyond them. At one pass, what later passes
    reuse (the cross-attention keys and values, the masks, the positional-attention
    weights) is computed once in every call; a note gives `refine` at two passes less one,
    a later pass inside the loop. The initial hypothesis is [MASK] whatever the method's
    `init`. Each time is a median of `repeats` calls less an empty call's (see `Part`).
    """
    candidates = refinement.predict_candidates(
        model, params, jnp.asarray(source, jnp.int32),
        num_length_candidates=num_length_candidates, length_offsets=tuple(length_offsets),
        max_len=max_len)
    width = refinement.output_width(candidates.lengths, max_len)
    per_sentence = candidates.lengths.shape[1]
    lengths = candidates.lengths.reshape(-1)  # [N]
    encoded, memory_mask = jax.tree.map(lambda x: jnp.repeat(x, per_sentence, axis=0),
                                        (candidates.encoded, candidates.memory_mask))
    initial = masked_hypothesis(lengths, width)  # [N, T]: MASK, EOS, PAD
    valid, content = initial != PAD_ID, initial == MASK_ID
    memory = model.decoder_memory(params, encoded, memory_mask, valid)
    network = jax.jit(model.pass_logits)
    logits = network(params, memory, initial)
    read = jax.jit(refinement.read_logits)
    reading = read(logits)

    def loop(logits, initial, lengths):
        return refinement.refine_loop(lambda hypothesis: logits, initial, lengths, 1)

    def refine(passes):
        return jax.jit(lambda p, c: refinement.refine(model, p, c, width=width,
                                                    max_iterations=passes))

    calls = {
        "network": (network, (params, memory, initial)),
        "read": (read, (logits,)),
        "accept": (jax.jit(refinement.accept_predictions), (reading.prediction, initial, content)),
        "loop": (jax.jit(loop), (logits, initial, lengths)),
        "refine1": (refine(1), (params, candidates)),
        "refine2": (refine(2), (params, candidates)),
    }
    split = isinstance(model, PaDIRModel)
    if split:
        calls.update(_network_split(model, params, encoded, memory_mask, valid))
    measured, dispatch = _measure(calls, repeats)
    for name in SPLIT if split else ():  # per application; XLA counts a loop body once
        if name in measured:
            part = measured[name]
            measured[name] = dataclasses.replace(part, seconds=part.seconds / CHAIN,
                                                 call_seconds=part.call_seconds / CHAIN)
    layers = getattr(model.config, "num_decoder_layers", 1)
    net = measured["network"]
    parts = [_renamed(net, "network: decoder forward (pass_logits)")]
    if split:
        attention = [n for n in SPLIT[:3] if n in measured]
        per_layer = ", ".join(f"{n.split('_')[0]} {1e3 * measured[n].seconds:.3f}"
                              for n in attention)
        inner = [
            _renamed(Part("attention", sum(measured[n].seconds for n in attention),
                          sum(measured[n].call_seconds for n in attention),
                          _sum_or_none(measured[n].mflop for n in attention)),
                     f"attention, layer 0 x {layers} (per layer ms: {per_layer})",
                     level=1, times=layers),
            _renamed(measured["mlp"], f"MLP, layer 0 x {layers}", level=1, times=layers),
            _renamed(measured["projection"], "output projection to the vocabulary",
                     level=1),
        ]
        parts += inner + [Part("rest: embedding, norms, residuals, masks, the call's own cost "
                               "(the difference)",
                               net.seconds - sum(p.seconds for p in inner), level=1,
                               residual=True)]
    read_part, accept_part, loop_part = measured["read"], measured["accept"], measured["loop"]
    parts += [
        _renamed(read_part, "reading the logits (read_logits: argmax, exp-sum, scores)"),
        _renamed(accept_part, "acceptance (accept_predictions)"),
        Part("state update and while loop (refine_loop on given logits, less the two above)",
             loop_part.seconds - read_part.seconds - accept_part.seconds, residual=True),
    ]
    whole = _renamed(measured["refine1"], "refine at 1 pass (one call)")
    parts.append(Part("refine's set-up and choice of a candidate (the difference)",
                      whole.seconds - net.seconds - loop_part.seconds, residual=True))
    notes = []
    two = jax.device_get(calls["refine2"][0](params, candidates).passes)
    if int(np.max(two)) == 2:
        later = measured["refine2"].seconds - whole.seconds
        notes.append(f"a later pass inside the loop (refine at 2 passes less 1): "
                     f"{1e3 * later:.3f} ms (what passes reuse is computed once, before it)")
    sentences, rows = candidates.lengths.shape[0], int(lengths.shape[0])
    title = (f"one PaDIR pass: {sentences} sentence(s), {num_length_candidates} x "
             f"{tuple(length_offsets)} candidates = {rows} row(s) of width {width}, "
             f"{layers} decoder layers")
    return Profile(title, "pass", parts, whole, dispatch["refine1"], notes)


def _sum_or_none(values) -> Optional[float]:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def ar_step_profile(model: Any, params: Any, source: Any, *, max_len: int,
                    repeats: int = 30) -> Profile:
    """One AR greedy step (`beam_search.greedy` into `max_len` cache slots), part by part.

    Per step, over the steps greedy runs on `source` (until every row has emitted EOS),
    each a jitted call of that many steps: the greedy call (its cache set-up included); a
    bare loop that only runs the cached decoder step and its argmax (the network as in the
    loop: the cross-attention keys and values are computed once, before it); a loop of
    argmaxes over one step's logits. The network is the bare loop less the argmax loop;
    the bookkeeping (done flags, writing the tokens, the loop condition, the cache set-up)
    greedy less the bare loop. Times less an empty call's, divided by the steps.
    """
    source = jnp.asarray(source, jnp.int32)
    encoded, memory_mask = jax.jit(model.encode)(params, source)
    greedy = jax.jit(lambda p, e, m: beam_search.greedy(model, p, e, m, max_len))
    tokens = np.asarray(jax.device_get(greedy(params, encoded, memory_mask)))
    ends = [list(row).index(EOS_ID) + 1 if EOS_ID in row else max_len for row in tokens]
    steps = max(ends)
    cache = jax.jit(lambda p, e, m: model.init_cache(p, e, m, max_len))(
        params, encoded, memory_mask)
    start = jnp.full((source.shape[0], 1), BOS_ID, jnp.int32)

    def bare(p, e, m, cache, ids):
        step = model.make_tokens_to_logits(p, model.memory(p, e, m), m)

        def body(_, carry):
            ids, cache = carry
            logits, cache = step(ids, cache)
            return transformer.argmax_last(logits)[:, None], cache  # as greedy picks

        return jax.lax.fori_loop(0, steps, body, (ids, cache))[0]

    def argmaxes(logits, ids):  # the loop's argmax alone: each depends on the last one
        def body(_, ids):
            masked = jnp.where(ids == -1, 0.0, logits)  # never true; XLA cannot know it
            return transformer.argmax_last(masked)[:, None]

        return jax.lax.fori_loop(0, steps, body, ids)

    step_logits = jax.jit(lambda p, e, m, cache, ids: model.make_tokens_to_logits(
        p, model.memory(p, e, m), m)(ids, cache)[0])(
        params, encoded, memory_mask, cache, start)  # [B, V]
    calls = {
        "greedy": (greedy, (params, encoded, memory_mask)),
        "bare": (jax.jit(bare), (params, encoded, memory_mask, cache, start)),
        "argmax": (jax.jit(argmaxes), (step_logits, start)),
    }
    measured, dispatch = _measure(calls, repeats)
    bare, argmax, greedy_call = (
        dataclasses.replace(part, seconds=part.seconds / steps,
                            call_seconds=part.call_seconds / steps)
        for part in (measured["bare"], measured["argmax"], measured["greedy"]))
    whole = dataclasses.replace(greedy_call, name=f"greedy step (greedy call / {steps} steps)")
    parts = [
        Part("network: one cached decoder step (bare loop less argmax loop)",
             bare.seconds - argmax.seconds, mflop=bare.mflop, residual=True),
        dataclasses.replace(argmax, name="next token: argmax over the vocabulary and a loop "
                                         "iteration (a loop of argmaxes / steps)"),
        Part("bookkeeping: done flags, token writes, loop condition, cache set-up "
             "(greedy less bare loop)", whole.seconds - bare.seconds, residual=True),
    ]
    layers = getattr(model.config, "num_decoder_layers", 1)
    title = (f"one AR greedy step: {source.shape[0]} sentence(s), {steps} steps into "
             f"{max_len} cache slots, {layers} decoder layers")
    return Profile(title, "step", parts, whole, dispatch["greedy"], [])


def profile_table(profile: Profile) -> str:
    """A profile as a markdown table: part, ms, share of a pass (or step), MFLOP."""
    def row(part: Part) -> str:
        share = 100 * part.seconds / profile.whole.seconds if profile.whole.seconds > 0 \
            else None
        name = ("- " if part.level else "") + part.name
        return (f"| {name} | {1e3 * part.seconds:.3f} | {_fmt(share, 0, '%')} "
                f"| {_fmt(part.mflop, 2)} |")

    lines = [f"{profile.title}; medians of jitted calls, each less an empty call with its "
             f"arguments (its dispatch; the whole call's: "
             f"{1e3 * profile.dispatch_seconds:.3f} ms):", "",
             f"| part | ms | share of a {profile.unit} | MFLOP |", "|---|---:|---:|---:|"]
    lines += [row(part) for part in profile.parts] + [row(profile.whole)]
    lines += [f"\n{note}" for note in profile.notes]
    return "\n".join(lines)


def _source_ids(loaded: trained_model.LoadedModel, text: str, boundaries: Sequence[int]
                ) -> list[int]:
    """A sentence's ids as `Translator` decodes them: cut to the widest bucket, EOS last."""
    return loaded.tokenizer.encode([text])[0][:boundaries[-1] - 1] + [EOS_ID]


def _source_batch(loaded: trained_model.LoadedModel, text: str, boundaries: Sequence[int]
                  ) -> tuple[np.ndarray, int]:
    """One sentence as `Translator` feeds it: (source int32[1, S], output cap)."""
    row = _source_ids(loaded, text, boundaries)
    source_width, max_len = records_lib.decoder_shape(len(row), boundaries)
    source = np.full((1, source_width), PAD_ID, np.int32)
    source[0, :len(row)] = row
    return source, max_len


def representative(translations: Sequence[Any], key: str = "width") -> int:
    """The index of the first sentence whose `key` (width, or passes) is the median's
    (the lower median: a value some sentence has)."""
    values = [getattr(t, key) for t in translations]
    return values.index(statistics.median_low(values))


def print_pass_profiles(pairs: Sequence[dict], known: dict, translators: dict,
                        translations: dict, focus: str, repeats: int) -> None:
    """`pass_profile` of the focus PaDIR method (else the first `padir` one) on the sentence
    of its median width, and `ar_step_profile` of the first `ar_greedy` method on the same
    sentence (by its median steps when no PaDIR method ran)."""
    names = list(translators)
    padir = [n for n in [focus] + names if n in translators and known[n].kind == "refine"]
    greedy = [n for n in names if known[n].kind == "ar_greedy"]
    if not padir and not greedy:
        print("\nno padir or ar_greedy method measured: no pass profile")
        return
    chosen = padir[0] if padir else greedy[0]
    index = representative(translations[chosen], "width" if padir else "passes")
    print(f"\npass profile on sentence {index} (the median {'width' if padir else 'steps'} of "
          f"{chosen}), batch 1:\n")
    if padir:
        translator, method = translators[padir[0]], known[padir[0]]
        source, max_len = _source_batch(translator.loaded, pairs[index]["source"],
                                        translator.boundaries)
        print(profile_table(pass_profile(
            translator.loaded.model, translator.loaded.params, source, max_len=max_len,
            num_length_candidates=method.num_length_candidates,
            length_offsets=method.length_offsets, repeats=repeats)) + "\n")
    if greedy:
        translator = translators[greedy[0]]
        source, max_len = _source_batch(translator.loaded, pairs[index]["source"],
                                        translator.boundaries)
        print(profile_table(ar_step_profile(translator.loaded.model, translator.loaded.params,
                                            source, max_len=max_len, repeats=repeats)) + "\n")


# The kinds `--floor` times (benchmarks/floors.py).
FLOOR_KINDS = ("refine", "ar_greedy", "draft_verify")


def floor_of(floors: floors_lib.Floors, kind: str, source_ids: Sequence[int],
             boundaries: Sequence[int], translation: Any) -> floors_lib.Floor:
    """The floor of one sentence's decoding by a method of `kind`, from what it did: PaDIR,
    its passes over the length it chose; AR greedy, one step per token it emitted; draft
    and verify, its rounds into its width."""
    source_width, _ = records_lib.decoder_shape(len(source_ids), boundaries)
    if kind == "refine":
        return floors.padir(source_ids, source_width=source_width,
                            length=len(translation.tokens), passes=translation.passes)
    if kind == "draft_verify":
        return floors.draft_verify(source_ids, source_width=source_width,
                                   width=translation.width, rounds=translation.rounds)
    return floors.greedy(source_ids, source_width=source_width, steps=len(translation.tokens))


def print_floors(translations: dict[str, list], floors: dict[str, list]) -> None:
    """Each method beside its floor at batch 1 (medians over the sentences): the whole, the
    encoder call and the search, and the method's median of its per-sentence ratios."""
    header = (f"{'method':18} {'total ms':>9} {'floor':>7} {'x floor':>8} {'encode':>7} "
              f"{'floor':>7} {'search':>7} {'floor':>7} {'host':>6}")
    print("\nbatch 1, each method beside its floor (benchmarks/floors.py; medians, ms):")
    print(header)
    print("-" * len(header))
    for name, done in floors.items():
        methods = translations[name]
        def ms(values):
            return 1e3 * statistics.median(values)
        ratio = statistics.median(t.batch_seconds / f.seconds for t, f in zip(methods, done))
        print(f"{name:18} {ms([t.batch_seconds for t in methods]):9.2f} "
              f"{ms([f.seconds for f in done]):7.2f} {ratio:7.2f}x "
              f"{ms([t.encode_seconds for t in methods]):7.2f} "
              f"{ms([f.encode_seconds for f in done]):7.2f} "
              f"{ms([t.search_seconds for t in methods]):7.2f} "
              f"{ms([f.search_seconds for f in done]):7.2f} "
              f"{ms([t.batch_seconds - t.encode_seconds - t.search_seconds for t in methods]):6.2f}")


def ctranslate2_threads(config: config_lib.Config, prepared_uri: str,
                        methods: Sequence[config_lib.DecodeMethod]
                        ) -> dict[tuple[str, str], ctranslate2_search.Threads]:
    """The threads the decode stage gives each CTranslate2 method of `methods` per regime
    (its sweep, kept beside the method's export if timed before on this machine): (name,
    `LATENCY` or `BATCHED`) -> threads. CTranslate2 runs several-fold slower with threads
    a regime does not suit (two intra threads at batch 1 here: 38 against 3.6 ms)."""
    methods = tuple(m for m in methods if m.kind in ctranslate2_search.KINDS)
    if not methods:
        return {}
    selected = dataclasses.replace(config, decode=dataclasses.replace(config.decode,
                                                                      methods=methods))
    sweeps = decode.sweep_ctranslate2(selected, prepared_uri, {
        method.stage: dag.output_uri(config, method.stage) for method in methods})
    return {(name, regime): ctranslate2_sweep.chosen(record, regime)
            for name, record in sweeps.items() for regime in (LATENCY, BATCHED)}


def main(argv=None) -> int:
    args = parse_args(argv)
    config = config_lib.load(args.config, args.set)
    prepared = dag.require_input(config, "prepare")
    test_set = args.test_set or decode.decoded_splits(config.data)[0]
    pairs = list(corpus.read_split(prepared.uri, test_set))[:args.max_sentences]
    wanted = args.methods.split(",") if args.methods else [m.name for m in config.decode.methods]
    known = {m.name: m for m in config.decode.methods}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; the config has {list(known)}")
    # No batch wider than the test set: filler rows would count as work but not as sentences.
    batch_size = min(args.batch_size or config.decode.throughput_batch_size, len(pairs))
    present = [known[name] for name in wanted
               if artifacts.is_complete(dag.output_uri(config, known[name].stage))]
    for name in sorted(set(wanted) - {method.name for method in present}):
        print(f"skipping {name}: no complete {known[name].stage} artifact")
    threads = ctranslate2_threads(config, prepared.uri, present)
    latency, batched = {}, {}
    for method in present:
        loaded = trained_model.load_cached(dag.output_uri(config, method.stage))
        common = dict(boundaries=config.encode.bucket_boundaries)
        latency[method.name] = translator.Translator(
            loaded, method, batch_size=1, ctranslate2_threads=threads.get((method.name, LATENCY)),
            **common)
        batched[method.name] = translator.Translator(
            loaded, method, batch_size=batch_size,
            ctranslate2_threads=threads.get((method.name, BATCHED)), **common)
    if not latency:
        raise SystemExit("nothing to measure")
    names = list(latency)
    print(f"{test_set}: {len(pairs)} sentences, methods {names}, devices {jax.devices()}, "
          f"{os.cpu_count()} CPUs")

    floor_names = [n for n in names if args.floor and known[n].kind in FLOOR_KINDS]
    floors = {n: floors_lib.Floors(*floors_lib.models_of(latency[n])) for n in floor_names}
    floor_times: dict[str, list] = {name: [] for name in floor_names}
    started = time.time()
    translations = {name: [] for name in names}
    for i, pair in enumerate(pairs):  # interleaved batch-1 pass
        for name in names[i % len(names):] + names[:i % len(names)]:
            translations[name].append(latency[name].translate([pair["source"]])[0])
        for name in floor_names:  # each floor right after its method, on the same sentence
            floor_times[name].append(floor_of(floors[name], known[name].kind,
                                              _source_ids(latency[name].loaded, pair["source"],
                                                          latency[name].boundaries),
                                              latency[name].boundaries,
                                              translations[name][-1]))
    print(f"batch-1 pass: {time.time() - started:.1f} s")
    started = time.time()
    results = []
    # Shortest first, as the decode stage batches (pipelines/batching.py); scored in id order.
    tokenizer = next(iter(batched.values())).loaded.tokenizer
    lengths = [len(ids) for ids in tokenizer.encode([pair["source"] for pair in pairs])]
    by_length = sorted(range(len(pairs)), key=lambda i: (lengths[i], i))
    references = [pair["target"] for pair in pairs]
    for name in names:  # scored as the decode stage scores: the batched hypotheses
        translated = batched[name].translate([pairs[i]["source"] for i in by_length])
        in_order = [t for _, t in sorted(zip(by_length, translated), key=lambda x: x[0])]
        records = _records(pairs, in_order)
        results.append(report.score_method(name, known[name].kind, records, references,
                                           report.throughput(records, batch_size),
                                           _records(pairs, translations[name]),
                                           setting=report.describe_setting(known[name]),
                                           target_lang=config.data.target_lang))
    print(f"batched pass: {time.time() - started:.1f} s\n")
    content = report.build_report({test_set: results})
    print_table(content["test_sets"][test_set], args.focus)
    print_breakdown(translations)
    if floor_times:
        print_floors(translations, floor_times)
    for name in floor_names:
        if known[name].kind == "draft_verify":
            ids = _source_ids(latency[name].loaded, pairs[0]["source"], latency[name].boundaries)
            source_width, _ = records_lib.decoder_shape(len(ids), latency[name].boundaries)
            verify, step = floors[name].verify_against_step(
                ids, source_width=source_width, width=translations[name][0].width)
            print(f"{name}: the teacher over a block of {latency[name].loaded.model.block + 1} "
                  f"positions over its cache {1e3 * verify:.3f} ms, one cached step "
                  f"{1e3 * step:.3f} ms: {verify / step:.2f}x")
    if args.pass_profile:
        print_pass_profiles(pairs, known, latency, translations, args.focus, args.profile_calls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
