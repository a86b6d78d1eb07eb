"""pipelines/ar_student.py: the AR baseline with a one-layer decoder, on tiny data.

The AR student here has two encoder layers against the teacher's one, so that starting from
the teacher takes some arrays and leaves others. The teacher is published untrained
(`publish_untrained`: starting from it needs no training); the AR student trains 3 steps on
the original pairs (an untrained teacher's translations never reach EOS: distillation would
reject them all), is stopped by SIGTERM after step 2 and resumed, then decoded by two AR
kinds with `model: ar_student`, on our search and on CTranslate2.
"""

import io
import json
import logging
import os
import re

import jax
import numpy as np
import pytest

from components import artifacts, corpus, dag
from components import config as config_lib
from components.config import DecodeMethod
from flows import cli
from flows.stages import run_stage
from model import train, trained_model
from model.decoding import translator
from pipelines import decode, training
from pipelines import score as score_stage
from tiny_experiment import (TINY_MODEL, ensure, publish_untrained, stop_after_step,
                             tiny_config)

METHODS = [{"name": "ar_student_greedy", "kind": "ar_greedy", "model": "ar_student"},
           {"name": "ct2_ar_student", "kind": "ct2_greedy", "model": "ar_student"}]


@pytest.fixture(scope="module")
def config(tiny_workdir):
    return tiny_config(
        # One length bucket (one compiled shape), in shards of its own: an encode key that
        # no other test has (test_distill needs the one-bucket key's originals unencoded).
        tiny_workdir, "distill.enabled=false", "encode.bucket_boundaries=[64]",
        "encode.num_shards=2", f"ar_student.model={ {**TINY_MODEL, 'num_encoder_layers': 2} }",
        f"decode.methods={json.dumps(METHODS)}", "decode.max_sentences=4",
        "decode.throughput_batch_size=4", "decode.latency_sentences=2")


def test_it_starts_from_the_teacher_where_shapes_agree(config):
    ensure(config, "prepare", "vocab", "encode")
    publish_untrained(config, "teacher")
    model = training.ar_student_model(config, training.load_tokenizer(config))
    assert (model.config.num_encoder_layers, model.config.num_decoder_layers) == (2, 1)
    fresh = model.init(jax.random.key(0), train.example_batch(model))
    started = training.teacher_warm_start(config, "ar_student")(fresh)
    teacher = trained_model.load(dag.output_uri(config, "teacher")).params
    jax.tree.map(np.testing.assert_array_equal, started["token_embedding"],
                 teacher["token_embedding"])
    for stack in ("encoder", "decoder"):
        jax.tree.map(np.testing.assert_array_equal, started[stack]["layer_0"],
                     teacher[stack]["layer_0"])
    # The teacher has one encoder layer: the second starts from scratch.
    jax.tree.map(np.testing.assert_array_equal, started["encoder"]["layer_1"],
                 fresh["encoder"]["layer_1"])


def test_it_trains_on_the_students_data_resumes_and_publishes(config, monkeypatch, caplog):
    ensure(config, "prepare", "vocab", "encode")
    publish_untrained(config, "teacher")
    stop_after_step(2, monkeypatch)
    with caplog.at_level(logging.INFO, logger="model"):
        with pytest.raises(artifacts.StageStopped, match="ar_student stopped at step 2"):
            run_stage("ar_student", config)
    taken, total = map(int, re.search(
        r"initialised (\d+) of (\d+) parameter arrays from the teacher", caplog.text).groups())
    assert total - taken == 8  # the second encoder layer: 2 norms, 4 projections, 2 MLP
    monkeypatch.undo()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="model"):
        artifact = run_stage("ar_student", config)
    assert "resuming from step 2" in caplog.text
    assert artifact.uri == dag.output_uri(config, "ar_student")
    assert artifact.manifest["counts"]["steps"] == 3
    assert artifact.manifest["inputs"] == {
        name: dag.output_uri(config, name) for name in ("prepare", "vocab", "encode", "teacher")}
    assert set(artifact.manifest["metrics"]["dev_final"]) == {"greedy", "beam4"}
    assert artifact.manifest["config"]["ar_student"]["model"]["num_decoder_layers"] == 1
    # With distillation on, it reads the distilled pairs, as the student does.
    distilled = config.replace(distill=config_lib.DistillConfig(), workdir="/nonexistent")
    assert dag.inputs(distilled, "ar_student")[2] == "encode_distilled"
    with pytest.raises(artifacts.IncompleteArtifactError, match="padir stage encode_distilled"):
        training.training_data(distilled, "ar_student", training.load_tokenizer(config))


def test_the_decode_stage_decodes_the_ar_kinds_with_the_ar_student(config, monkeypatch,
                                                                   capsys, tmp_path):
    ensure(config, "prepare", "vocab", "encode")
    publish_untrained(config, "teacher")
    ensure(config, "ar_student")
    uri = dag.output_uri(config, "ar_student")
    decoded = run_stage("decode", config)
    assert decoded.manifest["inputs"] == {"prepare": dag.output_uri(config, "prepare"),
                                          "ar_student": uri}
    assert [m["stage"] for m in decoded.manifest["metrics"]["methods"]] == ["ar_student"] * 2
    loaded = trained_model.load_cached(uri)
    sources = {pair["id"]: pair["source"] for pair in
               corpus.read_split(dag.output_uri(config, "prepare"), "test2016")}
    timed = {}
    for method in METHODS:  # the batch-1 pass: each sentence alone, as a Translator decodes it
        path = decode.output_path(decoded.uri, decode.LATENCY, "test2016", method["name"])
        with open(path) as f:
            records = timed[method["name"]] = [json.loads(line) for line in f]
        assert len(records) == 2
        ours = translator.Translator(loaded, DecodeMethod(**method), batch_size=1)
        assert [r["hypothesis"] for r in records] == [
            t.hypothesis for t in ours.translate([sources[r["id"]] for r in records])]
    with pytest.raises(config_lib.ConfigError, match="decodes with a 'ar_student' artifact"):
        translator.Translator(trained_model.load_cached(dag.output_uri(config, "teacher")),
                              DecodeMethod(**METHODS[0]), batch_size=1)
    # `padir translate` decodes an AR student's artifact with it; `padir export` writes it.
    first = timed["ar_student_greedy"][0]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(sources[first["id"]].encode())))
    assert cli.main(["translate", "--checkpoint", uri, "--method", "ar_greedy",
                     "--batch-size", "1"]) == 0
    assert capsys.readouterr().out == first["hypothesis"] + "\n"
    assert cli.main(["export", "--checkpoint", uri, "--output", str(tmp_path / "ct2")]) == 0
    assert os.path.isfile(tmp_path / "ct2" / "model.bin")
    scored = run_stage("score", config)
    with open(scored.path(score_stage.REPORT_JSON)) as f:
        content = json.load(f)
    assert list(content["training"]) == ["ar_student"]
    assert content["test_sets"]["test2016"]["baselines"] == {}  # never the AR student's rows
    with open(scored.path(score_stage.REPORT_MD)) as f:
        assert "| ar_student_greedy | ar_greedy | greedy, model ar_student |" in f.read()


def test_an_ar_student_row_is_compared_with_the_baselines_never_one_of_them():
    from components import report

    records = [{"hypothesis": "a dog runs", "latency_s": 0.1, "passes": 4,
                "hypothesis_tokens": 4}]
    rows = [("student_greedy", "ar_greedy", "ar_student"), ("greedy", "ar_greedy", "teacher"),
            ("student_ct2", "ct2_greedy", "ar_student"), ("padir_4", "refine", "student")]
    results = [report.score_method(name, kind, records, ["a dog runs"],
                                   {"sentences_per_s": 10.0}, records, stage=stage)
               for name, kind, stage in rows]
    assert {kind: r.method for kind, r in report.baselines(results).items()} == {
        "ar_greedy": "greedy"}
    assert report.describe_setting(DecodeMethod("s", "ct2_beam", model="ar_student")) == \
        "beam 4, length penalty 0.6, CTranslate2 float32, model ar_student"
