"""The block drafter's choices, measured on dev: the block K, its shape, drafter passes a
draft, and exact against tolerant verification.

Each arm is a set of `drafter.*` overrides, trained by the `drafter` stage itself (published
and cached under its key, so a rerun decodes again without training; the config's teacher
and distilled data are reused as they are) for the config's step and time budget: equal
training time when the budget is `drafter.loop.max_minutes`. Each arm then decodes the dev
set's first `--sentences` sentences at batch 64, for each drafter pass count in `--passes`
(exact verification) and once tolerant (top 3 within 1 nat), beside the teacher's greedy
search on the same sentences, and prints per row:

* rounds a sentence; drafted tokens accepted a round (over all rounds, as the report
  counts them, and the shares of sentences whose rounds accept on average none, half the
  block or more, and all of it); output tokens a round;
* sequential calls a sentence (drafter passes plus teacher passes) against greedy's steps;
* exact: the share of sentences whose output is greedy's token for token (exact
  verification: 100% but where the teacher's two best logits tie to float precision);
* batch-1 median ms over the first `--latency-sentences`, and greedy's on the same ones,
  measured in the same process before the arms.

    PADIR_DATA_ROOT=/path/to/data python -m benchmarks.drafter_study \\
        --config configs/demo.yaml --arms "drafter.block=4" "drafter.block=8" \\
        [--passes 1,2] [--sentences 500] [--latency-sentences 50] [--json study.json]

An arm is a space-separated list of overrides ("drafter.block=4 drafter.prefixes=1");
"base" is the config as it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

from components import artifacts, corpus, dag
from components import config as config_lib
from components.config import DecodeMethod

GREEDY = DecodeMethod("ar_greedy", "ar_greedy")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--arms", nargs="+", default=["base"],
                        help='each a space-separated list of overrides, or "base"')
    parser.add_argument("--passes", default="1", help="drafter passes a draft, e.g. 1,2")
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--latency-sentences", type=int, default=50)
    parser.add_argument("--json", help="write the rows here")
    return parser.parse_args(argv)


def round_shares(records: Sequence[dict], block: int) -> dict[str, float]:
    """Accepted drafted tokens a round, from records with `rounds` and `accepted` (per
    sentence): over all rounds (as the report's `draft_cost`), and the shares of sentences
    whose rounds accept on average none, at least half the block, the whole block."""
    per_round = [r["accepted"] / r["rounds"] for r in records]
    return {"accepted_per_round": (sum(r["accepted"] for r in records)
                                   / sum(r["rounds"] for r in records)),
            "none": float(np.mean([a == 0 for a in per_round])),
            "half_or_more": float(np.mean([a >= block / 2 for a in per_round])),
            "whole": float(np.mean([a >= block for a in per_round]))}


def measure(drafter: Any, teacher: Any, method: DecodeMethod, sources: list[str],
            greedy: list[Any], greedy_ms: float, latency_sentences: int) -> dict[str, Any]:
    """One decoding row of an arm (see the module docstring)."""
    from model.decoding import translator

    batched = translator.Translator(drafter, method, batch_size=min(64, len(sources)),
                                    rescorer=teacher)
    done = batched.translate(sources)
    records = [{"rounds": t.rounds, "accepted": t.accepted} for t in done]
    single = translator.Translator(drafter, method, batch_size=1, rescorer=teacher)
    latency = [single.translate([s])[0].latency_s for s in sources[:latency_sentences]]
    tokens = sum(len(t.tokens) for t in done)
    rounds = sum(t.rounds for t in done)
    return {
        "method": method.name,
        "rounds": rounds / len(done),
        **round_shares(records, drafter.model.block),
        "tokens_per_round": tokens / rounds,
        "calls": sum(t.passes for t in done) / len(done),
        "greedy_steps": sum(len(g.tokens) for g in greedy) / len(greedy),
        "exact": float(np.mean([t.tokens == g.tokens for t, g in zip(done, greedy)])),
        "median_ms": 1e3 * statistics.median(latency),
        "greedy_median_ms": greedy_ms,
    }


def run_arm(config: config_lib.Config, arm: str, args: argparse.Namespace,
            sources: list[str], greedy: list[Any], greedy_ms: float) -> list[dict]:
    """Trains (or reuses) the arm's drafter and measures its rows."""
    from model import trained_model
    from pipelines import drafter as drafter_stage

    started = time.time()
    uri = dag.output_uri(config, "drafter")
    artifact = (artifacts.read(uri) if artifacts.is_complete(uri)
                else drafter_stage.run(config))
    trained_s = time.time() - started
    drafter = trained_model.load_cached(artifact.uri)
    teacher = trained_model.load_cached(dag.output_uri(config, "teacher"))
    dev = artifact.manifest["metrics"]["dev"]
    rows = []
    methods = [DecodeMethod(f"draft_verify_{p}", "draft_verify", iterations=int(p))
               for p in args.passes.split(",")]
    methods.append(DecodeMethod("draft_verify_tolerant", "draft_verify", iterations=1,
                                tolerance_top_k=3, tolerance_margin=1.0))
    for method in methods:
        row = measure(drafter, teacher, method, sources, greedy, greedy_ms,
                      args.latency_sentences)
        rows.append({"arm": arm, "block": drafter.model.block,
                     "steps": artifact.manifest["counts"]["steps"],
                     "stage_s": round(trained_s, 1), "dev_accuracy": dev.get("accuracy"),
                     **row})
        print_rows(rows[-1:], header=not rows[:-1] and arm == args.arms[0])
    return rows


def print_rows(rows: Sequence[dict], header: bool) -> None:
    columns = ("arm", "block", "steps", "dev_accuracy", "method", "rounds",
               "accepted_per_round", "none", "half_or_more", "whole", "tokens_per_round",
               "calls", "greedy_steps", "exact", "median_ms", "greedy_median_ms")
    if header:
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        print("| " + " | ".join(cells) + " |", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    base = config_lib.load(args.config)
    pairs = sorted(corpus.read_split(dag.output_uri(base, "prepare"), "dev"),
                   key=lambda pair: corpus.id_sort_key(pair["id"]))[:args.sentences]
    sources = [pair["source"] for pair in pairs]
    from model import trained_model
    from model.decoding import translator

    teacher = trained_model.load_cached(dag.output_uri(base, "teacher"))
    greedy = translator.Translator(teacher, GREEDY, batch_size=min(64, len(sources)))
    greedy_out = greedy.translate(sources)
    single = translator.Translator(teacher, GREEDY, batch_size=1)
    greedy_ms = 1e3 * statistics.median(
        [single.translate([s])[0].latency_s for s in sources[:args.latency_sentences]])
    rows = []
    for arm in args.arms:
        overrides = [] if arm == "base" else arm.split()
        config = config_lib.load(args.config, overrides)
        if not artifacts.is_complete(dag.output_uri(config, "teacher")):
            raise SystemExit(f"{arm}: no published teacher for this config: run "
                             "`padir run` on it first")
        rows += run_arm(config, arm, args, sources, greedy_out, greedy_ms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
