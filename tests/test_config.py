"""components/config.py: the typed schema, overrides, includes, env vars, section hashes."""

import json
import os

import pytest
import yaml

from components import config as config_lib
from components import dag
from components.config import ConfigError

LANGS = {"source_lang": "en", "target_lang": "de"}
BASE = {"workdir": "work", "data": {**LANGS, "train": {"source": "a.en", "target": "a.de"}}}


def _write_yaml(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _load(tmp_path, data=None, overrides=()) -> config_lib.Config:
    return config_lib.load(_write_yaml(tmp_path / "c.yaml", data or BASE), overrides)


def test_defaults_live_in_the_schema(tmp_path):
    config = _load(tmp_path)
    assert config.prepare == config_lib.PrepareConfig()
    assert config.runner.name == "FnApiRunner"
    assert config.data.train.source == "a.en"


def test_load_round_trips_through_dump(tmp_path):
    config = _load(tmp_path, overrides=["data.test=[{name: t1, corpus: {tsv: t.tsv}}]"])
    reloaded = config_lib.load(_write_yaml(tmp_path / "dumped.yaml",
                                           yaml.safe_load(config_lib.dump(config))))
    assert reloaded == config


@pytest.mark.parametrize("override, key", [
    ("prepare.max_charz=3", "prepare.max_charz"),
    ("data.train.sauce=x", "data.train.sauce"),
    ("colour=red", "colour"),
])
def test_unknown_key_names_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        _load(tmp_path, overrides=[override])


@pytest.mark.parametrize("override, key, expected", [
    ("prepare.max_chars=many", "prepare.max_chars", "an integer"),
    ("prepare.max_chars=1.5", "prepare.max_chars", "an integer"),
    ("prepare.deduplicate=1", "prepare.deduplicate", "true/false"),
    ("prepare.max_length_ratio=[1]", "prepare.max_length_ratio", "a number"),
    ("prepare.max_length_ratio=2e", "prepare.max_length_ratio", "a number"),
    ("prepare.max_chars=1e3", "prepare.max_chars", "an integer"),
    ("runner.options=--flag", "runner.options", "a list"),
    ("data.train=3", "data.train", "a mapping"),
    ("vocab.model_type=wordpiece", "vocab.model_type", "one of"),
])
def test_wrong_type_names_the_key(tmp_path, override, key, expected):
    with pytest.raises(ConfigError, match=f"{key}: expected {expected}"):
        _load(tmp_path, overrides=[override])


def test_set_overrides_scalars_nested_keys_and_lists(tmp_path):
    config = _load(tmp_path, overrides=[
        "seed=3",
        "prepare.max_length_ratio=2",  # an int where a float is expected
        "data.train.target=b.de",  # nested, keeps the sibling `source`
        "runner.options=[--direct_num_workers=2, --direct_running_mode=multi_threading]",
        "data.test=[{name: test2016, corpus: {source: t.en, target: t.de}}]",
        "data.max_train_pairs=null",
        "teacher.optimizer.learning_rate=2e-3",  # PyYAML reads it as a string
    ])
    assert config.teacher.optimizer.learning_rate == 0.002
    assert config.seed == 3
    assert config.prepare.max_length_ratio == 2.0 and isinstance(
        config.prepare.max_length_ratio, float)
    assert (config.data.train.source, config.data.train.target) == ("a.en", "b.de")
    assert config.runner.options == ("--direct_num_workers=2", "--direct_running_mode=multi_threading")
    assert config.data.test == (config_lib.TestSetConfig(
        "test2016", config_lib.CorpusConfig(source="t.en", target="t.de")),)
    assert config.data.max_train_pairs is None


def test_set_needs_key_and_value(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        _load(tmp_path, overrides=["seed"])
    with pytest.raises(ConfigError, match="'workdir' is not a section"):
        _load(tmp_path, overrides=["workdir.x=1"])


def test_corpus_locations_keep_their_placeholders_and_other_strings_are_expanded(
        tmp_path, monkeypatch):
    monkeypatch.setenv("PADIR_DATA_ROOT", "https://user:s3cret@host/data")
    monkeypatch.setenv("PADIR_WORK", str(tmp_path / "w"))
    data = {"workdir": "${PADIR_WORK}",
            "data": {**LANGS, "train": {"source": "${PADIR_DATA_ROOT}/train.en.gz",
                                          "target": "${PADIR_DATA_ROOT}/train.de.gz"}}}
    config = _load(tmp_path, data)
    assert config.workdir == str(tmp_path / "w")
    assert config.data.train.source == "${PADIR_DATA_ROOT}/train.en.gz"
    assert config_lib.expand_env(config.data.train.source) == \
        "https://user:s3cret@host/data/train.en.gz"
    written = config_lib.dump(config) + json.dumps(dag.section_values(config, "prepare"))
    assert "s3cret" not in written and "${PADIR_DATA_ROOT}/train.de.gz" in written
    # The key hashes the placeholder: a rotated token or another data root changes nothing.
    monkeypatch.setenv("PADIR_DATA_ROOT", "/elsewhere")
    assert dag.stage_key(_load(tmp_path, data), "prepare") == dag.stage_key(config, "prepare")


def test_summary_is_one_line_of_section_hashes(tmp_path):
    config = _load(tmp_path)
    line = config_lib.summary(config, ("data", "prepare", "seed"))
    assert line == f"data {config.section_hash('data')}, prepare " \
                   f"{config.section_hash('prepare')}, seed 0"


def test_missing_env_var_names_variable_and_key(tmp_path, monkeypatch):
    monkeypatch.delenv("PADIR_NOT_SET", raising=False)
    data = {"data": {"train": {"tsv": "${PADIR_NOT_SET}/deu.zip"}}}
    with pytest.raises(ConfigError, match="data.train.tsv: environment variable PADIR_NOT_SET"):
        _load(tmp_path, data)


def test_include_merges_the_overlay_over_its_base(tmp_path):
    _write_yaml(tmp_path / "base.yaml", {
        "workdir": "work/base", "seed": 1,
        "data": {**LANGS, "train": {"source": "a.en", "target": "a.de"},
                 "max_train_pairs": 100},
        "prepare": {"max_chars": 400, "num_shards": 8},
    })
    (tmp_path / "overlays").mkdir()
    overlay = _write_yaml(tmp_path / "overlays" / "small.yaml", {
        "include": "../base.yaml", "workdir": "work/small",
        "data": {"max_train_pairs": 10}, "prepare": {"num_shards": 1},
    })
    config = config_lib.load(overlay, ["prepare.max_chars=50"])
    assert config.workdir == os.path.abspath("work/small") and config.seed == 1
    assert config.data.train.source == "a.en" and config.data.max_train_pairs == 10
    assert (config.prepare.max_chars, config.prepare.num_shards) == (50, 1)


def test_the_shipped_configs_load(monkeypatch):
    monkeypatch.setenv("PADIR_DATA_ROOT", "/data")
    demo = config_lib.load("configs/demo.yaml")
    assert demo.data.max_train_pairs == 10000
    assert config_lib.expand_env(demo.data.train.source) == "/data/multi30k/train.en.gz"
    assert [t.name for t in demo.data.test] == ["test2016"]
    benchmark = config_lib.load("configs/multi30k_en_de.yaml")
    assert benchmark.decode.latency_sentences == 200 and benchmark.distill.enabled
    tpu = config_lib.load("configs/overlays/tpu.yaml")
    assert tpu.mesh.distributed and tpu.mesh.fsdp == 4 and tpu.workdir.startswith("gs://")
    for section in (tpu.teacher, tpu.student, tpu.ar_student):  # the paper's shape, no budget
        assert (section.model.d_model, section.model.num_encoder_layers) == (512, 6)
        assert section.loop.max_minutes is None
    assert tpu.data == benchmark.data and tpu.vocab == benchmark.vocab


@pytest.mark.parametrize("data, message", [
    ({"train": {"source": "a"}}, "data.train: source and target must both be given"),
    ({"train": {"source": "a", "target": "b", "tsv": "c"}}, "data.train: give either"),
    ({"train": {}}, "data.train: give source"),
    ({"train": {"source": "a", "target": "b", "member": "m"}}, "data.train.member"),
    ({"train": {"tsv": "c", "tsv_columns": [1, 1]}}, "data.train.tsv_columns"),
    ({"train": {"tsv": "c", "tsv_columns": [0, 2], "tsv_num_columns": 2}},
     "data.train.tsv_num_columns"),
    ({"train": {"tsv": "c"}, "carve_dev_fraction": 1.5}, "data.carve_dev_fraction"),
    ({"train": {"tsv": "c"}, "carve_dev_fraction": 0.5, "carve_test_fraction": 0.5},
     "carve_test_fraction must be < 1"),
    ({"train": {"tsv": "c"}, "max_train_pairs": 0}, "data.max_train_pairs"),
    ({"train": {"tsv": "c"}, "train_sample_fraction": 0.0}, "data.train_sample_fraction"),
    ({"train": {"tsv": "c"}, "train_sample_fraction": 1.5}, "data.train_sample_fraction"),
    ({"train": {"tsv": "c"}, "carve_by": "english"}, "data.carve_by: expected one of"),
    ({"train": {"tsv": "c"}, "test": [{"name": "train", "corpus": {"tsv": "t"}}]},
     r"data.test\[0\].name"),
    ({"train": {"tsv": "c"}, "test": [{"name": "a/b", "corpus": {"tsv": "t"}}]},
     r"data.test\[0\].name"),
    ({"train": {"tsv": "c"}, "test": [{"name": "t", "corpus": {"tsv": "t"}},
                                      {"name": "t", "corpus": {"tsv": "u"}}]},
     r"data.test\[1\].name: 't' is given twice"),
    ({"train": {"tsv": "c"}, "test": [{"name": "t", "corpus": {}}]}, r"data.test\[0\]"),
])
def test_invalid_data_sections_are_named(tmp_path, data, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, {"data": {**LANGS, **data}})


@pytest.mark.parametrize("missing", ["source_lang", "target_lang"])
def test_the_language_pair_is_required(tmp_path, missing):
    """No default pair: a config for another pair would label its metrics en/de."""
    data = {key: value for key, value in BASE["data"].items() if key != missing}
    with pytest.raises(ConfigError, match=f"data.{missing} is required"):
        _load(tmp_path, {"data": data})
    with pytest.raises(ConfigError, match="data.source_lang is required"):
        _load(tmp_path, {"workdir": "work"})  # no data section at all


def test_invalid_prepare_section(tmp_path):
    with pytest.raises(ConfigError, match="prepare.max_length_ratio"):
        _load(tmp_path, overrides=["prepare.max_length_ratio=0.5"])
    with pytest.raises(ConfigError, match="num_shards"):
        _load(tmp_path, overrides=["prepare.num_shards=0"])


@pytest.mark.parametrize("rate", ["1.0", "-0.1"])
def test_dropout_rate_outside_0_1_is_rejected(tmp_path, rate):
    with pytest.raises(ConfigError, match="model.dropout_rate"):
        _load(tmp_path, overrides=[f"teacher.model.dropout_rate={rate}"])


def test_section_hash_is_stable_and_changes_only_for_the_changed_section(tmp_path):
    config = _load(tmp_path)
    again = _load(tmp_path)
    sections = ("data", "prepare", "vocab", "runner")
    assert {s: config.section_hash(s) for s in sections} == {
        s: again.section_hash(s) for s in sections}
    changed = _load(tmp_path, overrides=["prepare.max_chars=77"])
    assert changed.section_hash("prepare") != config.section_hash("prepare")
    assert {s: changed.section_hash(s) for s in ("data", "vocab", "runner")} == {
        s: config.section_hash(s) for s in ("data", "vocab", "runner")}
    # Artifact keys: the changed stage and its dependents change, upstream does not.
    assert dag.stage_key(changed, "prepare") != dag.stage_key(config, "prepare")
    assert dag.stage_key(changed, "vocab") != dag.stage_key(config, "vocab")
    vocab_changed = _load(tmp_path, overrides=["vocab.size=4000"])
    assert dag.stage_key(vocab_changed, "prepare") == dag.stage_key(config, "prepare")
    assert dag.stage_key(vocab_changed, "vocab") != dag.stage_key(config, "vocab")
    # Settings that do not define any output (the runner, the workdir) change no key.
    moved = _load(tmp_path, overrides=["workdir=elsewhere", "runner.name=DataflowRunner"])
    assert dag.stage_key(moved, "vocab") == dag.stage_key(config, "vocab")


def test_a_local_workdir_is_made_absolute_and_a_remote_one_kept():
    assert config_lib.from_dict(config_lib.Config, {**BASE, "workdir": "runs/a"}).workdir == \
        os.path.abspath("runs/a")
    assert config_lib.from_dict(config_lib.Config, {**BASE, "workdir": "gs://b/runs"}).workdir == \
        "gs://b/runs"


# --- a broken file or override is one line naming the file, line or key ----------------


@pytest.mark.parametrize("text, message", [
    ("seed: [1, 2\n", r"c.yaml:2:1: invalid YAML: expected ',' or ']'"),
    ("seed: 1\n  workdir: x\n", r"c.yaml:2:10: invalid YAML: mapping values"),
    ("seed: !!python/object/apply:os.system [echo hi]\n",
     r"c.yaml:1:7: invalid YAML: could not determine a constructor.*python/object"),
    ("- a\n- b\n", r"c.yaml: expected a mapping at the top level, got list \['a', 'b'\]"),
    ("include: [a]\n", r"c.yaml: include: expected a file name"),
    ("include: nowhere.yaml\n", r"nowhere.yaml: no such config file"),
])
def test_a_broken_config_file_is_one_line_naming_file_and_line(tmp_path, text, message):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message) as error:
        config_lib.load(str(tmp_path / "c.yaml"))
    assert "\n" not in str(error.value)


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"missing.yaml: no such config file"):
        config_lib.load(str(tmp_path / "missing.yaml"))


def test_an_include_loop_names_the_chain(tmp_path):
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\nseed: 1\n")
    with pytest.raises(ConfigError, match=r"include loop: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        config_lib.load(str(tmp_path / "a.yaml"))


@pytest.mark.parametrize("override, message", [
    ("seed=[", r"--set seed: the value is not valid YAML .*quote it"),
    ("seed={a: [}", r"--set seed: the value is not valid YAML"),
])
def test_a_bad_set_value_is_one_line(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, overrides=[override])


def test_a_type_error_never_echoes_the_whole_value(tmp_path):
    # A YAML alias bomb: a few hundred bytes whose value prints as 9**9 strings.
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    (tmp_path / "c.yaml").write_text("\n".join(["prepare:", *(f"  {line}" for line in lines),
                                                "  max_chars: *a8"]) + "\n")
    with pytest.raises(ConfigError, match="unknown config key 'prepare.a0'"):
        config_lib.load(str(tmp_path / "c.yaml"))
    with pytest.raises(ConfigError, match=r"prepare.max_chars: expected an integer, got list") \
            as error:
        config_lib.load(str(tmp_path / "c.yaml"), ["prepare={max_chars: [[[[[[[[1]]]]]]]]}"])
    assert len(str(error.value)) < 200
    bomb = yaml.safe_load("\n".join(lines))["a8"]
    with pytest.raises(ConfigError, match=r"prepare.max_chars: expected an integer") as error:
        config_lib.from_dict(config_lib.Config, {**BASE, "prepare": {"max_chars": bomb}})
    assert len(str(error.value)) < 200


def test_the_dataflow_overlay_carries_the_runinference_flags(monkeypatch):
    monkeypatch.setenv("PADIR_DATA_ROOT", "gs://b/data")
    options = config_lib.load("configs/overlays/dataflow.yaml").runner.options
    assert {"--experiments=no_use_multiple_sdk_containers",
            "--number_of_worker_harness_threads=1", "--sdk_location=container"} <= set(options)


def test_the_ar_student_section_is_the_teachers_with_one_decoder_layer(tmp_path):
    config = _load(tmp_path, overrides=["ar_student.steps=7", "ar_student.init_from_teacher=true",
                                        "ar_student.model.num_encoder_layers=6"])
    assert (config.ar_student.steps, config.ar_student.init_from_teacher) == (7, True)
    model = config.ar_student.model
    assert (model.num_encoder_layers, model.num_decoder_layers) == (6, 1)
    assert config_lib.ARStudentConfig().model == config_lib.ModelConfig(num_decoder_layers=1)
    for override, message in (
            ("ar_student.steps=0", "ar_student: steps must be >= 1"),
            ("ar_student.label_smoothing=1.0", "ar_student: .* label_smoothing in"),
            ("ar_student.init_from_teacher=1", "ar_student.init_from_teacher: expected true"),
            ("ar_student.phase1_steps=5", "unknown config key 'ar_student.phase1_steps'"),
            ("ar_student.model.max_target_len=32", "ar_student.model.max_source_len and "
                                                   "max_target_len must be >= the widest")):
        with pytest.raises(ConfigError, match=message):
            _load(tmp_path, overrides=[override])


def test_the_drafter_section_is_a_teachers_with_one_decoder_layer_and_a_block(tmp_path):
    config = _load(tmp_path, overrides=["drafter.block=4", "drafter.model.num_encoder_layers=6"])
    assert (config.drafter.block, config.drafter.init_from_teacher) == (4, True)
    assert (config.drafter.model.num_encoder_layers, config.drafter.model.num_decoder_layers) \
        == (6, 1)
    assert config_lib.DrafterConfig().block == 8
    for override, message in (
            ("drafter.block=0", r"drafter.block: expected 1 <= block < model.max_target_len "
                                r"\(64\), got 0"),
            ("drafter.block=64", r"drafter.block: .* got 64"),
            ("drafter.steps=0", "drafter: steps must be >= 1"),
            ("drafter.phase1_steps=5", "unknown config key 'drafter.phase1_steps'"),
            ("drafter.model.max_target_len=32", "drafter.model.max_source_len and "
                                                "max_target_len must be >= the widest")):
        with pytest.raises(ConfigError, match=message):
            _load(tmp_path, overrides=[override])
    # draft_verify drafts with it and verifies with the teacher.
    method = config_lib.DecodeMethod("dv", "draft_verify", iterations=1)
    assert (method.stage, method.rescorer) == ("drafter", "teacher")
    assert config_lib.DecodeConfig(methods=(method,)).models == ("drafter", "teacher")


def test_the_ar_kinds_decode_the_ar_model_they_name():
    for kind in ("ar_greedy", "ar_beam", "ct2_greedy", "ct2_beam"):
        assert config_lib.DecodeMethod("m", kind).stage == "teacher"
        assert config_lib.DecodeMethod("m", kind, model="ar_student").stage == "ar_student"
    with pytest.raises(ConfigError, match="'model' does not apply to kind refine"):
        config_lib.DecodeMethod("p", "refine", model="ar_student")
    with pytest.raises(ConfigError, match=r"model must be one of \['teacher', 'ar_student'\]"):
        config_lib.DecodeMethod("g", "ar_greedy", model="student")
    with pytest.raises(ConfigError, match=r"decode.methods\[0\].model: expected one of"):
        config_lib.from_dict(config_lib.Config, {**BASE, "decode": {"methods": [
            {"name": "g", "kind": "ar_greedy", "model": "student"}]}})
    methods = (config_lib.DecodeMethod("g", "ar_greedy", model="ar_student"),
               config_lib.DecodeMethod("r", "refine_rescored"))
    assert config_lib.DecodeConfig(methods=methods).models == ("ar_student", "student", "teacher")
