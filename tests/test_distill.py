"""The distill stage (pipelines/distill.py), its element logic (components/distillation.py),
and the student's distilled training data (`encode_distilled`, pipelines/training.py).

The stage tests run the real prepare and vocab stages on the tiny Multi30k slice and
distill it with an *untrained* tiny teacher (`publish_untrained`): its translations are
nonsense that rarely stops before the output width, which exercises the rejects as much
as the kept pairs. One length bucket keeps it to one compiled decoder shape.
"""

import dataclasses
import json
import os

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from components import artifacts, corpus, dag, distillation
from components.config import ConfigError, DecodeMethod, DistillConfig, from_dict
from components.tokenizer import EOS_ID, Tokenizer
from flows import cli
from flows.stages import run_stage
from pipelines import distill
from tiny_experiment import ensure, publish_untrained, tiny_config

# --- element logic -----------------------------------------------------------------------


def _translation(tokens: int, *, eos: bool = True, text: str = "ein Hund", score: float = -1.0,
                 source_tokens: int = 5, truncated: bool = False) -> dict:
    ids = [7] * (tokens - 1) + [EOS_ID if eos else 7]
    return {"hypothesis": text, "tokens": ids, "score": score, "source_tokens": source_tokens,
            "truncated": truncated, "latency_s": 0.5}


def test_each_reason_rejects_exactly_what_it_names_first_match_wins():
    filters = DistillConfig(max_length_ratio=2.0, min_token_log_prob=-1.0, length_penalty=0.0)
    cases = [
        (_translation(5), None),
        (_translation(5, truncated=True, eos=False), "source_too_long"),
        (_translation(5, eos=False), "unfinished"),
        (_translation(1, text=""), "empty"),
        (_translation(3, text=" "), "empty"),
        (_translation(11), "length_ratio"),  # 11 / 5 > 2
        (_translation(10), None),  # 10 / 5 = 2: not above
        (_translation(2), "length_ratio"),  # 5 / 2 > 2, the other way
        (_translation(5, score=-5.5), "low_score"),  # -1.1 per token
        (_translation(5, score=-5.0), None),  # -1.0 per token: not below
        (_translation(11, score=-99.0), "length_ratio"),
    ]
    assert [distillation.rejection(t, filters) for t, _ in cases] == [r for _, r in cases]
    unfiltered = DistillConfig(max_length_ratio=None, min_token_log_prob=None)
    assert [distillation.rejection(t, unfiltered) for t, _ in cases].count(None) == 7


def test_the_score_is_the_log_probability_without_length_penalty():
    # Ours scores log-prob / ((5 + length) / 6) ** alpha: length 7 -> penalty 2 ** alpha;
    # CTranslate2 log-prob / length ** alpha: length 4 -> 2 ** (2 alpha).
    def log_prob(tokens, **settings):
        return distillation.log_prob(_translation(tokens, score=-3.0), DistillConfig(**settings))

    assert log_prob(7, length_penalty=1.0) == pytest.approx(-6.0)
    assert log_prob(7, length_penalty=0.0) == pytest.approx(-3.0)
    assert log_prob(4, engine="ctranslate2", length_penalty=0.5) == pytest.approx(-6.0)
    assert log_prob(4, engine="ctranslate2", length_penalty=0.0) == pytest.approx(-3.0)
    verdict = distillation.judge({"id": "train:000001", "source": "a dog", "target": "ein Hund"},
                                 _translation(7, score=-3.0, text="Hund"),
                                 DistillConfig(length_penalty=1.0))
    assert verdict.kept_record() == {"id": "train:000001", "source": "a dog", "target": "Hund",
                                     "score": -6.0, "target_tokens": 7}
    assert verdict.reason is None and verdict.decode_seconds == 0.5


def test_stats_compare_distilled_and_original_targets_on_kept_pairs():
    def verdict(hypothesis, target, reason=None):
        return distillation.Verdict("i", "a b", target, hypothesis, -1.0, 3, 3, reason, 0.25)

    verdicts = [verdict("x x y", "x y z w"), verdict("x y", "z z"),
                verdict("q r s t u v", "q", reason="length_ratio")]
    left = distillation.DistillationStats().add(verdicts[0])
    right = distillation.DistillationStats().add(verdicts[1]).add(verdicts[2])
    with BeamTestPipeline(runner="FnApiRunner") as p:
        types = p | beam.Create(verdicts) | distill.CountTypes()
        assert_that(types, equal_to([("distilled", 2), ("original", 4)]))
    summary = left.merge(right).summary({"distilled": 2, "original": 4})
    assert summary["translated"] == 3 and summary["kept"] == 2
    assert summary["decode_seconds"] == 0.75
    assert summary["length_ratio"] == {"distilled": 5 / 4, "original": 6 / 4}
    assert summary["type_token_ratio"] == {"distilled": 2 / 5, "original": round(4 / 6, 4)}
    assert summary["types"] == {"distilled": 2, "original": 4}
    nothing_kept = distillation.DistillationStats().summary({})
    assert nothing_kept["length_ratio"]["distilled"] is None
    assert nothing_kept["types"] == {"distilled": 0, "original": 0}


def test_the_config_refuses_meaningless_values():
    defaults = DistillConfig()
    assert defaults.enabled and (defaults.beam_size, defaults.length_penalty) == (4, 0.6)
    for bad in ({"beam_size": 0}, {"batch_size": 0}, {"max_length_ratio": 0.5},
                {"min_token_log_prob": 0.5}, {"length_penalty": -1.0}, {"engine": "onnx"}):
        with pytest.raises(ConfigError, match="distill"):
            DistillConfig(**bad)
    with pytest.raises(ConfigError, match="distill.engine.*ctranslate2.*onnx"):
        from_dict(DistillConfig, {"engine": "onnx"}, "distill")


def test_each_engine_decodes_with_a_scored_beam_search_of_its_kind():
    assert distill.method(DistillConfig(beam_size=4, length_penalty=0.0)) == DecodeMethod(
        "ar_beam4", "ar_beam", beam_size=4, length_penalty=0.0)
    assert distill.method(DistillConfig(engine="ctranslate2", beam_size=1)) == DecodeMethod(
        "ct2_beam1", "ct2_beam", beam_size=1, length_penalty=0.6)


# --- the stage ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def config(tiny_workdir):
    config = tiny_config(tiny_workdir, "encode.bucket_boundaries=[64]",
                         "distill.max_length_ratio=null")
    ensure(config, "prepare", "vocab")
    publish_untrained(config, "teacher")
    return config


def _lines(uri: str, split: str) -> list[dict]:
    fs, pattern = artifacts.filesystem(corpus.split_pattern(uri, split))
    records = []
    for path in sorted(fs.glob(pattern)):
        with fs.open(path, "rb") as f:
            records += [json.loads(line) for line in f.read().split(b"\n") if line]
    return sorted(records, key=lambda record: corpus.id_sort_key(record["id"]))


@pytest.fixture(scope="module")
def distilled(config):
    artifact = run_stage("distill", config)
    return artifact, _lines(artifact.uri, "train"), _lines(artifact.uri, "rejects")


def test_every_source_is_kept_or_a_counted_reject_aligned_by_id(config, distilled):
    artifact, kept, rejects = distilled
    prepared = {p["id"]: p for p in corpus.read_split(dag.output_uri(config, "prepare"), "train")}
    counts = artifact.manifest["counts"]
    assert len(prepared) == counts["read"] > 150  # 200 pairs less the carved dev
    assert sorted({r["id"] for r in kept} | {r["id"] for r in rejects},
                  key=corpus.id_sort_key) == list(prepared)
    assert not {r["id"] for r in kept} & {r["id"] for r in rejects}
    assert counts["kept"] == len(kept) > 0
    assert counts["read"] == counts["kept"] + sum(counts[f"rejected.{reason}"]
                                                  for reason in distillation.REASONS)
    for reason in distillation.REASONS:
        assert counts[f"rejected.{reason}"] == sum(r["reason"] == reason for r in rejects)
    assert counts["rejected.unfinished"] > 0  # untrained: most beams never stop
    for record in kept:
        assert set(record) == {"id", "source", "target", "score", "target_tokens"}
        assert record["source"] == prepared[record["id"]]["source"]
        assert record["target"] and record["score"] < 0
    for record in rejects:
        assert record["target"] == prepared[record["id"]]["target"]  # the original
    assert artifact.manifest["inputs"] == {"prepare": dag.output_uri(config, "prepare"),
                                           "teacher": dag.output_uri(config, "teacher")}
    # The dev split is the prepared one, untouched: the student's dev BLEU is unchanged.
    assert _lines(artifact.uri, "dev") == list(
        corpus.read_split(dag.output_uri(config, "prepare"), "dev"))
    assert counts["dev"] == len(_lines(artifact.uri, "dev"))
    metrics = artifact.manifest["metrics"]
    assert metrics["length_ratio"]["original"] == pytest.approx(1.0, abs=0.3)
    assert 0 < metrics["type_token_ratio"]["distilled"] <= 1
    assert metrics["throughput"]["sentences_per_s"] > 0
    assert metrics["kept_fraction"] == pytest.approx(len(kept) / counts["read"], abs=1e-4)
    assert metrics["types"] == {  # the distinct words, counted by a distributed step
        "distilled": len({word for r in kept for word in r["target"].split()}),
        "original": len({word for r in kept for word in prepared[r["id"]]["target"].split()})}


def test_a_rerun_writes_identical_pairs_and_rejects(config, distilled):
    _, kept, rejects = distilled
    again = run_stage("distill", config)
    assert again.uri == distilled[0].uri
    assert _lines(again.uri, "train") == kept
    assert _lines(again.uri, "rejects") == rejects


def _files(root: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(folder, name), root):
            open(os.path.join(folder, name), "rb").read()
            for folder, _, names in os.walk(root) for name in names}


@pytest.mark.slow  # two SDK worker processes, each restoring the teacher
def test_two_worker_processes_write_the_same_bytes_as_one_in_process(config, tmp_path):
    """As a Dataflow worker runs the SDK: batches and verdicts reach the writes in another
    order, and every file is still the in-process run's, byte for byte (measured times
    aside: the manifest's, and `decode_seconds` in stats.json)."""
    for stage in ("prepare", "vocab", "teacher"):
        os.symlink(dag.output_uri(config, stage).rsplit("/", 1)[0], tmp_path / stage)
    own = config.replace(workdir=str(tmp_path))
    in_process = _files(distill.run(own).uri)
    manifest = json.loads(in_process.pop(artifacts.MANIFEST))
    artifact = distill.run(own, pipeline_args=["--direct_running_mode=multi_processing",
                                               "--direct_num_workers=2"])
    two_workers = _files(artifact.uri)
    assert json.loads(two_workers.pop(artifacts.MANIFEST))["counts"] == manifest["counts"]
    stats = {name: json.loads(files.pop(distill.STATS_FILE))
             for name, files in (("in_process", in_process), ("two_workers", two_workers))}
    for figures in stats.values():
        del figures["decode_seconds"]
    assert stats["two_workers"] == stats["in_process"]
    assert sorted(two_workers) == sorted(in_process) == [
        "config.yaml", "dev-00000-of-00001.jsonl", "rejects-00000-of-00001.jsonl",
        "train-00000-of-00001.jsonl"]
    assert two_workers == in_process
    assert manifest["counts"]["kept"] and len(in_process["rejects-00000-of-00001.jsonl"]) > 0


def test_filters_reject_exactly_the_pairs_they_should(config, distilled):
    _, kept, _ = distilled
    tokenizer = Tokenizer.for_artifact(dag.require_input(config, "teacher"))
    source_tokens = {r["id"]: len(tokenizer.encode([r["source"]])[0]) + 1 for r in kept}
    ratio = {r["id"]: r["target_tokens"] / source_tokens[r["id"]] for r in kept}
    max_ratio = 1.5
    too_long = {i for i, value in ratio.items() if max(value, 1 / value) > max_ratio}
    per_token = sorted({r["score"] / r["target_tokens"] for r in kept if r["id"] not in too_long})
    assert too_long and len(per_token) >= 2, "the untrained teacher's outputs changed"
    # Halfway across the widest gap: far from every (rounded) score the filter compares.
    _, below, above = max((b - a, a, b) for a, b in zip(per_token, per_token[1:]))
    threshold = (below + above) / 2
    low = {r["id"] for r in kept
           if r["id"] not in too_long and r["score"] / r["target_tokens"] < threshold}

    filtered = config.replace(distill=dataclasses.replace(
        config.distill, max_length_ratio=max_ratio, min_token_log_prob=threshold))
    artifact = run_stage("distill", filtered)
    assert artifact.uri != distilled[0].uri  # a filter setting is part of the key
    counts = artifact.manifest["counts"]
    rejects = _lines(artifact.uri, "rejects")
    assert counts["rejected.length_ratio"] == len(too_long)
    assert counts["rejected.low_score"] == len(low) > 0
    assert {r["id"] for r in rejects if r["reason"] == "length_ratio"} == too_long
    assert {r["id"] for r in rejects if r["reason"] == "low_score"} == low
    assert [r["id"] for r in _lines(artifact.uri, "train")] == \
        [r["id"] for r in kept if r["id"] not in too_long | low]


def test_the_student_trains_on_the_encoded_distilled_pairs(config, distilled, monkeypatch):
    from pipelines import student as student_stage
    from pipelines import training

    artifact, kept, _ = distilled
    encoded = run_stage("encode_distilled", config)
    assert encoded.uri == dag.output_uri(config, "encode_distilled")
    assert encoded.manifest["inputs"] == {"distill": artifact.uri,
                                          "vocab": dag.output_uri(config, "vocab")}
    counts = encoded.manifest["counts"]
    assert counts["read.train"] == len(kept)
    assert counts["read.dev"] == artifact.manifest["counts"]["dev"]

    read = []
    real_split_files = training.input_pipeline.split_files
    monkeypatch.setattr(training.input_pipeline, "split_files",
                        lambda uri, split: read.append(uri) or real_split_files(uri, split))
    tokenizer = training.load_tokenizer(config)
    data = training.training_data(config, "student", tokenizer)
    assert set(read) == {encoded.uri}
    assert len(data.references) == counts["encoded.dev"]
    off = config.replace(distill=dataclasses.replace(config.distill, enabled=False))
    with pytest.raises(artifacts.IncompleteArtifactError, match="padir stage encode"):
        training.training_data(off, "student", tokenizer)  # the originals: not encoded here
    student_dir = os.path.join(config.workdir, "student")  # shared: other tests' keys live there

    def listed() -> list[str]:
        return sorted(os.listdir(student_dir)) if os.path.isdir(student_dir) else []

    before = listed()
    with pytest.raises(artifacts.IncompleteArtifactError, match="padir stage encode"):
        student_stage.run(off)
    assert listed() == before  # the refused run left nothing behind: no partial, no lease


def test_distill_is_a_padir_stage(config):
    for stage in ("distill", "encode_distilled"):
        assert cli.build_parser().parse_args(["stage", stage, "c.yaml"]).name == stage
    lonely = config.replace(workdir=config.workdir + "-empty")
    with pytest.raises(artifacts.IncompleteArtifactError, match="padir stage prepare"):
        run_stage("distill", lonely)


# --- the engines -------------------------------------------------------------------------


def _translate(config, settings: DistillConfig, count: int = 8):
    """The teacher's translations of the first `count` train sources: (loaded, sources,
    translation records)."""
    from model import trained_model
    from model.decoding import translator

    sources = [pair["source"] for pair in corpus.read_split(
        dag.output_uri(config, "prepare"), "train")][:count]
    loaded = trained_model.load_cached(dag.output_uri(config, "teacher"))
    decoder = translator.Translator(loaded, distill.method(settings), batch_size=4,
                                    boundaries=config.encode.bucket_boundaries)
    return loaded, sources, [t.as_record() for t in decoder.translate(sources)]


@pytest.mark.parametrize("engine,length_penalty", [("jax", 0.6), ("ctranslate2", 0.6),
                                                   ("ctranslate2", 0.0)])
def test_the_score_is_the_teacher_forced_log_probability(config, engine, length_penalty):
    import jax.numpy as jnp
    import numpy as np

    settings = DistillConfig(engine=engine, length_penalty=length_penalty)
    loaded, sources, translations = _translate(config, settings)
    ids = loaded.tokenizer.encode(sources)
    source = np.zeros((len(sources), max(map(len, ids)) + 1), np.int32)
    target = np.zeros((len(sources), max(len(t["tokens"]) for t in translations)), np.int32)
    for i, (row, translation) in enumerate(zip(ids, translations)):
        source[i, :len(row) + 1] = row + [EOS_ID]
        target[i, :len(translation["tokens"])] = translation["tokens"]
    model, params = loaded.model, loaded.params
    forced = model.target_log_probs(params, *model.encode(params, jnp.asarray(source)),
                                    jnp.asarray(target)).sum(-1)
    assert [distillation.log_prob(t, settings) for t in translations] == \
        pytest.approx(np.asarray(forced).tolist(), rel=1e-5, abs=1e-3)


def _unscored(records: list[dict]) -> list[dict]:
    return [{**record, "score": None} for record in records]


def test_without_length_penalty_both_engines_give_the_same_verdicts(config):
    verdicts = {}
    for engine in ("jax", "ctranslate2"):
        settings = dataclasses.replace(config.distill, engine=engine, length_penalty=0.0)
        _, sources, translations = _translate(config, settings, count=16)
        pairs = [{"id": str(i), "source": source, "target": ""}
                 for i, source in enumerate(sources)]
        verdicts[engine] = [distillation.judge(pair, translation, settings).reject_record()
                            for pair, translation in zip(pairs, translations)]
    assert _unscored(verdicts["ctranslate2"]) == _unscored(verdicts["jax"])
    assert {v["reason"] for v in verdicts["jax"]} >= {None, "unfinished"}
    assert [v["score"] for v in verdicts["ctranslate2"]] == \
        pytest.approx([v["score"] for v in verdicts["jax"]], abs=1e-3)


@pytest.mark.slow  # about 4 minutes on 2 cores: two distill jobs, mostly our beam search
def test_the_ctranslate2_engine_distils_the_jax_engines_pairs_without_length_penalty(config):
    def distilled(engine):
        settings = dataclasses.replace(config.distill, engine=engine, length_penalty=0.0)
        artifact = run_stage("distill", config.replace(distill=settings))
        return _lines(artifact.uri, "train"), _lines(artifact.uri, "rejects")

    (ours, our_rejects), (theirs, their_rejects) = distilled("jax"), distilled("ctranslate2")
    assert ours and our_rejects
    assert _unscored(theirs) == _unscored(ours)
    assert _unscored(their_rejects) == _unscored(our_rejects)
    assert [r["score"] for r in theirs] == pytest.approx([r["score"] for r in ours], abs=1e-3)
