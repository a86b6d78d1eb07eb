"""The decoding path on tiny data: model/decoding/translator.py (Translator),
pipelines/model_handler.py (the RunInference handler), pipelines/decode.py (the stage), pipelines/score.py and
components/report.py (the score stage), and `padir translate`.

The fixture runs the real prepare and vocab stages on the tiny Multi30k slice
(tests/tiny_experiment.py), then publishes *untrained* teacher and train artifacts through
the real artifact and checkpoint modules (`publish_untrained`), in seconds: training the
tiny models costs ~2 minutes and is covered by tests/test_training_stages.py. Decoding reads them
exactly as it reads trained ones; the hypotheses are nonsense, which no test here minds.
"""

import functools
import io
import json
import logging

import apache_beam as beam
import numpy as np
import pytest
import sacrebleu
from apache_beam.ml.inference.base import KeyedModelHandler, RunInference
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to

from components import artifacts, corpus, dag, report
from pipelines import score as score_stage
from components import config as config_lib
from components.config import ConfigError, DecodeMethod
from components.tokenizer import EOS_ID
from flows import cli
from flows.stages import run_stage
from model import input_pipeline, trained_model
from model.decoding import ctranslate2_search, shortlist, translator
from pipelines import decode
from pipelines import model_handler
from tiny_experiment import ensure, publish_untrained, tiny_config

METHODS = [  # every kind, each as cheap as it gets
    {"name": "greedy", "kind": "ar_greedy"},
    {"name": "beam2", "kind": "ar_beam", "beam_size": 2},
    {"name": "padir_2", "kind": "refine", "iterations": 2},
    {"name": "padir_2_rescored", "kind": "refine_rescored", "iterations": 2,
     "length_offsets": [-1, 0, 1]},
    {"name": "mp_2", "kind": "mask_predict", "iterations": 2},
    {"name": "adaptive16", "kind": "adaptive", "tokens_per_step": 16},
    {"name": "draft_verify", "kind": "draft_verify", "iterations": 1},
    {"name": "ct2", "kind": "ct2_greedy"},
    {"name": "ct2_beam2", "kind": "ct2_beam", "beam_size": 2, "compute_type": "int8"},
]
MAX_SENTENCES = 6
LATENCY_SENTENCES = 4  # the batch-1 pass times the first 4 of the 6
BUCKETS = (16, 32, 64)  # the handler tests' buckets (the stage's config has one: [64])


@pytest.fixture(scope="module")
def config(tiny_workdir):
    config = tiny_config(
        tiny_workdir, f"decode.methods={json.dumps(METHODS)}",
        f"decode.max_sentences={MAX_SENTENCES}", "decode.throughput_batch_size=4",
        f"decode.latency_sentences={LATENCY_SENTENCES}",
        # One bucket: one compiled shape per method and pass keeps the stage test quick.
        "encode.bucket_boundaries=[64]")
    ensure(config, "prepare", "vocab")
    for stage in ("teacher", "student", "drafter"):
        publish_untrained(config, stage)
    return config


def _uri(config, stage: str) -> str:
    return dag.output_uri(config, stage)


def _sentences(config, count: int, lengths: range) -> list[str]:
    """`count` distinct word prefixes of test sentences whose token count (with EOS) is in
    `lengths`, so that they fall in one length bucket and one output width."""
    tokenizer = trained_model.load_cached(_uri(config, "student")).tokenizer
    found = []
    for pair in corpus.read_split(dag.output_uri(config, "prepare"), "test2016"):
        words = pair["source"].split()
        for end in range(1, len(words) + 1):
            text = " ".join(words[:end])
            if len(tokenizer.encode([text])[0]) + 1 in lengths and text not in found:
                found.append(text)
                break
        if len(found) == count:
            return found
    raise AssertionError(f"not {count} test sentence prefixes of {lengths} tokens")


# --- config ------------------------------------------------------------------------------


def test_decode_methods_refuse_options_their_kind_does_not_read():
    assert DecodeMethod("p", "refine", iterations=10).stage == "student"
    assert DecodeMethod("b", "ar_beam", beam_size=8).stage == "teacher"
    with pytest.raises(ConfigError, match="'beam_size' does not apply to kind refine"):
        DecodeMethod("p", "refine", beam_size=8)
    with pytest.raises(ConfigError, match="given twice"):
        config_lib.DecodeConfig(methods=(DecodeMethod("a", "ar_greedy"),) * 2)
    assert [m.kind for m in config_lib.DecodeConfig().methods].count("refine") == 4


def test_every_decoding_kind_has_one_search_options_it_may_read_and_a_flag():
    kinds = list(translator.SEARCHES) + list(ctranslate2_search.KINDS)  # CTranslate2: no search
    assert kinds == list(config_lib.DECODING_KINDS) == [m["kind"] for m in METHODS]
    fields = {field.name for field in config_lib.decode_options()}
    flags = cli.build_parser().parse_args(["translate", "--checkpoint", "c"])
    for kind, decoder in config_lib.DECODING_KINDS.items():
        assert decoder.stage in ("teacher", "student", "drafter") and \
            set(decoder.options) <= fields, kind
    assert {name for name in vars(flags) if name in fields} == fields  # one flag per option
    assert cli.build_parser().parse_args(
        ["translate", "--checkpoint", "c", "--length-offsets=-1,0,1",
         "--length-candidates", "2"]).length_offsets == (-1, 0, 1)


# --- the handler -------------------------------------------------------------------------


def test_handler_loads_once_per_process_and_compiles_once_per_bucket(config):
    uri = _uri(config, "student")
    method = DecodeMethod("padir_2", "refine", iterations=2)
    sources = _sentences(config, 10, range(9, 17))  # bucket 16, output width 32
    handler = model_handler.TranslationModelHandler(uri, method, batch_size=2,
                                                     boundaries=BUCKETS)
    load_key, trace_key = (uri, "padir_2", 2), (uri, "padir_2", 2)
    loads, traces = model_handler.LOADS[load_key], translator.TRACES[trace_key]
    restores = trained_model.RESTORES[uri]
    with test_pipeline.TestPipeline(runner="FnApiRunner") as p:
        results = (p
                   | beam.Create(list(enumerate(sources)))
                   | RunInference(KeyedModelHandler(handler))
                   | beam.MapTuple(lambda i, result: (i, result.example,
                                                      result.inference["batch_size"] <= 2)))
        assert_that(results, equal_to([(i, s, True) for i, s in enumerate(sources)]))
    assert model_handler.LOADS[load_key] - loads == 1  # 5+ batches, one load
    assert translator.TRACES[trace_key] - traces == 1  # lengths 9..16: one shape
    assert trained_model.RESTORES[uri] - restores <= 1 and trained_model.RESTORES[uri] >= 1


def test_handler_logs_progress_with_an_eta(config, monkeypatch, caplog):
    monkeypatch.setattr(model_handler, "PROGRESS_EVERY_S", 0.0)  # log after every batch
    handler = model_handler.TranslationModelHandler(
        _uri(config, "teacher"), DecodeMethod("greedy", "ar_greedy"), batch_size=2,
        boundaries=BUCKETS, expected_sentences=10)
    model = handler.load_model()
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            results = list(handler.run_inference(_sentences(config, 2, range(2, 9)), model))
            assert len(results) == 2
    lines = [r.getMessage() for r in caplog.records if "sentences translated" in r.getMessage()]
    assert lines[0].startswith("greedy: 2 sentences translated of 10, ETA ")
    assert lines[-1].startswith("greedy: 4 sentences translated of 10, ETA ")


def test_translator_pads_to_buckets_and_times_each_batch(config):
    loaded = trained_model.load_cached(_uri(config, "teacher"))
    decoder = translator.Translator(loaded, DecodeMethod("g", "ar_greedy"), batch_size=3,
                                    boundaries=BUCKETS)
    key = (loaded.uri, "g", 3)
    short = _sentences(config, 4, range(2, 9))  # bucket 16, width 16
    long = _sentences(config, 1, range(17, 33))  # bucket 32, width 64
    first = decoder.translate(short)
    assert translator.TRACES[key] == 1
    assert len(first) == 4 and [t.batch_size for t in first] == [3, 3, 3, 1]
    assert all(t.latency_s > 0 and t.passes == len(t.tokens) and t.score is None for t in first)
    assert first[3].latency_s == first[3].batch_seconds  # a batch of one is not divided
    assert first[0].latency_s == pytest.approx(first[0].batch_seconds / 3)
    assert decoder.translate(short[::-1] + long)[-1].source_tokens in range(17, 33)
    assert translator.TRACES[key] == 2  # the long sentence's bucket; no other shape
    with pytest.raises(ConfigError, match="decodes with a 'student' artifact"):
        translator.Translator(loaded, DecodeMethod("p", "refine"), batch_size=1)


def test_a_rescored_translator_decodes_with_the_teacher_it_is_given(config):
    student = trained_model.load_cached(_uri(config, "student"))
    teacher = trained_model.load_cached(_uri(config, "teacher"))
    sentences = _sentences(config, 3, range(2, 9))
    one = DecodeMethod("r", "refine_rescored", iterations=2)  # one candidate: refine's output
    rescored = translator.Translator(student, one, batch_size=2, boundaries=BUCKETS,
                                     rescorer=teacher).translate(sentences)
    plain = translator.Translator(student, DecodeMethod("p", "refine", iterations=2),
                                  batch_size=2, boundaries=BUCKETS).translate(sentences)
    assert [t.tokens for t in rescored] == [t.tokens for t in plain]
    assert [t.passes for t in rescored] == [t.passes + 1 for t in plain]  # + the teacher's
    assert all(t.latency_s > 0 and t.score <= 0 for t in rescored)
    with pytest.raises(ConfigError, match="rescores with a 'teacher' artifact"):
        translator.Translator(student, one, batch_size=1, rescorer=student)
    with pytest.raises(ValueError, match="takes no rescorer"):
        translator.Translator(student, DecodeMethod("p", "refine"), batch_size=1,
                              rescorer=teacher)


def test_draft_and_verify_translates_as_the_teachers_greedy_search(config):
    drafter = trained_model.load_cached(_uri(config, "drafter"))
    teacher = trained_model.load_cached(_uri(config, "teacher"))
    sentences = _sentences(config, 3, range(2, 9)) + _sentences(config, 1, range(17, 33))
    verified = translator.Translator(
        drafter, DecodeMethod("dv", "draft_verify", iterations=1), batch_size=2,
        boundaries=BUCKETS, rescorer=teacher).translate(sentences)
    greedy = translator.Translator(teacher, DecodeMethod("g", "ar_greedy"), batch_size=2,
                                   boundaries=BUCKETS).translate(sentences)
    assert [t.tokens for t in verified] == [t.tokens for t in greedy]
    assert all(1 <= t.rounds <= len(t.tokens) and t.passes == 2 * t.rounds
               and t.width == g.width for t, g in zip(verified, greedy))


def test_a_students_teacher_is_found_through_its_inputs(tmp_path):
    """`padir translate` gives no teacher: the one the student's artifact was computed
    from rescores, the nearest first; a student computed from no teacher is a clear error."""
    def publish(stage, key, **inputs):
        with artifacts.write(str(tmp_path), stage, key, config={}, inputs=inputs):
            pass
        return artifacts.location(str(tmp_path), stage, key)

    prepare = publish("prepare", "p")
    distiller = publish("teacher", "t1", prepare=prepare)
    distilled = publish("encode_distilled", "e", distill=publish("distill", "d", teacher=distiller))
    assert translator.upstream(publish("student", "s1", encode_distilled=distilled),
                               "teacher") == distiller
    starter = publish("teacher", "t2", prepare=prepare)
    assert translator.upstream(publish("student", "s2", encode_distilled=distilled,
                                       teacher=starter), "teacher") == starter
    with pytest.raises(ConfigError, match="not computed from a 'teacher' artifact"):
        translator.upstream(publish("student", "s3", prepare=prepare), "teacher")


def test_translate_rescores_with_the_students_own_teacher(config, tiny_workdir, capsys,
                                                          monkeypatch):
    warm = tiny_config(tiny_workdir, "encode.bucket_boundaries=[64]", "distill.enabled=false",
                       "student.init_from_teacher=true")
    student = publish_untrained(warm, "student").uri  # its manifest names the teacher
    sentences = _sentences(config, 2, range(2, 9))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(
        "\n".join(sentences).encode())))
    assert cli.main(["translate", "--checkpoint", student, "--method", "refine_rescored",
                     "--iterations", "2", "--length-offsets=-1,0,1", "--batch-size", "2"]) == 0
    method = DecodeMethod("r", "refine_rescored", iterations=2, length_offsets=(-1, 0, 1))
    expected = translator.Translator(
        trained_model.load_cached(student), method, batch_size=2,
        rescorer=trained_model.load_cached(_uri(config, "teacher"))).translate(sentences)
    assert capsys.readouterr().out.split("\n")[:2] == [t.hypothesis for t in expected]


def test_a_shortlist_translator_decodes_over_its_batchs_selection(config, monkeypatch):
    """The table comes from the model's own training pairs, once; every hypothesis keeps to
    its batch's selection; the search compiles per width and shortlist size."""
    monkeypatch.setattr(shortlist, "SIZE_STEP", 8)  # the tiny vocabulary has 400 pieces
    monkeypatch.setattr(shortlist, "build", functools.partial(shortlist.build, frequent=8))
    monkeypatch.setattr(translator, "_SHORTLISTS", {})
    loaded = trained_model.load_cached(_uri(config, "teacher"))
    # The prepared pairs, tokenised, stand in for the encode artifact (not built in this
    # shared workdir: test_distill checks that the student refuses to train without it).
    read = []
    pairs = [(np.array(loaded.tokenizer.encode([pair["source"]])[0]),
              np.array(loaded.tokenizer.encode([pair["target"]])[0]))
             for pair in corpus.read_split(dag.output_uri(config, "prepare"), "train")]
    monkeypatch.setattr(input_pipeline, "split_files",
                        lambda uri, split: read.append(uri) or [uri])
    monkeypatch.setattr(input_pipeline, "read_pairs", lambda files: iter(pairs))
    decoder = translator.Translator(loaded, DecodeMethod("g_short", "ar_greedy",
                                                         shortlist=True),
                                    batch_size=1, boundaries=BUCKETS)
    table = translator.shortlist_table(loaded)
    assert translator.shortlist_table(loaded) is table
    assert table.vocab_size == loaded.tokenizer.vocab_size
    assert read == [artifacts.read(loaded.uri).manifest["inputs"]["encode"]]
    sentences = _sentences(config, 3, range(2, 9))
    for sentence, translation in zip(sentences, decoder.translate(sentences)):
        source = np.array([loaded.tokenizer.encode([sentence])[0] + [EOS_ID]])
        allowed = shortlist.select(table, source)
        assert len(allowed) < loaded.tokenizer.vocab_size and len(allowed) % 8 == 0
        assert set(translation.tokens) <= set(allowed.tolist())
    sizes = {key[4] for key in translator.WIDTH_TRACES if key[:3] == (loaded.uri, "g_short", 1)}
    assert sizes and all(size % 8 == 0 and size < loaded.tokenizer.vocab_size for size in sizes)


# --- the decode and score stages ---------------------------------------------------------


@pytest.fixture(scope="module")
def decoded(config):
    return run_stage("decode", config)


def test_decode_writes_one_record_per_sentence_method_and_pass(config, decoded):
    ids = [pair["id"] for pair in corpus.read_split(_uri(config, "prepare"), "test2016")]
    counts = decoded.manifest["counts"]
    assert counts["read.test2016"] == MAX_SENTENCES
    assert decoded.manifest["metrics"]["test_sets"] == ["test2016"]
    assert decoded.manifest["metrics"]["latency_sentences"] == {"test2016": LATENCY_SENTENCES}
    assert set(decoded.manifest["inputs"]) == {"prepare", "teacher", "student", "drafter"}
    decode_seconds = 0.0
    for method in METHODS:
        for folder, name, expected in ((decode.HYPOTHESES, "batched", ids[:MAX_SENTENCES]),
                                       (decode.LATENCY, "latency", ids[:LATENCY_SENTENCES])):
            path = decode.output_path(decoded.uri, folder, "test2016", method["name"])
            with open(path) as f:
                records = [json.loads(line) for line in f]
            assert [r["id"] for r in records] == expected, (method, folder)
            assert counts[f"decoded.test2016.{method['name']}.{name}"] == len(expected)
            assert all(r["latency_s"] > 0 and r["passes"] >= 1 and r["source_tokens"] >= 2
                       for r in records)
            decode_seconds += sum(r["latency_s"] for r in records)
            if method["kind"] == "draft_verify":  # its cost: rounds of 1 draft + 1 check
                assert all(r["passes"] == 2 * r["rounds"] and 0 <= r["accepted"]
                           and r["rounds"] <= r["hypothesis_tokens"] for r in records)
        speed = decoded.manifest["metrics"]["throughput"]["test2016"][method["name"]]
        assert speed["sentences"] == MAX_SENTENCES and speed["batch_size"] == 4
        assert speed["sentences_per_s"] > 0 and speed["tokens_per_s"] > 0
    spent = decoded.manifest["metrics"]["decode_seconds"]
    assert spent == pytest.approx(decode_seconds) and spent < decoded.manifest["wall_seconds"]
    # Where the rest of the stage's time went: every part counted, none negative, and
    # together no more than the stage's wall time.
    split = decoded.manifest["metrics"]["time_split"]
    assert split["decode calls"] == pytest.approx(spent, abs=0.05)
    assert split["first calls (compiling)"] > 0  # loading: ~0 if the models were restored
    assert split["host around the calls"] > 0 and min(split.values()) >= 0
    assert sum(split.values()) < decoded.manifest["wall_seconds"]
    assert not any(name.startswith("ms.") for name in counts)  # not counts: the split


def test_decode_times_each_ctranslate2_method_at_the_threads_its_sweep_chose(config, decoded):
    sweeps = decoded.manifest["metrics"]["ctranslate2_sweep"]
    assert [s["method"] for s in sweeps] == [m["name"] for m in METHODS
                                             if m["kind"].startswith("ct2_")]
    for sweep in sweeps:
        assert sweep["test_set"] == "test2016" and sweep["sentences"] == MAX_SENTENCES
        for regime, batch_size in (("latency", 1), ("batched", 4)):
            assert sweep[regime]["batch_size"] == batch_size
            assert sweep[regime]["chosen"] in [
                {k: s[k] for k in ("intra_threads", "inter_threads")}
                for s in sweep[regime]["settings"]]
    markdown = report.render_markdown(report.build_report({}, None, sweeps))
    assert "## CTranslate2's threads" in markdown
    chosen = [line for line in markdown.splitlines() if line.endswith("| chosen |")]
    assert [line.split(" | ")[:2] for line in chosen] == [
        ["| " + s["method"], regime] for s in sweeps for regime in ("latency", "batched")]


def test_each_pass_of_a_ctranslate2_method_gets_its_regimes_threads(config, monkeypatch,
                                                                    tmp_path):
    made = []

    def handler(uri, method, **kwargs):  # a function: Beam pickles the handler it returns
        made.append((method.name, kwargs["batch_size"], kwargs["ctranslate2_threads"]))
        return model_handler.TranslationModelHandler(uri, method, **kwargs)

    monkeypatch.setattr(decode, "TranslationModelHandler", handler)
    threads = {("ct2", "latency"): {"intra_threads": 1, "inter_threads": 1},
               ("ct2", "batched"): {"intra_threads": 1, "inter_threads": 2}}
    decode.build(beam.Pipeline(), config, prepared_uri=_uri(config, "prepare"),
                 checkpoints={stage: _uri(config, stage) for stage in config.decode.models},
                 tokenizer=trained_model.load_cached(_uri(config, "teacher")).tokenizer,
                 output_uri=str(tmp_path), ctranslate2_threads=threads)
    assert [m for m in made if m[0] == "ct2"] == [("ct2", 4, threads["ct2", "batched"]),
                                                  ("ct2", 1, threads["ct2", "latency"])]
    assert all(m[2] is None for m in made if m[0] != "ct2")


def test_the_ctranslate2_alone_benchmark_times_the_stages_sample_beside_it(config, decoded):
    from benchmarks import ctranslate2_alone

    rows = ctranslate2_alone.compare(config, methods=["ct2"], rounds=1)  # no JAX alone
    [row] = rows
    assert row["sentences"] == LATENCY_SENTENCES and row["threads"].startswith("intra ")
    assert all(row[f"{name}_median_ms"] > 0 for name in ("stage", "translator", "alone"))
    assert "| ct2 | intra " in ctranslate2_alone.render(rows)


def _row(name, kind, bleu, median_ms, p99_ms, sentences_per_s):
    return {"method": name, "kind": kind, "bleu": {"score": bleu},
            "latency_s": {"median": median_ms / 1e3, "p99": p99_ms / 1e3},
            "throughput": {"sentences_per_s": sentences_per_s}}


def test_the_verdict_compares_each_regime_with_its_fastest_ar_row():
    entry = {"baselines": {"ar_greedy": "greedy"}, "methods": [
        _row("greedy", "ar_greedy", 30.0, 4.0, 8.0, 300.0),
        _row("ct2", "ct2_greedy", 30.0, 2.0, 10.0, 900.0),  # fastest but at p99
        _row("padir_4", "refine", 27.0, 3.0, 4.0, 450.0),
        _row("dv", "draft_verify", 30.0, 1.0, 2.0, 100.0)]}
    lines = report._verdict_lines(entry)
    assert lines[3:] == [
        "- padir_4 (BLEU 27.00): batch 1 median slower, 0.67x ct2 (BLEU -3.00); batch 1 p99 "
        "faster, 2.00x greedy (BLEU -3.00); batched slower, 0.50x ct2 (BLEU -3.00). On the "
        "BLEU/speed frontier: in no regime.",
        "- dv (BLEU 30.00): batch 1 median faster, 2.00x ct2 (BLEU +0.00); batch 1 p99 "
        "faster, 4.00x greedy (BLEU +0.00); batched slower, 0.11x ct2 (BLEU +0.00). On the "
        "BLEU/speed frontier: batch 1 median, batch 1 p99."]
    assert report._verdict_lines({**entry, "methods": entry["methods"][:2]}) == []


def test_the_frontier_keeps_the_rows_no_other_beats_on_both():
    methods = [_row("a", "ar_greedy", 30.0, 4.0, 4.0, 100.0),
               _row("b", "refine", 27.0, 2.0, 2.0, 100.0),
               _row("c", "refine", 26.0, 3.0, 3.0, 200.0),  # beaten at batch 1 by b
               _row("d", "refine", 30.0, 4.0, 4.0, 100.0)]  # ties a: neither beats the other
    assert report.on_frontier(methods, "median") == [True, True, False, True]
    assert report.on_frontier(methods, "throughput") == [True, False, True, True]


def test_score_reports_every_method_as_sacrebleu_scores_it(config, decoded):
    scored = run_stage("score", config)
    with open(scored.path(score_stage.REPORT_JSON)) as f:
        content = json.load(f)
    entry = content["test_sets"]["test2016"]
    assert [m["method"] for m in entry["methods"]] == [m["name"] for m in METHODS]
    assert entry["baselines"] == {"ar_greedy": "greedy", "ar_beam": "beam2",
                                  "ct2_greedy": "ct2", "ct2_beam": "ct2_beam2"}
    drafted = next(m for m in entry["methods"] if m["kind"] == "draft_verify")
    assert drafted["draft"]["rounds_mean"] >= 1 and drafted["draft"]["tokens_per_round"] >= 1
    references = {p["id"]: p["target"]
                  for p in corpus.read_split(_uri(config, "prepare"), "test2016")}
    for method in entry["methods"]:
        path = decode.output_path(decoded.uri, decode.HYPOTHESES, "test2016", method["method"])
        with open(path) as f:
            records = [json.loads(line) for line in f]
        hypotheses = [r["hypothesis"] for r in records]
        refs = [[references[r["id"]] for r in records]]
        assert method["bleu"]["score"] == pytest.approx(
            sacrebleu.corpus_bleu(hypotheses, refs).score)
        assert method["chrf"]["score"] == pytest.approx(
            sacrebleu.corpus_chrf(hypotheses, refs).score)
        assert method["bleu_tok_lc"]["score"] == pytest.approx(
            sacrebleu.corpus_bleu(hypotheses, refs, lowercase=True).score)
        assert "tok:13a" in method["bleu"]["signature"]
        assert method["sentences"] == MAX_SENTENCES
        assert method["latency_s"]["count"] == LATENCY_SENTENCES
        assert set(method["speedup"]) == {"vs_greedy", "vs_beam2", "vs_ct2", "vs_ct2_beam2"}
        assert method["speedup"]["vs_greedy"]["median"] > 0
    assert list(content["training"]) == ["drafter", "student", "teacher"]  # the models decoded
    for stage, about in content["training"].items():
        manifest = artifacts.read(_uri(config, stage)).manifest
        assert about["steps"] == manifest["counts"].get("steps")
        assert about["stop_reason"] is None
    with open(scored.path(score_stage.REPORT_MD)) as f:
        markdown = f.read()
    assert "## Models" in markdown and "Warning" not in markdown
    assert all(f"| {m['name']} |" in markdown for m in METHODS)
    assert "| beam2 | ar_beam | beam 2, length penalty 0.6 |" in markdown
    assert "| ct2_beam2 | ct2_beam | beam 2, length penalty 0.6, CTranslate2 int8 |" in markdown
    assert "- padir_2 (BLEU " in markdown and "On the BLEU/speed frontier" in markdown
    assert "- draft_verify (BLEU " in markdown and "| draft_verify | " in markdown
    # Tokenised lowercased BLEU is explained for any language pair, not one corpus.
    assert "compare with published figures" in markdown and "Multi30k" not in markdown
    for plot in report.PLOTS:
        with open(scored.path("plots", "test2016", f"{plot}.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_training_run_cut_short_by_its_time_budget_is_loud_in_the_report():
    manifests = {
        "teacher": {"counts": {"steps": 1370}, "metrics": {
            "stop_reason": "time budget", "dev": {"bleu": 20.5, "bleu_tok_lc": 20.9}}},
        "student": {"counts": {"steps": 400}, "metrics": {"stop_reason": None, "dev": {}}},
    }
    content = report.build_report({}, report.training_summary(manifests))
    assert content["training"]["teacher"]["stop_reason"] == "time budget"
    markdown = report.render_markdown(content)
    assert ("**Warning: the teacher stopped early (time budget) at step 1,370**"
            in markdown)
    assert "`teacher.loop.max_minutes` cut it short" in markdown
    assert "the student stopped" not in markdown
    assert "| teacher | time budget | 1,370 | 20.50 | 20.90 |" in markdown
    assert "| student | completed | 400 | – | – |" in markdown
    assert "|---|---|---:|---:|---:|" in markdown  # names left, figures right


def test_the_students_dev_curve_is_reported_and_plotted(tmp_path):
    """A curve as components/training_artifact.py `dev_curve` reads it."""
    curve = [{"phase": 1, "step": 500, "bleu": 5.0}, {"phase": 1, "step": 1000, "bleu": 9.0},
             {"phase": 2, "step": 1200, "bleu": 10.0}, {"phase": 2, "step": 1400, "bleu": 12.5}]
    manifests = {"student": {"counts": {"steps": 400}, "metrics": {"stop_reason": None,
                                                                   "dev": {"bleu": 12.5}}}}
    content = report.build_report({}, report.training_summary(manifests, {"student": curve}))
    markdown = report.render_markdown(content)
    assert "gained +2.50 BLEU over the 200 steps before it" in markdown
    assert "![student dev BLEU](plots/student_dev_bleu.png)" in markdown
    [path] = report.write_plots(content, {}, str(tmp_path / "out"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    without = report.build_report({}, report.training_summary(manifests))
    assert "dev_curve" not in without["training"]["student"]
    assert "student_dev_bleu" not in report.render_markdown(without)


def test_report_scores_agree_with_sacrebleu_on_real_text(config):
    pairs = list(corpus.read_split(_uri(config, "prepare"), "test2016"))[:40]
    references = [p["target"] for p in pairs]
    hypotheses = [" ".join(r.split()[:-2] + r.split()[-1:]) for r in references]  # a word out
    records = [{"hypothesis": h, "latency_s": 0.5, "passes": 2} for h in hypotheses]
    timed = [{"latency_s": 0.01 * (i + 1)} for i in range(40)]  # the batch-1 pass's
    result = report.score_method("m", "refine", records, references, {"sentences_per_s": 5.0},
                                 timed)
    assert result.bleu.score == pytest.approx(
        sacrebleu.corpus_bleu(hypotheses, [references]).score)
    assert 50 < result.bleu.score < 100
    assert result.chrf.score == pytest.approx(
        sacrebleu.corpus_chrf(hypotheses, [references]).score)
    assert result.latency.median == pytest.approx(0.205)  # from the batch-1 records


def test_the_report_names_each_methods_setting():
    settings = {
        DecodeMethod("g", "ar_greedy"): "greedy",
        DecodeMethod("gs", "ar_greedy", shortlist=True): "greedy, shortlist",
        DecodeMethod("b", "ar_beam"): "beam 4, length penalty 0.6",
        DecodeMethod("b8", "ar_beam", beam_size=8, length_penalty=1.0):
            "beam 8, length penalty 1",
        DecodeMethod("p", "refine"): "iterations 4, 1 length candidate x offsets (0)",
        DecodeMethod("p3", "refine", iterations=10, num_length_candidates=3,
                     length_offsets=(-1, 0, 1)):
            "iterations 10, 3 length candidates x offsets (-1, 0, 1)",
        DecodeMethod("m", "mask_predict", iterations=10, shortlist=True):
            "iterations 10, 1 length candidate x offsets (0), shortlist",
        DecodeMethod("a", "adaptive", tokens_per_step=1):
            "1 token per pass by margin, 1 length candidate x offsets (0)",
    }
    assert {m.name: report.describe_setting(m) for m in settings} == {
        m.name: text for m, text in settings.items()}
    records = [{"hypothesis": "a dog runs", "latency_s": 0.1, "passes": 2,
                "hypothesis_tokens": 4}]
    results = [report.score_method(m.name, m.kind, records, ["a dog runs"],
                                   {"sentences_per_s": 10.0}, records,
                                   setting=report.describe_setting(m)) for m in settings]
    content = report.build_report({"test": results})
    assert [m["setting"] for m in content["test_sets"]["test"]["methods"]] == list(
        settings.values())
    markdown = report.render_markdown(content)
    assert "| method | kind | setting | BLEU |" in markdown
    assert "| p | refine | iterations 4, 1 length candidate x offsets (0) | " in markdown
    assert "|---|---|---|---:|" in markdown  # the text columns are left-aligned
    # A report.json written before settings were recorded still renders.
    del content["test_sets"]["test"]["methods"][0]["setting"]
    assert "| g | ar_greedy | – |" in report.render_markdown(content)


# --- padir translate ---------------------------------------------------------------------


def test_translate_reads_stdin_and_prints_one_line_per_line(config, monkeypatch, capsys):
    uri = _uri(config, "student")
    sentences = _sentences(config, 2, range(2, 17))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(
        f"{sentences[0]}\n\n  {sentences[1]} \n".encode())))
    assert cli.main(["translate", "--checkpoint", uri, "--method", "refine",
                     "--iterations", "2", "--batch-size", "2"]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""
    decoder = translator.Translator(trained_model.load_cached(uri),
                                    DecodeMethod("refine", "refine", iterations=2),
                                    batch_size=2)
    # The command decodes each line alone here (a blank line fills its batch of 2).
    assert [lines[0], lines[2]] == [decoder.translate([s])[0].hypothesis for s in sentences]
    with pytest.raises(SystemExit) as error:
        cli.main(["translate", "--checkpoint", uri, "--method", "refine", "--beam-size", "8"])
    assert error.value.code == 2
    assert "'beam_size' does not apply" in capsys.readouterr().err

