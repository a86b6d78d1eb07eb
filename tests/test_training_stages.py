"""pipelines/training.py and the `padir stage` entry point: every stage up to `train` on tiny data.

One smoke test runs the real entry points in order on 200 Multi30k pairs with tiny models,
and checks each artifact and the metrics the manifests promise. The student trains on the
original pairs: a 3-step teacher's translations never reach EOS, so distillation would
reject them all (tests/test_distill.py covers the distilled path).
"""

import dataclasses
import logging
import os
import re
import types

import pytest

from components import artifacts, dag
from components import config as config_lib
from flows.stages import run_stage
from pipelines import teacher as teacher_stage
from pipelines import training
from tiny_experiment import ensure, tiny_config


@pytest.fixture(scope="module")
def config(tiny_workdir):
    # Two length buckets, not the config's seven: the stages still train and evaluate over
    # several shapes, each compiled (most of their time) for two buckets, not seven.
    return tiny_config(tiny_workdir, "distill.enabled=false", "encode.bucket_boundaries=[32, 64]")


def test_every_stage_runs_in_order_and_publishes(config, caplog):
    ensure(config, "prepare", "vocab")  # the session's; test_prepare and test_vocab run them
    for stage in ("prepare", "vocab", "encode", "teacher", "student"):
        with caplog.at_level(logging.INFO, logger=""):
            artifact = (artifacts.read(dag.output_uri(config, stage))
                        if stage in ("prepare", "vocab") else run_stage(stage, config))
        assert artifact.uri == dag.output_uri(config, stage)
        assert artifacts.is_complete(artifact.uri)
    teacher = artifacts.read(dag.output_uri(config, "teacher"))
    assert teacher.manifest["counts"]["steps"] == 3
    assert set(teacher.manifest["metrics"]["dev_final"]) == {"greedy", "beam4"}
    assert "tok:13a" in teacher.manifest["metrics"]["dev_final"]["beam4"]["signature"]
    for search in ("greedy", "beam4"):  # the published Multi30k figures' metric, beside ours
        assert "bleu_tok_lc" in teacher.manifest["metrics"]["dev_final"][search]
    assert {"bleu", "bleu_tok_lc"} <= set(teacher.manifest["metrics"]["dev"])
    assert "teacher dev greedy: BLEU" in caplog.text and "(step 3's evaluation)" in caplog.text
    _check_the_final_greedy_bleu_is_the_decoded_one(config, teacher)
    student = artifacts.read(dag.output_uri(config, "student"))
    assert student.manifest["inputs"]["encode"] == dag.output_uri(config, "encode")
    assert student.manifest["counts"]["steps"] == 2  # phase 2's own step count
    assert {"bleu", "bleu_tok_lc", "loss", "length_accuracy"} <= set(
        student.manifest["metrics"]["dev"])
    assert not [p for p in os.listdir(os.path.dirname(student.uri)) if p.startswith(".")]


def _check_the_final_greedy_bleu_is_the_decoded_one(config, teacher):
    """The published greedy BLEU is the last evaluation's (the best step of a 3-step run):
    exactly what decoding the published checkpoint again scores."""
    tokenizer = training.load_tokenizer(config)
    never_evaluated = types.SimpleNamespace(state=types.SimpleNamespace(step=-1),
                                            dev_metrics=None)
    decoded = teacher_stage.final_dev_bleu(
        training.teacher_model(config, tokenizer), teacher.path("checkpoints"),
        config.teacher.loop.best_metric, training.training_data(config, "teacher", tokenizer),
        never_evaluated)
    assert teacher.manifest["metrics"]["dev_final"] == decoded


def test_the_student_can_start_from_the_teacher(config, caplog):
    ensure(config, "prepare", "vocab")
    run_stage("encode", config)
    run_stage("teacher", config)  # the session's, if the test above ran
    warm = config.replace(student=dataclasses.replace(config.student, init_from_teacher=True))
    with caplog.at_level(logging.INFO, logger="model"):
        student = run_stage("student", warm)
    assert student.manifest["inputs"]["teacher"] == dag.output_uri(config, "teacher")
    assert re.search(r"initialised \d+ of \d+ parameter arrays from the teacher", caplog.text)


def test_a_stage_refuses_to_run_without_its_inputs(config, tmp_path):
    lonely = config.replace(workdir=str(tmp_path / "empty"))
    with pytest.raises(artifacts.IncompleteArtifactError, match="padir stage vocab"):
        run_stage("teacher", lonely)


def test_training_stages_take_no_pipeline_flags(config):
    with pytest.raises(config_lib.ConfigError, match="not a Beam job"):
        run_stage("teacher", config, pipeline_args=["--runner=DataflowRunner"])


def test_the_students_dev_curve_covers_both_phases(config):
    """What the report plots (components/training_artifact.py `dev_curve`), from the real
    stage's TensorBoard files: each phase evaluates at its last step (2 of 2, eval_every 3)."""
    from components import training_artifact

    ensure(config, "prepare", "vocab", "encode", "teacher", "student")
    student = artifacts.read(dag.output_uri(config, "student"))
    curve = training_artifact.dev_curve(student.uri)
    assert [(point["phase"], point["step"]) for point in curve] == [(1, 2), (2, 4)]
    assert curve[-1]["bleu"] == pytest.approx(student.manifest["metrics"]["dev"]["bleu"])
