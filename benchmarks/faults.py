"""Fault injection: SIGKILL each stage at random moments, rerun it, check what a crash leaves.

For each stage of the DAG, inputs first: one uninterrupted run (the reference, kept aside),
then `--kills` times: the stage's output is moved aside, a fresh run is SIGKILLed (its
whole process group) at a moment drawn (seeded) from the stretch in which the reference
wrote its output, and the stage is run again to completion. Each run is its own
`python -m flows.cli stage NAME CONFIG` process, as a user would start it (JAX cannot be
forked). Checks, per stage:
  read partial  after a kill, `artifacts.require` (how every stage reads its inputs) either
                refuses the output or returns a whole one: the reference's files at the
                reference's sizes (its content is compared too, and reported);
  identical     each rerun's output equals the reference: files byte for byte, training
                checkpoints array for array (bitwise), apart from measured times
                (`MEASURED_FILES`, `measured`);
  resumed       reruns that completed, and of those how many continued from a checkpoint;
  leftovers     what the kills left in the workdir after the reruns (`artifacts.leftovers`),
                which `padir status` must list and `padir gc` remove (checked at the end,
                with every output intact after it), and files the stage processes left
                in their TMPDIR.
Checkpoints are read (orbax) only once every process has run.

    PADIR_DATA_ROOT=/path/to/data python -m benchmarks.faults --kills 3 --seed 0 \\
        --set data.max_train_pairs=200 --set vocab.size=400 ...   # see docs/failures.md

Exit status 1 if a check failed; the scratch directory is then kept for inspection.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from components import artifacts, dag, training_artifact
from components import config as config_lib
from components.config import TRAINING_STAGES
from flows import plan

CHECKPOINT_FILES = f"{training_artifact.CHECKPOINTS}/*"  # compared array for array
# Files whose content is a measured time, which no rerun reproduces (relative to the artifact).
MEASURED_FILES = {
    # event files carry wall times
    **{stage: (f"{training_artifact.TENSORBOARD}/*",) for stage in TRAINING_STAGES},
    # rendered from the latencies in report.json
    "score": ("report.md", "plots/*/bleu_vs_latency.png", "plots/*/bleu_vs_throughput.png",
              "plots/*/latency_vs_length.png"),
}


def measured(key: str) -> bool:
    """Whether a JSON key (in manifests, .json and .jsonl files) holds a measured time or a
    rate or ratio of times: `wall_seconds`, `latency_s`, `tokens_per_s`, `speedup`..."""
    return key == "created" or key.endswith(("seconds", "_s")) or key.startswith(
        ("latency", "speedup"))

POLL_SECONDS = 0.05
SAME = "identical"


@dataclasses.dataclass(frozen=True)
class Run:
    """One stage process: how it ended and what it printed."""

    seconds: float
    returncode: int
    killed: bool
    first_write: Optional[float]  # seconds until its temporary output appeared
    published: Optional[float]  # seconds until its manifest appeared
    log: str


@dataclasses.dataclass
class StageResult:
    """What the runs of one stage showed (the table row), filled as they run."""

    stage: str
    attempts: int = 0  # kills tried; a run that ended before its moment was not killed
    kills: int = 0
    resumed: int = 0
    from_checkpoint: int = 0
    read_partial: int = 0
    # (check, reference, output): compared at the end, once no process is started any more
    comparisons: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    identical: int = 0
    leftovers: list[artifacts.Leftover] = dataclasses.field(default_factory=list)
    tmpdir_leftovers: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Bench:
    """What every stage run shares: the command line, the workdir, where outputs go aside."""

    config: config_lib.Config
    argv: tuple[str, ...]  # `python -m flows.cli stage NAME` + these
    scratch: str

    def command(self, name: str, *args: str) -> list[str]:
        return [sys.executable, "-m", "flows.cli", name, *args, *self.argv]

    def aside(self, label: str) -> str:
        return os.path.join(self.scratch, "aside", label)


def run_stage(bench: Bench, stage: str, kill_at: Optional[float] = None) -> Run:
    """Runs `stage` in a fresh process, SIGKILLed after `kill_at` seconds if still running."""
    tmpdir = os.path.join(bench.scratch, "tmp", stage)
    os.makedirs(tmpdir, exist_ok=True)
    log_path = os.path.join(bench.scratch, "logs", f"{stage}-{time.time_ns()}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    key = dag.stage_key(bench.config, stage)
    stage_dir = artifacts.join(bench.config.workdir, stage)
    before = set(os.listdir(stage_dir)) if os.path.isdir(stage_dir) else set()
    start = time.monotonic()
    manifest = artifacts.join(artifacts.location(bench.config.workdir, stage, key),
                              artifacts.MANIFEST)
    first_write = published = None
    killed = False
    with open(log_path, "w+") as log:
        process = subprocess.Popen(
            bench.command("stage", stage), stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, TMPDIR=tmpdir), start_new_session=True)
        while process.poll() is None:
            elapsed = time.monotonic() - start
            if first_write is None and _writing(stage_dir, key, before):
                first_write = elapsed
            if published is None and os.path.exists(manifest):
                published = elapsed
            if kill_at is not None and elapsed >= kill_at:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                killed = True
                break
            time.sleep(POLL_SECONDS)
        log.seek(0)
        text = log.read()
    return Run(time.monotonic() - start, process.returncode, killed, first_write, published,
               text)


def _writing(stage_dir: str, key: str, before: set[str]) -> bool:
    if not os.path.isdir(stage_dir):
        return False
    return any(name.startswith((f".tmp-{key}-", f".partial-{key}"))
               for name in set(os.listdir(stage_dir)) - before)


def differences(stage: str, want: str, got: str) -> list[str]:
    """Relative paths whose content differs between two outputs of `stage` (or that only
    one has), apart from measured times; checkpoints compared array for array."""
    skip = MEASURED_FILES.get(stage, ()) + ((CHECKPOINT_FILES,) if stage in TRAINING_STAGES
                                            else ())
    files = {side: {path for path in _files(root)
                    if not any(fnmatch.fnmatch(path, pattern) for pattern in skip)}
             for side, root in (("want", want), ("got", got))}
    differ = sorted(files["want"] ^ files["got"])
    for path in sorted(files["want"] & files["got"]):
        if _content(os.path.join(want, path)) != _content(os.path.join(got, path)):
            differ.append(path)
    if stage in TRAINING_STAGES:
        differ += _checkpoint_differences(training_artifact.checkpoints(want),
                                          training_artifact.checkpoints(got))
    return differ


def truncated(stage: str, want: str, got: str) -> list[str]:
    """Paths that `got` lacks, or holds at another size (JSON lines: record count) than
    `want`: what a partial output shows (content that only differs as `differences` finds
    it is a determinism matter)."""
    training = stage in TRAINING_STAGES
    skip = MEASURED_FILES.get(stage, ()) + (artifacts.MANIFEST,) + (
        (CHECKPOINT_FILES,) if training else ())

    def sizes(root: str) -> dict[str, int]:
        """Records of a JSON-lines file (their measured times vary in width), else bytes."""
        return {path: (len(_content(os.path.join(root, path))) if path.endswith(".jsonl")
                       else os.path.getsize(os.path.join(root, path)))
                for path in _files(root)
                if not any(fnmatch.fnmatch(path, pattern) for pattern in skip)}

    have = sizes(got)
    short = sorted(path for path, size in sizes(want).items() if have.get(path) != size)
    if training:  # orbax names its data files at random: a checkpoint is whole if its arrays are
        short += _checkpoint_differences(training_artifact.checkpoints(want),
                                         training_artifact.checkpoints(got))
    return short


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, _, names in os.walk(root) for name in names)


def _content(path: str) -> Any:
    """Bytes; JSON (lines) parsed, without measured times."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".jsonl"):
        return [_unmeasured(json.loads(line)) for line in data.splitlines() if line.strip()]
    if path.endswith(".json"):
        return _unmeasured(json.loads(data))
    return data


def _unmeasured(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _unmeasured(child) for key, child in value.items()
                if not measured(key)}
    if isinstance(value, list):
        return [_unmeasured(child) for child in value]
    return value


def _checkpoint_differences(want: str, got: str) -> list[str]:
    """Steps that only one side has, and every item of a common step that differs: arrays
    (params, optimizer state) restored and compared bitwise, JSON items (data position,
    metrics) byte for byte. Imports orbax: call it once no process is started any more."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    def steps(root: str) -> set[str]:
        return {os.path.relpath(folder, root) for folder, _, names in os.walk(root)
                if "_CHECKPOINT_METADATA" in names}

    def same_arrays(a: str, b: str) -> bool:
        left, right = (jax.tree_util.tree_leaves(checkpointer.restore(path)) for path in (a, b))
        return len(left) == len(right) and all(
            np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
            for x, y in zip(left, right))

    def same_files(a: str, b: str) -> bool:
        return _files(a) == _files(b) and all(
            _content(os.path.join(a, path)) == _content(os.path.join(b, path))
            for path in _files(a))

    folder = training_artifact.CHECKPOINTS
    differ = sorted(f"{folder}/{step}" for step in steps(want) ^ steps(got))
    checkpointer = ocp.StandardCheckpointer()
    for step in sorted(steps(want) & steps(got)):
        items = sorted(name for name in os.listdir(os.path.join(want, step))
                       if os.path.isdir(os.path.join(want, step, name)))
        for item in items:
            a, b = os.path.join(want, step, item), os.path.join(got, step, item)
            same = (os.path.isdir(b) and
                    (same_arrays if os.path.exists(os.path.join(a, "_METADATA")) else same_files)(a, b))
            if not same:
                differ.append(f"{folder}/{step}/{item}")
    checkpointer.close()
    return differ


MAX_ATTEMPTS_PER_KILL = 3  # runs that end before their moment are retried, within bounds


def _kill_window(reference: Run) -> tuple[float, float]:
    """While the reference wrote its output: before, a kill only hits the imports; after,
    the exit."""
    return (reference.first_write or 0.0, reference.published or reference.seconds)


def inject(bench: Bench, stage: str, kills: int, rng: random.Random) -> StageResult:
    """The reference run of `stage`, then runs killed at random moments, each followed by a
    rerun, until `kills` of them were really killed. A run that ends before its moment (the
    machine got faster) counts as an attempt, and later moments are drawn within its time."""
    result = StageResult(stage)
    key = dag.stage_key(bench.config, stage)
    final = artifacts.location(bench.config.workdir, stage, key)
    reference = run_stage(bench, stage)
    if reference.returncode != 0:
        result.failures.append(f"reference run failed:\n{reference.log[-3000:]}")
        return result
    want = bench.aside(f"{stage}-reference")
    os.rename(final, want)
    low, high = _kill_window(reference)
    print(f"{stage}: reference {reference.seconds:.1f}s, writes from {low:.1f}s to {high:.1f}s",
          flush=True)
    while result.kills < kills and result.attempts < MAX_ATTEMPTS_PER_KILL * kills:
        trial = result.attempts + 1
        if os.path.exists(final):  # the previous rerun's output: set aside, compared later
            aside = bench.aside(f"{stage}-rerun-{trial - 1}")
            os.rename(final, aside)
            check, reference_dir, _ = result.comparisons[-1]
            result.comparisons[-1] = (check, reference_dir, aside)
        kill_at = rng.uniform(low, high)
        killed = run_stage(bench, stage, kill_at=kill_at)
        result.attempts += 1
        left = sorted({item.kind for item in artifacts.leftovers(bench.config.workdir, [stage])
                       if item.key == key})
        note = f"kill {trial} at {kill_at:.1f}s: "
        if killed.killed:
            result.kills += 1
            note += f"left {', '.join(left) or 'nothing'}"
        else:
            note += f"missed (the run ended in {killed.seconds:.1f}s, status {killed.returncode})"
            high = max(low, min(high, killed.published or killed.seconds))
        try:
            artifacts.require(bench.config.workdir, stage, key)
        except artifacts.IncompleteArtifactError:
            pass
        else:  # published before the kill: it must be the whole output
            readable = bench.aside(f"{stage}-killed-{trial}")
            os.rename(final, readable)
            result.comparisons.append(("read partial", want, readable))
            note += "; output readable"
        rerun = run_stage(bench, stage)
        if rerun.returncode != 0:
            result.failures.append(f"rerun {trial} failed:\n{rerun.log[-3000:]}")
            print(f"{stage}: {note}; rerun FAILED", flush=True)
            continue
        result.resumed += 1
        resumed = "resuming from" in rerun.log
        result.from_checkpoint += resumed
        result.comparisons.append((SAME, want, final))  # the last rerun stays in place
        print(f"{stage}: {note}; rerun {rerun.seconds:.1f}s"
              f"{', resumed from a checkpoint' if resumed else ''}", flush=True)
    result.leftovers = artifacts.leftovers(bench.config.workdir, [stage])
    result.tmpdir_leftovers = sorted(os.listdir(os.path.join(bench.scratch, "tmp", stage)))
    return result


def check_status_and_gc(bench: Bench, results: Sequence[StageResult]) -> list[str]:
    """`padir status` names every leftover and `padir gc` removes them, and nothing else."""
    problems = []
    listed = [item for result in results for item in result.leftovers]
    outputs = {stage: _files(dag.output_uri(bench.config, stage))
               for stage in (result.stage for result in results)}
    status = subprocess.run(bench.command("status"), capture_output=True, text=True)
    for item in listed:
        if f"{item.stage}/{os.path.basename(item.uri)}" not in status.stdout:
            problems.append(f"padir status does not list {item.uri}")
    gc = subprocess.run(bench.command("gc"), capture_output=True, text=True)
    if gc.returncode != 0 or plan.leftovers(bench.config):
        problems.append(f"padir gc left {plan.leftovers(bench.config)}: {gc.stdout}{gc.stderr}")
    for stage, files in outputs.items():
        if _files(dag.output_uri(bench.config, stage)) != files:
            problems.append(f"padir gc changed the output of {stage}")
    print(f"padir status listed {len(listed)} leftovers, padir gc removed them: "
          f"{'ok' if not problems else 'FAILED'}", flush=True)
    return problems


def compare(results: Sequence[StageResult]) -> None:
    """Fills `identical` and `read_partial` (after every process ran: this imports orbax)."""
    for result in results:
        for check, want, got in result.comparisons:
            if check != SAME and truncated(result.stage, want, got):
                result.read_partial += 1
                result.failures.append(f"{check}: {got} lacks or cuts short "
                                       f"{truncated(result.stage, want, got)[:10]}")
            differ = differences(result.stage, want, got)
            result.identical += check == SAME and not differ
            if differ:
                result.failures.append(f"{check}: {got} differs from {want} in {differ[:10]}")


def table(results: Sequence[StageResult]) -> str:
    rows = [("stage", "kills", "resumed", "identical", "read partial", "leftovers")]
    for r in results:
        kinds = sorted({item.kind for item in r.leftovers})
        leftovers = f"{len(r.leftovers)}" + (f" ({', '.join(kinds)})" if kinds else "")
        if r.tmpdir_leftovers:  # names without the random part that tempfile adds
            names = sorted({re.sub(r"[a-z0-9_]{8}(\.py)?$", "*", name)
                            for name in r.tmpdir_leftovers})
            leftovers += f" + {len(r.tmpdir_leftovers)} in TMPDIR ({', '.join(names)})"
        rows.append((r.stage, f"{r.kills}/{r.attempts}",
                     f"{r.resumed}" + (f" ({r.from_checkpoint} from ckpt)"
                                       if r.stage in TRAINING_STAGES else ""),
                     f"{r.identical}/{r.resumed}", str(r.read_partial), leftovers))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--kills", type=int, default=3, choices=range(1, 101), metavar="N",
                        help="kills per stage, 1 to 100 (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="draws the kill moments")
    parser.add_argument("--stages", help="comma-separated stages to kill (default: all); "
                        "the others run once, uninterrupted, for their outputs")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="padir-faults-")
    overrides = [*args.set, f"workdir={os.path.join(scratch, 'work')}"]
    config = config_lib.load(args.config, overrides)
    argv_tail = (os.path.abspath(args.config), *(f"--set={text}" for text in overrides))
    bench = Bench(config, argv_tail, scratch)
    os.makedirs(bench.aside(""), exist_ok=True)
    print(f"scratch {scratch}; {args.kills} kills per stage, seed {args.seed}", flush=True)
    rng = random.Random(args.seed)
    results = []
    order = plan.topological_order(dag.graph(config))
    chosen = args.stages.split(",") if args.stages else order
    unknown = sorted(set(chosen) - set(order))
    if unknown:
        parser.error(f"unknown stages {unknown}; this config runs {order}")
    last = max(order.index(stage) for stage in chosen)
    for stage in order[:last + 1]:  # what comes after the last chosen stage is not needed
        if stage not in chosen:
            if run_stage(bench, stage).returncode != 0:
                print(f"FAILED {stage}: its uninterrupted run failed; kept {scratch}")
                return 1
            continue
        results.append(inject(bench, stage, args.kills, rng))
        if results[-1].failures:
            break  # its dependents have no input
    problems = check_status_and_gc(bench, results)
    compare(results)
    print(table(results))
    problems += [f"{r.stage}: {failure}" for r in results for failure in r.failures]
    for problem in problems:
        print(f"FAILED {problem}")
    if problems:
        print(f"kept {scratch}")
        return 1
    shutil.rmtree(scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
