"""The `drafter` stage: the block drafter of `draft_verify`, an encoder-decoder that, given
the source and the accepted prefix, predicts the next `block` tokens in one pass; trained
as the teacher is, on the PaDIR student's data.

Contract:
  reads:  the students' encode artifact, `dag.student_data(config)` (the distilled pairs,
          `encode_distilled`, when `distill.enabled`, else `encode`); the `vocab` and
          `prepare` artifacts; the `teacher` artifact when `drafter.init_from_teacher`.
  writes: `<workdir>/drafter/<key>/` laid out as the teacher's (`checkpoints/`,
          `tensorboard/`: components/training_artifact.py; a manifest with the loop's dev
          metrics: loss, accuracy and the BLEU of the drafter's own block-by-block
          translation), which the `draft_verify` kind drafts with.

Training, resuming and publishing work as pipelines/training.py says.

    padir stage drafter configs/multi30k_en_de.yaml
"""

from __future__ import annotations

from components import artifacts, training_artifact
from components import config as config_lib
from components.tokenizer import Tokenizer
from model import train
from pipelines import training


def run(config: config_lib.Config) -> artifacts.Artifact:
    """Trains the drafter (on distilled pairs if `distill.enabled`), as the teacher trains.

    No final greedy and beam dev decoding: the drafter is read only by draft_verify, whose
    output the teacher decides."""
    def train_fn(pending, data: train.TrainData, tokenizer: Tokenizer):
        model = training.drafter_model(config, tokenizer)
        return train.train_teacher(
            model, data, config.drafter, config.mesh,
            checkpoint_dir=training_artifact.checkpoints(pending.tmp_uri), seed=config.seed,
            predict=model.predict_batch,
            log_dir=training_artifact.tensorboard(pending.tmp_uri),
            warm_start=training.teacher_warm_start(config, "drafter"))

    return training.publish(config, "drafter", train_fn)
