"""The end-to-end Prefect flow: one task per active stage of the config, in DAG order.

Contract:
  reads:  an experiment config (path + `--set` overrides) and whatever artifacts of it exist.
  writes: every selected stage's artifact (`<workdir>/<stage>/<key>/`), Prefect's cache
          records under `<workdir>/.prefect/results/` (one JSON file per stage key), a
          Prefect table artifact per stage (its manifest's counts and metrics) and, once the
          score stage exists, a markdown artifact with its `report.md`.

Caching: a stage task's cache key is its artifact key (`<stage>-<dag.stage_key>`), never the
run id or the source tree, so an unchanged config reuses every stage and a changed section
recomputes its stage and the stages downstream only. The run is planned before anything
executes (flows/plan.py): a stage that is forced, whose artifact is incomplete (deleted,
or never finished), or one of whose inputs runs, is called with `refresh_cache=True`, so
the cache key stays the artifact key yet a missing artifact is rebuilt. A complete artifact
without a cache record (built by `padir stage`) is adopted, not recomputed.

By default stages run one after the other in the flow's own thread (no process pool: JAX
must not be initialised in a process that later forks). With `lanes` > 1, the stages a
run computes start as soon as their inputs are complete, up to `lanes` at once, each in a
`padir stage` process of its own on its share of the cores (flows/lanes.py); the stages it
reuses are resolved first, in the flow's thread. Runs of a served deployment execute in
spawned, not forked, processes.

    padir run configs/demo.yaml                         # ephemeral Prefect API, no server
    padir run configs/demo.yaml --from student          # recompute student and downstream
    padir run configs/multi30k_en_de.yaml --lanes 2     # independent stages side by side
    padir serve configs/multi30k_en_de.yaml --cron "0 3 * * *"   # needs PREFECT_API_URL
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any, Optional, Sequence

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext
from prefect.filesystems import RemoteFileSystem
from prefect.futures import as_completed
from prefect.states import State

from components import artifacts, dag
from components import config as config_lib
from components.config import Config, stable_hash
from flows import lanes as lanes_lib
from flows import plan as plan_lib
from flows import stages

FLOW_NAME = "padir-pipeline"
RESULTS_DIR = (".prefect", "results")  # under the workdir: cache records live with artifacts
RETRY_DELAYS_SECONDS = [10, 60]  # one retry per delay, for transient I/O errors only

# OSErrors that a retry cannot fix (a missing input artifact is a FileNotFoundError).
_PERMANENT_OS_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError,
                        NotADirectoryError, PermissionError)


class StageFailed(RuntimeError):
    """A stage raised: the flow stops there; earlier stages stay cached for a rerun."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"stage '{stage}' failed: {type(error).__name__}: {error}")
        self.stage = stage


def is_transient(error: BaseException) -> bool:
    """Whether an exception looks like flaky I/O (a network hiccup, a storage timeout)."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    return isinstance(error, OSError) and not isinstance(error, _PERMANENT_OS_ERRORS)


def _retry_if_transient(task_: Any, task_run: Any, state: State) -> bool:
    return is_transient(state.result(raise_on_failure=False))


def _artifact_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    stage = parameters["stage"]
    return f"{stage}-{dag.stage_key(parameters['config'], stage)}"


@task(cache_key_fn=_artifact_cache_key, persist_result=True, result_serializer="json",
      retries=len(RETRY_DELAYS_SECONDS), retry_delay_seconds=RETRY_DELAYS_SECONDS,
      retry_condition_fn=_retry_if_transient)
def stage_task(stage: str, config: Config, rerun: bool,
               process: Optional[tuple[str, tuple[str, ...], tuple[int, ...]]] = None) -> str:
    """Computes one stage (unless its artifact is complete and `rerun` is false): its URI.
    `process`: (config path, overrides, cores) to compute it in a process of its own
    (`lanes_lib.run`), else it runs in this thread."""
    uri = dag.output_uri(config, stage)
    if not rerun and artifacts.is_complete(uri):  # complete, but no cache record: adopt it
        get_run_logger().info("%s: adopting the complete artifact %s", stage, uri)
        return uri
    if process is None:
        return stages.run_stage(stage, config).uri
    config_path, overrides, cores = process
    get_run_logger().info("%s: starting on cores %s", stage, ",".join(map(str, cores)))
    lanes_lib.run(stage, config_path, overrides, cores)
    return artifacts.read(uri).uri


def result_storage(workdir: str) -> Any:
    """Where cache records go: `<workdir>/.prefect/results`, local or remote."""
    uri = artifacts.join(workdir, *RESULTS_DIR)
    if "://" not in uri:
        return pathlib.Path(uri)
    # Prefect takes remote storage only as a saved block, referenced by its slug.
    name = f"padir-results-{stable_hash(uri, length=10)}"
    RemoteFileSystem(basepath=uri).save(name, overwrite=True)
    return f"remote-file-system/{name}"


def artifact_key(stage: str) -> str:
    """The Prefect artifact key of a stage's table (lowercase letters, digits and dashes)."""
    return "padir-" + re.sub(r"[^a-z0-9-]", "-", stage.lower())


def publish_manifest(stage: str, uri: str, ran: bool) -> None:
    """The stage's manifest counts and metrics as a Prefect table artifact."""
    manifest = artifacts.read(uri).manifest
    rows = [{"name": name, "value": value}
            for section in ("counts", "metrics")
            for name, value in plan_lib.flatten(manifest.get(section, {}), f"{section}.",
                                                max_chars=200).items()]
    rows.append({"name": "wall_seconds", "value": manifest.get("wall_seconds")})
    create_table_artifact(
        table=rows, key=artifact_key(stage),
        description=f"`{stage}` ({'computed' if ran else 'reused'}): {uri}")


def publish_report(config: Config) -> Optional[str]:
    """The score stage's report.md as a Prefect markdown artifact; its path, if any."""
    path = plan_lib.report_path(config)
    if path is not None:
        fs, local = artifacts.filesystem(path)
        with fs.open(local, "r") as f:
            create_markdown_artifact(markdown=f.read(), key="padir-report",
                                     description=f"report of {config.workdir}: {path}")
    return path


@flow(name=FLOW_NAME)
def padir_pipeline(config_path: str, overrides: tuple[str, ...] = (),
                   from_stage: str | None = None, only: str | None = None,
                   force: tuple[str, ...] = (), lanes: int = 1) -> dict[str, str]:
    """Runs the config's active stages (`components.dag.graph`) in topological order;
    returns stage -> URI.

    (The annotations use builtins only: a served run validates its parameters against them
    in a process that loads this function from its entry point, without typing's names.)

    Args:
      config_path: the experiment YAML.
      overrides: `a.b=c` config overrides (`padir run --set`).
      from_stage: recompute this stage and everything downstream of it.
      only: run just this stage (its inputs must be complete).
      force: recompute these stages (and everything downstream of them).
      lanes: how many stages may run at once (flows/lanes.py); 1: one after the other.

    Raises:
      StageFailed: naming the stage that raised; stages before it are complete and cached
        (with lanes, the stages running beside it finish first).
    """
    log = get_run_logger()
    config = config_lib.load(config_path, overrides)
    log.info("config %s %s: workdir %s (each stage writes the resolved config next to "
             "its artifact)", config_path, list(overrides), config.workdir)
    steps = plan_lib.plan(config, from_stage=from_stage, only=only, force=force)
    for step in steps:
        log.info("plan: %-8s %s (%s) %s", step.stage, "run" if step.run else "reuse",
                 step.reason, step.uri)
    storage = result_storage(config.workdir)

    def task_of(step: plan_lib.StagePlan) -> Any:
        return stage_task.with_options(name=step.stage, task_run_name=step.stage,
                                       refresh_cache=step.run, result_storage=storage)

    uris: dict[str, str] = {}

    def record(step: plan_lib.StagePlan, state: State) -> None:
        if not state.is_completed():
            error = state.result(raise_on_failure=False)
            if not isinstance(error, BaseException):
                error = RuntimeError(state.message or state.name)
            raise StageFailed(step.stage, error) from error
        uris[step.stage] = state.result()
        publish_manifest(step.stage, uris[step.stage], ran=step.run)

    side_by_side = lanes > 1
    for step in steps:
        if not (side_by_side and step.run):
            record(step, task_of(step)(step.stage, config, step.run, return_state=True))
    if side_by_side:
        _run_side_by_side([step for step in steps if step.run], config, lanes, task_of,
                          record, process=(config_path, tuple(overrides)))
    uris = {step.stage: uris[step.stage] for step in steps}  # in the plan's order
    publish_report(config)
    return uris


def _run_side_by_side(steps: list[plan_lib.StagePlan], config: Config, lanes: int,
                      task_of: Any, record: Any, *, process: tuple[str, tuple[str, ...]]
                      ) -> None:
    """Runs `steps` as `lanes_lib.Scheduler` lets them start; a stage that fails stops new
    starts, and is raised once the stages running beside it have ended."""
    by_stage = {step.stage: step for step in steps}
    scheduler = lanes_lib.Scheduler([step.stage for step in steps], dag.graph(config), lanes,
                                    lanes_lib.available_cores())
    running: dict[Any, plan_lib.StagePlan] = {}
    failure: Optional[StageFailed] = None
    while not scheduler.done:
        if failure is None:
            for stage, cores in scheduler.start():
                future = task_of(by_stage[stage]).submit(stage, config, True,
                                                         (*process, cores))
                running[future] = by_stage[stage]
        if not running:
            break
        future = next(as_completed(list(running)))
        future.wait()  # sets its final state (else `state` asks the API, which may lag)
        step = running.pop(future)
        scheduler.finish(step.stage)
        try:
            record(step, future.state)
        except StageFailed as e:
            failure = failure or e
    if failure is not None:
        raise failure


def serve(config_path: str, overrides: Sequence[str] = (), *, name: str, cron: str,
          from_stage: Optional[str] = None, only: Optional[str] = None,
          force: Sequence[str] = (), lanes: int = 1) -> None:
    """Registers a deployment of the flow on a cron schedule and executes its runs (blocks).

    Needs a Prefect server (`prefect server start --host 127.0.0.1`) and PREFECT_API_URL.
    One run of the deployment at a time: a scheduled run that comes due while the previous
    one still runs waits for it (the server's deployment concurrency limit, enqueueing),
    rather than racing it for the same artifact keys (whose leases would fail it).
    """
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise config_lib.ConfigError(
            "padir serve needs a Prefect server: run `prefect server start --host 127.0.0.1` "
            "and set PREFECT_API_URL=http://127.0.0.1:4200/api")
    parameters = dict(config_path=os.path.abspath(config_path), overrides=list(overrides),
                      from_stage=from_stage, only=only, force=list(force), lanes=lanes)
    padir_pipeline.serve(name=name, cron=cron, parameters=parameters, global_limit=1)
