"""Tests for model/noising.py."""

import jax
import jax.numpy as jnp
import numpy as np

from components.tokenizer import EOS_ID, MASK_ID, PAD_ID
from model import noising
from model.noising import noise_targets

VOCAB = 1000
FIRST_REAL = 6


def _targets(batch: int, length: int, seed: int = 0) -> jax.Array:
    """Random real pieces, EOS at a random length, pads after. int32[batch, length]."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(FIRST_REAL, VOCAB, size=(batch, length))
    lengths = rng.integers(1, length + 1, size=batch)
    positions = np.arange(length)[None, :]
    ids = np.where(positions == (lengths - 1)[:, None], EOS_ID, ids)
    ids = np.where(positions >= lengths[:, None], PAD_ID, ids)
    return jnp.asarray(ids, jnp.int32)


def _noise(key: int, targets: jax.Array, **kwargs):
    return jax.jit(
        lambda rng, t: noise_targets(rng, t, vocab_size=VOCAB, first_real_id=FIRST_REAL, **kwargs)
    )(jax.random.key(key), targets)


def test_deterministic_under_the_key_and_different_across_keys():
    targets = _targets(16, 12)
    ids_a, mask_a = _noise(3, targets)
    ids_b, mask_b = _noise(3, targets)
    ids_c, mask_c = _noise(4, targets)
    np.testing.assert_array_equal(ids_a, ids_b)
    np.testing.assert_array_equal(mask_a, mask_b)
    assert not np.array_equal(mask_a, mask_c)
    assert not np.array_equal(ids_a, ids_c)


def test_eos_and_pad_never_noised():
    targets = _targets(256, 16)
    ids, mask = _noise(0, targets)
    special = (targets == EOS_ID) | (targets == PAD_ID)
    assert not np.any(np.asarray(mask)[np.asarray(special)])
    np.testing.assert_array_equal(np.asarray(ids)[special], np.asarray(targets)[special])
    # Outside the noised positions nothing changes.
    kept = ~np.asarray(mask)
    np.testing.assert_array_equal(np.asarray(ids)[kept], np.asarray(targets)[kept])


def test_rates_match_80_10_10_and_ratio_is_uniform():
    targets = _targets(2048, 32)
    ids, mask = map(np.asarray, _noise(1, targets))
    targets = np.asarray(targets)
    eligible = (targets != EOS_ID) & (targets != PAD_ID)
    noised = mask.sum()
    masked = (mask & (ids == MASK_ID)).sum() / noised
    randomised = (mask & (ids != MASK_ID) & (ids != targets)).sum() / noised
    kept = (mask & (ids == targets)).sum() / noised
    assert abs(masked - 0.8) < 0.01, masked
    # A random piece equals the original with probability 1/994: negligible.
    assert abs(randomised - 0.1) < 0.01, randomised
    assert abs(kept - 0.1) < 0.01, kept
    # r ~ U(0, 1) per example: on average half of the eligible tokens are noised.
    assert abs(noised / eligible.sum() - 0.5) < 0.03
    # ...and the per-example ratio spans the whole range.
    per_example = mask.sum(1) / np.maximum(eligible.sum(1), 1)
    long_rows = eligible.sum(1) >= 20
    assert per_example[long_rows].min() < 0.1 and per_example[long_rows].max() > 0.9


def test_random_pieces_only_from_real_range():
    targets = _targets(512, 32)
    ids, mask = map(np.asarray, _noise(2, targets, mask_prob=0.0, random_prob=1.0))
    pieces = ids[mask]
    assert pieces.size > 1000
    assert pieces.min() >= FIRST_REAL and pieces.max() < VOCAB
    # Uniform over the range: both ends are reached.
    assert pieces.min() < FIRST_REAL + 20 and pieces.max() > VOCAB - 20


def test_draft_block_keeps_a_gold_prefix_then_a_masked_block_and_nothing_after():
    targets = _targets(4096, 24)
    hypothesis, start = map(np.asarray, noising.draft_block(jax.random.key(3), targets, 4))
    targets = np.asarray(targets)
    tokens = (targets != PAD_ID).sum(1)
    assert (start >= 0).all() and (start < tokens).all()
    positions = np.arange(targets.shape[1])[None, :]
    prefix = positions < start[:, None]
    block = ~prefix & (positions < start[:, None] + 4)
    np.testing.assert_array_equal(hypothesis[prefix], targets[prefix])
    assert (hypothesis[block] == MASK_ID).all()
    assert (hypothesis[~prefix & ~block] == PAD_ID).all()
    # Uniform over the n tokens (EOS counted): the prefix is about half of them.
    assert abs(((start + 0.5) / tokens).mean() - 0.5) < 0.03
