"""Decoding quality and speed on a test set: every method of a config, in one process.

With the trained models of an experiment (its `teacher` and `student` artifacts), decodes the
test set (Multi30k test2016 for configs/multi30k_en_de.yaml) with each method of the
config's `decode` section and prints, per method: sacreBLEU, chrF, mean decoder passes,
latency per sentence at batch 1 (median, p99), batched throughput, and the speedups over
AR greedy and AR beam search (components/report.py defines them), then the headline: the
focus method (PaDIR at 4 iterations) against both, and where a sentence's time goes at
batch 1 (medians): the encoder call (PaDIR: encoder + length head), the search (passes or
AR steps), the host between the two (PaDIR: reading the lengths, choosing the width), the
passes or steps, the cost of one, and the output width.

Measurement: model/inference.py's Translator (jitted, static shapes; every shape is run
once untimed before it is timed; the time is the jitted call until block_until_ready). The
batch-1 pass is interleaved: sentence by sentence, every method decodes it in turn (the
order rotating per sentence), so that a change in the machine's load affects all methods
alike; the batched pass then runs method after method over the whole set. The figures are
decode time only, on whatever this machine is doing besides: compare ratios, not rates.
Methods whose artifact does not exist yet (e.g. the student while it trains) are skipped
with a note.

    PADIR_DATA_ROOT=/path/to/data python benchmarks/decode_speed.py \\
        [--config configs/multi30k_en_de.yaml] [--set k=v ...] [--max-sentences 20] \\
        [--methods ar_greedy,ar_beam4,padir_4] [--focus padir_4] [--batch-size 64] \\
        [--json report.json]

Other models or settings through `--set`: `--set workdir=/elsewhere` reads the artifacts
of another run of the config; `--set 'decode.methods=[{"name": "p", "kind": "padir",
"length_offsets": [0]}, ...]'` measures other decoding settings on the same checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
from apache_beam.ml.inference.base import PredictionResult

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from components import artifacts, corpus, dag, report  # noqa: E402
from components import config as config_lib  # noqa: E402
from model import inference  # noqa: E402
from pipelines import decode  # noqa: E402


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
    """Where a sentence's time goes at batch 1: medians over the sentences (model/inference.py
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
    latency, batched = {}, {}
    for name in wanted:
        method = known[name]
        uri = dag.output_uri(config, method.stage)
        if not artifacts.is_complete(uri):
            print(f"skipping {name}: no complete {method.stage} artifact at {uri}")
            continue
        loaded = inference.load_cached(uri)
        common = dict(boundaries=config.encode.bucket_boundaries, seed=config.seed)
        latency[name] = inference.Translator(loaded, method, batch_size=1, **common)
        batched[name] = inference.Translator(loaded, method, batch_size=batch_size, **common)
    if not latency:
        raise SystemExit("nothing to measure")
    names = list(latency)
    print(f"{test_set}: {len(pairs)} sentences, methods {names}, devices {jax.devices()}, "
          f"{os.cpu_count()} CPUs")

    started = time.time()
    translations = {name: [] for name in names}
    for i, pair in enumerate(pairs):  # interleaved batch-1 pass
        for name in names[i % len(names):] + names[:i % len(names)]:
            translations[name].append(latency[name].translate([pair["source"]])[0])
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
                                           _records(pairs, translations[name])))
    print(f"batched pass: {time.time() - started:.1f} s\n")
    content = report.build_report({test_set: results})
    print_table(content["test_sets"][test_set], args.focus)
    print_breakdown(translations)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
