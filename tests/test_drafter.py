"""pipelines/drafter.py: the block drafter of draft_verify, on tiny data.

The drafter here has two encoder layers against the teacher's one, so that starting from
the teacher takes some arrays and leaves others, and drafts blocks of 4 (not the default
8), so that the loaded model is seen to read its block from the manifest. The teacher is
published untrained (`publish_untrained`: starting from it needs no training); the drafter
trains 3 steps on the original pairs (an untrained teacher's translations never reach EOS:
distillation would reject them all), is stopped by SIGTERM after step 2 and resumed, then
translates with `padir translate`, verified by the teacher it started from.
"""

import io
import logging
import re

import jax
import numpy as np
import pytest

from components import artifacts, corpus, dag
from components import config as config_lib
from components.config import DecodeMethod
from flows import cli, plan
from flows.stages import run_stage
from model import train, trained_model
from model.decoding import translator
from model.models import DrafterModel
from pipelines import training
from tiny_experiment import (TINY_MODEL, ensure, publish_untrained, stop_after_step,
                             tiny_config)

METHODS = '[{name: draft_verify, kind: draft_verify, iterations: 1}]'


@pytest.fixture(scope="module")
def config(tiny_workdir):
    return tiny_config(
        # One length bucket in shards of two: test_ar_student's encode key (test_distill
        # needs the one-bucket key's originals unencoded).
        tiny_workdir, "distill.enabled=false", "encode.bucket_boundaries=[64]",
        "encode.num_shards=2", f"drafter.model={ {**TINY_MODEL, 'num_encoder_layers': 2} }",
        "drafter.block=4", f"decode.methods={METHODS}")


def test_it_runs_only_when_a_method_drafts_with_it(config):
    assert "drafter" in dag.active_stages(config)
    assert dag.inputs(config, "decode") == ("prepare", "vocab", "teacher", "student", "drafter")
    greedy = config.replace(decode=config_lib.DecodeConfig(
        methods=(config_lib.DecodeMethod("g", "ar_greedy"),)))
    assert dag.inactive_reason(greedy, "drafter") == "no decode method has kind: draft_verify"
    with pytest.raises(config_lib.ConfigError, match="'drafter' is not part of this config's "
                                                     "run"):
        plan.plan(greedy, only="drafter")


def test_it_starts_from_the_teacher_where_shapes_agree(config):
    ensure(config, "prepare", "vocab", "encode")
    publish_untrained(config, "teacher")
    model = training.drafter_model(config, training.load_tokenizer(config))
    assert (model.config.num_encoder_layers, model.config.num_decoder_layers) == (2, 1)
    assert model.block == 4
    fresh = model.init(jax.random.key(0), train.example_batch(model))
    started = training.teacher_warm_start(config, "drafter")(fresh)
    teacher = trained_model.load(dag.output_uri(config, "teacher")).params
    jax.tree.map(np.testing.assert_array_equal, started["token_embedding"],
                 teacher["token_embedding"])
    jax.tree.map(np.testing.assert_array_equal, started["encoder"]["layer_0"],
                 teacher["encoder"]["layer_0"])
    # The teacher has one encoder layer: the second starts from scratch.
    jax.tree.map(np.testing.assert_array_equal, started["encoder"]["layer_1"],
                 fresh["encoder"]["layer_1"])


def test_it_trains_on_the_students_data_resumes_and_publishes(config, monkeypatch, caplog):
    ensure(config, "prepare", "vocab", "encode")
    publish_untrained(config, "teacher")
    stop_after_step(2, monkeypatch)
    with caplog.at_level(logging.INFO, logger="model"):
        with pytest.raises(artifacts.StageStopped, match="drafter stopped at step 2"):
            run_stage("drafter", config)
    taken, total = map(int, re.search(
        r"initialised (\d+) of (\d+) parameter arrays from the teacher", caplog.text).groups())
    assert 0 < taken < total
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="model"):
        artifact = run_stage("drafter", config)
    assert "resuming from step 2" in caplog.text
    assert artifact.uri == dag.output_uri(config, "drafter")
    assert artifact.manifest["counts"]["steps"] == 3
    assert artifact.manifest["inputs"] == {
        name: dag.output_uri(config, name) for name in ("prepare", "vocab", "encode", "teacher")}
    metrics = artifact.manifest["metrics"]
    assert {"loss", "accuracy", "bleu"} <= set(metrics["dev"])  # the loop's, of predict_batch
    assert "dev_final" not in metrics  # no greedy or beam search: it is not an AR model
    assert metrics["parameters"] > 0
    section = artifact.manifest["config"]["drafter"]
    assert (section["block"], section["model"]["num_decoder_layers"]) == (4, 1)
    # Restored as a DrafterModel drafting the block it trained on.
    loaded = trained_model.load(artifact.uri)
    assert isinstance(loaded.model, DrafterModel) and loaded.model.block == 4
    assert loaded.stage == "drafter" and loaded.step == 3
    # With distillation on, it reads the distilled pairs, as the student does.
    distilled = config.replace(distill=config_lib.DistillConfig(), workdir="/nonexistent")
    assert dag.inputs(distilled, "drafter")[2] == "encode_distilled"
    with pytest.raises(artifacts.IncompleteArtifactError, match="padir stage encode_distilled"):
        training.training_data(distilled, "drafter", training.load_tokenizer(config))


def test_padir_translate_drafts_with_it_for_its_teacher(config, monkeypatch, capsys):
    ensure(config, "prepare", "vocab", "encode")
    publish_untrained(config, "teacher")
    ensure(config, "drafter")
    source = next(iter(corpus.read_split(dag.output_uri(config, "prepare"), "test2016")))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(source["source"].encode())))
    # No --method: a drafter artifact decodes with draft_verify, the teacher found through
    # its inputs; exact verification is the teacher's greedy output.
    assert cli.main(["translate", "--checkpoint", dag.output_uri(config, "drafter"),
                     "--batch-size", "1"]) == 0
    teacher = trained_model.load_cached(dag.output_uri(config, "teacher"))
    greedy, = translator.Translator(teacher, DecodeMethod("g", "ar_greedy"),
                                    batch_size=1).translate([source["source"]])
    assert capsys.readouterr().out == greedy.hypothesis + "\n"
