"""model/stages.py and the `padir stage` entry point: every stage up to `train` on tiny data.

One smoke test runs the real entry points in order on 200 Multi30k pairs with tiny models,
and checks each artifact and the metrics the manifests promise.
"""

import os

import pytest

from components import artifacts, dag
from components import config as config_lib
from flows import cli

DATA_ROOT = os.environ.get("PADIR_DATA_ROOT", "")
TINY_MODEL = {"d_model": 32, "num_heads": 2, "num_encoder_layers": 1, "num_decoder_layers": 1,
              "mlp_dim": 64, "dropout_rate": 0.0}
TINY_LOOP = {"tokens_per_batch": 512, "log_every": 2, "eval_every": 3, "checkpoint_every": 3}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    if not os.path.isdir(os.path.join(DATA_ROOT, "multi30k")):
        pytest.skip("PADIR_DATA_ROOT does not hold multi30k")
    workdir = tmp_path_factory.mktemp("stages")
    path = workdir / "tiny.yaml"
    path.write_text(f"include: {os.path.abspath('configs/multi30k_en_de.yaml')}\n")
    return config_lib.load(str(path), [
        f"workdir={workdir}/work",
        "data.max_train_pairs=200",
        "prepare.num_shards=1",
        "vocab.size=400",
        "encode.num_shards=1",
        f"teacher.model={TINY_MODEL}", f"teacher.loop={TINY_LOOP}", "teacher.steps=3",
        "teacher.optimizer.warmup_steps=1",
        f"train.model={TINY_MODEL}", f"train.loop={TINY_LOOP}", "train.phase1_steps=2",
        "train.phase2_steps=2", "train.optimizer.warmup_steps=1",
    ])


def test_every_stage_runs_in_order_and_publishes(config):
    for stage in ("prepare", "vocab", "encode", "teacher", "train"):
        artifact = cli.run_stage(stage, config)
        assert artifact.uri == dag.output_uri(config, stage)
        assert artifacts.is_complete(artifact.uri)
    teacher = artifacts.read(dag.output_uri(config, "teacher"))
    assert teacher.manifest["counts"]["steps"] == 3
    assert set(teacher.manifest["metrics"]["dev_final"]) == {"greedy", "beam4"}
    assert "tok:13a" in teacher.manifest["metrics"]["dev_final"]["beam4"]["signature"]
    student = artifacts.read(dag.output_uri(config, "train"))
    assert student.manifest["counts"]["steps"] == 2  # phase 2's own step count
    assert {"bleu", "loss", "length_accuracy"} <= set(student.manifest["metrics"]["dev"])
    assert not [p for p in os.listdir(os.path.dirname(student.uri)) if p.startswith(".")]


def test_a_stage_refuses_to_run_without_its_inputs(config, tmp_path):
    lonely = config.replace(workdir=str(tmp_path / "empty"))
    with pytest.raises(artifacts.IncompleteArtifactError, match="padir stage vocab"):
        cli.run_stage("teacher", lonely)


def test_training_stages_take_no_beam_flags(config):
    with pytest.raises(config_lib.ConfigError, match="not a Beam job"):
        cli.run_stage("teacher", config, beam_args=["--runner=DataflowRunner"])
