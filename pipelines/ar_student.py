"""The `ar_student` stage: the fair AR baseline, a deep encoder and a one-layer decoder
(Kasai et al. 2021, "Deep encoder, shallow decoder"), trained on the PaDIR student's data
for about the student's wall time.

Contract:
  reads:  the students' encode artifact, `dag.student_data(config)` (the distilled pairs,
          `encode_distilled`, when `distill.enabled`, else `encode`); the `vocab` and
          `prepare` artifacts; the `teacher` artifact when `ar_student.init_from_teacher`.
  writes: `<workdir>/ar_student/<key>/` laid out as the teacher's (`checkpoints/`,
          `tensorboard/`: components/training_artifact.py; a manifest with the final dev
          metrics, greedy and beam 4 on the best checkpoint), so that every AR decoding
          kind reads it (`model: ar_student`).

Training, resuming and publishing work as pipelines/training.py says.

    padir stage ar_student configs/multi30k_en_de.yaml
"""

from __future__ import annotations

import functools

from components import artifacts, training_artifact
from components import config as config_lib
from components.tokenizer import Tokenizer
from model import train
from model.decoding import beam_search
from pipelines import teacher, training


def run(config: config_lib.Config) -> artifacts.Artifact:
    """Trains the AR student (on distilled pairs if `distill.enabled`), as the teacher trains."""
    cfg = config.ar_student

    def train_fn(pending, data: train.TrainData, tokenizer: Tokenizer):
        model = training.ar_student_model(config, tokenizer)
        checkpoint_dir = training_artifact.checkpoints(pending.tmp_uri)
        result = train.train_teacher(
            model, data, cfg, config.mesh, checkpoint_dir=checkpoint_dir,
            seed=config.seed, predict=functools.partial(beam_search.predict_greedy, model),
            log_dir=training_artifact.tensorboard(pending.tmp_uri),
            warm_start=training.teacher_warm_start(config, "ar_student"))
        if result.completed or result.stop_reason == "time budget":
            pending.metrics["dev_final"] = teacher.final_dev_bleu(
                model, checkpoint_dir, cfg.loop.best_metric, data, result, stage="ar_student")
        return result

    return training.publish(config, "ar_student", train_fn)
