"""One writer per key under pauses, kills and takeovers: randomised trials of two writers of
one artifact key, on the GCS emulator (behind the test proxy, tests/gcs_emulator.py) and on
local disk, counting the runs in which a writer that lost its lease published, or removed or
mixed into an artifact another run published (the goal is 0).

Each trial, in a fresh workdir (with, half the time, an artifact of the key published
before, so that both writers are forced reruns that replace it):
  W1  a writer process (`python -m benchmarks.leases writer ...`) takes the lease, writes
      the same file names as every writer, each holding its tag, and publishes. At a
      moment drawn from its run (often just as it publishes) it is paused (SIGSTOP, for up
      to three stale periods, then SIGCONT), killed (SIGKILL), has its lease removed by
      hand (the lease file or object deleted), or is left alone.
  W2  a second writer of the key, started during W1's run, retries a held lease until it
      gets it: after W1's pause passed the stale period (a takeover, on gs://; a local
      lease is a kernel lock that only its holder's death frees), after W1's death or its
      lease's removal, or after W1's end; then publishes.
  a reader, meanwhile, reads the artifact whenever its manifest is complete.
Violations (the count printed):
  mixed       the final artifact's files do not all hold its manifest's tag, or are not the
              set every writer writes;
  removed     a writer published, and at the end no complete artifact is there;
  overwritten W2 published, and the artifact then changed (W1, which lost its lease to W2,
              wrote over it);
  published while held   W2, holding the lease, found the key published meanwhile.
Reader anomalies (a file missing or torn while a manifest was complete) are counted apart:
a forced rerun replaces files in place on gs:// and by two renames locally (docs/failures.md).

    PADIR_DATA_ROOT=... PYTHONPATH=tests python -m benchmarks.leases --trials 50 --seed 0 \\
        [--stale 2] [--backends gcs,local]

The gs:// backend runs on the tests' emulator (tests/gcs_emulator.py, which PYTHONPATH=tests
finds; the dev extra installs the server it starts); `--backends local` needs neither.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable, Iterator, Optional

from components import artifacts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STAGE, KEY = "prepare", "k"
FILES = 4  # the same names in every writer's output (content-keyed)
RENEW_SECONDS = 0.1
STALE_SECONDS = 2.0  # the emulator's `Date` counts whole seconds
WAIT_SECONDS = 20.0  # how long W2 retries a held lease


# --- a writer (its own process) ----------------------------------------------------------------


def writer(argv: list[str]) -> int:
    """`writer WORKDIR TAG BODY_SECONDS STALE_SECONDS`: prints READY, waits for a line on
    stdin, then
    writes the key (retrying a held lease for WAIT_SECONDS), printing LEASED inside the
    body, PUBLISHING as it leaves it, and one result: PUBLISHED, KEPT (another run's
    artifact kept), LOST (LeaseLost) or HELD."""
    workdir, tag, body = argv[0], argv[1], float(argv[2])
    artifacts.LEASE_RENEW_SECONDS = RENEW_SECONDS
    artifacts.LEASE_STALE_SECONDS = float(argv[3])
    kept = []

    class Kept(logging.Handler):
        def emit(self, record):
            if "another run published this key" in record.getMessage():
                kept.append(record)

    logging.getLogger("components.artifacts").addHandler(Kept())
    say = lambda *words: print(*words, flush=True)  # noqa: E731
    say("READY")
    sys.stdin.readline()
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        try:
            with artifacts.write(workdir, STAGE, KEY, config={}, inputs={}) as out:
                say("LEASED")
                fs, _ = artifacts.filesystem(out.tmp_uri)
                for i in range(FILES):
                    fs.pipe_file(artifacts.filesystem(out.path(f"part-{i}"))[1], tag.encode())
                    time.sleep(body / FILES)
                out.metrics["tag"] = tag
                say("PUBLISHING")
            say("KEPT" if kept else "PUBLISHED")
            return 0
        except artifacts.LeaseHeldError:
            if time.monotonic() > deadline:
                say("HELD")
                return 0
            time.sleep(0.1)
        except artifacts.LeaseLost as e:
            say("LOST", e)
            return 0


# --- one trial -------------------------------------------------------------------------------


@dataclasses.dataclass
class Writer:
    """A writer process and the lines it printed, with when the parent read them."""

    tag: str
    process: subprocess.Popen
    lines: list[tuple[float, str]] = dataclasses.field(default_factory=list)

    def start_reading(self) -> threading.Thread:
        def read():
            for line in self.process.stdout:
                self.lines.append((time.monotonic(), line.strip()))
        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return thread

    def seen(self, word: str) -> Optional[float]:
        return next((t for t, line in self.lines if line.split(" ", 1)[0] == word), None)

    def wait_for(self, word: str, timeout: float) -> Optional[float]:
        deadline = time.monotonic() + timeout
        while self.seen(word) is None and self.process.poll() is None and \
                time.monotonic() < deadline:
            time.sleep(0.005)
        return self.seen(word)

    @property
    def why_lost(self) -> Optional[str]:
        """A LOST line's reason, without names and figures."""
        line = next((line for _, line in self.lines if line.startswith("LOST ")), None)
        if line is None:
            return None
        reason = line.split(": ", 1)[-1].split(" (")[0].split(";")[0]
        return re.sub(r"\d+", "N", re.sub(r"file \S+", "file", reason))

    @property
    def result(self) -> str:
        results = [line.split(" ", 1)[0] for _, line in self.lines
                   if line.split(" ", 1)[0] in ("PUBLISHED", "KEPT", "LOST", "HELD")]
        if results:
            return results[-1]
        return "killed" if self.process.returncode == -signal.SIGKILL else \
            f"exit {self.process.returncode}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a trial does to W1: `action` ("pause", "kill", "unlink", "none") `at` seconds
    after W1 took the lease ("publishing": just as it publishes), pausing for `pause` seconds; W2
    starts `second_after` seconds after the action; `prepublished`: an artifact is there
    before."""

    action: str
    at: float | str
    pause: float
    second_after: float
    body: float
    prepublished: bool

    @staticmethod
    def draw(rng: random.Random, stale: float) -> "Plan":
        action = rng.choice(["pause", "pause", "kill", "unlink", "none"])
        at = "publishing" if rng.random() < 0.4 else round(rng.uniform(0.0, 0.6), 3)
        return Plan(action, at, round(rng.uniform(0.0, 3 * stale), 3),
                    round(rng.uniform(0.0, 0.5), 3), round(rng.uniform(0.1, 0.6), 3),
                    rng.random() < 0.5)


@dataclasses.dataclass
class Trial:
    plan: Plan
    outcomes: tuple[str, str]
    why_lost: list[str]
    violations: list[str]
    reader_anomalies: list[str]


def _read_artifact(final: str) -> Optional[tuple[str, dict[str, bytes]]]:
    """The tag of the complete artifact at `final` and its files; None if incomplete."""
    fs, path = artifacts.filesystem(final)
    try:
        artifact = artifacts.read(final)
        fs.invalidate_cache()
        names = [name.rsplit("/", 1)[-1] for name in fs.ls(path, detail=False)]
        return artifact.manifest["metrics"]["tag"], {
            name: fs.cat_file(f"{path}/{name}") for name in names if name != artifacts.MANIFEST}
    except (artifacts.IncompleteArtifactError, FileNotFoundError):
        return None


def _reader(final: str, tags: set[str], stop: threading.Event, anomalies: list[str]) -> None:
    """Reads the artifact whenever its manifest is complete: each file it lists must be
    there, whole (one writer's tag)."""
    fs, path = artifacts.filesystem(final)
    while not stop.is_set():
        try:
            artifacts.read(final)
        except artifacts.IncompleteArtifactError:
            time.sleep(0.005)
            continue
        for i in range(FILES):
            try:
                data = fs.cat_file(f"{path}/part-{i}").decode()
            except FileNotFoundError:
                anomalies.append(f"part-{i} missing while the manifest was complete")
                continue
            if data not in tags:
                anomalies.append(f"part-{i} torn: {data!r}")
        time.sleep(0.02)


def _spawn(env: dict[str, str], workdir: str, tag: str, body: float, stale: float) -> Writer:
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.leases", "writer", workdir, tag, str(body),
         str(stale)],
        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    writer = Writer(tag, process)
    writer.start_reading()
    return writer


def _go(writer: Writer) -> None:
    writer.process.stdin.write("go\n")
    writer.process.stdin.flush()


def run_trial(workdir: str, env: dict[str, str], plan: Plan,
              stale: float = STALE_SECONDS) -> Trial:
    """Runs one trial in `workdir` (empty) with writer processes in `env`, whose leases go
    stale after `stale` seconds."""
    final = artifacts.location(workdir, STAGE, KEY)
    first, second = f"w1-{uuid.uuid4().hex[:6]}", f"w2-{uuid.uuid4().hex[:6]}"
    tags = {first, second, "before"}
    if plan.prepublished:
        with artifacts.write(workdir, STAGE, KEY, config={}, inputs={}) as out:
            fs, _ = artifacts.filesystem(out.tmp_uri)
            for i in range(FILES):
                fs.pipe_file(artifacts.filesystem(out.path(f"part-{i}"))[1], b"before")
            out.metrics["tag"] = "before"
    w1, w2 = (_spawn(env, workdir, first, plan.body, stale),
              _spawn(env, workdir, second, 0.05, stale))
    stop, anomalies = threading.Event(), []
    reader = threading.Thread(target=_reader, args=(final, tags, stop, anomalies), daemon=True)
    violations: list[str] = []
    try:
        for writer in (w1, w2):
            assert writer.wait_for("READY", 60), f"writer did not start: {writer.lines}"
        reader.start()
        _go(w1)
        w1.wait_for("LEASED", 30)
        if plan.at == "publishing":
            w1.wait_for("PUBLISHING", 30)
        else:
            time.sleep(plan.at)
        if plan.action == "pause" and w1.process.poll() is None:
            w1.process.send_signal(signal.SIGSTOP)
        elif plan.action == "kill":
            w1.process.kill()
        elif plan.action == "unlink":
            fs, path = artifacts.filesystem(artifacts.lease_uri(workdir, STAGE, KEY))
            with contextlib.suppress(FileNotFoundError):
                fs.rm(path)
        time.sleep(plan.second_after)
        _go(w2)
        if plan.action == "pause":
            time.sleep(max(0.0, plan.pause - plan.second_after))
            w1.process.send_signal(signal.SIGCONT)
        for writer in (w1, w2):
            writer.process.wait(timeout=120)
        time.sleep(0.05)  # the reading threads see the last lines
        w2_done = w2.seen("PUBLISHED")
    finally:
        stop.set()
        for writer in (w1, w2):
            if writer.process.poll() is None:
                writer.process.kill()
                writer.process.wait()
        reader.join(timeout=10)
    end = _read_artifact(final)
    if end is not None:
        tag, files = end
        if sorted(files) != [f"part-{i}" for i in range(FILES)] or \
                any(data.decode() != tag for data in files.values()):
            violations.append(f"mixed: {tag} with {files}")
    if end is None and "PUBLISHED" in (w1.result, w2.result):
        violations.append("removed: a writer published, and no complete artifact is left")
    if w2_done is not None and (end is None or end[0] != second):
        violations.append(f"overwritten: W2 published, the artifact is now {end and end[0]}")
    if w2.result == "KEPT":
        violations.append("published while held: W2 found the key published meanwhile")
    return Trial(plan, (w1.result, w2.result),
                 [f"W{i} {w.why_lost}" for i, w in ((1, w1), (2, w2)) if w.why_lost],
                 violations, anomalies)


# --- the benchmark ---------------------------------------------------------------------------


@contextlib.contextmanager
def backend(name: str, scratch: str) -> Iterator[tuple[Callable[[], str], dict[str, str]]]:
    """(a fresh workdir for each trial, the writers' environment) on `name`."""
    env = dict(os.environ)
    if name == "local":
        yield (lambda: os.path.join(scratch, uuid.uuid4().hex[:8], "work")), env
        return
    import gcs_emulator

    with gcs_emulator.running() as emulator, gcs_emulator.FaultProxy(emulator.url) as proxy:
        behind = dataclasses.replace(emulator, url=proxy.url)
        with gcs_emulator.pointed_at(behind) as client_env:
            yield (lambda: behind.uri(uuid.uuid4().hex[:8], "work")), dict(env, **client_env)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["writer"]:
        return writer(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="per backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", default="gcs,local")
    parser.add_argument("--stale", type=float, default=STALE_SECONDS,
                        help="seconds before a lease is stale (its holder gives up at half)")
    args = parser.parse_args(argv)
    artifacts.LEASE_RENEW_SECONDS = RENEW_SECONDS
    artifacts.LEASE_STALE_SECONDS = args.stale
    logging.basicConfig(level=logging.ERROR)
    total = 0
    with tempfile.TemporaryDirectory(prefix="padir-leases-") as scratch:
        for name in args.backends.split(","):
            rng = random.Random(f"{args.seed}-{name}")
            counts: dict[str, int] = {}
            reasons: dict[str, int] = {}  # why a writer stopped with LeaseLost
            violations = anomalies = 0
            started = time.monotonic()
            with backend(name, scratch) as (fresh, env):
                for index in range(args.trials):
                    plan = Plan.draw(rng, args.stale)
                    trial = run_trial(fresh(), env, plan, args.stale)
                    key = f"{plan.action}: W1 {trial.outcomes[0]}, W2 {trial.outcomes[1]}"
                    counts[key] = counts.get(key, 0) + 1
                    for why in trial.why_lost:
                        reasons[why] = reasons.get(why, 0) + 1
                    violations += bool(trial.violations)
                    anomalies += bool(trial.reader_anomalies)
                    for line in trial.violations + trial.reader_anomalies:
                        print(f"  trial {index} ({plan}): {line}")
            total += violations
            print(f"{name}: {args.trials} trials in {time.monotonic() - started:.0f} s")
            for key, count in sorted(counts.items()):
                print(f"  {count:3d}  {key}")
            for why, count in sorted(reasons.items()):
                print(f"  {count:3d}  LOST: {why}")
            print(f"  runs where a writer that lost its lease published, removed or mixed "
                  f"into another's artifact: {violations}")
            print(f"  runs where the reader met a missing or torn file: {anomalies}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
