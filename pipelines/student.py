"""The `student` stage: trains the PaDIR student, phase 1 single-stage, then phase 2 unrolled.

Contract:
  reads:  the student's encode artifact, `dag.student_data(config)` (the distilled pairs,
          `encode_distilled`, when `distill.enabled`, else `encode`); the `vocab` and `prepare`
          artifacts; the `teacher` artifact when `student.init_from_teacher`.
  writes: `<workdir>/student/<key>/` with the checkpoints (orbax) and TensorBoard files of
          each phase (components/training_artifact.py), and a manifest with the final dev
          metrics.

Training, resuming and publishing work as pipelines/training.py says.

    padir stage student configs/multi30k_en_de.yaml
"""

from __future__ import annotations

from components import artifacts, training_artifact
from components import config as config_lib
from components.tokenizer import Tokenizer
from model import train
from model.decoding import refinement
from pipelines import training


def run(config: config_lib.Config) -> artifacts.Artifact:
    """Trains the PaDIR student (on distilled pairs if `distill.enabled`): phase 1
    single-stage, then phase 2 unrolled."""

    def train_fn(pending, data: train.TrainData, tokenizer: Tokenizer):
        model = training.student_model(config, tokenizer)
        return train.train_student(
            model, data, config.student, config.mesh,
            checkpoint_dir=training_artifact.checkpoints(pending.tmp_uri), seed=config.seed,
            predict=refinement.dev_predict(model),
            log_dir=training_artifact.tensorboard(pending.tmp_uri),
            warm_start=training.teacher_warm_start(config, "student"))

    return training.publish(config, "student", train_fn)
