"""CTranslate2 alone against CTranslate2 in the decode stage: same model, sentences, threads.

The decode stage times CTranslate2 in a worker process that never imports JAX, at the
threads its sweep chose for each pass (model/decoding/ctranslate2_search.py,
model/decoding/ctranslate2_sweep.py). This script checks that nothing of the stage's process costs
it time. For each CTranslate2 method of the config's decode artifact, it takes the stage's
batch-1 pass (its latency sample: the same sentences one at a time, with the same output
caps, search options and threads) and times it, in `--rounds` alternating rounds so that
a change in the machine's load touches both alike:

  alone        the same exported model in a fresh Python process that imports CTranslate2
               and nothing else (no JAX, no Beam): each round one untimed pass over the
               sample, then one timed;
  translator   the decode stage's path without Beam, in this process, where JAX holds the
               model (model/decoding/translator.py's Translator and its CTranslate2 worker).

Each sentence's figure is the median of its rounds. It prints the stage's median (from the
decode artifact, measured when the stage ran) and the translator's beside the one alone,
and the ratios to it: the stage's figure is trusted when it is at most 1.15x alone.

    PADIR_DATA_ROOT=/path/to/data python -m benchmarks.ctranslate2_alone \\
        [--config configs/demo.yaml] [--set workdir=/tmp/run] [--methods ct2_greedy] \\
        [--rounds 5]

The decode artifact must have been written with the sweep (its manifest's
`ctranslate2_sweep`). The stage's column compares with the others only on a machine as
quiet as it was when the stage ran; the translator's column is measured beside alone's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL = 1.15  # the stage's median over the one alone, at most


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--methods", help="comma-separated CTranslate2 methods (default: all)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating timed passes over the sample, each way")
    parser.add_argument("--alone", action="store_true",
                        help="(internal) time the requests read from stdin, in this process")
    return parser.parse_args(argv)


def time_alone(job: dict) -> dict:
    """In a fresh process: loads the model as the worker does, translates every request
    once untimed, then times each once. Returns {"seconds": per request; "modules": the
    runtimes this process imported besides CTranslate2 (none, or the figure is not
    alone)}."""
    # The worker's environment; it imports nothing else.
    from model.decoding import ctranslate2_worker

    for name, value in ctranslate2_worker.ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    import ctranslate2

    translator = ctranslate2.Translator(
        job["model_dir"], device=job["device"], compute_type=job["compute_type"],
        intra_threads=job["intra_threads"], inter_threads=job["inter_threads"])
    for rows, options in job["requests"]:  # warm-up, untimed
        translator.translate_batch(rows, **options)
    seconds = []
    for rows, options in job["requests"]:
        started = time.perf_counter()
        translator.translate_batch(rows, **options)
        seconds.append(time.perf_counter() - started)
    return {"seconds": seconds,
            "modules": sorted({m.split(".")[0] for m in sys.modules}
                              & {"jax", "jaxlib", "flax", "tensorflow", "apache_beam"})}


def _percentile(values, q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def compare(config: Any, *, methods: Optional[Sequence[str]] = None, rounds: int = 5
            ) -> list[dict]:
    """Per CTranslate2 method of a config's decode artifact (all, or those named in
    `methods`): the stage's, the translator's and the alone batch-1 figures (ms) and the
    ratios of the medians to the alone one."""
    import dataclasses

    import numpy as np

    from components import corpus, dag, records
    from components.tokenizer import EOS_ID
    from model import trained_model
    from model.decoding import ctranslate2_search, ctranslate2_sweep, translator
    from pipelines import decode

    decoded = dag.require_input(config, "decode")
    prepared = dag.require_input(config, "prepare")
    sweeps = {sweep["method"]: sweep
              for sweep in decoded.manifest["metrics"]["ctranslate2_sweep"]}
    wanted = methods or list(sweeps)
    boundaries = config.encode.bucket_boundaries
    split = decoded.manifest["metrics"]["test_sets"][0]
    sources = {pair["id"]: pair["source"] for pair in corpus.read_split(prepared.uri, split)}
    rows = []
    for method in config.decode.methods:
        if method.name not in wanted or method.name not in sweeps:
            continue
        timed = list(corpus.read_jsonl(
            decode.output_path(decoded.uri, decode.LATENCY, split, method.name)))
        texts = [sources[record["id"]] for record in timed]
        loaded = trained_model.load_cached(decoded.manifest["inputs"][method.stage])
        threads = ctranslate2_sweep.chosen(sweeps[method.name], ctranslate2_sweep.LATENCY)
        ours = translator.Translator(loaded, method, batch_size=1, boundaries=boundaries,
                                     ctranslate2_threads=threads)
        search = ctranslate2_search.Search(  # its requests; the Translator's worker
            loaded, method, threads=threads,
            vocabulary_map=translator.shortlist_table(loaded) if method.shortlist else None)
        requests = []
        for text in texts:  # the batch-1 rows and output caps, as the Translator makes them
            ids = loaded.tokenizer.encode([text])[0][:boundaries[-1] - 1] + [EOS_ID]
            _, max_len = records.decoder_shape(len(ids), boundaries)
            requests.append(search.request(np.asarray([ids], np.int32), max_len))
        job = json.dumps({"model_dir": search.model_dir, "device": ctranslate2_search.device(),
                          "compute_type": method.compute_type, "requests": requests,
                          **dataclasses.asdict(threads)})
        alone, translated = [], []
        ours.translate(texts)  # warm-up, untimed
        for _ in range(rounds):
            child = subprocess.run([sys.executable, "-m", "benchmarks.ctranslate2_alone", "--alone"],
                                   input=job, capture_output=True, text=True, check=True,
                                   cwd=ROOT)
            result = json.loads(child.stdout)
            if result["modules"]:
                raise RuntimeError(f"the process timed alone imported {result['modules']}")
            alone.append(result["seconds"])
            translated.append([t.latency_s for t in ours.translate(texts)])
        figures = {"stage": [1e3 * record["latency_s"] for record in timed],
                   "translator": [1e3 * statistics.median(s) for s in zip(*translated)],
                   "alone": [1e3 * statistics.median(s) for s in zip(*alone)]}
        row = {"method": method.name, "threads": str(threads), "sentences": len(timed)}
        for name, values in figures.items():
            row[f"{name}_median_ms"] = statistics.median(values)
            row[f"{name}_p90_ms"] = _percentile(values, 90)
        for name in ("stage", "translator"):
            row[f"{name}_ratio"] = row[f"{name}_median_ms"] / row["alone_median_ms"]
        rows.append(row)
    return rows


def render(rows: Sequence[dict]) -> str:
    """`compare`'s rows as a markdown table and a verdict per method."""
    lines = ["| method | threads (batch 1) | sentences | median ms: stage | translator | alone | "
             "stage / alone | translator / alone | p90 ms: stage | translator | alone |"]
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        lines.append(f"| {row['method']} | {row['threads']} | {row['sentences']} | "
                     + " | ".join(f"{row[f'{name}_median_ms']:.2f}"
                                  for name in ("stage", "translator", "alone"))
                     + f" | {row['stage_ratio']:.2f}x | {row['translator_ratio']:.2f}x | "
                     + " | ".join(f"{row[f'{name}_p90_ms']:.2f}"
                                  for name in ("stage", "translator", "alone")) + " |")
    for row in rows:
        verdict = "at most" if row["stage_ratio"] <= GOAL else "MORE than"
        lines.append(f"{row['method']}: the stage's median is {verdict} {GOAL - 1:.0%} slower "
                     f"than the same model timed alone ({row['stage_ratio']:.2f}x; the "
                     f"translator's, measured beside it, {row['translator_ratio']:.2f}x)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.alone:
        print(json.dumps(time_alone(json.load(sys.stdin))))
        return 0
    from components import config as config_lib

    config = config_lib.load(args.config, args.set)
    print(render(compare(config, methods=args.methods.split(",") if args.methods else None,
                         rounds=args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
