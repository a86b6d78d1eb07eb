"""benchmarks/decode_speed.py's pass profile on tiny untrained models (no data, seconds)."""

import math
import types

import jax
import pytest

from benchmarks import decode_speed
from model.models import ARModel, PaDIRModel
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
