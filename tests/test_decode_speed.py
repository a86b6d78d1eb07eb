"""benchmarks/decode_speed.py's pass profile on tiny untrained models (no data, seconds)."""

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import decode_speed, floors
from components.tokenizer import EOS_ID, MASK_ID, PAD_ID
from model.decoding import beam_search
from model.models import ARModel, PaDIRModel, masked_hypothesis
from tiny_models import BATCH, CONFIG, FIRST_REAL, MAX_LEN, VOCAB


@pytest.fixture(scope="module")
def bench():
    return decode_speed


def _check(profile, names):
    assert [part.name.split(" ")[0] for part in profile.parts] == names
    for part in profile.parts + [profile.whole]:
        assert math.isfinite(part.seconds)
        assert part.call_seconds is None if part.residual else part.call_seconds > 0
    assert profile.whole.seconds > 0 and profile.dispatch_seconds > 0
    top = sum(part.seconds for part in profile.parts if part.level == 0)
    assert top == pytest.approx(profile.whole.seconds, rel=1e-6, abs=1e-12)


def test_pass_profile_names_the_parts_of_a_padir_pass(bench):
    model = PaDIRModel(CONFIG, VOCAB, FIRST_REAL)
    params = jax.jit(model.init)(jax.random.key(0), BATCH)
    profile = bench.pass_profile(model, params, BATCH["source"][:1], max_len=MAX_LEN,
                                 length_offsets=(-1, 0), repeats=3)
    _check(profile, ["network:", "attention,", "MLP,", "output", "rest:", "reading",
                     "acceptance", "state", "refine's"])
    network = profile.parts[0]
    split = [part for part in profile.parts if part.level == 1]
    assert sum(part.seconds for part in split) == pytest.approx(network.seconds, abs=1e-12)
    assert all(part.mflop > 0 for part in split if not part.residual)
    assert "2 row(s) of width 8" in profile.title
    table = bench.profile_table(profile)
    assert "| part | ms | share of a pass | MFLOP |" in table
    assert "| refine at 1 pass (one call) |" in table and "| 100% |" in table


def test_ar_step_profile_names_the_parts_of_a_greedy_step(bench):
    model = ARModel(CONFIG, VOCAB)
    params = jax.jit(model.init)(jax.random.key(0), BATCH)
    profile = bench.ar_step_profile(model, params, BATCH["source"][:1], max_len=MAX_LEN,
                                    repeats=3)
    _check(profile, ["network:", "next", "bookkeeping:"])
    assert "share of a step" in bench.profile_table(profile)


def test_representative_is_the_first_sentence_of_the_median_width(bench):
    done = [types.SimpleNamespace(width=w, passes=p)
            for w, p in [(24, 3), (8, 2), (16, 4), (16, 2)]]
    assert bench.representative(done) == 2  # lower median 16: the first at 16
    assert bench.representative(done, "passes") == 1


def test_print_pass_profiles_profiles_the_median_width_sentence_of_each_kind(bench, capsys,
                                                                             monkeypatch):
    from components.config import DecodeMethod
    from components.tokenizer import EOS_ID

    seen = []

    def fake(kind):
        def profile(model, params, source, *, max_len, repeats, **options):
            seen.append((kind, model, source.tolist(), max_len, repeats, options))
            part = bench.Part("whole", 1e-3, 1e-3)
            return bench.Profile(kind, "pass", [part], part, 1e-5, [])
        return profile

    monkeypatch.setattr(bench, "pass_profile", fake("refine"))
    monkeypatch.setattr(bench, "ar_step_profile", fake("ar"))
    tokenizer = types.SimpleNamespace(
        encode=lambda texts: [[10 + len(t)] * len(t) for t in texts])

    def translator(model):
        return types.SimpleNamespace(boundaries=(4, 8), loaded=types.SimpleNamespace(
            model=model, params={}, tokenizer=tokenizer))

    known = {"greedy": DecodeMethod("greedy", "ar_greedy"),
             "p4": DecodeMethod("p4", "refine", length_offsets=(-1, 0, 1))}
    translators = {"greedy": translator("teacher"), "p4": translator("student")}
    widths = [types.SimpleNamespace(width=w, passes=2) for w in (16, 8, 8)]
    pairs = [{"source": "a"}, {"source": "bb"}, {"source": "ccc"}]
    bench.print_pass_profiles(pairs, known, translators, {"p4": widths, "greedy": widths},
                              focus="padir_4", repeats=5)
    row = [12, 12, EOS_ID, 0]  # "bb": two pieces and EOS in the bucket of 4; cap 8 >= 2 x 3
    assert seen == [("refine", "student", [row], 8, 5,
                     {"num_length_candidates": 1, "length_offsets": (-1, 0, 1)}),
                    ("ar", "teacher", [row], 8, 5, {})]
    out = capsys.readouterr().out
    assert "sentence 1 (the median width of p4)" in out and out.count("| part | ms |") == 2


def test_padir_floor_runs_its_passes_on_the_argmax_of_the_last():
    model = PaDIRModel(CONFIG, VOCAB, FIRST_REAL)
    params = jax.jit(model.init)(jax.random.key(0), BATCH)
    encoded, memory_mask = jax.jit(model.encode)(params, BATCH["source"])
    length = 6
    one = floors.padir_passes(model, params, encoded, memory_mask, 1, length=length)
    hypothesis = masked_hypothesis(jnp.full((BATCH["source"].shape[0],), length), length)
    memory = model.decoder_memory(params, encoded, memory_mask, hypothesis != PAD_ID)
    network = jax.jit(model.pass_logits)
    logits = network(params, memory, hypothesis)
    expected = jnp.where(hypothesis == MASK_ID, jnp.argmax(logits, axis=-1), hypothesis)
    np.testing.assert_array_equal(one, expected)
    two = floors.padir_passes(model, params, encoded, memory_mask, 2, length=length)
    logits = network(params, memory, expected)
    np.testing.assert_array_equal(
        two, jnp.where(hypothesis == MASK_ID, jnp.argmax(logits, axis=-1), hypothesis))
    np.testing.assert_array_equal(
        floors.padir_passes(model, params, encoded, memory_mask, 0, length=length), hypothesis)


def test_greedy_floor_steps_are_greedys_steps():
    model = ARModel(CONFIG, VOCAB)
    params = jax.jit(model.init)(jax.random.key(0), BATCH)
    encoded, memory_mask = jax.jit(model.encode)(params, BATCH["source"])
    greedy = jax.jit(functools.partial(beam_search.greedy, model), static_argnums=3)
    tokens = np.asarray(greedy(params, encoded, memory_mask, MAX_LEN))
    for steps in (1, 3):
        last = floors.greedy_steps(model, params, encoded, memory_mask, steps, slots=MAX_LEN)
        before = ~np.any(tokens[:, :steps - 1] == EOS_ID, axis=1)  # rows still decoding
        assert before.any()
        np.testing.assert_array_equal(np.asarray(last)[before, 0], tokens[before, steps - 1])


def test_floors_time_each_shape_after_compiling_it_once():
    model = PaDIRModel(CONFIG, VOCAB, FIRST_REAL)
    params = jax.jit(model.init)(jax.random.key(0), BATCH)
    timer = floors.Floors(model, params)
    source = [7, 8, 9, EOS_ID]
    first = timer.padir(source, source_width=MAX_LEN, length=5, passes=4)
    again = timer.padir(source, source_width=MAX_LEN, length=5, passes=2)  # no new shape
    assert first.encode_seconds > 0 and first.search_seconds > 0
    assert again.seconds == again.encode_seconds + again.search_seconds
    assert timer._warm == {("encode", (1, 4)), ("padir", MAX_LEN, 5)}


def test_a_batch_floor_runs_each_kind_at_its_rows_and_width():
    model = ARModel(CONFIG, VOCAB)
    params = jax.jit(model.init)(jax.random.key(0), BATCH)
    timer = floors.Floors(model, params)
    source = np.asarray(BATCH["source"])  # [4, S]
    greedy = timer.batch("ar_greedy", source, width=5, loops=[(4, 3), (2, 1)])
    beam = timer.batch("ar_beam", source, width=5, loops=[(4, 3)], beam_size=2)
    assert greedy.encode_seconds > 0 and beam.search_seconds > 0
    # Each loop at its rows (the beam's over its 4 x 2); the encoder once over the batch's 4.
    rows = source.shape[1:]
    assert timer._warm == {("encode", source.shape), ("ar_greedy", (4,) + rows, 5, 1),
                           ("ar_greedy", (2,) + rows, 5, 1), ("ar_beam", (4,) + rows, 5, 2)}


def test_batch_floors_split_the_stage_into_network_cap_bookkeeping_and_host(monkeypatch):
    from benchmarks import batch_floors

    seconds = {"stage": 10.0, "calls": 8.0, "floor_at_cap": 5.0, "floor": 4.0}
    monkeypatch.setattr(batch_floors.floors_lib, "Floors", lambda *a: None)
    monkeypatch.setattr(batch_floors.floors_lib, "models_of", lambda search: ())
    monkeypatch.setattr(batch_floors, "time_batch", lambda search, floors, texts: seconds)
    figures = batch_floors.measure(None, [["a", "b"], ["c"]], repeats=3)
    assert figures["stage_sentences_per_s"] == pytest.approx(3 / 20.0)
    assert figures["calls_over_floor"] == pytest.approx(2.0)
    assert (figures["network_s"], figures["cap_s"], figures["bookkeeping_s"],
            figures["host_s"]) == pytest.approx((8.0, 2.0, 6.0, 4.0))


def test_a_batch_floor_counts_what_the_batch_ran():
    from benchmarks import batch_floors

    done = [types.SimpleNamespace(tokens=[5] * n, passes=p, rounds=r, width=24)
            for n, p, r in [(7, 3, 2), (11, 2, 4)]]
    assert batch_floors.floor_shape("refine", done, 2) == ([(2, 3)], 24, 11)
    assert batch_floors.floor_shape("draft_verify", done, 2) == ([(2, 4)], 24, 11)
    assert batch_floors.floor_shape("ar_beam", done, 2) == ([(2, 11)], 24, 11)
    # 32 rows, 30 of them filler copies of the first (7 tokens): dropped after its 7 steps.
    assert batch_floors.floor_shape("ar_greedy", done, 32) == ([(32, 7), (8, 4)], 24, 11)
    texts = ["ccc", "a", "bb", "dddd", "e"]
    tokenizer = types.SimpleNamespace(encode=lambda texts: [[1] * len(t) for t in texts])
    assert batch_floors.batches(texts, tokenizer, 2) == [["a", "e"], ["bb", "ccc"], ["dddd"]]
