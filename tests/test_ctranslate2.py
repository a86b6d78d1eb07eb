"""The teacher exported to CTranslate2 (model/decoding/ctranslate2_export.py) decodes as our
JAX search does (model/decoding/beam_search.py), through the Translator
(model/decoding/ctranslate2_search.py), and `padir export` writes it."""

import dataclasses
import functools
import json
import os
import pathlib
import tempfile
import types

import ctranslate2
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_models
from components.config import DecodeMethod
from components.tokenizer import EOS_ID, RESERVED_PIECES
from model.decoding import ctranslate2_export
from model.decoding import beam_search
from model.decoding.beam_search import length_penalty
from model.models import ARModel
from model.transformer import NON_TARGET_IDS, mask_non_target_ids
from tiny_models import BATCH, CONFIG, MAX_LEN, VOCAB

PIECES = list(RESERVED_PIECES) + [f"p{i}" for i in range(len(RESERVED_PIECES), VOCAB)]


@functools.cache
def teacher():
    """A tiny AR teacher that has memorised BATCH, and its CTranslate2 export."""
    model = ARModel(CONFIG, VOCAB, label_smoothing=0.0)
    params = tiny_models.train(model, jax.jit(model.init)(jax.random.key(0), BATCH), 150)
    directory = ctranslate2_export.export(CONFIG, params, PIECES, os.path.join(
        tempfile.mkdtemp(prefix="padir-test-ct2-"), "model"))
    return model, params, directory


def _greedy(model):
    return jax.jit(functools.partial(beam_search.predict_greedy, model))


def _sources() -> np.ndarray:
    """BATCH's memorised sources, then 12 it never saw. int32[16, MAX_LEN]."""
    sources = np.array(tiny_models.pairs(16, seed=3)["source"])
    sources[:4] = np.asarray(BATCH["source"])
    return sources


def _ct2(directory, sources, *, compute_type="float32", **options) -> list[list[int]]:
    translator = ctranslate2.Translator(directory, device="cpu", compute_type=compute_type)
    results = translator.translate_batch(
        [[PIECES[i] for i in row if i] for row in sources], max_decoding_length=MAX_LEN,
        min_decoding_length=0, return_end_token=True,
        suppress_sequences=[[PIECES[i]] for i in NON_TARGET_IDS], **options)
    return [[PIECES.index(piece) for piece in result.hypotheses[0]] for result in results]


def _rows(tokens) -> list[list[int]]:
    return [[int(i) for i in row if i] for row in np.asarray(tokens)]


def _log_prob(model, params, source, hypothesis) -> float:
    """The teacher's log-probability of `hypothesis` (ids + EOS), non-target ids masked."""
    target = jnp.asarray([hypothesis + [0] * (MAX_LEN - len(hypothesis))])
    logits = model.module.apply({"params": params}, jnp.asarray(source[None]), target)
    log_probs = jax.nn.log_softmax(mask_non_target_ids(logits[0]))
    return float(sum(log_probs[i, t] for i, t in enumerate(hypothesis)))


def test_greedy_is_our_greedy_token_for_token():
    model, params, directory = teacher()
    sources = _sources()
    ours = _greedy(model)(params, {"source": jnp.asarray(sources)})
    assert _ct2(directory, sources, beam_size=1) == _rows(ours)


def test_beam_search_is_ours_without_length_penalty_and_differs_only_by_its_normalisation():
    model, params, directory = teacher()
    sources = _sources()
    search = jax.jit(lambda p, b, alpha: beam_search.predict_beam(model, p, b, 4, alpha))
    plain, _ = search(params, {"source": jnp.asarray(sources)}, 0.0)
    assert _ct2(directory, sources, beam_size=4, length_penalty=0.0) == _rows(plain)
    # At 0.6 CTranslate2 ranks finished hypotheses by log p / len ** 0.6, ours by GNMT's
    # log p / ((5 + len) / 6) ** 0.6: where the two pick differently, each pick is the
    # better one under its own normalisation.
    gnmt, _ = search(params, {"source": jnp.asarray(sources)}, 0.6)
    theirs = _ct2(directory, sources, beam_size=4, length_penalty=0.6)
    for source, mine, other in zip(sources, _rows(gnmt), theirs):
        if mine != other:
            mine_lp, other_lp = (_log_prob(model, params, source, h) for h in (mine, other))
            assert mine_lp / length_penalty(len(mine), 0.6) >= \
                other_lp / length_penalty(len(other), 0.6) - 1e-4
            assert other_lp / len(other) ** 0.6 >= mine_lp / len(mine) ** 0.6 - 1e-4


def test_int8_greedy_runs_on_the_same_export():
    model, params, directory = teacher()
    sources = _sources()
    ours = _rows(_greedy(model)(params, {"source": jnp.asarray(sources)}))
    quantised = _ct2(directory, sources, compute_type="int8", beam_size=1)
    assert all(row[-1] == 1 or len(row) == MAX_LEN for row in quantised)  # EOS or the cap
    assert sum(a == b for a, b in zip(quantised, ours)) >= len(ours) // 2


def test_export_refuses_a_vocabulary_without_our_reserved_pieces(tmp_path):
    model, params, _ = teacher()
    with pytest.raises(ValueError, match="reserved"):
        ctranslate2_export.export(CONFIG, params, ["<unk>"] + PIECES[1:], str(tmp_path / "m"))
    with pytest.raises(ValueError, match="distinct"):
        ctranslate2_export.export(CONFIG, params, PIECES[:-1] + ["p6"], str(tmp_path / "m"))


def test_the_ar_students_shape_exports_and_decodes_as_ours(tmp_path):
    """A deeper encoder than decoder (2 + 1 layers), as the AR student has."""
    config = dataclasses.replace(CONFIG, num_encoder_layers=2, num_decoder_layers=1)
    model = ARModel(config, VOCAB, label_smoothing=0.0)
    params = tiny_models.train(model, jax.jit(model.init)(jax.random.key(0), BATCH), 150)
    directory = ctranslate2_export.export(config, params, PIECES, str(tmp_path / "model"))
    sources = _sources()
    ours = _greedy(model)(params, {"source": jnp.asarray(sources)})
    assert _ct2(directory, sources, beam_size=1) == _rows(ours)


# --- through the Translator and `padir export`, on a published (untrained) teacher -----------


@pytest.fixture(scope="module")
def published(tiny_workdir):
    from tiny_experiment import ensure, publish_untrained, tiny_config

    config = tiny_config(tiny_workdir)
    ensure(config, "prepare", "vocab")
    return publish_untrained(config, "teacher")


SENTENCES = ["Ein Hund läuft im Park.", "Zwei Männer spielen Fußball auf einer Wiese.",
             "Eine Frau."]


def test_translator_ct2_kinds_give_our_greedy_hypotheses(published):
    from model import trained_model
    from model.decoding import translator

    loaded = trained_model.load(published.uri)
    ours = translator.Translator(loaded, DecodeMethod("g", "ar_greedy"), batch_size=2)
    ct2 = translator.Translator(loaded, DecodeMethod("c", "ct2_greedy"), batch_size=2)
    expected, got = ours.translate(SENTENCES), ct2.translate(SENTENCES)
    assert [t.tokens for t in got] == [t.tokens for t in expected]
    assert [t.passes for t in got] == [len(t.tokens) for t in got]
    assert all(t.latency_s > 0 and t.encode_seconds == 0 and t.score is None for t in got)
    assert [t.batch_size for t in got] == [2, 2, 1]  # the last batch has no filler row
    beam = translator.Translator(loaded, DecodeMethod("b", "ct2_beam", compute_type="int8"),
                                 batch_size=1).translate(SENTENCES[:1])
    assert beam[0].score is not None and beam[0].tokens


def test_padir_export_writes_a_model_ctranslate2_loads(published, tmp_path, capsys):
    from flows import cli

    out = tmp_path / "ct2"
    assert cli.main(["export", "--checkpoint", published.uri, "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert {"model.bin", "config.json", "shared_vocabulary.json",
            ctranslate2_export.SPM_FILE} <= set(os.listdir(out))
    with open(out / "config.json") as f:
        assert json.load(f)["layer_norm_epsilon"] == ctranslate2_export.RMS_NORM_EPSILON
    ctranslate2.Translator(str(out), device="cpu").translate_batch([["▁Ein", "</s>"]],
                                                                   max_decoding_length=4)


# --- the worker process, the thread sweep and the vocabulary map ------------------------------


def _options(**options) -> dict:
    return dict(max_decoding_length=MAX_LEN, min_decoding_length=0, return_end_token=True,
                suppress_sequences=[[PIECES[i]] for i in NON_TARGET_IDS], **options)


def test_the_worker_translates_as_ctranslate2_in_process_does_and_times_the_call():
    from model.decoding.ctranslate2_search import Threads, Worker

    _, _, directory = teacher()
    sources = _sources()
    rows = [[PIECES[i] for i in row if i] for row in sources]
    worker = Worker(directory, device="cpu", compute_type="float32", threads=Threads(1, 2))
    try:
        for beam in (1, 4):  # two sub-batches of 8, one per translator (inter_threads 2)
            hypotheses, scores, seconds = worker.translate(
                rows, _options(beam_size=beam, return_scores=beam > 1, max_batch_size=8))
            assert [[PIECES.index(p) for p in h] for h in hypotheses] == \
                _ct2(directory, sources, beam_size=beam)
            assert seconds > 0 and all((s is not None) == (beam > 1) for s in scores)
    finally:
        worker.close()


def test_a_worker_failure_is_an_error_in_the_parent(tmp_path):
    from model.decoding.ctranslate2_search import Threads, Worker, WorkerError

    with pytest.raises(WorkerError, match="(?s)missing.*failed:.*Traceback"):
        Worker(str(tmp_path / "missing"), device="cpu", compute_type="float32",
               threads=Threads(1))
    worker = Worker(teacher()[2], device="cpu", compute_type="float32", threads=Threads(1))
    with pytest.raises(WorkerError, match="no_such_option"):
        worker.translate([["p6", "</s>"]], {"no_such_option": 1})
    assert worker.translate([["p6", "</s>"]], _options())[0]  # it still answers
    worker._process.kill()
    with pytest.raises(WorkerError, match="exited"):
        worker.translate([["p6", "</s>"]], _options())
    worker.close()


def test_the_worker_process_imports_ctranslate2_and_no_other_runtime():
    import subprocess
    import sys

    script = ("import sys, ctranslate2, model.decoding.ctranslate2_worker; "
              "print(sorted({m.split('.')[0] for m in sys.modules} & "
              "{'jax', 'jaxlib', 'flax', 'tensorflow', 'torch', 'components'}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_the_thread_grids_stay_within_the_cpus():
    from model.decoding.ctranslate2_search import Threads
    from model.decoding.ctranslate2_sweep import grid, thread_counts

    assert [thread_counts(n) for n in (1, 2, 6, 16)] == [[1], [1, 2], [1, 2, 4, 6],
                                                          [1, 2, 4, 8, 16]]
    assert grid("latency", 2) == [Threads(1), Threads(2)]
    assert grid("batched", 2) == [Threads(1, 1), Threads(1, 2), Threads(2, 1)]
    assert len(grid("batched", 16)) == 15
    assert all(t.intra_threads * t.inter_threads <= 6 for t in grid("batched", 6))


def test_the_sweep_times_every_setting_and_records_the_fastest(published):
    from model import trained_model
    from model.decoding import ctranslate2_sweep

    loaded = trained_model.load(published.uri)
    record = ctranslate2_sweep.sweep(
        loaded, DecodeMethod("c", "ct2_greedy"), SENTENCES,
        batch_sizes={"latency": 1, "batched": 2}, boundaries=loaded.boundaries, cpus=2)
    json.dumps(record)  # it goes into the decode manifest
    assert {k: record[k] for k in ("cpus", "sentences", "repeats")} == {
        "cpus": 2, "sentences": 3, "repeats": ctranslate2_sweep.REPEATS}
    for regime, best, batch_size in (("latency", min, 1), ("batched", max, 2)):
        about = record[regime]
        figure = about["figure"]
        assert about["batch_size"] == batch_size
        assert [(s["intra_threads"], s["inter_threads"]) for s in about["settings"]] == [
            (t.intra_threads, t.inter_threads) for t in ctranslate2_sweep.grid(regime, 2)]
        assert all(s[figure] > 0 for s in about["settings"])
        fastest = best(about["settings"], key=lambda s: s[figure])
        assert about["chosen"] == {k: fastest[k] for k in ("intra_threads", "inter_threads")}
        assert ctranslate2_sweep.chosen(record, regime).intra_threads == \
            fastest["intra_threads"]


def test_a_sweep_is_kept_beside_its_export_and_timed_again_only_for_another(
        published, monkeypatch):
    from model import trained_model
    from model.decoding import ctranslate2_search, ctranslate2_sweep

    loaded = trained_model.load(published.uri)
    timed = []
    monkeypatch.setattr(ctranslate2_sweep, "sweep",
                        lambda *a, **k: timed.append(k["batch_sizes"]) or {"timed": len(timed)})

    def kept(batched):
        return ctranslate2_sweep.kept_sweep(
            loaded, DecodeMethod("c", "ct2_greedy"), SENTENCES,
            batch_sizes={"latency": 1, "batched": batched}, boundaries=loaded.boundaries,
            cpus=2)

    folder = pathlib.Path(ctranslate2_search.export_dir(loaded, None)).parent / "sweeps"
    before = set(folder.glob("*.json"))
    first = kept(3)
    [written] = set(folder.glob("*.json")) - before
    assert first == {"timed": 1} and not list(folder.glob("*.partial"))
    assert kept(3) == first and len(timed) == 1  # read back, not timed again
    assert kept(5) == {"timed": 2}  # another batch size is another sweep
    written.unlink()
    assert kept(3) == {"timed": 3}


def test_a_vocabulary_map_keeps_each_sentence_to_its_shortlist(tmp_path, monkeypatch):
    from model.decoding import shortlist

    _, params, _ = teacher()
    table = shortlist.build(zip(np.asarray(BATCH["source"]), np.asarray(BATCH["target"])),
                            VOCAB, frequent=4, per_source=2)
    mapped = ctranslate2_export.export(CONFIG, params, PIECES, str(tmp_path / "m"),
                                       vocabulary_map=table)
    with open(os.path.join(mapped, ctranslate2_export.VMAP_FILE), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert lines[0] == "\t" + " ".join(PIECES[i] for i in np.flatnonzero(table.always))
    assert len(lines) == 1 + VOCAB - len(RESERVED_PIECES)
    sources = _sources()
    monkeypatch.setattr(shortlist, "SIZE_STEP", 1)  # `select` without its padding
    allowed = [set(shortlist.select(table, row[None]).tolist()) for row in sources]
    free = _ct2(mapped, sources, beam_size=1, max_batch_size=1)
    kept = _ct2(mapped, sources, beam_size=1, max_batch_size=1, use_vmap=True)
    assert all(set(row) <= cands for row, cands in zip(kept, allowed))
    assert any(not set(row) <= cands for row, cands in zip(free, allowed))  # it restricts


def test_a_shortlist_ct2_translator_decodes_with_the_vocabulary_map(published, monkeypatch):
    from model import trained_model
    from model.decoding import shortlist, translator

    loaded = trained_model.load(published.uri)
    ids = [np.asarray(row + [EOS_ID]) for row in loaded.tokenizer.encode(SENTENCES)]
    table = shortlist.build(zip(ids, ids), loaded.tokenizer.vocab_size, frequent=4,
                            per_source=2)
    monkeypatch.setitem(translator._SHORTLISTS, loaded.uri, table)  # no encode artifact
    monkeypatch.setattr(shortlist, "SIZE_STEP", 1)  # `select` without its padding
    ct2 = translator.Translator(loaded, DecodeMethod("c", "ct2_greedy", shortlist=True),
                                batch_size=1)
    assert os.path.exists(os.path.join(ct2._ctranslate2.model_dir,
                                       ctranslate2_export.VMAP_FILE))
    allowed = [set(shortlist.select(table, source[None]).tolist()) for source in ids]
    kept = [set(t.tokens) for t in ct2.translate(SENTENCES)]
    free = [set(t.tokens) for t in translator.Translator(
        loaded, DecodeMethod("c", "ct2_greedy"), batch_size=1).translate(SENTENCES)]
    assert all(tokens <= cands for tokens, cands in zip(kept, allowed))
    assert any(not tokens <= cands for tokens, cands in zip(free, allowed))  # it restricts


class _Pieces:
    """The tokenizer interface `ctranslate2_search.pieces` reads, over PIECES."""

    vocab_size = VOCAB

    def id_to_piece(self, i: int) -> str:
        return PIECES[i]


def test_an_export_is_kept_per_model_and_a_partial_one_is_never_read(monkeypatch, tmp_path):
    from model.decoding import ctranslate2_search

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, params, _ = teacher()
    loaded = types.SimpleNamespace(uri="a", model=model, params=params, tokenizer=_Pieces())
    exports = []
    real = ctranslate2_export.export
    monkeypatch.setattr(ctranslate2_export, "export",
                        lambda *a, **k: exports.append(a[-1]) or real(*a, **k))
    key = ctranslate2_search.export_key(loaded, None)
    # A killed export's partial directory is left beside where the export goes.
    (tmp_path / "padir" / "ctranslate2" / f"{key}.partial-x").mkdir(parents=True)
    first = ctranslate2_search.export_dir(loaded, None)
    assert first == str(tmp_path / "padir" / "ctranslate2" / key / "model")
    assert ctranslate2_search.export_dir(loaded, None) == first and len(exports) == 1
    assert _ct2(first, _sources()[:4]) == _rows(_greedy(model)(params, BATCH))
    # Other parameters are another export.
    other = types.SimpleNamespace(uri="b", model=model, tokenizer=_Pieces(),
                                  params=jax.tree.map(lambda x: x + 0.01, params))
    assert ctranslate2_search.export_dir(other, None) != first and len(exports) == 2
