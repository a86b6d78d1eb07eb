"""Tests for model/decoding/beam_search.py: a synthetic model checked by enumeration, and a
tiny AR model."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.config import ModelConfig
from components.tokenizer import BOS_ID, EOS_ID, PAD_ID
from model.decoding import compaction
from model.decoding.beam_search import NEG_INF, beam_search, greedy_search, length_penalty
from model.models import ARModel
from model.transformer import mask_non_target_ids

# --- a second-order Markov "model": logits depend on the previous and the current id ---
VOCAB = 9
REAL = (EOS_ID, 6, 7, 8)  # every other id is masked
MAX_LEN = 3
TABLE = np.full((VOCAB, VOCAB, VOCAB), NEG_INF, np.float32)
TABLE[..., list(REAL)] = np.random.default_rng(0).normal(size=(VOCAB, VOCAB, len(REAL))) * 2.0
LOG_PROBS = np.asarray(jax.nn.log_softmax(jnp.asarray(TABLE)))


def markov_tokens_to_logits(ids, cache, context):
    """The cache holds each row's previous input id [N] and a shared step counter."""
    current = ids[:, 0]
    logits = jnp.asarray(TABLE)[cache["previous"], current]  # [N, V]
    return logits, {"previous": current, "step": cache["step"] + 1}


def markov_cache(rows):
    return {"previous": jnp.zeros((rows,), jnp.int32), "step": jnp.zeros((), jnp.int32)}


def enumerate_finished(alpha):
    """Every hypothesis ending in EOS within MAX_LEN, best first: [(score, ids)]."""
    results = []
    for n in range(1, MAX_LEN + 1):
        for body in itertools.product(REAL[1:], repeat=n - 1):
            ids = list(body) + [EOS_ID]
            previous, current, total = 0, BOS_ID, 0.0
            for token in ids:
                total += LOG_PROBS[previous, current, token]
                previous, current = current, token
            results.append((total / float(length_penalty(n, alpha)), ids))
    return sorted(results, key=lambda r: -r[0])


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_exhaustive_beam_finds_every_hypothesis_in_order(alpha):
    beams = 36  # >= every candidate at every step: the search is exhaustive
    seqs, scores = jax.jit(
        functools.partial(beam_search, markov_tokens_to_logits, batch_size=1,
                          beam_size=beams, max_len=MAX_LEN)
    )(markov_cache(beams), alpha=alpha)
    expected = enumerate_finished(alpha)
    found = len(expected)
    np.testing.assert_allclose(scores[0, :found], [s for s, _ in expected], rtol=1e-5)
    for row, (_, ids) in zip(np.asarray(seqs[0]), expected):
        np.testing.assert_array_equal(row, ids + [PAD_ID] * (MAX_LEN - len(ids)))
    assert np.all(np.asarray(scores[0, found:]) <= NEG_INF / 2)


def test_narrow_beam_scores_are_sorted_and_beam_one_is_greedy():
    seqs, scores = beam_search(markov_tokens_to_logits, markov_cache(2), batch_size=1,
                               beam_size=2, max_len=MAX_LEN)
    assert scores[0, 0] >= scores[0, 1]
    one, _ = beam_search(markov_tokens_to_logits, markov_cache(1), batch_size=1,
                         beam_size=1, max_len=MAX_LEN)
    greedy = greedy_search(markov_tokens_to_logits, markov_cache(1), batch_size=1, max_len=MAX_LEN)
    np.testing.assert_array_equal(one[:, 0], greedy)


def test_immediate_eos():
    def always_eos(ids, cache, context):
        return jnp.zeros((ids.shape[0], VOCAB)).at[:, EOS_ID].set(100.0), cache

    seqs, scores = beam_search(always_eos, markov_cache(6), batch_size=2, beam_size=3, max_len=4)
    np.testing.assert_array_equal(seqs[:, 0], [[EOS_ID, 0, 0, 0]] * 2)
    np.testing.assert_allclose(scores[:, 0], 0.0, atol=1e-5)
    greedy = greedy_search(always_eos, markov_cache(2), batch_size=2, max_len=4)
    np.testing.assert_array_equal(greedy, [[EOS_ID, 0, 0, 0]] * 2)


def test_searches_drop_finished_rows_and_keep_each_rows_output():
    """40 rows, each emitting its own token until its own step, then EOS: the searches
    decode them in loops of 40 and 10 rows (finished rows dropped) and every row's output
    is its own."""
    rows = 40
    stops = np.random.default_rng(1).permutation(np.arange(rows) % 12 + 1)  # 1..12 steps
    shapes = []

    def countdown(ids, cache, context):
        shapes.append(ids.shape[0])  # at tracing: the rows of each loop
        stop, token = context
        emit = jnp.where(cache["step"] + 1 >= stop, EOS_ID, token)  # [N]
        logits = jnp.zeros((ids.shape[0], VOCAB)).at[jnp.arange(ids.shape[0]), emit].set(50.0)
        return logits, {"step": cache["step"] + 1}

    context = (jnp.asarray(stops), jnp.asarray(6 + np.arange(rows) % 3))
    expected = np.zeros((rows, 13), np.int32)
    for row, stop in enumerate(stops):
        expected[row, :stop - 1] = 6 + row % 3
        expected[row, stop - 1] = EOS_ID

    greedy = greedy_search(countdown, {"step": jnp.zeros((rows,), jnp.int32)}, context,
                           batch_size=rows, max_len=13)
    np.testing.assert_array_equal(greedy, expected)
    assert sorted(set(shapes)) == [10, 40]

    shapes.clear()
    beams = 2
    seqs, _ = beam_search(countdown, {"step": jnp.zeros((rows * beams,), jnp.int32)},
                          tuple(jnp.repeat(x, beams) for x in context),
                          batch_size=rows, beam_size=beams, max_len=13)
    np.testing.assert_array_equal(seqs[:, 0], expected)
    assert sorted(set(shapes)) == [20, 80]  # 40 sentences of 2 beams, then 10


# --- the tiny AR Transformer with its KV cache ---

CONFIG = ModelConfig(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                     mlp_dim=64, dropout_rate=0.0, max_source_len=8, max_target_len=6)
MODEL = ARModel(CONFIG, vocab_size=20)
BATCH = {
    "source": jnp.array([[6, 7, 8, EOS_ID], [9, EOS_ID, 0, 0], [10, 11, EOS_ID, 0]], jnp.int32),
    "target": jnp.zeros((3, 6), jnp.int32),
}


@pytest.fixture(scope="module")
def params():
    # Random weights: hypotheses rarely finish, so this covers the KV cache, its reordering
    # and the no-EOS fallback; test_models.py covers finished hypotheses (and greedy ==
    # beam 1) on a trained model, the Markov tests above the search itself.
    return jax.jit(MODEL.init)(jax.random.key(0), BATCH)


def teacher_forced_scores(params, seqs, alpha):
    """Length-penalised log-probability of int32[B, T] hypotheses (as the search scores)."""
    logits = MODEL.module.apply({"params": params}, BATCH["source"], seqs)
    log_probs = jax.nn.log_softmax(mask_non_target_ids(logits))
    token = jnp.take_along_axis(log_probs, seqs[..., None], -1)[..., 0]
    valid = seqs != PAD_ID
    lengths = valid.sum(1)
    return jnp.sum(token * valid, 1) / length_penalty(lengths, alpha)


def test_model_beam_scores_sorted_and_match_teacher_forcing(params):
    encoded, memory_mask = MODEL.encode(params, BATCH["source"])
    beams = 3

    @jax.jit
    def search(params):
        enc = jnp.repeat(encoded, beams, axis=0)
        mask = jnp.repeat(memory_mask, beams, axis=0)
        def step(ids, cache, context):
            return MODEL.make_tokens_to_logits(params, *context)(ids, cache)

        return beam_search(
            step, MODEL.init_cache(params, enc, mask, 6), (MODEL.memory(params, enc, mask), mask),
            batch_size=3, beam_size=beams, max_len=6, alpha=0.6,
        )

    seqs, scores = search(params)  # [B, K, T], [B, K]
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 0)
    filled = np.asarray(scores) > NEG_INF / 2  # slots a short finished pool left empty
    for k in range(beams):
        expected = teacher_forced_scores(params, seqs[:, k], 0.6)
        np.testing.assert_allclose(scores[:, k][filled[:, k]], expected[filled[:, k]], rtol=1e-4)


def test_the_loops_of_a_batch_are_what_the_search_runs():
    """compaction.loops, from each row's finishing step, says the (rows, steps) of every
    loop: here 40 rows as in the countdown test above."""
    stops = np.random.default_rng(1).permutation(np.arange(40) % 12 + 1)
    loops = compaction.loops(stops.tolist())
    assert [rows for rows, _ in loops] == [40, 10]
    assert sum(steps for _, steps in loops) == stops.max()
    # 40 rows run until at most 10 are unfinished: after the step where 30 have finished.
    assert loops[0] == (40, int(np.sort(stops)[29]))
    assert compaction.loops([3] * 16) == [(16, 3)]  # all finish together: one loop
    assert compaction.loops([1, 5, 2]) == [(3, 5)]  # too few rows to drop any
