"""Stages side by side: independent stages run at once, each in a process on its own cores.

The benchmark's three trainings after distillation (student, AR student, drafter) read the
same inputs and none reads another. With `lanes` > 1 (`padir run --lanes 2`) a run starts
every stage as soon as its inputs are complete, up to `lanes` at once, each in a process
of its own (`padir stage ... --cores`) pinned to its share of the cores left free: a stage
that starts alone gets every free core (the teacher, decode), stages that start together
split them, and a stage waits while no core is free. Each process initialises its own JAX,
TensorFlow and Beam: the flow's process never does, so it never forks after them.

    scheduler = Scheduler(stages_to_run, graph, lanes=2, cores=available_cores())
    for stage, cores in scheduler.start():     # what may start now, and its cores
        ...                                    # run `command(stage, ..., cores)`
    scheduler.finish(stage)                    # when one ends; then start() again
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Sequence

from components import artifacts
from components import config as config_lib
from flows.plan import Graph

# `padir stage`'s exit statuses (flows/cli.py `main`).
_USER_ERROR, _STOPPED = 2, 3


def available_cores() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


def split(cores: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """`cores` in `parts` contiguous shares as even as can be, the larger first."""
    size, extra = divmod(len(cores), parts)
    shares, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        shares.append(tuple(cores[start:end]))
        start = end
    return shares


@dataclasses.dataclass
class Scheduler:
    """Which stages may start, on which cores: a stage starts when every input of it that
    this run computes has finished, while fewer than `lanes` run and a core is free; the
    stages that start together split the free cores. `stages`: in topological order."""

    stages: Sequence[str]
    graph: Graph
    lanes: int
    cores: Sequence[int]
    running: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    finished: set[str] = dataclasses.field(default_factory=set)

    def __post_init__(self):
        if self.lanes < 1 or not self.cores:
            raise config_lib.ConfigError(f"lanes must be >= 1 and cores given, got "
                                         f"{self.lanes} lanes on cores {list(self.cores)}")

    def start(self) -> list[tuple[str, tuple[int, ...]]]:
        """The stages to start now, each with its cores (marked running)."""
        busy = {core for cores in self.running.values() for core in cores}
        free = [core for core in self.cores if core not in busy]
        ready = [stage for stage in self.stages
                 if stage not in self.running and stage not in self.finished
                 and all(up in self.finished or up not in self.stages
                         for up in self.graph[stage])]
        ready = ready[:min(self.lanes - len(self.running), len(free))]
        if not ready:
            return []
        started = list(zip(ready, split(free, len(ready))))
        self.running.update(started)
        return started

    def finish(self, stage: str) -> None:
        del self.running[stage]
        self.finished.add(stage)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.stages)


def command(stage: str, config_path: str, overrides: Sequence[str],
            cores: Sequence[int]) -> list[str]:
    """The `padir stage` command line that computes `stage` on `cores`."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    return [sys.executable, "-m", "flows.cli", "stage", stage, config_path, *sets,
            "--cores", ",".join(map(str, cores))]


def run(stage: str, config_path: str, overrides: Sequence[str],
        cores: Sequence[int]) -> None:
    """Computes `stage` in a process of its own on `cores` (its output goes to this
    process's stdout and stderr).

    Raises:
      config_lib.ConfigError: the stage refused its config or inputs (exit status 2).
      artifacts.StageStopped: it stopped early (exit status 3: a stop request, a safety
        stop, a lost lease), its partial work kept to resume from.
      RuntimeError: it failed otherwise.
    """
    status = subprocess.run(command(stage, config_path, overrides, cores)).returncode
    if status == 0:
        return
    message = f"`padir stage {stage}` exited with status {status} (its error is above)"
    if status == _USER_ERROR:
        raise config_lib.ConfigError(message)
    if status == _STOPPED:
        raise artifacts.StageStopped(message)
    raise RuntimeError(message)
