"""A tiny end-to-end experiment config on a slice of Multi30k, shared by stage tests."""

import os

import pytest

from components import config as config_lib

DATA_ROOT = os.environ.get("PADIR_DATA_ROOT", "")
TINY_MODEL = {"d_model": 32, "num_heads": 2, "num_encoder_layers": 1, "num_decoder_layers": 1,
              "mlp_dim": 64, "dropout_rate": 0.0}
TINY_LOOP = {"tokens_per_batch": 512, "log_every": 2, "eval_every": 3, "checkpoint_every": 3}


def tiny_config(workdir, *overrides: str) -> config_lib.Config:
    """configs/multi30k_en_de.yaml shrunk to 200 pairs, a 400-piece vocab and tiny models
    trained for 2-3 steps: every stage runs in seconds."""
    if not os.path.isdir(os.path.join(DATA_ROOT, "multi30k")):
        pytest.skip("PADIR_DATA_ROOT does not hold multi30k")
    path = os.path.join(workdir, "tiny.yaml")
    with open(path, "w") as f:
        f.write(f"include: {os.path.abspath('configs/multi30k_en_de.yaml')}\n")
    return config_lib.load(path, [
        f"workdir={workdir}/work",
        "data.max_train_pairs=200",
        "prepare.num_shards=1",
        "vocab.size=400",
        "encode.num_shards=1",
        f"teacher.model={TINY_MODEL}", f"teacher.loop={TINY_LOOP}", "teacher.steps=3",
        "teacher.optimizer.warmup_steps=1",
        f"train.model={TINY_MODEL}", f"train.loop={TINY_LOOP}", "train.phase1_steps=2",
        "train.phase2_steps=2", "train.optimizer.warmup_steps=1",
        *overrides,
    ])
