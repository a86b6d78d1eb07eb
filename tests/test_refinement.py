"""Tests for model/decoding/refinement.py: oracles pin down passes and re-masking; a tiny trained
PaDIR model checks that every decoder emits valid sequences."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.config import ModelConfig
from components.tokenizer import EOS_ID, MASK_ID, NUM_RESERVED, PAD_ID
from model.decoding import refinement
from model.models import ARModel, masked_hypothesis
from model.transformer import mask_non_target_ids
from tiny_models import BATCH, CONFIG, FIRST_REAL, MAX_LEN, VOCAB, memorised_padir


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

    def decoder_memory(self, params, encoded, memory_mask, valid):
        return {"reference": encoded["reference"][:, :valid.shape[1]],
                "restless": encoded["restless"]}

    def pass_logits(self, params, memory, hypothesis, vocab_ids=None):
        reference = memory["reference"]  # [N, T]
        shifted = FIRST_REAL + (reference - FIRST_REAL + 1) % (VOCAB - FIRST_REAL)
        shifted = jnp.where(reference >= FIRST_REAL, shifted, reference)
        flip = memory["restless"][:, None] & (hypothesis[:, :1] == reference[:, :1])
        logits = 20.0 * jax.nn.one_hot(jnp.where(flip, shifted, reference), VOCAB)
        return logits if vocab_ids is None else logits[..., vocab_ids]


ORACLE = CopyOracle()
REFERENCE = _rows([7, 8], [9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 20])  # L = 3, 6, 8


def _calm(batch_size):
    return {"restless": jnp.zeros((batch_size,), bool)}


def _decode(decoder, model, params, source, *, num_length_candidates, length_offsets,
            width=None, **options):
    """Both calls, as the Translator makes them; `width` defaults to the lengths' width."""
    max_len = model.config.max_target_len
    candidates = refinement.predict_candidates(
        model, params, source, num_length_candidates=num_length_candidates,
        length_offsets=length_offsets, max_len=max_len)
    width = width or refinement.output_width(candidates.lengths, max_len)
    return decoder(model, params, candidates, width=width, **options)


def _oracle_logits_fn(params, source, width):
    encoded, _ = ORACLE.encode(params, source)
    memory = ORACLE.decoder_memory(params, encoded, None, jnp.ones((1, width), bool))
    return lambda hypothesis: ORACLE.pass_logits(params, memory, hypothesis)


def _assert_valid(tokens, lengths):
    """Real pieces before EOS, exactly one EOS at lengths - 1, PAD after."""
    for row, n in zip(np.asarray(tokens), np.asarray(lengths)):
        assert np.all(row[: n - 1] >= NUM_RESERVED), row
        assert row[n - 1] == EOS_ID and np.all(row[n:] == PAD_ID), row


def test_candidate_lengths_take_top_classes_plus_offsets_clipped():
    logits = jnp.array([[9.0, 0, 5, 0, 0, 0, 0, 7], [0, 0, 0, 0, 0, 3, 2, 0]])
    # Row 0: class 0 (length 1) is infeasible, so lengths 8 then 3; row 1: 6 then 7.
    lengths = refinement.candidate_lengths(logits, 2, (-1, 0, 1), 8)
    np.testing.assert_array_equal(lengths, [[7, 8, 8, 2, 3, 4], [5, 6, 7, 6, 7, 8]])
    # A narrower output excludes longer classes before ranking.
    np.testing.assert_array_equal(refinement.candidate_lengths(logits, 1, (0,), 7), [[3], [6]])


def test_accept_predictions_rejects_reserved_and_remasks_stutter():
    # Length 8: content 0..6, EOS at 7.
    predictions = jnp.array([[7, 7, 7, EOS_ID, 9, 2, 10, 11]])
    initial = jnp.array([[MASK_ID] * 7 + [EOS_ID]])
    content = jnp.arange(8)[None] < 7
    hypothesis, accepted = refinement.accept_predictions(predictions, initial, content)
    # "7 7 7" keeps its first 7; EOS and UNK inside the sentence are rejected.
    np.testing.assert_array_equal(
        hypothesis, [[7, MASK_ID, MASK_ID, MASK_ID, 9, MASK_ID, 10, EOS_ID]])
    np.testing.assert_array_equal(accepted, [[1, 0, 0, 0, 1, 0, 1, 0]])
    # With random initial pieces, the same positions go back to their initial piece.
    random_initial = jnp.array([[30, 31, 32, 33, 34, 35, 36, EOS_ID]])
    hypothesis, _ = refinement.accept_predictions(predictions, random_initial, content)
    np.testing.assert_array_equal(hypothesis, [[7, 31, 32, 33, 9, 35, 10, EOS_ID]])


def test_refine_with_an_oracle_converges_after_one_pass_and_one_confirming_pass():
    result = _decode(
        refinement.refine, ORACLE, _calm(3), REFERENCE, num_length_candidates=1,
        length_offsets=(-1, 0, 1), max_iterations=4)
    np.testing.assert_array_equal(result.tokens, REFERENCE)
    np.testing.assert_array_equal(result.lengths, [3, 6, 8])
    np.testing.assert_array_equal(result.passes, [2, 2, 2])  # every pass that ran
    assert result.tokens.dtype == jnp.int32 and result.passes.dtype == jnp.int32
    np.testing.assert_allclose(result.scores, 0.0, atol=1e-4)


def test_refine_stops_counting_a_converged_row_while_others_go_on():
    params = {"restless": jnp.array([False, True])}
    result = _decode(
        refinement.refine, ORACLE, params, REFERENCE[:2], num_length_candidates=1,
        length_offsets=(0,), max_iterations=5)
    np.testing.assert_array_equal(result.passes, [2, 5])
    np.testing.assert_array_equal(result.tokens[0], REFERENCE[0])
    _assert_valid(result.tokens, result.lengths)
    # The loop state: row 0 converged (and froze), row 1 ran out of iterations.
    logits_fn = _oracle_logits_fn(params, REFERENCE[:2], MAX_LEN)
    lengths = jnp.array([3, 6])
    initial = masked_hypothesis(lengths, MAX_LEN)
    state = refinement.refine_loop(logits_fn, initial, lengths, 5)
    assert int(state.step) == 5
    np.testing.assert_array_equal(state.converged, [True, False])


def test_refine_remasks_stutter_and_rejected_predictions():
    # The model insists on "7 8 8 <eos> 9": position 2 stutters, position 3 predicts EOS
    # inside the sentence (its best real piece is 12).
    logits = 20.0 * jax.nn.one_hot(jnp.array([[7, 8, 8, EOS_ID, 9, EOS_ID, 0, 0]]), VOCAB)
    logits = logits.at[0, 3, 12].set(10.0)
    lengths = jnp.array([6])
    initial = masked_hypothesis(lengths, MAX_LEN)
    state = refinement.refine_loop(lambda h: logits, initial, lengths, 4)
    np.testing.assert_array_equal(
        state.hypothesis, [[7, 8, MASK_ID, MASK_ID, 9, EOS_ID, 0, 0]])
    # Output: the best real piece where the prediction was not accepted.
    np.testing.assert_array_equal(state.tokens, [[7, 8, 8, 12, 9, EOS_ID, 0, 0]])
    assert bool(state.converged[0]) and int(state.passes[0]) == 2 and int(state.step) == 2


@pytest.mark.parametrize("iterations", [1, 3])
def test_mask_predict_uses_t_passes(iterations):
    result = _decode(
        refinement.mask_predict, ORACLE, _calm(3), REFERENCE, num_length_candidates=2,
        length_offsets=(0, 1), iterations=iterations)
    np.testing.assert_array_equal(result.tokens, REFERENCE)
    np.testing.assert_array_equal(result.passes, [iterations] * 3)
    np.testing.assert_array_equal(result.lengths, [3, 6, 8])


def test_lowest_ranked_selects_per_row_counts_among_candidates():
    values = jnp.array([[0.5, 0.1, 0.3, 0.1, 0.0], [0.2, 0.9, 0.4, 0.8, 0.1]])
    candidates = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    chosen = refinement.lowest_ranked(values, candidates, jnp.array([2, 0]))
    # Ties go to the leftmost; position 4 of row 0 is not a candidate.
    np.testing.assert_array_equal(chosen, [[0, 1, 0, 1, 0], [0, 0, 0, 0, 0]])
    chosen = refinement.lowest_ranked(values, candidates, jnp.array([9, 3]))
    np.testing.assert_array_equal(chosen, [[1, 1, 1, 1, 0], [1, 0, 1, 0, 1]])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_adaptive_unmasks_k_per_pass(k):
    result = _decode(
        refinement.adaptive, ORACLE, _calm(3), REFERENCE, num_length_candidates=1,
        length_offsets=(0,), tokens_per_step=k)
    np.testing.assert_array_equal(result.tokens, REFERENCE)
    np.testing.assert_array_equal(result.passes, [math.ceil(n / k) for n in (2, 5, 7)])


def test_certainty_is_the_margin_between_the_two_best_real_pieces():
    probs = np.full((1, 2, VOCAB), 1e-6)
    probs[0, 0, [7, 8]] = [0.50, 0.45]  # top 0.50, margin 0.05
    probs[0, 1, [7, 8, 9]] = [0.40, 0.05, 0.05]  # top 0.40, margin 0.35
    probs[0, 0, EOS_ID] = probs[0, 1, EOS_ID] = 0.5  # mass on EOS is ignored
    log_probs = jnp.log(jnp.asarray(probs, jnp.float32))
    np.testing.assert_allclose(refinement.certainty(log_probs), [[0.05, 0.35]], atol=1e-5)


def test_refine_traces_once_per_shape_and_settings():
    def run(source):
        # A fresh but equal model object each time: static arguments hash by value.
        return _decode(
            refinement.refine, CopyOracle(), _calm(3), source, num_length_candidates=1,
            length_offsets=(0, 1), max_iterations=3)

    run(REFERENCE)
    before = refinement.refine._cache_size()
    np.testing.assert_array_equal(run(REFERENCE[::-1]).tokens, REFERENCE[::-1])
    assert refinement.refine._cache_size() == before


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="max_iterations"):
        _decode(refinement.refine, ORACLE, _calm(3), REFERENCE, num_length_candidates=1,
                length_offsets=(0,), max_iterations=0)
    with pytest.raises(ValueError, match="num_length_candidates"):
        refinement.predict_candidates(ORACLE, _calm(3), REFERENCE, num_length_candidates=8,
                                    length_offsets=(0,))


# --- a tiny trained model -------------------------------------------------------------


@pytest.fixture(scope="module")
def trained():
    """(model, params, candidate lengths int[4, 6] of BATCH for k=2, offsets (-1, 0, 1))."""
    model, params = memorised_padir()

    @jax.jit
    def candidates(params, source):
        length_logits = model.length_logits(params, model.encode(params, source)[0])
        return refinement.candidate_lengths(length_logits, 2, (-1, 0, 1), MAX_LEN)

    return model, params, np.asarray(candidates(params, BATCH["source"]))


DECODERS = {
    "refine": lambda m, p, s: _decode(
        refinement.refine, m, p, s, num_length_candidates=2, length_offsets=(-1, 0, 1),
        max_iterations=4),
    "mask_predict": lambda m, p, s: _decode(
        refinement.mask_predict, m, p, s, num_length_candidates=2, length_offsets=(-1, 0, 1),
        iterations=3),
    "adaptive": lambda m, p, s: _decode(
        refinement.adaptive, m, p, s, num_length_candidates=2, length_offsets=(-1, 0, 1),
        tokens_per_step=2),
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


def test_predict_refined_is_the_test_decoding_with_one_length_candidate(trained):
    """What the student's dev BLEU reads during training equals PaDIR-4 at one candidate."""
    model, params, _ = trained
    dev = jax.jit(functools.partial(refinement.predict_refined, model, max_iterations=4))(
        params, BATCH)
    result = _decode(refinement.refine, model, params, BATCH["source"], num_length_candidates=1,
                     length_offsets=(0,), max_iterations=4, width=BATCH["target"].shape[1])
    np.testing.assert_array_equal(dev, result.tokens)
    np.testing.assert_array_equal(dev, BATCH["target"])  # the memorised pairs


# --- width from the predicted lengths ----------------------------------------------------

WIDE = dataclasses.replace(CONFIG, max_source_len=25, max_target_len=24)


def _wide_rows(*lengths):
    """Rows of real pieces + EOS of the given lengths (counting EOS), 24 wide."""
    out = np.zeros((len(lengths), 24), np.int32)
    for i, n in enumerate(lengths):
        out[i, :n - 1] = FIRST_REAL + (np.arange(n - 1) * 7 + i) % (VOCAB - FIRST_REAL)
        out[i, n - 1] = EOS_ID
    return jnp.asarray(out)


def test_output_width_is_the_longest_candidate_on_a_ladder_of_8():
    assert refinement.output_width(np.array([[3, 4], [9, 2]]), 64) == 16
    assert refinement.output_width(np.array([[8]]), 64) == 8
    assert refinement.output_width(np.array([[17]]), 20) == 20  # never past the cap


ALL_DECODERS = {
    "refine": (refinement.refine, dict(max_iterations=3)),
    "mask_predict": (refinement.mask_predict, dict(iterations=2)),
    "adaptive": (refinement.adaptive, dict(tokens_per_step=2)),
}


@pytest.mark.parametrize("name", sorted(ALL_DECODERS))
def test_width_from_lengths_decodes_the_tokens_of_max_width(name):
    decoder, options = ALL_DECODERS[name]
    model = CopyOracle(config=WIDE)
    source = _wide_rows(4, 11, 6)  # width 16 of 24
    params = {"restless": jnp.array([False, True, False])}
    common = dict(num_length_candidates=1, length_offsets=(-1, 0), **options)
    narrow = _decode(decoder, model, params, source, **common)
    wide = _decode(decoder, model, params, source, width=24, **common)
    assert narrow.tokens.shape == (3, 16)
    np.testing.assert_array_equal(narrow.tokens, wide.tokens[:, :16])
    assert np.all(np.asarray(wide.tokens[:, 16:]) == PAD_ID)
    np.testing.assert_array_equal(narrow.passes, wide.passes)
    np.testing.assert_array_equal(narrow.lengths, wide.lengths)
    np.testing.assert_allclose(narrow.scores, wide.scores, atol=1e-6)


def test_each_width_compiles_once():
    model = CopyOracle(config=WIDE)
    params = _calm(2)
    run = functools.partial(_decode, refinement.refine, model, params, num_length_candidates=1,
                            length_offsets=(0,), max_iterations=2)
    run(_wide_rows(3, 5))  # width 8
    before = refinement.refine._cache_size()
    for lengths, width in (((3, 12), 16), ((20, 2), 24), ((4, 7), 8), ((9, 16), 16)):
        source = _wide_rows(*lengths)
        result = run(source)
        assert result.tokens.shape[1] == width
        np.testing.assert_array_equal(result.tokens, source[:, :width])
    assert refinement.refine._cache_size() - before == 2  # widths 16 and 24, once each


def test_read_logits_gives_the_tokens_and_scores_of_a_full_log_softmax():
    logits = jax.random.normal(jax.random.key(0), (3, 5, VOCAB)) * 3.0
    logits = logits.at[0, 0, EOS_ID].set(20.0).at[0, 1, 2].set(20.0)  # EOS, UNK win
    logits = logits.at[1, 0, [EOS_ID, 9]].set(15.0)  # a tie: the lower id wins
    reading = refinement.read_logits(logits)
    log_probs = jax.nn.log_softmax(mask_non_target_ids(logits), axis=-1)
    np.testing.assert_array_equal(reading.prediction, jnp.argmax(log_probs, axis=-1))
    assert int(reading.prediction[0, 0]) == EOS_ID and int(reading.prediction[1, 0]) == EOS_ID
    best_real = jnp.argmax(log_probs[..., NUM_RESERVED:], axis=-1) + NUM_RESERVED
    np.testing.assert_array_equal(reading.best_real, best_real)
    np.testing.assert_allclose(
        reading.best_real_log_prob,
        jnp.take_along_axis(log_probs, best_real[..., None], axis=-1)[..., 0], atol=1e-5)
    np.testing.assert_allclose(reading.eos_log_prob, log_probs[..., EOS_ID], atol=1e-5)


def _loop_body_ops(compiled_text: str, op: str) -> int:
    """How many `op` instructions (e.g. "dot") XLA runs inside the (only) while loop of a
    compiled computation."""
    computations, current = {}, None
    for line in compiled_text.split("\n"):
        header = re.match(r"^(?:ENTRY )?(%[\w.\-]+) \(", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif current is not None:
            current.append(line)

    def dots(name, seen):
        count = 0
        for line in computations.get(name, []):
            count += f" {op}(" in line
            for called in re.findall(r"(?:calls|body|condition|to_apply)=(%[\w.\-]+)", line):
                if called not in seen:
                    seen.add(called)
                    count += dots(called, seen)
        return count

    [body] = re.findall(r" while\(.*body=(%[\w.\-]+)", compiled_text)
    return dots(body, set())


def test_a_pass_recomputes_nothing_that_is_fixed_across_passes(trained):
    """Cross-attention keys/values and the positional attention weights depend on the
    encoder output and the (fixed) lengths only: XLA hoists them out of the loop."""
    model, params, _ = trained
    candidates = refinement.predict_candidates(
        model, params, BATCH["source"], num_length_candidates=1, length_offsets=(0,))
    compiled = refinement.refine.lower(
        model, params, candidates, width=MAX_LEN, max_iterations=2).compile().as_text()
    # Per layer: self-attention q, k, v, scores, mix, out (6); positional attention v, mix,
    # out (3); cross-attention q, scores, mix, out (4); MLP (2). Then the output projection.
    assert _loop_body_ops(compiled, "dot") == 15 * CONFIG.num_decoder_layers + 1
    # Softmaxes: self- and cross-attention per layer, then the one exp-sum over the vocabulary.
    assert _loop_body_ops(compiled, "exponential") == 2 * CONFIG.num_decoder_layers + 1


# --- shortlists (model/decoding/shortlist.py) -----------------------------------------------------


def test_read_logits_over_a_shortlist_reads_the_full_logits_restricted_to_it():
    logits = jax.random.normal(jax.random.key(1), (3, 5, VOCAB)) * 3.0
    vocab_ids = jnp.asarray(np.union1d(np.arange(NUM_RESERVED), [7, 11, 12, 30]), jnp.int32)
    outside = jnp.ones(VOCAB, bool).at[vocab_ids].set(False)
    restricted = refinement.read_logits(jnp.where(outside, -1e9, logits))
    reading = refinement.read_logits(logits[..., vocab_ids], vocab_ids)
    for field in ("prediction", "best_real"):
        np.testing.assert_array_equal(getattr(reading, field), getattr(restricted, field))
    assert set(np.unique(reading.best_real)) <= {7, 11, 12, 30}
    for field in ("best_real_log_prob", "eos_log_prob"):
        np.testing.assert_allclose(getattr(reading, field), getattr(restricted, field),
                                   atol=1e-5)


@pytest.mark.parametrize("name", sorted(ALL_DECODERS))
def test_a_shortlist_holding_the_answer_decodes_the_tokens_of_all_ids(name):
    decoder, options = ALL_DECODERS[name]
    model = CopyOracle(config=WIDE)
    source = _wide_rows(4, 11, 6)
    params = {"restless": jnp.array([False, True, False])}
    # The restless row's shifted copies are answers too: keep every id it can emit.
    shifted = FIRST_REAL + (np.asarray(source) - FIRST_REAL + 1) % (VOCAB - FIRST_REAL)
    vocab_ids = jnp.asarray(np.union1d(np.arange(NUM_RESERVED), np.union1d(source, shifted)),
                            jnp.int32)
    assert len(vocab_ids) < VOCAB
    common = dict(num_length_candidates=1, length_offsets=(-1, 0), **options)
    full = _decode(decoder, model, params, source, **common)
    short = _decode(decoder, model, params, source, vocab_ids=vocab_ids, **common)
    for field in ("tokens", "passes", "lengths"):
        np.testing.assert_array_equal(getattr(short, field), getattr(full, field))
    np.testing.assert_allclose(short.scores, full.scores, atol=1e-5)


def test_a_trained_model_decodes_only_shortlisted_ids(trained):
    model, params, _ = trained
    every = jnp.arange(VOCAB, dtype=jnp.int32)
    run = functools.partial(_decode, refinement.refine, model, params, BATCH["source"],
                            num_length_candidates=1, length_offsets=(0,), max_iterations=4)
    full, same = run(), run(vocab_ids=every)  # the real output layer, over a shortlist
    np.testing.assert_array_equal(same.tokens, full.tokens)
    np.testing.assert_allclose(same.scores, full.scores, atol=1e-5)
    missing = np.unique(np.asarray(full.tokens)[:, 0])  # every first word of the answers
    vocab_ids = jnp.asarray(np.setdiff1d(np.arange(VOCAB), missing), jnp.int32)
    short = run(vocab_ids=vocab_ids)
    assert not np.any(np.isin(np.asarray(short.tokens)[:, 0], missing))
    assert np.all(np.isin(np.asarray(short.tokens), vocab_ids))


# --- length candidates rescored by an AR model ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class LengthJudge:
    """A stand-in `Rescorer` that likes one length per sentence: every token of a candidate
    of length L gets log-probability -|L - liked|, `liked` being params["liked"][b]."""

    def encode(self, params, source):
        return params["liked"][:, None] * jnp.ones_like(source), source != PAD_ID

    def target_log_probs(self, params, encoded, memory_mask, targets):
        lengths = jnp.sum(targets != PAD_ID, axis=1, keepdims=True)  # [N, 1]
        log_probs = -jnp.abs(lengths - encoded[:, :1]).astype(jnp.float32)  # [N, 1]
        return jnp.where(targets != PAD_ID, log_probs, 0.0)  # [N, T]


def _rescored(model, params, rescorer, rescorer_params, source, *, num_length_candidates,
              length_offsets, **options):
    """Both calls of `refine_rescored`, as the Translator makes them."""
    candidates = refinement.predict_candidates(
        model, params, source, num_length_candidates=num_length_candidates,
        length_offsets=length_offsets, max_len=model.config.max_target_len)
    rescoring = refinement.Rescoring(candidates, rescorer.encode(rescorer_params, source))
    width = refinement.output_width(rescoring.lengths, model.config.max_target_len)
    return refinement.refine_rescored(model, params, rescorer, rescorer_params, rescoring,
                                      width=width, **options)


def test_rescoring_keeps_the_candidate_the_rescorer_scores_best():
    # The oracle's own score prefers the reference lengths 3, 6, 8; the judge wants 4, 5, 7.
    liked = {"liked": jnp.array([4, 5, 7])}
    result = _rescored(ORACLE, _calm(3), LengthJudge(), liked, REFERENCE,
                       num_length_candidates=1, length_offsets=(-1, 0, 1), max_iterations=4)
    np.testing.assert_array_equal(result.lengths, [4, 5, 7])
    np.testing.assert_allclose(result.scores, 0.0)  # the judge's score of its choice
    _assert_valid(result.tokens, result.lengths)
    np.testing.assert_array_equal(result.passes, [3, 3, 3])  # 2 refinement passes + scoring
    # Each chosen row is the refinement of that candidate length.
    for row, (source, length) in enumerate(zip(REFERENCE, [4, 5, 7])):
        logits_fn = _oracle_logits_fn(_calm(1), source[None], MAX_LEN)
        lengths = jnp.array([length])
        state = refinement.refine_loop(logits_fn, masked_hypothesis(lengths, MAX_LEN),
                                       lengths, 4)
        np.testing.assert_array_equal(result.tokens[row], state.tokens[0][:MAX_LEN])


def test_rescoring_picks_the_teachers_most_likely_candidate(trained):
    """With a real AR model: the choice is the argmax of its mean log-probability over the
    refined candidates, each refined as `refine` refines it alone."""
    model, params, lengths = trained
    teacher = ARModel(CONFIG, VOCAB)  # untrained: it disagrees with the student's own scores
    teacher_params = jax.jit(teacher.init)(jax.random.key(0), BATCH)
    source = BATCH["source"]
    result = _rescored(model, params, teacher, teacher_params, source,
                       num_length_candidates=2, length_offsets=(-1, 0, 1), max_iterations=4)
    candidates = refinement.predict_candidates(model, params, source, num_length_candidates=1,
                                               length_offsets=(0,))
    log_probs = jax.jit(teacher.target_log_probs)
    scores, tokens = [], []
    for column in range(lengths.shape[1]):  # candidate c of every sentence, alone
        alone = candidates.replace(lengths=jnp.asarray(lengths[:, column:column + 1]))
        refined = refinement.refine(model, params, alone, width=MAX_LEN,
                                    max_iterations=4).tokens  # [B, T]
        total = jnp.sum(log_probs(teacher_params, *teacher.encode(teacher_params, source),
                                  refined), axis=1)
        scores.append(np.asarray(total) / lengths[:, column])
        tokens.append(np.asarray(refined))
    best = np.argmax(np.stack(scores, axis=1), axis=1)  # [B]; ties: the first
    rows = np.arange(len(best))
    np.testing.assert_array_equal(result.tokens, np.stack(tokens, axis=1)[rows, best])
    np.testing.assert_allclose(result.scores, np.stack(scores, axis=1)[rows, best], atol=1e-5)
    own = _decode(refinement.refine, model, params, source, num_length_candidates=2,
                  length_offsets=(-1, 0, 1), max_iterations=4)
    assert np.any(np.asarray(result.lengths) != np.asarray(own.lengths))  # the teacher chose


def test_rescoring_one_candidate_gives_refines_output(trained):
    model, params, _ = trained
    teacher = ARModel(CONFIG, VOCAB)
    teacher_params = jax.jit(teacher.init)(jax.random.key(5), BATCH)
    common = dict(num_length_candidates=1, length_offsets=(0,), max_iterations=4)
    plain = _decode(refinement.refine, model, params, BATCH["source"], **common)
    rescored = _rescored(model, params, teacher, teacher_params, BATCH["source"], **common)
    np.testing.assert_array_equal(rescored.tokens, plain.tokens)
    np.testing.assert_array_equal(rescored.lengths, plain.lengths)
    np.testing.assert_array_equal(rescored.passes, plain.passes + 1)
