"""Running one stage: the function `components.dag.STAGES` names for it, imported on use.

The CLI (`padir stage`) and the Prefect flow (`flows/flow.py`) both run stages through
`run_stage`, so a stage is registered once, in the DAG, beside its inputs and sections.
"""

from __future__ import annotations

import importlib
from typing import Sequence

from components import artifacts, dag
from components import config as config_lib


def entry_point(name: str):
    """The function that computes stage `name` (its module imported now: Beam, JAX or TF)."""
    module, function = dag.STAGES[name].entry.split(":")
    return getattr(importlib.import_module(module), function)


def run_stage(name: str, config: config_lib.Config,
              pipeline_args: Sequence[str] = ()) -> artifacts.Artifact:
    """Recomputes one stage from its (complete) inputs and returns its artifact.

    Raises:
      config_lib.ConfigError: `pipeline_args` given to a stage that is not a Beam job.
    """
    if dag.STAGES[name].pipeline_job:
        return entry_point(name)(config, pipeline_args=pipeline_args)
    if pipeline_args:
        raise config_lib.ConfigError(f"stage {name} is not a Beam job: unexpected {pipeline_args}")
    return entry_point(name)(config)
