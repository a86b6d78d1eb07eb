"""The stage graph: which config sections and which upstream stages each stage depends on.

A stage's artifact key hashes its own config sections and the keys of its inputs, so
changing one section invalidates that stage and everything downstream, nothing upstream.
The Prefect flow uses the same keys as its cache keys.
"""

from __future__ import annotations

import dataclasses

from components import artifacts
from components.config import Config, stable_hash, to_dict


@dataclasses.dataclass(frozen=True)
class StageSpec:
    sections: tuple[str, ...]  # config attributes whose values determine the output
    inputs: tuple[str, ...]  # upstream stages whose artifacts it reads


STAGES: dict[str, StageSpec] = {
    "prepare": StageSpec(sections=("data", "prepare", "seed"), inputs=()),
    "vocab": StageSpec(sections=("vocab", "seed"), inputs=("prepare",)),
    "encode": StageSpec(sections=("encode",), inputs=("prepare", "vocab")),
    "teacher": StageSpec(sections=("teacher", "seed"), inputs=("prepare", "vocab", "encode")),
    "train": StageSpec(sections=("train", "seed"), inputs=("prepare", "vocab", "encode")),
    "decode": StageSpec(sections=("decode",), inputs=("prepare", "vocab", "teacher", "train")),
    "score": StageSpec(sections=(), inputs=("prepare", "decode")),
}


def stage_key(config: Config, stage: str) -> str:
    spec = STAGES[stage]
    return stable_hash(
        {
            "stage": stage,
            "sections": {name: config.section_hash(name) for name in spec.sections},
            "inputs": {name: stage_key(config, name) for name in spec.inputs},
        }
    )


def section_values(config: Config, stage: str) -> dict:
    """The resolved config sections of one stage (recorded in its manifest)."""
    return {name: to_dict(config.section(name)) for name in STAGES[stage].sections}


def require_input(config: Config, stage: str) -> artifacts.Artifact:
    """The complete artifact of upstream `stage` for this config, or a clear error."""
    return artifacts.require(config.workdir, stage, stage_key(config, stage))


def output_uri(config: Config, stage: str) -> str:
    return artifacts.location(config.workdir, stage, stage_key(config, stage))
