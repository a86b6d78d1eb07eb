"""Running one Beam stage: the sequence every job's `run` shares.

A job's `run(config, pipeline_args)` finds and checks its inputs (a missing one fails before
anything is written), then hands the rest to `job.run`:

    return job.run(config, "distill", pipeline_args, inputs={"prepare": prepared, ...},
                   build=lambda pipeline, output_uri: build(pipeline, config, ...),
                   namespace=NAMESPACE, counter_names=COUNTER_NAMES, finish=finish)

`job.run` logs the stage's config, takes the artifact's lease and temporary directory
(`components.artifacts.write`), builds the pipeline under it with the config's and the
command line's options (`options.pipeline_options`), runs it to the end, reads its counters
(`counter_values`) and hands them to the job's `finish`. `finish` checks that they add up
(`check_accounting`), does what is left to plain Python, and fills the manifest's counts
and metrics; if it raises, nothing is published. Then the artifact is published, manifest
last, and returned.

Counters are how a job accounts for every element: it counts them into its namespace
(`counted` in a `beam.Map`, or `Metrics.counter` in a DoFn), and their names become the
manifest's counts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import apache_beam as beam
from apache_beam.metrics.metric import Metrics, MetricsFilter

from components import artifacts, dag
from components import config as config_lib
from pipelines import options

T = TypeVar("T")


def counted(element: T, namespace: str, name: str) -> T:
    """`element`, counted once more as `name`: `beam.Map(counted, NAMESPACE, "read")`."""
    Metrics.counter(namespace, name).inc()
    return element


def counter_values(result: beam.runners.runner.PipelineResult, namespace: str,
                   counter_names: Iterable[str] = ()) -> dict[str, int]:
    """A finished job's counters in `namespace` by name, sorted; each of `counter_names`
    that nothing incremented is 0."""
    counts = dict.fromkeys(counter_names, 0)
    for counter in result.metrics().query(MetricsFilter().with_namespace(namespace))["counters"]:
        # Committed values are exact under retries; runners without them report attempted.
        value = counter.committed if counter.committed is not None else counter.attempted
        name = counter.key.metric.name
        counts[name] = counts.get(name, 0) + value
    return dict(sorted(counts.items()))


def check_accounting(stage: str, balances: Mapping[str, tuple[int, int]]) -> None:
    """Fails a job that lost or doubled elements: each balance is `what: (expected, counted)`.

    Raises:
      RuntimeError: naming every balance that does not hold.
    """
    wrong = [f"{what} is {actual}, expected {expected}"
             for what, (expected, actual) in balances.items() if actual != expected]
    if wrong:
        raise RuntimeError(f"{stage}: counts do not add up: {'; '.join(wrong)}")


@dataclasses.dataclass(frozen=True)
class Finished:
    """A pipeline that ran to the end, as `finish` sees it."""

    counts: dict[str, int]  # its counters (`counter_values`)
    seconds: float  # from submitting it until it finished


def run(config: config_lib.Config, stage: str, pipeline_args: Sequence[str], *,
        inputs: Mapping[str, artifacts.Artifact],
        build: Callable[[beam.Pipeline, str], None],
        namespace: str, counter_names: Iterable[str],
        finish: Callable[[artifacts.PendingArtifact, Finished], None]) -> artifacts.Artifact:
    """Runs the Beam job of `stage` and publishes its artifact (see the module docstring).

    Args:
      inputs: the upstream artifacts, recorded in the manifest by stage.
      build: adds the job's steps to a pipeline, writing under the given URI (the
        artifact's temporary directory).
      namespace, counter_names: the job's counters (`counter_values`).
      finish: checks the finished job and fills the pending artifact's counts and metrics.
    """
    logging.info("%s: %s", stage, config_lib.summary(config, dag.STAGES[stage].sections))
    logging.debug("%s: resolved config\n%s", stage, config_lib.dump(config))
    with artifacts.write(config.workdir, stage, dag.stage_key(config, stage),
                         config=dag.section_values(config, stage),
                         config_yaml=config_lib.dump(config),
                         inputs={name: artifact.uri for name, artifact in inputs.items()}) as out:
        pipeline = beam.Pipeline(options=options.pipeline_options(config, pipeline_args))
        build(pipeline, out.tmp_uri)
        started = time.perf_counter()
        result = pipeline.run()
        result.wait_until_finish()
        seconds = time.perf_counter() - started
        finish(out, Finished(counter_values(result, namespace, counter_names), seconds))
    artifact = artifacts.read(dag.output_uri(config, stage))
    logging.info("%s: wrote %s counts=%s", stage, artifact.uri, artifact.manifest["counts"])
    return artifact
