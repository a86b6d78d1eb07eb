"""Tests for model/transformer.py (tiny configs, random weights)."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.config import ModelConfig
from components.tokenizer import BOS_ID, EOS_ID, LENGTH_ID, MASK_ID, PAD_ID
from model.transformer import (
    ARTransformer,
    Dropout,
    PaDIRTransformer,
    argmax_ids,
    argmax_last,
    best_target_logit,
    mask_non_target_ids,
    max_and_argmax,
    project_on_table,
    shift_right,
    sum_exp,
    top_k_last,
)

VOCAB = 50
CONFIG = ModelConfig(
    d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, mlp_dim=64,
    dropout_rate=0.1, max_source_len=10, max_target_len=8,
)
SOURCE = jnp.array([[7, 8, 9, 10, EOS_ID, 0], [11, 12, EOS_ID, 0, 0, 0]], jnp.int32)
TARGET = jnp.array([[13, 14, 15, EOS_ID, 0, 0], [16, EOS_ID, 0, 0, 0, 0]], jnp.int32)
ALLOWED_AXES = {"vocab", "embed", "mlp", "heads", "kv", "length"}


# Tests call jitted functions: one compilation is much cheaper than op-by-op dispatch.
@functools.partial(jax.jit, static_argnames=("module", "deterministic"))
def forward(module, params, source, target, deterministic=True, dropout_seed=0):
    rngs = {"dropout": jax.random.key(dropout_seed)}
    return module.apply({"params": params}, source, target, deterministic, rngs=rngs)


@pytest.fixture(scope="module")
def padir():
    module = PaDIRTransformer(CONFIG, VOCAB)
    params = jax.jit(module.init)(jax.random.key(0), SOURCE, TARGET)["params"]
    return module, nn.unbox(params), params


@pytest.fixture(scope="module")
def ar():
    module = ARTransformer(CONFIG, VOCAB)
    return module, nn.unbox(jax.jit(module.init)(jax.random.key(0), SOURCE, TARGET)["params"])


def test_every_parameter_has_logical_axis_names(padir):
    _, _, boxed = padir
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
        assert set(leaf.names) <= ALLOWED_AXES


def test_helpers():
    np.testing.assert_array_equal(shift_right(TARGET)[:, 0], [BOS_ID, BOS_ID])
    np.testing.assert_array_equal(shift_right(TARGET)[:, 1:], TARGET[:, :-1])
    logits = jnp.zeros((2, VOCAB)).at[:, PAD_ID].set(5.0).at[:, MASK_ID].set(4.0).at[:, 9].set(1.0)
    np.testing.assert_array_equal(argmax_ids(logits), [9, 9])
    assert mask_non_target_ids(logits)[0, LENGTH_ID] < -1e8


def test_argmax_last_is_jnp_argmax_ties_included():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(5, 7, 40)).astype(np.float32)  # many ties
    x[0, 0] = -1e9  # all equal, as masked logits
    np.testing.assert_array_equal(jax.jit(argmax_last)(x), np.argmax(x, axis=-1))
    assert argmax_last(x).dtype == jnp.int32


@pytest.mark.parametrize("size", [40, 64, 4000, 4096, 8000, 127])
def test_max_and_argmax_is_max_and_jnp_argmax_across_blocks(size):
    """Ties inside a block, across blocks and in the last block go to the lowest index; a
    size with no block divisor (127) is padded."""
    rng = np.random.default_rng(size)
    x = rng.integers(-4, 4, size=(7, size)).astype(np.float32)
    x[1, -1] = 9.0  # the max alone in the last block
    x[2, [5, size // 2, size - 1]] = 9.0  # tied across blocks: the first wins
    x[3] = -1e9  # all equal, as masked logits
    top, index = jax.jit(max_and_argmax)(x)
    np.testing.assert_array_equal(index, np.argmax(x, axis=-1))
    np.testing.assert_array_equal(top, np.max(x, axis=-1))
    assert index.dtype == jnp.int32 and index[1] == size - 1 and index[2] == 5


@pytest.mark.parametrize("size,k", [(32000, 4), (16000, 4), (127, 3), (40, 1), (200, 8)])
def test_top_k_last_is_lax_top_k(size, k):
    """The k largest from the k blocks with the largest maxima: the values of
    `jax.lax.top_k`, and its indices where the values are distinct; k of at least the
    blocks (200 / 50 = 4 < 8) falls back to it."""
    rng = np.random.default_rng(size)
    x = rng.normal(size=(6, size)).astype(np.float32)
    x[1, :k] = 5.0 + np.arange(k)  # the k largest in the first block
    x[2, -1], x[2, size // 2] = 7.0, 6.0  # in the last block and the middle
    values, index = jax.jit(top_k_last, static_argnums=1)(x, k)
    expected_values, expected_index = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(values, expected_values)
    np.testing.assert_array_equal(index, expected_index)
    assert index.dtype == jnp.int32


def test_max_and_argmax_and_sum_exp_leave_the_excluded_ids_out():
    x = np.random.default_rng(0).normal(size=(4, 3, 4000)).astype(np.float32)
    x[0, :, PAD_ID] = 50.0  # an excluded id far above the rest: never chosen, never summed
    x[1, :, MASK_ID] = 3.0
    x[1, :, 3999] = 3.0  # tied with an excluded id: the kept one wins
    excluded = (PAD_ID, BOS_ID, MASK_ID, LENGTH_ID)
    masked = np.where(np.isin(np.arange(4000), excluded), -np.inf, x)
    top, index = jax.jit(max_and_argmax, static_argnums=1)(x, excluded)
    np.testing.assert_array_equal(index, np.argmax(masked, axis=-1))
    np.testing.assert_array_equal(top, np.max(masked, axis=-1))
    total = jax.jit(sum_exp, static_argnums=2)(x, top, excluded)
    np.testing.assert_allclose(total, np.sum(np.exp(masked - top[..., None]), axis=-1),
                               rtol=1e-5)
    assert np.all(np.isfinite(total))
    np.testing.assert_array_equal(argmax_ids(x), np.argmax(masked, axis=-1))


def test_best_target_logit_is_the_max_of_the_masked_logits():
    x = np.random.default_rng(0).normal(size=(3, 4, VOCAB)).astype(np.float32)
    x[0, :, [PAD_ID, BOS_ID, MASK_ID, LENGTH_ID]] = 9.0  # control ids hold the largest logit
    x[1, :, EOS_ID] = 8.0  # a target id below the control ids holds it
    np.testing.assert_array_equal(jax.jit(best_target_logit)(x),
                                  jnp.max(mask_non_target_ids(x), axis=-1))


def test_project_on_table_has_the_gradient_of_a_plain_matmul():
    y = jax.random.normal(jax.random.key(0), (2, 3, 8))
    table = jax.random.normal(jax.random.key(1), (VOCAB, 8))
    cotangent = jax.random.normal(jax.random.key(2), (2, 3, VOCAB))

    def pulled_back(project):
        return jax.vjp(project, y, table)[1](cotangent)

    ours, plain = pulled_back(project_on_table), pulled_back(lambda a, b: a @ b.T)
    np.testing.assert_allclose(project_on_table(y, table), y @ table.T, rtol=1e-6)
    for got, expected in zip(ours, plain):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_padir_output_shapes_and_length_classifier(padir):
    module, params, _ = padir
    logits, length_logits = forward(module, params, SOURCE, TARGET)
    assert logits.shape == (2, 6, VOCAB) and logits.dtype == jnp.float32
    assert length_logits.shape == (2, CONFIG.max_target_len)
    encoded, memory_mask = module.apply({"params": params}, SOURCE, method=module.encode)
    assert encoded.shape == (2, 7, CONFIG.d_model)
    np.testing.assert_array_equal(memory_mask[:, 0], [False, False])
    np.testing.assert_array_equal(memory_mask[:, 1:], SOURCE != PAD_ID)


def test_padir_takes_max_source_len_plus_length_token(padir):
    module, params, _ = padir
    longest = jnp.ones((1, CONFIG.max_source_len), jnp.int32)
    module.apply({"params": params}, longest, TARGET[:1])
    with pytest.raises(ValueError, match="max_source_len"):
        module.apply({"params": params}, jnp.ones((1, CONFIG.max_source_len + 1), jnp.int32),
                     TARGET[:1])


def test_length_position_excluded_from_cross_attention(padir):
    module, params, _ = padir
    encoded, memory_mask = module.apply({"params": params}, SOURCE, method=module.encode)

    @jax.jit
    def decode(enc):
        return module.apply({"params": params}, enc, memory_mask, TARGET, method=module.decode)

    noise = 10.0 * jax.random.normal(jax.random.key(1), encoded[:, :1].shape)
    valid = np.asarray(TARGET != PAD_ID)  # pad queries attend uniformly; they carry no loss
    reference = np.asarray(decode(encoded))[valid]
    # Whatever the encoder puts at the [LENGTH] position, the decoder cannot see it...
    moved = np.asarray(decode(encoded.at[:, :1].set(noise)))[valid]
    np.testing.assert_allclose(moved, reference, atol=1e-5)
    # ...while it does see a real source position.
    moved = np.asarray(decode(encoded.at[:, 1:2].set(noise)))[valid]
    assert not np.allclose(moved, reference, atol=1e-3)


def test_padir_decoder_is_bidirectional_and_ignores_pads(padir):
    module, params, _ = padir

    def logits(source, hypothesis):
        return forward(module, params, source, hypothesis)[0]

    reference = logits(SOURCE, TARGET)
    # Changing the last real token changes the logits at position 0 (no causal mask).
    changed = logits(SOURCE, TARGET.at[0, 2].set(30))
    assert not np.allclose(changed[0, 0], reference[0, 0], atol=1e-4)
    # Extra padding on either side leaves the real positions unchanged.
    padded = logits(jnp.pad(SOURCE, ((0, 0), (0, 2))), jnp.pad(TARGET, ((0, 0), (0, 2))))
    valid = np.asarray(TARGET != PAD_ID)
    np.testing.assert_allclose(
        np.asarray(padded[:, :6])[valid], np.asarray(reference)[valid], atol=1e-5
    )


def test_positional_attention_switch(padir):
    module, params, _ = padir
    hypothesis = jnp.where(TARGET == EOS_ID, EOS_ID, jnp.where(TARGET == PAD_ID, PAD_ID, MASK_ID))
    without = PaDIRTransformer(dataclasses.replace(CONFIG, positional_attention=False), VOCAB)
    params_without = jax.eval_shape(without.init, jax.random.key(0), SOURCE, TARGET)["params"]
    assert "positional_attention" in params["decoder"]["layer_0"]
    assert "positional_attention" not in params_without["decoder"]["layer_0"]
    # Same weights for everything the two variants share: only the sublayer differs.
    on = forward(module, params, SOURCE, hypothesis)[0]
    off = forward(without, params, SOURCE, hypothesis)[0]
    assert not np.allclose(on, off, atol=1e-3)


def test_dropout_only_when_not_deterministic(padir):
    module, params, _ = padir

    def run(seed, deterministic):
        return forward(module, params, SOURCE, TARGET, deterministic, seed)[0]

    np.testing.assert_array_equal(run(0, True), run(1, True))
    np.testing.assert_array_equal(run(0, False), run(0, False))
    assert not np.allclose(run(0, False), run(1, False))


@pytest.mark.parametrize("width", [256, 130])  # a width that is no multiple of 4, too
def test_byte_dropout_drops_the_rounded_rate_and_rescales_the_rest(width):
    x = jnp.ones((64, 32, width))
    dropout = Dropout(0.1)
    y = np.asarray(dropout.apply({}, x, False, rngs={"dropout": jax.random.key(0)}))
    kept = y != 0
    np.testing.assert_array_equal(y[kept], np.float32(256 / 230))  # rate 0.1 -> 26/256
    assert abs(1 - kept.mean() - 26 / 256) < 0.005  # 524,288 (or 266,240) draws
    # Each of a word's four bytes decides its own element: no pattern along the width.
    for lane in range(4):
        assert abs(1 - kept[..., lane::4].mean() - 26 / 256) < 0.01
    again = dropout.apply({}, x, False, rngs={"dropout": jax.random.key(0)})
    np.testing.assert_array_equal(y, again)
    other = dropout.apply({}, x, False, rngs={"dropout": jax.random.key(1)})
    assert not np.array_equal(y, other)
    np.testing.assert_array_equal(dropout.apply({}, x, True), x)
    np.testing.assert_array_equal(Dropout(0.001).apply({}, x, False), x)


def test_ar_decoder_is_causal(ar):
    module, params = ar
    reference = forward(module, params, SOURCE, TARGET)
    changed = forward(module, params, SOURCE, TARGET.at[0, 2].set(30))
    # Target 2 is the input at position 3: positions 0..2 are unaffected, 3 is not.
    np.testing.assert_allclose(changed[0, :3], reference[0, :3], atol=1e-5)
    assert not np.allclose(changed[0, 3], reference[0, 3], atol=1e-4)


def test_ar_kv_cache_matches_full_sequence(ar):
    module, params = ar
    target = jnp.array([[13, 14, 15, 16, 17, EOS_ID], [18, 19, 20, 21, 22, 23]], jnp.int32)
    full = forward(module, params, SOURCE, target)  # [B, T, V]
    encoded, memory_mask = module.apply({"params": params}, SOURCE, method=module.encode)
    inputs = shift_right(target)
    _, variables = module.apply(
        {"params": params}, encoded, memory_mask, inputs, decode=True,
        method=module.decode, mutable=["cache"],
    )
    cache = jax.tree.map(jnp.zeros_like, variables["cache"])

    @jax.jit
    def step(cache, ids):
        logits, variables = module.apply(
            {"params": params, "cache": cache}, encoded, memory_mask, ids,
            decode=True, method=module.decode, mutable=["cache"],
        )
        return logits[:, 0], variables["cache"]

    steps = []
    for i in range(target.shape[1]):
        logits, cache = step(cache, inputs[:, i : i + 1])
        steps.append(logits)
    np.testing.assert_allclose(jnp.stack(steps, axis=1), full, atol=1e-5)


def test_bfloat16_compute_keeps_float32_params_and_logits(padir):
    _, params, _ = padir
    module = PaDIRTransformer(dataclasses.replace(CONFIG, dtype="bfloat16"), VOCAB)
    shapes = jax.eval_shape(module.init, jax.random.key(0), SOURCE, TARGET)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nn.unbox(shapes)))
    logits, length_logits = forward(module, params, SOURCE, TARGET)
    assert logits.dtype == jnp.float32 and length_logits.dtype == jnp.float32
    reference = forward(PaDIRTransformer(CONFIG, VOCAB), params, SOURCE, TARGET)[0]
    np.testing.assert_allclose(logits, reference, atol=0.3)
