"""Tests for model/decoding.py: oracles pin down passes and re-masking; a tiny trained
PaDIR model checks that every decoder emits valid sequences."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from components.config import ModelConfig
from components.tokenizer import EOS_ID, MASK_ID, NUM_RESERVED, PAD_ID
from model import decoding
from model.models import PaDIRModel, masked_hypothesis

VOCAB = 40
FIRST_REAL = 6
MAX_LEN = 8
CONFIG = ModelConfig(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                     mlp_dim=64, dropout_rate=0.0, max_source_len=9, max_target_len=MAX_LEN)


def _rows(*sequences):
    """Id lists (EOS appended) -> int32[len, MAX_LEN], 0-padded."""
    out = np.zeros((len(sequences), MAX_LEN), np.int32)
    for i, ids in enumerate(sequences):
        out[i, : len(ids) + 1] = list(ids) + [EOS_ID]
    return jnp.asarray(out)


@dataclasses.dataclass(frozen=True)
class CopyOracle:
    """A stand-in `NARModel` that knows the answer: the reference of a row is its source.

    Decode logits put all mass on the reference token at every position whatever the
    hypothesis, except on rows marked restless in `params`, which alternate between the
    reference and a shifted copy of it (so they change at every pass and never converge).
    """

    config: ModelConfig = CONFIG
    vocab_size: int = VOCAB
    first_real_id: int = FIRST_REAL

    def encode(self, params, source):
        return {"reference": source, "restless": params["restless"]}, source != PAD_ID

    def length_logits(self, params, encoded):
        lengths = jnp.sum(encoded["reference"] != PAD_ID, axis=1)  # counting EOS
        return 10.0 * jax.nn.one_hot(lengths - 1, self.config.max_target_len)

    def decode_logits(self, params, encoded, memory_mask, hypothesis):
        reference = encoded["reference"]  # [N, T]
        shifted = FIRST_REAL + (reference - FIRST_REAL + 1) % (VOCAB - FIRST_REAL)
        shifted = jnp.where(reference >= FIRST_REAL, shifted, reference)
        flip = encoded["restless"][:, None] & (hypothesis[:, :1] == reference[:, :1])
        return 20.0 * jax.nn.one_hot(jnp.where(flip, shifted, reference), VOCAB)


ORACLE = CopyOracle()
REFERENCE = _rows([7, 8], [9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 20])  # L = 3, 6, 8


def _calm(batch_size):
    return {"restless": jnp.zeros((batch_size,), bool)}


def _assert_valid(tokens, lengths):
    """Real pieces before EOS, exactly one EOS at lengths - 1, PAD after."""
    for row, n in zip(np.asarray(tokens), np.asarray(lengths)):
        assert np.all(row[: n - 1] >= NUM_RESERVED), row
        assert row[n - 1] == EOS_ID and np.all(row[n:] == PAD_ID), row


def test_candidate_lengths_take_top_classes_plus_offsets_clipped():
    logits = jnp.array([[9.0, 0, 5, 0, 0, 0, 0, 7], [0, 0, 0, 0, 0, 3, 2, 0]])
    # Row 0: class 0 (length 1) is infeasible, so lengths 8 then 3; row 1: 6 then 7.
    lengths = decoding.candidate_lengths(logits, 2, (-1, 0, 1), 8)
    np.testing.assert_array_equal(lengths, [[7, 8, 8, 2, 3, 4], [5, 6, 7, 6, 7, 8]])
    # A narrower output excludes longer classes before ranking.
    np.testing.assert_array_equal(decoding.candidate_lengths(logits, 1, (0,), 7), [[3], [6]])


def test_accept_predictions_rejects_reserved_and_remasks_stutter():
    # Length 8: content 0..6, EOS at 7.
    predictions = jnp.array([[7, 7, 7, EOS_ID, 9, 2, 10, 11]])
    initial = jnp.array([[MASK_ID] * 7 + [EOS_ID]])
    content = jnp.arange(8)[None] < 7
    hypothesis, accepted = decoding.accept_predictions(predictions, initial, content)
    # "7 7 7" keeps its first 7; EOS and UNK inside the sentence are rejected.
    np.testing.assert_array_equal(
        hypothesis, [[7, MASK_ID, MASK_ID, MASK_ID, 9, MASK_ID, 10, EOS_ID]])
    np.testing.assert_array_equal(accepted, [[1, 0, 0, 0, 1, 0, 1, 0]])
    # With random initial pieces, the same positions go back to their initial piece.
    random_initial = jnp.array([[30, 31, 32, 33, 34, 35, 36, EOS_ID]])
    hypothesis, _ = decoding.accept_predictions(predictions, random_initial, content)
    np.testing.assert_array_equal(hypothesis, [[7, 31, 32, 33, 9, 35, 10, EOS_ID]])


@pytest.mark.parametrize("init", ["mask", "random"])
def test_refine_with_an_oracle_converges_in_one_pass(init):
    result = decoding.refine(
        ORACLE, _calm(3), REFERENCE, num_length_candidates=1, length_offsets=(-1, 0, 1),
        max_iterations=4, init=init, rng=jax.random.key(0))
    np.testing.assert_array_equal(result.tokens, REFERENCE)
    np.testing.assert_array_equal(result.lengths, [3, 6, 8])
    np.testing.assert_array_equal(result.passes, [1, 1, 1])
    assert result.tokens.dtype == jnp.int32 and result.passes.dtype == jnp.int32
    np.testing.assert_allclose(result.scores, 0.0, atol=1e-4)


def test_refine_stops_counting_a_converged_row_while_others_go_on():
    params = {"restless": jnp.array([False, True])}
    result = decoding.refine(
        ORACLE, params, REFERENCE[:2], num_length_candidates=1, length_offsets=(0,),
        max_iterations=5)
    np.testing.assert_array_equal(result.passes, [1, 5])
    np.testing.assert_array_equal(result.tokens[0], REFERENCE[0])
    _assert_valid(result.tokens, result.lengths)
    # The loop state: row 0 converged (and froze), row 1 ran out of iterations.
    logits_fn = lambda h: ORACLE.decode_logits(  # noqa: E731
        params, ORACLE.encode(params, REFERENCE[:2])[0], None, h)
    lengths = jnp.array([3, 6])
    initial = masked_hypothesis(lengths, MAX_LEN)
    state = decoding.refine_loop(logits_fn, initial, lengths, 5)
    assert int(state.step) == 5
    np.testing.assert_array_equal(state.converged, [True, False])


def test_refine_remasks_stutter_and_rejected_predictions():
    # The model insists on "7 8 8 <eos> 9": position 2 stutters, position 3 predicts EOS
    # inside the sentence (its best real piece is 12).
    logits = 20.0 * jax.nn.one_hot(jnp.array([[7, 8, 8, EOS_ID, 9, EOS_ID, 0, 0]]), VOCAB)
    logits = logits.at[0, 3, 12].set(10.0)
    lengths = jnp.array([6])
    initial = masked_hypothesis(lengths, MAX_LEN)
    state = decoding.refine_loop(lambda h: logits, initial, lengths, 4)
    np.testing.assert_array_equal(
        state.hypothesis, [[7, 8, MASK_ID, MASK_ID, 9, EOS_ID, 0, 0]])
    # Output: the best real piece where the prediction was not accepted.
    np.testing.assert_array_equal(state.tokens, [[7, 8, 8, 12, 9, EOS_ID, 0, 0]])
    assert bool(state.converged[0]) and int(state.passes[0]) == 1 and int(state.step) == 2


@pytest.mark.parametrize("iterations", [1, 3])
def test_mask_predict_uses_t_passes(iterations):
    result = decoding.mask_predict(
        ORACLE, _calm(3), REFERENCE, num_length_candidates=2, length_offsets=(0, 1),
        iterations=iterations)
    np.testing.assert_array_equal(result.tokens, REFERENCE)
    np.testing.assert_array_equal(result.passes, [iterations] * 3)
    np.testing.assert_array_equal(result.lengths, [3, 6, 8])


def test_lowest_ranked_selects_per_row_counts_among_candidates():
    values = jnp.array([[0.5, 0.1, 0.3, 0.1, 0.0], [0.2, 0.9, 0.4, 0.8, 0.1]])
    candidates = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    chosen = decoding.lowest_ranked(values, candidates, jnp.array([2, 0]))
    # Ties go to the leftmost; position 4 of row 0 is not a candidate.
    np.testing.assert_array_equal(chosen, [[0, 1, 0, 1, 0], [0, 0, 0, 0, 0]])
    chosen = decoding.lowest_ranked(values, candidates, jnp.array([9, 3]))
    np.testing.assert_array_equal(chosen, [[1, 1, 1, 1, 0], [1, 0, 1, 0, 1]])


@pytest.mark.parametrize("criterion", ["top_prob", "margin"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_adaptive_unmasks_k_per_pass(criterion, k):
    result = decoding.adaptive(
        ORACLE, _calm(3), REFERENCE, num_length_candidates=1, length_offsets=(0,),
        tokens_per_step=k, criterion=criterion)
    np.testing.assert_array_equal(result.tokens, REFERENCE)
    np.testing.assert_array_equal(result.passes, [math.ceil(n / k) for n in (2, 5, 7)])


def test_certainty_criteria_disagree_where_they_should():
    probs = np.full((1, 2, VOCAB), 1e-6)
    probs[0, 0, [7, 8]] = [0.50, 0.45]  # top 0.50, margin 0.05
    probs[0, 1, [7, 8, 9]] = [0.40, 0.05, 0.05]  # top 0.40, margin 0.35
    probs[0, 0, EOS_ID] = probs[0, 1, EOS_ID] = 0.5  # mass on EOS is ignored
    log_probs = jnp.log(jnp.asarray(probs, jnp.float32))
    np.testing.assert_allclose(decoding.certainty(log_probs, "top_prob"), [[0.5, 0.4]], atol=1e-5)
    np.testing.assert_allclose(decoding.certainty(log_probs, "margin"), [[0.05, 0.35]], atol=1e-5)
    with pytest.raises(ValueError, match="criterion"):
        decoding.certainty(log_probs, "entropy")


def test_refine_traces_once_per_shape_and_settings():
    def run(source):
        # A fresh but equal model object each time: static arguments hash by value.
        return decoding.refine(
            CopyOracle(), _calm(3), source, num_length_candidates=1, length_offsets=(0, 1),
            max_iterations=3)

    run(REFERENCE)
    before = decoding.refine._cache_size()
    np.testing.assert_array_equal(run(REFERENCE[::-1]).tokens, REFERENCE[::-1])
    assert decoding.refine._cache_size() == before


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="rng"):
        decoding.refine(ORACLE, _calm(3), REFERENCE, num_length_candidates=1,
                        length_offsets=(0,), max_iterations=2, init="random")
    with pytest.raises(ValueError, match="num_length_candidates"):
        decoding.mask_predict(ORACLE, _calm(3), REFERENCE, num_length_candidates=8,
                              length_offsets=(0,), iterations=2)


# --- a tiny trained model -------------------------------------------------------------


def _pairs(count, seed=0):
    rng = np.random.default_rng(seed)
    source = np.zeros((count, MAX_LEN), np.int32)
    target = np.zeros((count, MAX_LEN), np.int32)
    for i in range(count):
        n, m = rng.integers(2, 8), rng.integers(2, 7)
        source[i, :n] = rng.integers(FIRST_REAL, VOCAB, n)
        source[i, n] = EOS_ID
        target[i, :m] = rng.integers(FIRST_REAL, VOCAB, m)
        target[i, m] = EOS_ID
    return {"source": jnp.asarray(source), "target": jnp.asarray(target)}


BATCH = _pairs(4)


def _train_tiny_model(steps=150):
    """A PaDIR model that memorises BATCH (single-stage loss, Adam)."""
    model = PaDIRModel(CONFIG, VOCAB, FIRST_REAL, label_smoothing=0.0)
    optimizer = optax.adam(3e-3)

    @jax.jit
    def train(params, rng):
        def step(carry, step_rng):
            params, opt_state = carry
            grads = jax.grad(lambda p: model.loss_fn(p, BATCH, step_rng)[0])(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None

        carry = (params, optimizer.init(params))
        return jax.lax.scan(step, carry, jax.random.split(rng, steps))[0][0]

    return model, train(jax.jit(model.init)(jax.random.key(0), BATCH), jax.random.key(1))


@pytest.fixture(scope="module")
def trained():
    """(model, params, candidate lengths int[4, 6] of BATCH for k=2, offsets (-1, 0, 1))."""
    model, params = _train_tiny_model()

    @jax.jit
    def candidates(params, source):
        length_logits = model.length_logits(params, model.encode(params, source)[0])
        return decoding.candidate_lengths(length_logits, 2, (-1, 0, 1), MAX_LEN)

    return model, params, np.asarray(candidates(params, BATCH["source"]))


DECODERS = {
    "refine_mask": lambda m, p, s: decoding.refine(
        m, p, s, num_length_candidates=2, length_offsets=(-1, 0, 1), max_iterations=4),
    "refine_random": lambda m, p, s: decoding.refine(
        m, p, s, num_length_candidates=2, length_offsets=(-1, 0, 1), max_iterations=4,
        init="random", rng=jax.random.key(3)),
    "mask_predict": lambda m, p, s: decoding.mask_predict(
        m, p, s, num_length_candidates=2, length_offsets=(-1, 0, 1), iterations=3),
    "adaptive": lambda m, p, s: decoding.adaptive(
        m, p, s, num_length_candidates=2, length_offsets=(-1, 0, 1), tokens_per_step=2,
        criterion="margin"),
}


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoders_on_a_trained_model_emit_valid_sequences(trained, name):
    model, params, candidates = trained
    result = DECODERS[name](model, params, BATCH["source"])
    assert result.tokens.shape == (4, MAX_LEN) and result.scores.shape == (4,)
    _assert_valid(result.tokens, result.lengths)
    for length, row in zip(np.asarray(result.lengths), candidates):
        assert length in row
    assert np.all(np.asarray(result.scores) <= 0) and np.all(np.isfinite(result.scores))
    assert np.all(np.asarray(result.passes) >= 1)
    # The memorised pairs come back (nearly) verbatim.
    accuracy = np.mean(np.asarray(result.tokens) == np.asarray(BATCH["target"]))
    assert accuracy >= 0.75, (name, accuracy, result.tokens)
