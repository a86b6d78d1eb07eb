"""The stage registry: for each stage, the config sections and upstream stages it depends
on, and the function that computes it (`flows/stages.py: run_stage` calls it).

A stage's artifact key hashes its own config sections and the keys of its inputs, so
changing one section invalidates that stage and everything downstream, nothing upstream.
The Prefect flow uses the same keys as its cache keys.

One switch shapes the graph, `distill.enabled`: when on, the teacher's translations of
the training sources (`distill`), encoded like the originals (`encode_distilled`), are
what the students train on: the PaDIR student (`student`), the AR student
(`ar_student`) and the block drafter (`drafter`); when off, those two stages are not part
of the run and the students read the original `encode` artifact, as the teacher always
does. So the switch changes the students' keys (and their dependents'), never the
teacher's:

  prepare ─► vocab ─► encode ─► teacher ─► distill ─► encode_distilled ─┬─► student ────┬─► decode ─► score
                        │                                               ├─► ar_student ─┤
                        │                                               ├─► drafter ────┘
                        └──────────── (distill.enabled: false) ─────────┘

The AR student is part of the run only when a decode method decodes with it
(`model: ar_student`), the block drafter only when one has kind `draft_verify`; decode
reads each of them then, and its key covers theirs.
"""

from __future__ import annotations

import dataclasses

from components import artifacts
from components.config import Config, stable_hash, to_dict


@dataclasses.dataclass(frozen=True)
class StageSpec:
    sections: tuple[str, ...]  # config attributes whose values determine the output
    inputs: tuple[str, ...]  # upstream stages whose artifacts it reads (see `inputs`)
    # "module:function" that computes it, imported only when the stage runs (Beam, JAX and
    # TF are heavy, and this module sits below them). A Beam stage's function takes
    # `(config, pipeline_args=...)`, the others `(config)`; flows/stages.py calls it.
    entry: str
    pipeline_job: bool  # a Beam job: takes pipeline flags, runs standalone on Dataflow


STAGES: dict[str, StageSpec] = {
    "prepare": StageSpec(sections=("data", "prepare", "seed"), inputs=(),
                         entry="pipelines.prepare:run", pipeline_job=True),
    "vocab": StageSpec(sections=("vocab", "seed"), inputs=("prepare",),
                       entry="pipelines.vocab:run", pipeline_job=True),
    "encode": StageSpec(sections=("encode",), inputs=("prepare", "vocab"),
                        entry="pipelines.encode:run", pipeline_job=True),
    "teacher": StageSpec(sections=("teacher", "seed"), inputs=("prepare", "vocab", "encode"),
                         entry="pipelines.teacher:run", pipeline_job=False),
    "distill": StageSpec(sections=("distill",), inputs=("prepare", "teacher"),
                         entry="pipelines.distill:run", pipeline_job=True),
    "encode_distilled": StageSpec(sections=("encode",), inputs=("distill", "vocab"),
                                  entry="pipelines.encode_distilled:run", pipeline_job=True),
    # Read "encode" as registered here; `inputs` swaps in the distilled pairs when enabled.
    "student": StageSpec(sections=("student", "seed"), inputs=("prepare", "vocab", "encode"),
                         entry="pipelines.student:run", pipeline_job=False),
    "ar_student": StageSpec(sections=("ar_student", "seed"),
                            inputs=("prepare", "vocab", "encode"),
                            entry="pipelines.ar_student:run", pipeline_job=False),
    "drafter": StageSpec(sections=("drafter", "seed"), inputs=("prepare", "vocab", "encode"),
                         entry="pipelines.drafter:run", pipeline_job=False),
    # Reads "ar_student" and "drafter" only when a method decodes with them (`inputs`).
    "decode": StageSpec(sections=("decode",),
                        inputs=("prepare", "vocab", "teacher", "student", "ar_student",
                                "drafter"),
                        entry="pipelines.decode:run", pipeline_job=True),
    "score": StageSpec(sections=(), inputs=("prepare", "decode"),
                       entry="pipelines.score:run", pipeline_job=False),
}
DISTILL_STAGES = ("distill", "encode_distilled")  # active only with `distill.enabled`
# Train on `student_data`, may start from the teacher.
STUDENTS = ("student", "ar_student", "drafter")
OPTIONAL_MODELS = ("ar_student", "drafter")  # active only when a decode method uses them


def student_data(config: Config) -> str:
    """The encode stage whose pairs the students train on: the distilled ones
    when `distill.enabled`, else the original ones, which the teacher always trains on."""
    return "encode_distilled" if config.distill.enabled else "encode"


def inputs(config: Config, stage: str) -> tuple[str, ...]:
    """The upstream stages whose artifacts `stage` reads under this config: a student
    also reads the teacher when it starts from it (`init_from_teacher`); decode reads
    the AR student and the drafter only when a method decodes with them."""
    spec = STAGES[stage]
    if stage == "decode":
        return tuple(name for name in spec.inputs
                     if name not in OPTIONAL_MODELS or name in config.decode.models)
    if stage not in STUDENTS:
        return spec.inputs
    names = tuple(student_data(config) if name == "encode" else name for name in spec.inputs)
    return names + ("teacher",) if config.section(stage).init_from_teacher else names


def inactive_reason(config: Config, stage: str) -> str | None:
    """Why a run of this config does not compute `stage`, or None if it does."""
    if stage in DISTILL_STAGES and not config.distill.enabled:
        return "distill.enabled is false"
    if stage == "ar_student" and stage not in inputs(config, "decode"):
        return "no decode method has model: ar_student"
    if stage == "drafter" and stage not in inputs(config, "decode"):
        return "no decode method has kind: draft_verify"
    return None


def active_stages(config: Config) -> tuple[str, ...]:
    """The stages a run of this config computes, in registration order."""
    return tuple(name for name in STAGES if inactive_reason(config, name) is None)


def graph(config: Config) -> dict[str, tuple[str, ...]]:
    """Active stage -> its inputs under this config (what flows/plan.py orders)."""
    return {name: inputs(config, name) for name in active_stages(config)}


def stage_key(config: Config, stage: str) -> str:
    spec = STAGES[stage]
    return stable_hash(
        {
            "stage": stage,
            "sections": {name: config.section_hash(name) for name in spec.sections},
            "inputs": {name: stage_key(config, name) for name in inputs(config, stage)},
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
