"""Tests for model/models.py: the shared interface, and tiny models that overfit a few pairs."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.tokenizer import EOS_ID, MASK_ID, NUM_RESERVED, PAD_ID
from model.decoding import beam_search
from model.losses import LossSettings
from model.models import (ARModel, DrafterModel, PaDIRModel, masked_hypothesis,
                          truncate_after_eos)
from model.transformer import mask_non_target_ids
from tiny_models import BATCH, CONFIG, FIRST_REAL, VOCAB, memorised_padir, train


def test_helpers():
    hypothesis = masked_hypothesis(jnp.array([1, 3]), 4)
    np.testing.assert_array_equal(hypothesis, [[EOS_ID, 0, 0, 0], [MASK_ID, MASK_ID, EOS_ID, 0]])
    ids = jnp.array([[7, EOS_ID, 8, EOS_ID], [7, 8, 9, 10]])
    np.testing.assert_array_equal(truncate_after_eos(ids), [[7, EOS_ID, 0, 0], [7, 8, 9, 10]])


@pytest.mark.parametrize("model", [ARModel(CONFIG, VOCAB), PaDIRModel(CONFIG, VOCAB, FIRST_REAL),
                                   DrafterModel(CONFIG, VOCAB, 3)])
def test_init_by_shape_and_logical_axes(model):
    shapes = jax.eval_shape(model.init, jax.random.key(0), BATCH)
    axes = model.logical_axes(BATCH)
    assert jax.tree.structure(shapes) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for shape, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(
            axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        assert len(spec) == len(shape.shape)
    # The shapes of a real init, without any LogicallyPartitioned box left.
    params = jax.jit(model.init)(jax.random.key(0), BATCH)
    assert not any(isinstance(x, nn.LogicallyPartitioned) for x in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)))
    assert jax.tree.map(lambda x: x.shape, params) == jax.tree.map(lambda x: x.shape, shapes)


@pytest.fixture(scope="module")
def ar_trained():
    model = ARModel(CONFIG, VOCAB, label_smoothing=0.0)
    params = train(model, jax.jit(model.init)(jax.random.key(0), BATCH), 150)
    return model, params


@pytest.fixture(scope="module")
def padir_trained():
    return memorised_padir()


def test_ar_overfits_and_decodes_its_targets(ar_trained):
    model, params = ar_trained
    loss, metrics = jax.jit(model.loss_fn)(params, BATCH, jax.random.key(2))
    assert set(metrics) == {"loss", "weights", "tokens", "accuracy"}
    assert metrics["weights"] == np.sum(np.asarray(BATCH["target"]) != PAD_ID)
    assert loss < 0.5, loss
    greedy = jax.jit(functools.partial(beam_search.predict_greedy, model))(params, BATCH)
    np.testing.assert_array_equal(greedy, BATCH["target"])
    beam = jax.jit(functools.partial(beam_search.predict_beam, model),
                   static_argnames="beam_size")
    tokens, scores = beam(params, BATCH, beam_size=1, length_penalty=0.6)
    np.testing.assert_array_equal(tokens, greedy)  # finished hypotheses: beam 1 is greedy
    tokens, scores = beam(params, BATCH, beam_size=4, length_penalty=0.6)
    np.testing.assert_array_equal(tokens, BATCH["target"])
    assert np.all(np.asarray(scores) <= 0) and np.all(np.asarray(scores) > -0.5)


def test_padir_overfits_and_predicts_in_one_pass(padir_trained):
    model, params = padir_trained
    loss_fn = jax.jit(model.loss_fn, static_argnames="settings")
    loss, metrics = loss_fn(params, BATCH, jax.random.key(2))
    assert metrics["loss"] / metrics["weights"] < 0.5
    assert metrics["length_accuracy"] == metrics["examples"] == 4
    assert loss < 0.5, loss
    prediction = jax.jit(model.predict_batch)(params, BATCH)
    np.testing.assert_array_equal(prediction, BATCH["target"])
    # Phase 2: both stages and the re-masking path run and are small on a memorised set.
    loss, metrics = loss_fn(params, BATCH, jax.random.key(3),
                            settings=LossSettings(num_passes=2))
    assert {"loss_pass2", "weights_pass2", "accuracy_pass2"} <= set(metrics)
    assert metrics["loss_pass2"] / metrics["weights_pass2"] < 0.5


def test_padir_loss_is_deterministic_under_the_rng(padir_trained):
    model, params = padir_trained
    loss_fn = jax.jit(functools.partial(model.loss_fn, deterministic=False))
    a, _ = loss_fn(params, BATCH, jax.random.key(5))
    b, _ = loss_fn(params, BATCH, jax.random.key(5))
    c, _ = loss_fn(params, BATCH, jax.random.key(6))
    assert a == b and a != c


def test_padir_predict_batch_places_eos_at_the_predicted_length(padir_trained):
    model, params = padir_trained

    @jax.jit
    def run(params, source):
        encoded, memory_mask = model.encode(params, source)
        length_logits = model.length_logits(params, encoded)
        hypothesis = masked_hypothesis(jnp.argmax(length_logits, -1) + 1, 8)
        logits = model.decode_logits(params, encoded, memory_mask, hypothesis)
        # Without a "target" the output is max_target_len wide.
        prediction = model.predict_batch(params, {"source": source})
        return encoded, memory_mask, length_logits, logits, prediction

    encoded, memory_mask, length_logits, logits, prediction = run(params, BATCH["source"])
    assert encoded.shape == (4, 9, CONFIG.d_model) and not np.any(memory_mask[:, 0])
    assert length_logits.shape == (4, CONFIG.max_target_len)
    assert logits.shape == (4, 8, VOCAB) and np.all(np.asarray(logits)[..., MASK_ID] < -1e8)
    assert prediction.shape == (4, CONFIG.max_target_len)
    for row, n in zip(np.asarray(prediction), np.argmax(length_logits, -1) + 1):
        assert row[n - 1] == EOS_ID and np.all(row[n:] == PAD_ID)
        assert np.all(row[: n - 1] != PAD_ID)


def _shortlist_of(targets):
    """The reserved ids and every id of `targets`, sorted (a shortlist's layout)."""
    return jnp.asarray(np.union1d(np.arange(NUM_RESERVED), np.asarray(targets)), jnp.int32)


def test_ar_searches_over_a_shortlist_holding_the_answer_decode_the_same(ar_trained):
    model, params = ar_trained
    encoded, memory_mask = jax.jit(model.encode)(params, BATCH["source"])
    width = BATCH["target"].shape[1]
    vocab_ids = _shortlist_of(BATCH["target"])
    assert len(vocab_ids) < VOCAB
    greedy = jax.jit(functools.partial(beam_search.greedy, model), static_argnums=3)
    np.testing.assert_array_equal(
        greedy(params, encoded, memory_mask, width, vocab_ids), BATCH["target"])
    beam = jax.jit(functools.partial(beam_search.beam, model), static_argnums=(3, 4))
    full_tokens, full_scores = beam(params, encoded, memory_mask, width, 4)
    tokens, scores = beam(params, encoded, memory_mask, width, 4, 0.6, vocab_ids)
    np.testing.assert_array_equal(tokens, full_tokens)
    # Probabilities are renormalised over the shortlist: never lower than over all ids.
    assert np.all(np.asarray(scores) >= np.asarray(full_scores) - 1e-5)


def test_ar_searches_emit_only_shortlisted_ids(ar_trained):
    model, params = ar_trained
    encoded, memory_mask = jax.jit(model.encode)(params, BATCH["source"])
    width = BATCH["target"].shape[1]
    missing = int(BATCH["target"][0, 0])  # the first answer is not in the shortlist
    vocab_ids = np.setdiff1d(np.arange(VOCAB), [missing]).astype(np.int32)
    tokens = jax.jit(functools.partial(beam_search.greedy, model), static_argnums=3)(
        params, encoded, memory_mask, width, jnp.asarray(vocab_ids))
    assert int(tokens[0, 0]) != missing
    assert np.all(np.isin(np.asarray(tokens), vocab_ids))


def test_target_log_probs_are_the_teacher_forced_log_softmax_at_the_targets():
    model = ARModel(CONFIG, VOCAB)
    params = jax.jit(model.init)(jax.random.key(4), BATCH)
    targets = BATCH["target"]
    encoded, memory_mask = model.encode(params, BATCH["source"])
    log_probs = jax.jit(model.target_log_probs)(params, encoded, memory_mask, targets)
    logits = model.module.apply({"params": params}, BATCH["source"], targets)  # [B, T, V]
    full = jax.nn.log_softmax(mask_non_target_ids(logits), axis=-1)
    expected = jnp.take_along_axis(full, targets[..., None], axis=-1)[..., 0]
    non_pad = np.asarray(targets) != PAD_ID
    np.testing.assert_allclose(np.asarray(log_probs)[non_pad], np.asarray(expected)[non_pad],
                               atol=1e-5)
    assert np.all(np.asarray(log_probs)[~non_pad] == 0.0)


def test_blocks_over_the_cache_score_as_one_teacher_forced_pass(ar_trained):
    """Rows advance by blocks of different sizes at their own positions, each block over
    the keys and values the earlier ones left (some written past where the next block
    starts, as a rejected draft leaves them): every position scores as the forced pass."""
    model, params = ar_trained
    encoded, memory_mask = model.encode(params, BATCH["source"])
    target = np.asarray(BATCH["target"])
    forced = np.asarray(model.forced_logits(params, encoded, memory_mask, BATCH["target"]))
    inputs = np.asarray(jnp.concatenate([jnp.full((4, 1), 3), BATCH["target"]], axis=1))
    width = 3
    cache = model.init_block_cache(params, encoded, memory_mask, target.shape[1] + width)
    start = np.zeros(4, np.int32)
    advance = np.array([[1, 3, 2, 3], [2, 1, 3, 1], [3, 3, 3, 3]])  # per round, per row
    block_logits = jax.jit(model.block_logits)
    memory = model.memory(params, encoded, memory_mask)
    for steps in advance:
        at = start[:, None] + np.arange(width)
        logits, cache = block_logits(params, memory, memory_mask,
                                     jnp.asarray(np.take_along_axis(inputs, at, axis=1)),
                                     jnp.asarray(start), cache)
        for row in range(4):
            for i in range(steps[row]):
                position = start[row] + i
                if target[row, position] == PAD_ID:
                    continue
                np.testing.assert_allclose(mask_non_target_ids(logits[row, i]),
                                           forced[row, position], rtol=1e-4, atol=1e-4)
        start = start + steps


def test_the_drafter_learns_the_block_after_any_prefix():
    model = DrafterModel(CONFIG, VOCAB, 3, label_smoothing=0.0)
    params = train(model, jax.jit(model.init)(jax.random.key(0), BATCH), 400)
    _, metrics = model.loss_fn(params, BATCH, jax.random.key(5), deterministic=True)
    # One block a row, cut at the target's end: at most 3 weighted tokens each.
    assert 4 <= metrics["weights"] <= 12
    assert metrics["accuracy"] == metrics["weights"]
    target = np.asarray(BATCH["target"])
    encoded, memory_mask = model.encode(params, BATCH["source"])
    memory = model.memory(params, encoded, memory_mask)
    for n in range(4):
        drafted = model.draft(params, memory, memory_mask, BATCH["target"],
                              jnp.full((4,), n, jnp.int32))
        expected = np.concatenate([target, np.zeros((4, 3), np.int32)], axis=1)[:, n:n + 3]
        content = expected != PAD_ID
        np.testing.assert_array_equal(np.asarray(drafted)[content], expected[content])
    # Its own translation, block by block with nothing verified: the memorised targets.
    np.testing.assert_array_equal(jax.jit(model.predict_batch)(params, BATCH), target)
