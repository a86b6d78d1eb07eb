"""The cost curve of the data stages: Tatoeba de->en at 10k, 40k and all 170k pairs.

For each size (a hashed sample of the corpus's lines, `data.train_sample_fraction`: the
same share of short and long sentences at every size; `all` reads the whole corpus) this
runs prepare, vocab, encode, teacher, distill and decode on configs/tatoeba_de_en.yaml, each
stage as its own `python -m flows.cli stage NAME CONFIG` process, as a user would start
it, and prints per stage and size: the pairs the stage processed, the process's wall time,
the stage's own wall time (its manifest's `wall_seconds`: without interpreter start-up and
imports), that time per 1k pairs, the marginal time per 1k pairs from the previous size
(fixed costs cancel out), the process's CPU time per 1k pairs (user + system: what a
Dataflow worker would be billed for; less disturbed than wall time by other processes on
the machine) and its marginal figure, and its peak RSS (`os.wait4`: the stage process and
what it waited for; Beam's FnApiRunner runs in-process).

The teacher is fixed and cheap, and not part of the curve: a tiny model (`TINY_TEACHER`)
trained for 600 steps at the first size, then published under every later size's teacher
key (`publish_teacher`: the same checkpoint, whose manifest names the first size's
vocabulary, so distill and decode tokenise with it). So distill and decode run one model
at every size, and their cost per pair is the corpus's, not that of a teacher trained on
more data, which ends its translations differently (a search runs until the last row of
its batch ends). It must be trained enough to end its translations near the source's
length: at 150 steps it stopped after two tokens, or never. Its translations are still
poor, and the benchmark's teacher costs more per decoder step: distill and decode show how
the cost of the search grows with the corpus, not what it is with a real teacher (`--set
teacher.model=...` measures another). decode runs the AR methods only (no student is
trained) and times every test sentence one at a time too (`latency_sentences: null`), so
its cost is linear in the carved test set, which is a fixed share of the sample. The
`words/pair` column (both sides, as the vocab stage counts them) shows that every size holds
sentences of the same lengths. At small sizes fixed costs (Beam start-up, compiling each
decoder shape) weigh on the time per 1k pairs; the marginal column is the per-pair cost.

    PADIR_DATA_ROOT=/path/to/data python -m benchmarks.scaling --sizes 10000 40000 all
    PADIR_DATA_ROOT=/path/to/data python -m benchmarks.scaling --sizes 10000 \\
        --workdir /tmp/scaling --set distill.batch_size=32

Exit status 1 if a stage failed (its log is named).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import yaml

from components import artifacts, corpus, dag
from components import config as config_lib

STAGES = ("prepare", "vocab", "encode", "teacher", "distill", "decode")
MEASURED = ("prepare", "vocab", "encode", "distill", "decode")  # the teacher is set-up
VOCAB_SIZE = 4000  # one size for every slice: the 10k shortest pairs hold about 5,000 pieces
TINY_TEACHER = {
    "model": {"d_model": 64, "num_heads": 2, "num_encoder_layers": 1, "num_decoder_layers": 1,
              "mlp_dim": 128, "dropout_rate": 0.0},
    "optimizer": {"learning_rate": 3.0e-3, "warmup_steps": 50},
    "loop": {"tokens_per_batch": 2048, "log_every": 100, "eval_every": 600,
             "checkpoint_every": 600},
    "steps": 600,
}


@dataclasses.dataclass(frozen=True)
class StageRun:
    """One stage process at one size."""

    stage: str
    pairs: int  # what the stage processed (see `pairs_processed`)
    process_seconds: float
    cpu_seconds: float  # user + system time of the process and what it waited for
    stage_seconds: float  # the manifest's wall_seconds
    peak_rss_mib: float


def size_overlay(path: str, base_config: str, workdir: str, fraction: float) -> str:
    """Writes the config of one size (an overlay of `base_config`) to `path`."""
    overlay = {
        "include": os.path.abspath(base_config),
        "workdir": workdir,
        "data": {"train_sample_fraction": fraction},
        "vocab": {"size": VOCAB_SIZE},
        "teacher": TINY_TEACHER,
        "decode": {"methods": [{"name": "ar_greedy", "kind": "ar_greedy"},
                               {"name": "ar_beam4", "kind": "ar_beam", "beam_size": 4}],
                   "latency_sentences": None},
    }
    with open(path, "w") as f:
        yaml.safe_dump(overlay, f, sort_keys=False)
    return path


def run_stage(stage: str, config_path: str, overrides: Sequence[str], log_path: str
              ) -> tuple[float, float, float, int]:
    """Runs one stage in a fresh process; returns (wall seconds, CPU seconds, peak RSS in
    MiB, status)."""
    command = [sys.executable, "-m", "flows.cli", "stage", stage, config_path]
    command += [flag for override in overrides for flag in ("--set", override)]
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        # wait4, not wait: it returns this child's own resource usage (ru_maxrss in KiB).
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    return (time.monotonic() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
            process.returncode)


# The pairs each stage processed, from its manifest's counts: the train pairs (encode: and
# dev), or for decode the test sentences (each decoded by every method, batched and alone).
PAIRS = {
    "prepare": lambda counts: counts["read.train"],
    "vocab": lambda counts: counts["train_pairs"],
    "encode": lambda counts: counts["read.train"] + counts["read.dev"],
    "teacher": lambda counts: 0,  # set-up, not on the curve
    "distill": lambda counts: counts["read"],
    "decode": lambda counts: sum(n for name, n in counts.items() if name.startswith("read.")),
}


def publish_teacher(config: config_lib.Config, teacher: artifacts.Artifact) -> None:
    """Publishes `teacher` (trained at another size) under this size's teacher key: the
    same files and metrics, and its manifest's inputs, so its tokenizer is its own."""
    if artifacts.is_complete(dag.output_uri(config, "teacher")):
        return
    with artifacts.write(config.workdir, "teacher", dag.stage_key(config, "teacher"),
                         config=teacher.manifest["config"],
                         inputs=teacher.manifest["inputs"]) as out:
        shutil.copytree(teacher.uri, out.tmp_uri, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(artifacts.MANIFEST))
        out.metrics.update(teacher.manifest["metrics"], published_from=teacher.uri)


def measure_size(size: Optional[int], lines: int, args, scratch: str,
                 teacher: Optional[artifacts.Artifact]
                 ) -> tuple[list[StageRun], float, artifacts.Artifact]:
    """Runs every stage at one size (of a corpus of `lines` lines), with `teacher` if given
    (else trains it); returns its runs, the words per train pair and the teacher."""
    label = "all" if size is None else str(size)
    fraction = 1.0 if size is None else min(1.0, size / lines)
    config_path = size_overlay(os.path.join(scratch, f"scaling-{label}.yaml"), args.config,
                               os.path.join(scratch, "work"), fraction)
    config = config_lib.load(config_path, args.set)
    runs, counts = [], {}
    for stage in STAGES:
        if stage == "teacher" and teacher is not None:
            publish_teacher(config, teacher)
            continue
        log_path = os.path.join(scratch, "logs", f"{label}-{stage}.log")
        seconds, cpu, rss, status = run_stage(stage, config_path, args.set, log_path)
        if status != 0:
            raise RuntimeError(f"stage {stage} at size {label} failed (exit {status}): "
                               f"see {log_path}")
        manifest = artifacts.read(dag.output_uri(config, stage)).manifest
        counts[stage] = manifest["counts"]
        runs.append(StageRun(stage, PAIRS[stage](counts[stage]), seconds, cpu,
                             manifest["wall_seconds"], rss))
        print(f"  {label} {stage}: {seconds:.1f} s, {rss:.0f} MiB", file=sys.stderr, flush=True)
    # The vocab stage counts the whitespace words of both sides of the train split.
    return (runs, counts["vocab"]["words"] / counts["vocab"]["train_pairs"],
            artifacts.read(dag.output_uri(config, "teacher")))


def table(results: dict[str, tuple[list[StageRun], float]]) -> str:
    """Markdown: per measured stage and size, the figures of the module docstring."""
    lines = ["| stage | size | pairs | words/pair | process s | stage s | s / 1k pairs "
             "| marginal s / 1k | CPU s / 1k pairs | marginal CPU s / 1k | peak RSS MiB |",
             "|---" * 11 + "|"]
    for stage in MEASURED:
        previous = None
        for label, (runs, words) in results.items():
            run = next(r for r in runs if r.stage == stage)
            per_1k = 1e3 * run.stage_seconds / run.pairs if run.pairs else float("nan")
            cpu_per_1k = 1e3 * run.cpu_seconds / run.pairs if run.pairs else float("nan")
            marginal = marginal_cpu = "-"
            if previous is not None and run.pairs > previous.pairs:
                extra = 1e3 / (run.pairs - previous.pairs)
                marginal = f"{extra * (run.stage_seconds - previous.stage_seconds):.3f}"
                marginal_cpu = f"{extra * (run.cpu_seconds - previous.cpu_seconds):.3f}"
            lines.append(f"| {stage} | {label} | {run.pairs:,} | {words:.1f} | "
                         f"{run.process_seconds:.1f} | {run.stage_seconds:.1f} | {per_1k:.3f} | "
                         f"{marginal} | {cpu_per_1k:.3f} | {marginal_cpu} | "
                         f"{run.peak_rss_mib:.0f} |")
            previous = run
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["10000", "40000", "all"],
                        help="corpus lines sampled (data.train_sample_fraction), or 'all'")
    parser.add_argument("--config", default="configs/tatoeba_de_en.yaml")
    parser.add_argument("--workdir", help="scratch directory (default: a new temporary one)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the figures here (benchmarks/wmt_plan.py reads them)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value in every stage, e.g. distill.batch_size=32")
    args = parser.parse_args(argv)
    sizes = [None if size == "all" else int(size) for size in args.sizes]
    scratch = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="padir-scaling-"))
    os.makedirs(os.path.join(scratch, "logs"), exist_ok=True)
    train = config_lib.load(args.config, args.set).data.train
    lines = corpus.check_corpus(corpus.CorpusSpec(corpus.TRAIN, train))
    print(f"scratch {scratch}; {lines:,} corpus lines; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs", file=sys.stderr)
    results, teacher = {}, None
    try:
        for size in sizes:
            label = "all" if size is None else f"{size:,}"
            runs, words, teacher = measure_size(size, lines, args, scratch, teacher)
            results[label] = (runs, words)
    except RuntimeError as e:
        print(f"scaling: {e}", file=sys.stderr)
        return 1
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({label: {"words_per_pair": words,
                               "stages": [dataclasses.asdict(run) for run in runs]}
                       for label, (runs, words) in results.items()}, f, indent=2)
    first, (first_runs, _) = next(iter(results.items()))
    trained = next(run for run in first_runs if run.stage == "teacher")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"teacher (set-up, not measured, one for every size): "
          f"{trained.process_seconds:.0f} s at {first}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
