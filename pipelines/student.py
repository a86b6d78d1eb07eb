"""The `student` stage: trains the PaDIR student, phase 1 single-stage, then phase 2 unrolled.

Contract:
  reads:  the student's encode artifact, `dag.student_data(config)` (the distilled pairs,
          `encode_distilled`, when `distill.enabled`, else `encode`); the `vocab` and `prepare`
          artifacts; the `teacher` artifact when `student.init_from_teacher`.
  writes: `<workdir>/student/<key>/` with `checkpoints/phase1` and `checkpoints/phase2`
          (orbax), `tensorboard/`, and a manifest with the final dev metrics.

Training, resuming and publishing work as pipelines/training.py says.

    padir stage student configs/multi30k_en_de.yaml
"""

from __future__ import annotations

from components import artifacts, dag
from components import config as config_lib
from components.tokenizer import Tokenizer
from model import train, translator, warm_start
from pipelines import training


def run(config: config_lib.Config) -> artifacts.Artifact:
    """Trains the PaDIR student (on distilled pairs if `distill.enabled`): phase 1
    single-stage, then phase 2 unrolled."""

    def train_fn(pending, data: train.TrainData, tokenizer: Tokenizer):
        return train.train_student(
            training.student_model(config, tokenizer), data, config.student, config.mesh,
            checkpoint_dir=pending.path("checkpoints"), seed=config.seed,
            log_dir=pending.path("tensorboard"), warm_start=_teacher_warm_start(config))

    return training.publish(config, "student", train_fn)


def _teacher_warm_start(config: config_lib.Config):
    """With `student.init_from_teacher`: fresh student parameters -> the teacher's where
    they fit (model/warm_start.py); else None."""
    if not config.student.init_from_teacher:
        return None
    teacher_uri = dag.require_input(config, "teacher").uri

    def start(params):
        return warm_start.from_teacher(params, translator.load(teacher_uri).params)[0]

    return start
