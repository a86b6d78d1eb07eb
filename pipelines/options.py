"""Command line and pipeline options shared by every Beam job.

A job's flags are `--config C [--set a.b=c ...]` followed by any Beam pipeline flags,
which override the config's `runner` section:

    python -m pipelines.prepare --config configs/multi30k_en_de.yaml
    python -m pipelines.prepare --config C --runner DataflowRunner --project P \
        --region R --temp_location gs://BUCKET/tmp
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from apache_beam.options.pipeline_options import PipelineOptions

from components import artifacts, datasets, logs
from components.errors import USER_ERRORS
from components import config as config_lib


def parse_args(argv: Sequence[str] | None, description: str,
               reads_corpora: bool = False) -> tuple[config_lib.Config, list[str]]:
    """Parses our flags; everything else is returned as Beam pipeline flags. Without
    PADIR_DATA_ROOT the corpora are read from the data cache, as with `padir`, and a job that
    reads the raw corpora (`reads_corpora`: prepare) fetches them there first
    (`datasets.load_config`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="experiment YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set vocab.size=4000")
    known, pipeline_args = parser.parse_known_args(argv)
    config = datasets.load_config(known.config, known.set, reads_corpora=reads_corpora)
    return config, pipeline_args


def pipeline_options(config: config_lib.Config,
                     pipeline_args: Sequence[str] = ()) -> PipelineOptions:
    """Config defaults first, command-line flags last (argparse keeps the last value)."""
    flags = [f"--runner={config.runner.name}", *config.runner.options, *pipeline_args]
    return PipelineOptions(flags)


def main(run: Callable, argv: Sequence[str] | None, description: str) -> int:
    """The body of every Beam job's `main`: parse, run the stage, print its artifact. Bad
    input is one line on stderr (`prepare: error: ...`) and exit status 2, a stage stopped
    (its lease lost, or on request) one line and exit status 3, as with `padir`."""
    logs.configure()
    job = run.__module__.rsplit(".", 1)[-1]
    try:
        config, pipeline_args = parse_args(argv, description=description.splitlines()[0],
                                           reads_corpora=job == "prepare")
        artifact = run(config, pipeline_args=pipeline_args)
    except USER_ERRORS as e:
        print(f"{job}: error: {logs.redact(str(e))}", file=sys.stderr)
        return 2
    except artifacts.StageStopped as e:
        print(f"{job}: {e}", file=sys.stderr)
        return 3
    print(f"{artifact.stage}: {artifact.uri}")
    return 0
