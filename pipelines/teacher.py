"""The `teacher` stage: trains the AR teacher on the encoded original pairs.

Contract:
  reads:  the `encode` artifact (TFRecord shards of `train` and `dev`), the `vocab` artifact
          (`spm.model`) and the `prepare` artifact (raw dev references for BLEU).
  writes: `<workdir>/teacher/<key>/` with `checkpoints/` (orbax), `tensorboard/`
          (components/training_artifact.py), and a manifest with the final dev metrics
          (greedy and beam 4 on the best checkpoint).

Training, resuming and publishing work as pipelines/training.py says.

    padir stage teacher configs/multi30k_en_de.yaml
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from components import artifacts, metrics, training_artifact
from components import config as config_lib
from components.tokenizer import Tokenizer
from model import train, trained_model
from model.decoding import beam_search
from model.models import ARModel
from pipelines import training

log = logging.getLogger(__name__)

DEV_BEAM_SIZE, DEV_LENGTH_PENALTY = 4, 0.6  # the teacher's final dev evaluation


def run(config: config_lib.Config) -> artifacts.Artifact:
    """Trains the AR teacher on the encoded original pairs."""

    def train_fn(pending, data: train.TrainData, tokenizer: Tokenizer):
        model = training.teacher_model(config, tokenizer)
        checkpoint_dir = training_artifact.checkpoints(pending.tmp_uri)
        result = train.train_teacher(
            model, data, config.teacher, config.mesh, checkpoint_dir=checkpoint_dir,
            seed=config.seed, predict=functools.partial(beam_search.predict_greedy, model),
            log_dir=training_artifact.tensorboard(pending.tmp_uri))
        if result.completed or result.stop_reason == "time budget":
            pending.metrics["dev_final"] = final_dev_bleu(
                model, checkpoint_dir, config.teacher.loop.best_metric, data, result)
        return result

    return training.publish(config, "teacher", train_fn)


def final_dev_bleu(model: ARModel, checkpoint_dir: str, best_metric: str,
                    data: train.TrainData, result: train.TrainResult, *,
                    stage: str = "teacher") -> dict[str, Any]:
    """SacreBLEU of the best checkpoint of an AR model (`stage`, which the log names) on
    the dev set, greedy and with beam search.

    Every process decodes its slice of the dev rows with the whole parameters on its own
    device; the slices are gathered, so every process scores the whole dev set. Greedy
    decoding is what the dev evaluations score, and the training run evaluated its last
    step: when that step is the best, its greedy BLEU is taken, not decoded again."""
    params, step = trained_model.restore(model, checkpoint_dir, best_metric)
    last = result.dev_metrics or {}
    reuse_greedy = step == int(result.state.step) and {"bleu", "bleu_tok_lc"} <= set(last)
    searches = {} if reuse_greedy else {
        "greedy": jax.jit(functools.partial(beam_search.predict_greedy, model))}
    searches[f"beam{DEV_BEAM_SIZE}"] = jax.jit(functools.partial(
        beam_search.predict_beam, model, beam_size=DEV_BEAM_SIZE,
        length_penalty=DEV_LENGTH_PENALTY))
    scores = {}
    for name, search in searches.items():
        hypotheses = []
        for batch in data.dev_batches:
            output = search(params, batch)
            tokens = np.asarray(output[0] if isinstance(output, tuple) else output)
            sources = batch["source"]
            if jax.process_count() > 1:
                tokens, sources = (np.asarray(multihost_utils.process_allgather(x, tiled=True))
                                   for x in (tokens, sources))
            hypotheses += [data.detokenize(row.tolist())
                           for source, row in zip(sources, tokens) if source.any()]
        bleu = metrics.corpus_bleu(hypotheses, data.references, data.target_lang)
        tok_lc = metrics.tokenized_lowercased_bleu(hypotheses, data.references)
        scores[name] = {"bleu": round(bleu.score, 2), "signature": bleu.signature,
                        "bleu_tok_lc": round(tok_lc.score, 2)}
        log.info("%s dev %s: BLEU %.2f (tokenised lowercased %.2f)", stage, name, bleu.score,
                 tok_lc.score)
    if reuse_greedy:  # scored by the same sacreBLEU configuration as the beam search
        beam = scores[f"beam{DEV_BEAM_SIZE}"]
        scores = {"greedy": {"bleu": round(last["bleu"], 2), "signature": beam["signature"],
                             "bleu_tok_lc": round(last["bleu_tok_lc"], 2)}, **scores}
        log.info("%s dev greedy: BLEU %.2f (step %d's evaluation)", stage, last["bleu"], step)
    return scores
