"""Where a batch's time goes: each JAX decoding method at the decode stage's batch size
against its floor, on a config's trained models.

    PADIR_DATA_ROOT=/path/to/data python -m benchmarks.batch_floors \\
        [--config configs/multi30k_en_de.yaml] [--set k=v ...] [--max-sentences 1000] \\
        [--methods ar_greedy,ar_beam4,padir_4] [--batch-size 64] [--repeats 3] [--json PATH]

The test set is cut into the decode stage's batches (shortest source first, `batch-size`
rows) and every batch is decoded, per method, four ways, interleaved batch by batch so that
a change in the machine's load touches them alike (medians over `--repeats`):

* **stage**: `Translator.translate` on the batch's text, what the decode stage's model
  handler calls: tokenising, padding, both jitted calls, detokenising (Beam's own
  per-element work is not in it);
* **calls**: the jitted calls alone (`batch_seconds`: what the stage's sentences/s count);
* **floor at the cap**: the plain network work of the method's shape (benchmarks/floors.py
  `Floors.batch`): the encoder, then as many plain passes, cached steps or rounds as the
  batch ran, over the rows it ran them on (the AR searches and draft and verify drop
  finished rows: `compaction.loops`) and the positions it ran them at (PaDIR: its width,
  a multiple of 8; AR: its cache of the output cap; draft and verify: the cap);
* **floor**: the same over the batch's longest output only.

The stage's time then splits into network (the floor), the cap (floor at the cap less the
floor), search bookkeeping (calls less the floor at the cap: the loop's flags and writes,
a beam's top-k and cache reordering, PaDIR's acceptance and convergence test) and host
work (stage less calls). Greedy's and beam's floors step each row to its output's end;
beam search may run a few more steps before it knows no live beam can win (counted as
bookkeeping).
Methods over a shortlist and kinds without a floor (refine_rescored, adaptive, the
CTranslate2 kinds) are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

from benchmarks import floors as floors_lib
from components import artifacts, corpus, dag
from components import config as config_lib
from model import trained_model
from model.decoding import compaction, translator
from pipelines import decode

KINDS = floors_lib.PASS_KINDS + ("ar_greedy", "ar_beam", "draft_verify")
WAYS = ("stage", "calls", "floor_at_cap", "floor")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/multi30k_en_de.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--max-sentences", type=int, help="the first N sentences by id")
    parser.add_argument("--methods", help="comma-separated method names (default: every "
                                          "method of a kind with a floor)")
    parser.add_argument("--batch-size", type=int,
                        help="default: decode.throughput_batch_size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    return parser.parse_args(argv)


def batches(texts: Sequence[str], tokenizer: Any, batch_size: int) -> list[list[str]]:
    """The decode stage's batches: shortest source first, `batch_size` at a time."""
    lengths = [len(ids) for ids in tokenizer.encode(list(texts))]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    ordered = [texts[i] for i in order]
    return [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]


def floor_shape(kind: str, done: Sequence[translator.Translation], rows: int
                ) -> tuple[list[tuple[int, int]], int, int]:
    """(loops, width at the cap, longest output) of a decoded batch of `rows` rows (its
    sentences, then filler rows that copy the first): the (rows, count) of the loops it
    ran (count: passes, steps or rounds); the positions the method ran them at; its longest
    output, EOS counted."""
    longest = max(len(t.tokens) for t in done)
    filled = list(done) + [done[0]] * (rows - len(done))
    if kind in floors_lib.PASS_KINDS:
        loops = [(rows, max(t.passes for t in done))]
    elif kind == "draft_verify":
        loops = compaction.loops([t.rounds for t in filled])
    else:  # one step per token of each output
        loops = compaction.loops([len(t.tokens) for t in filled])
    return loops, done[0].width, longest


def time_batch(search: translator.Translator, floors: floors_lib.Floors,
               texts: Sequence[str]) -> dict[str, float]:
    """One batch's seconds, each of the four ways (the module docstring)."""
    started = time.perf_counter()
    done = search.translate(texts)
    stage = time.perf_counter() - started
    source, _, _ = search.source_batch(texts)
    loops, cap_width, longest = floor_shape(search.method.kind, done, len(source))
    beam_size = search.method.beam_size if search.method.kind == "ar_beam" else 1

    def floor(width: int) -> float:
        return floors.batch(search.method.kind, source, width=width, loops=loops,
                            beam_size=beam_size).seconds

    return {"stage": stage, "calls": done[0].batch_seconds,
            "floor_at_cap": floor(cap_width), "floor": floor(longest)}


def measure(search: translator.Translator, groups: Sequence[Sequence[str]],
            repeats: int) -> dict[str, float]:
    """Sentences per second of each way over all `groups`, and the stage's seconds split
    into network, cap, bookkeeping and host (medians per batch over `repeats`)."""
    floors = floors_lib.Floors(*floors_lib.models_of(search))
    for texts in groups:  # compiles every shape, untimed
        time_batch(search, floors, texts)
    per_batch = [[time_batch(search, floors, texts) for texts in groups]
                 for _ in range(repeats)]
    seconds = {way: sum(statistics.median(run[i][way] for run in per_batch)
                        for i in range(len(groups))) for way in WAYS}
    sentences = sum(len(texts) for texts in groups)
    figures = {f"{way}_sentences_per_s": sentences / seconds[way] for way in WAYS}
    figures.update(
        calls_over_floor=seconds["calls"] / seconds["floor"],
        network_s=seconds["floor"], cap_s=seconds["floor_at_cap"] - seconds["floor"],
        bookkeeping_s=seconds["calls"] - seconds["floor_at_cap"],
        host_s=seconds["stage"] - seconds["calls"], stage_s=seconds["stage"])
    return figures


def print_table(results: dict[str, dict[str, float]], batch_size: int) -> None:
    header = (f"{'method':16} {'stage':>7} {'calls':>7} {'floor@cap':>9} {'floor':>7} "
              f"{'calls/floor':>11} | {'network':>7} {'cap':>5} {'bookkeeping':>11} "
              f"{'host':>5}")
    print(f"\nbatch {batch_size}: sentences/s, and the stage's time split (% of it):")
    print(header)
    print("-" * len(header))
    for name, f in results.items():
        def share(key):
            return f"{100 * f[key] / f['stage_s']:.0f}%"
        print(f"{name:16} {f['stage_sentences_per_s']:7.1f} {f['calls_sentences_per_s']:7.1f} "
              f"{f['floor_at_cap_sentences_per_s']:9.1f} {f['floor_sentences_per_s']:7.1f} "
              f"{f['calls_over_floor']:10.2f}x | {share('network_s'):>7} {share('cap_s'):>5} "
              f"{share('bookkeeping_s'):>11} {share('host_s'):>5}")


def main(argv=None) -> int:
    args = parse_args(argv)
    config = config_lib.load(args.config, args.set)
    prepared = dag.require_input(config, "prepare")
    test_set = decode.decoded_splits(config.data)[0]
    texts = [pair["source"] for pair in corpus.read_split(prepared.uri, test_set)]
    texts = texts[:args.max_sentences]
    known = {m.name: m for m in config.decode.methods}
    wanted = (args.methods.split(",") if args.methods else
              [m.name for m in config.decode.methods if m.kind in KINDS and not m.shortlist])
    for name in wanted:
        if name not in known or known[name].kind not in KINDS or known[name].shortlist:
            raise SystemExit(f"{name}: not a method of the config with a floor "
                             f"(kinds {KINDS}, no shortlist)")
    batch_size = min(args.batch_size or config.decode.throughput_batch_size, len(texts))
    results: dict[str, dict[str, float]] = {}
    for name in wanted:
        method = known[name]
        uri = dag.output_uri(config, method.stage)
        if not artifacts.is_complete(uri):
            print(f"skipping {name}: no complete {method.stage} artifact at {uri}")
            continue
        search = translator.Translator(trained_model.load_cached(uri), method,
                                       batch_size=batch_size,
                                       boundaries=config.encode.bucket_boundaries)
        groups = batches(texts, search.loaded.tokenizer, batch_size)
        started = time.time()
        results[name] = measure(search, groups, args.repeats)
        print(f"{name}: {len(texts)} sentences in {len(groups)} batches, "
              f"measured in {time.time() - started:.0f} s", flush=True)
    if not results:
        raise SystemExit("nothing to measure")
    print_table(results, batch_size)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"test_set": test_set, "sentences": len(texts), "batch_size": batch_size,
                       "methods": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
