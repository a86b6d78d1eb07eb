"""What a pipeline run will do, decided before it starts: no Prefect here.

Every active stage of the config (`components.dag.graph`: the distillation stages only
with `distill.enabled`, the AR student only when a decode method reads it) is visited in
topological order. A selected stage runs when it is forced (`force`, or at or below
`from_stage`), when its artifact is not
complete (never built, deleted, or left partial by a crash), or when one of its inputs
runs; otherwise its complete artifact is reused. The Prefect flow (flows/flow.py)
executes this plan; `padir status` shows the same facts without running anything.

    plan(config)                        # everything, reusing what is complete
    plan(config, from_stage="student")  # recompute student and everything downstream
    plan(config, only="vocab")          # just vocab (its inputs must be complete)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence

from components import artifacts, dag
from components.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage of a run: where its artifact is and whether it must be computed."""

    stage: str
    key: str  # dag.stage_key: also the Prefect cache key
    uri: str
    run: bool
    reason: str  # why it runs ("forced", "no complete artifact", "input vocab runs") or not


Graph = Mapping[str, Sequence[str]]  # stage -> its inputs, e.g. `dag.graph(config)`


def topological_order(graph: Graph) -> list[str]:
    """Stage names, every stage after its inputs; ties keep the graph's order."""
    for name, inputs in graph.items():
        for upstream in inputs:
            if upstream not in graph:
                raise ConfigError(f"stage {name!r} reads unknown stage {upstream!r}")
    order: list[str] = []
    placed: set[str] = set()
    while len(order) < len(graph):
        ready = [name for name, inputs in graph.items()
                 if name not in placed and placed.issuperset(inputs)]
        if not ready:
            raise ConfigError(f"the stage graph has a cycle among {sorted(set(graph) - placed)}")
        order.append(ready[0])
        placed.add(ready[0])
    return order


def downstream(stage: str, graph: Graph) -> list[str]:
    """`stage` and every stage that reads it, directly or not, in topological order."""
    affected = {stage}
    order = topological_order(graph)
    for name in order:
        if affected.intersection(graph[name]):
            affected.add(name)
    return [name for name in order if name in affected]


def _check_stages(names: Iterable[str], flag: str, config: Config) -> None:
    for name in names:
        if name not in dag.STAGES:
            raise ConfigError(f"{flag}: unknown stage {name!r} (stages: {list(dag.STAGES)})")
        inactive = dag.inactive_reason(config, name)
        if inactive:
            raise ConfigError(f"{flag}: stage {name!r} is not part of this config's run "
                              f"({inactive})")


def plan(config: Config, *, from_stage: Optional[str] = None, only: Optional[str] = None,
         force: Sequence[str] = ()) -> list[StagePlan]:
    """The selected stages in topological order, each marked to run or to reuse.

    Args:
      from_stage: force this stage and everything downstream of it to be recomputed.
      only: select just this stage; its inputs are not run and must be complete.
      force: recompute these stages (and therefore everything downstream of them).

    Raises:
      ConfigError: an unknown stage name, or `only` whose inputs have no complete artifact.
    """
    graph = dag.graph(config)
    _check_stages(force, "--force", config)
    _check_stages([from_stage] if from_stage else [], "--from", config)
    _check_stages([only] if only else [], "--only", config)
    forced = set(force) | set(downstream(from_stage, graph) if from_stage else ())
    steps: dict[str, StagePlan] = {}
    for stage in topological_order(graph):
        if only is not None and stage != only:
            continue
        uri = dag.output_uri(config, stage)
        running_inputs = [name for name in graph[stage]
                          if name in steps and steps[name].run]
        if stage in forced:
            run, reason = True, "forced"
        elif not artifacts.is_complete(uri):
            run, reason = True, "no complete artifact"
        elif running_inputs:
            run, reason = True, f"input {running_inputs[0]} runs"
        else:
            run, reason = False, "complete"
        steps[stage] = StagePlan(stage, dag.stage_key(config, stage), uri, run, reason)
    if only is not None:
        missing = [name for name in graph[only]
                   if not artifacts.is_complete(dag.output_uri(config, name))]
        if missing:
            raise ConfigError(f"--only {only}: its input stage(s) {missing} have no complete "
                              "artifact for this config; run them first (drop --only)")
    return list(steps.values())


# --- what `padir status` shows -----------------------------------------------------------

HEADLINE_METRICS = 4  # scalars shown per stage
# Metrics that make a headline, best first: substrings of the last part of the name.
HEADLINE_WORDS = ("bleu", "chrf", "stutter", "latency", "per_s", "loss", "accuracy",
                  "unk_rate")
REPORT_STAGE, REPORT_FILE = "score", "report.md"  # the run's final report, once that stage exists


def headline_metrics(manifest: Mapping[str, Any], limit: int = HEADLINE_METRICS) -> dict[str, Any]:
    """A few scalars of a manifest: quality metrics by `HEADLINE_WORDS`, else its counts."""
    metrics = flatten(manifest.get("metrics", {}))
    ranked = sorted(
        (rank, name) for name in metrics
        for rank in [next((i for i, word in enumerate(HEADLINE_WORDS)
                           if word in name.rsplit(".", 1)[-1]), None)]
        if rank is not None)
    if ranked:
        chosen = {name: metrics[name] for _, name in ranked}
    else:
        chosen = flatten(manifest.get("counts", {})) or metrics
    return {name: round(value, 4) if isinstance(value, float) else value
            for name, value in list(chosen.items())[:limit]}


def flatten(value: Any, prefix: str = "", max_chars: int = 40) -> dict[str, Any]:
    """Nested mappings -> {"a.b.c": scalar}: numbers, and strings of at most `max_chars`
    (which leaves out e.g. sacreBLEU signatures by default), in order."""
    if isinstance(value, Mapping):
        flat: dict[str, Any] = {}
        for key, child in value.items():
            flat.update(flatten(child, f"{prefix}{key}.", max_chars))
        return flat
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return {}
    if isinstance(value, str) and len(value) > max_chars:
        return {}
    return {prefix.rstrip("."): value}


def partial_exists(config: Config, stage: str) -> bool:
    """Whether a resumable stage left work in `<stage>/.partial-<key>/` to continue from."""
    fs, path = artifacts.filesystem(
        artifacts.join(config.workdir, stage, f".partial-{dag.stage_key(config, stage)}"))
    return fs.exists(path)


def describe(config: Config) -> list[dict[str, Any]]:
    """One row per active stage in topological order: stage, key, uri, state ("complete",
    "partial": a resumable stage stopped midway, "missing"), what `padir run` would do
    next ("reuse" or "run (<reason>)"), the wall seconds its artifact took (None if not
    complete) and headline metrics."""
    rows = []
    for step in plan(config):
        row = {"stage": step.stage, "key": step.key, "uri": step.uri, "state": "missing",
               "next": f"run ({step.reason})" if step.run else "reuse", "metrics": {},
               "wall_seconds": None}
        if artifacts.is_complete(step.uri):
            manifest = artifacts.read(step.uri).manifest
            row.update(state="complete", metrics=headline_metrics(manifest),
                       wall_seconds=manifest.get("wall_seconds"))
        elif partial_exists(config, step.stage):
            row["state"] = "partial"
        rows.append(row)
    return rows


def report_path(config: Config) -> Optional[str]:
    """The final report (`report.md` of the score stage's artifact), if it exists yet."""
    if REPORT_STAGE not in dag.STAGES:
        return None
    uri = dag.output_uri(config, REPORT_STAGE)
    path = artifacts.join(uri, REPORT_FILE)
    fs, local = artifacts.filesystem(path)
    return path if artifacts.is_complete(uri) and fs.exists(local) else None


# --- what runs that died left: `padir status` lists it, `padir gc` removes it ----------------

LEFTOVER_KINDS = {  # artifacts.Leftover.kind -> what it is, for `padir status`
    "tmp": "temporary output of a run that died",
    "partial": "training work a rerun resumes from (gc drops it)",
    "old": "an output replaced by a publication that died",
    "lease": "lease file of a run that died, or of a running one",
    "incomplete": "output without a readable manifest (never read)",
}


def leftovers(config: Config) -> list[artifacts.Leftover]:
    """Everything runs of any key left in the workdir's stage folders (artifacts.leftovers)."""
    return artifacts.leftovers(config.workdir, list(dag.STAGES))


@dataclasses.dataclass(frozen=True)
class Garbage:
    """What `collect_garbage` did: removed leftovers, and the keys it left to a running stage."""

    removed: list[artifacts.Leftover]
    in_use: dict[str, str]  # "<stage>/<key>" -> why it was left (the holder of its lease)


def collect_garbage(config: Config) -> Garbage:
    """Removes the leftovers of every key whose lease it can take, so that nothing a
    running stage is writing is touched; they are listed again under the lease, where
    nothing can change them. The lease file goes when the lease is released."""
    listed = leftovers(config)
    removed: list[artifacts.Leftover] = []
    in_use: dict[str, str] = {}
    for stage, key in sorted({(item.stage, item.key) for item in listed}):
        try:
            with artifacts.lease(config.workdir, stage, key):
                found = [item for item in artifacts.leftovers(config.workdir, [stage])
                         if item.key == key and item.kind != "lease"]
                for item in found:
                    fs, path = artifacts.filesystem(item.uri)
                    fs.rm(path, recursive=True)
        except artifacts.LeaseHeldError as e:
            in_use[f"{stage}/{key}"] = str(e)
            continue
        removed.extend(found)
        removed.extend(item for item in listed
                       if (item.stage, item.key, item.kind) == (stage, key, "lease"))
    return Garbage(removed, in_use)
