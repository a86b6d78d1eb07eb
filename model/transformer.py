"""The Transformer family (Flax Linen): encoder, PaDIR (non-autoregressive) decoder, AR decoder.

Both models are pre-norm encoder-decoders with RMSNorm, learned absolute position tables,
one token embedding shared by encoder, decoder and the tied output projection, and no
biases in attention or MLP (T5 style).

* `PaDIRTransformer` (the student): a [LENGTH] token is prepended to the source inside the
  model; its encoder output feeds a length classifier with `max_target_len` classes
  (predicted length = class + 1, counting EOS) and it is hidden from cross-attention. The
  decoder attends bidirectionally over the current hypothesis and position i predicts
  target token i (no right shift). With `ModelConfig.positional_attention`, every decoder
  layer also has positional attention: queries and keys are the (RMS-normalised) learned
  position vectors, values the token stream, so position survives an all-[MASK] input.
* `ARTransformer` (the teacher): causal decoder over the target shifted right behind BOS;
  `decode=True` processes one token per call with a KV cache in the `cache` collection,
  and block mode (`start`) a block of tokens per row over its cache (draft and verify's
  verifier); both through `CachedAttention`, whose cache is laid out for XLA's batched
  matmul, as are cross-attention's keys and values of the encoder's output, which a
  decoding loop computes once (`MemoryAttention`, the `memory` collection).
* `DrafterTransformer` (draft and verify's drafter): the teacher's encoder and a NAR
  decoder that fills a block of [MASK]s after a given prefix; no length head.

Shapes: B batch, S source length, T target length, D d_model, V vocab_size.

Logical axis names on parameters (a trainer maps them to mesh axes, e.g. (data, fsdp), with
a rule table; names without a rule are replicated):
  vocab   rows of the shared token embedding (input and tied output)
  embed   model width D (every kernel, norm scale and position table has it)
  mlp     MLP hidden width
  heads   attention heads
  kv      width per head
  length  rows of the position tables; also the length classes of the length classifier
Activations are not annotated.
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from components.config import ModelConfig
from components.tokenizer import BOS_ID, LENGTH_ID, MASK_ID, PAD_ID

# Ids that never occur as a (weighted) target. Decoding never emits them: a PAD inside the
# hypothesis would be read as padding by the next pass, and control ids are inputs only.
NON_TARGET_IDS = (PAD_ID, BOS_ID, MASK_ID, LENGTH_ID)
# Finite, so that masked logits stay NaN-free through softmax and sums.
LOGIT_MASK_VALUE = -1e9

_default_kernel_init = nn.initializers.lecun_normal()


def _named(init_fn: Callable, names: tuple[str, ...]) -> Callable:
    return nn.with_logical_partitioning(init_fn, names)


def shift_right(targets: jax.Array, start_id: int = BOS_ID) -> jax.Array:
    """The AR decoder input: `start_id` then targets[:, :-1]. int32[B, T] -> int32[B, T]."""
    start = jnp.full_like(targets[:, :1], start_id)
    return jnp.concatenate([start, targets[:, :-1]], axis=1)


def _non_target(vocab_size: int) -> jax.Array:
    """bool[V]: True at `NON_TARGET_IDS`."""
    return jnp.zeros(vocab_size, bool).at[jnp.array(NON_TARGET_IDS)].set(True)


def mask_non_target_ids(logits: jax.Array) -> jax.Array:
    """Sets the logits of `NON_TARGET_IDS` to a large negative value. [..., V] -> [..., V]."""
    masked = jnp.asarray(LOGIT_MASK_VALUE, logits.dtype)
    return jnp.where(_non_target(logits.shape[-1]), masked, logits)


def _blocks(x: jax.Array) -> jax.Array:
    """x float[..., V] as blocks [..., NB, W]: W the divisor of V in [16, 128] nearest 64
    (V 4,000: 50; 8,000 and 32,000: 64), so that the blocks are a free reshape; a V with
    no such divisor is padded with -inf to a multiple of 64 (correct, slower)."""
    size = x.shape[-1]
    divisors = [w for w in range(16, 129) if size % w == 0]
    width = min(divisors, key=lambda w: (abs(w - 64), w)) if divisors else min(size, 64)
    pad = -size % width
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    return x.reshape(x.shape[:-1] + (x.shape[-1] // width, width))


def _first_block_kept(width: int, excluded: Sequence[int]) -> np.ndarray:
    """bool[W]: the columns of the first block that are not `excluded` (ids < W)."""
    if any(not 0 <= i < width for i in excluded):
        raise ValueError(f"excluded ids {tuple(excluded)} outside the first block of {width}")
    kept = np.ones(width, bool)
    kept[list(excluded)] = False
    return kept


def max_and_argmax(x: jax.Array, excluded: Sequence[int] = ()) -> tuple[jax.Array, jax.Array]:
    """The max over the last axis, `excluded` ids left out, and its first index
    (`jnp.argmax`'s ties: the lowest). float[..., V] -> (float[...], int32[...]).

    Why not `jnp.argmax`: XLA on CPU lowers it to a scalar loop (over 1,280 x 8,000 logits,
    12x a max), and a max followed by a min of the indices where x equals it writes a
    [..., V] mask (more than the output projection at 1,280 rows). Here two vectorised
    levels read the values once: the max of each block (`_blocks`), the first block holding
    the overall max, the first index inside it. The excluded ids (the reserved ids of a
    vocabulary, all in the first block) are masked on that block alone: a mask over
    [..., V] fused into the reductions costs XLA:CPU 5-15x them. Exact for finite values.
    """
    blocks = _blocks(x)  # [..., NB, W]
    num_blocks, width = blocks.shape[-2:]
    block_max = jnp.max(blocks, axis=-1)  # [..., NB]
    if excluded:
        kept = _first_block_kept(width, excluded)  # [W]
        first = jnp.max(jnp.where(kept, blocks[..., 0, :], -jnp.inf), axis=-1)  # [...]
        block_max = block_max.at[..., 0].set(first)
    top = jnp.max(block_max, axis=-1)  # [...]
    block = jnp.min(jnp.where(block_max == top[..., None],
                              jnp.arange(num_blocks, dtype=jnp.int32), num_blocks),
                    axis=-1)  # [...]: the first block holding the max
    inside = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]  # [..., W]
    if excluded:
        inside = jnp.where(kept | (block[..., None] > 0), inside, -jnp.inf)
    offset = jnp.min(jnp.where(inside == top[..., None], jnp.arange(width, dtype=jnp.int32),
                               width), axis=-1)  # [...]
    return top, block * width + offset


def sum_exp(x: jax.Array, top: jax.Array, excluded: Sequence[int] = ()) -> jax.Array:
    """The sum over the last axis of exp(x - top), `excluded` ids (in the first block, as
    `max_and_argmax`) left out; `top` float[...] at least the max of the rest, so that no
    term overflows (an excluded id above it is dropped before it is added).
    float[..., V] -> float[...]."""
    blocks = _blocks(x)  # [..., NB, W]
    terms = jnp.exp(blocks - top[..., None, None])  # [..., NB, W]
    if not excluded:
        return jnp.sum(terms, axis=(-2, -1))
    kept = _first_block_kept(blocks.shape[-1], excluded)  # [W]
    first = jnp.sum(jnp.where(kept, terms[..., 0, :], 0.0), axis=-1)  # [...]
    return jnp.sum(jnp.sum(terms, axis=-1)[..., 1:], axis=-1) + first


def top_k_last(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)`: the k largest values over the last axis, descending, and
    their indices. float[..., V] -> (float[..., k], int32[..., k]).

    Why not `jax.lax.top_k` over V: on XLA:CPU it costs about a sort of every row (a beam
    of 4 over 4 x 8,000 candidates at 64 sentences: 8 ms a step, as much as the step's
    network). The k largest lie in the k blocks of `_blocks` with the largest maxima (a
    value outside them has k blocks' maxima at least as large above it), so this reads
    the values once for the blocks' maxima and sorts k blocks. Among equal values the
    indices may differ from `jax.lax.top_k`'s, the values not."""
    blocks = _blocks(x)  # [..., NB, W]
    num_blocks, width = blocks.shape[-2:]
    if k >= num_blocks:
        values, index = jax.lax.top_k(x, k)
        return values, index.astype(jnp.int32)
    _, best = jax.lax.top_k(jnp.max(blocks, axis=-1), k)  # [..., k]: the blocks
    chosen = jnp.take_along_axis(blocks, best[..., None], axis=-2)  # [..., k, W]
    values, at = jax.lax.top_k(chosen.reshape(chosen.shape[:-2] + (k * width,)), k)
    block = jnp.take_along_axis(best, at // width, axis=-1)
    return values, (block * width + at % width).astype(jnp.int32)


def argmax_last(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (ties: the lowest index), vectorised (`max_and_argmax`).
    float[..., V] -> int32[...]."""
    return max_and_argmax(x)[1]


def argmax_ids(logits: jax.Array) -> jax.Array:
    """The most likely id among those a target can hold. float[..., V] -> int32[...]."""
    return max_and_argmax(logits, NON_TARGET_IDS)[1]


def best_target_logit(logits: jax.Array) -> jax.Array:
    """The largest logit among the ids a target can hold. float[..., V] -> float[...].

    The same value as the max of `mask_non_target_ids(logits)`, as one reduction of the
    logits plus a [V] penalty row, which XLA fuses: no masked [..., V] copy is written."""
    penalty = jnp.where(_non_target(logits.shape[-1]),
                        jnp.asarray(LOGIT_MASK_VALUE, logits.dtype), 0)
    return jnp.max(logits + penalty, axis=-1)


def _rms_norm(config: ModelConfig, name: str) -> nn.RMSNorm:
    return nn.RMSNorm(
        dtype=config.dtype, scale_init=_named(nn.initializers.ones, ("embed",)), name=name
    )


def _attention(config: ModelConfig, name: str) -> nn.Module:
    # Dropout is applied to residual branches only; attention weights stay un-dropped.
    return nn.MultiHeadDotProductAttention(
        num_heads=config.num_heads,
        qkv_features=config.d_model,
        out_features=config.d_model,
        dtype=config.dtype,
        use_bias=False,
        kernel_init=_named(_default_kernel_init, ("embed", "heads", "kv")),
        out_kernel_init=_named(_default_kernel_init, ("heads", "kv", "embed")),
        name=name,
    )


def _position_table(module: nn.Module, rows: int, d_model: int) -> jax.Array:
    """A learned position table float32[rows, D] owned by `module`."""
    return module.param(
        "pos_embedding",
        _named(nn.initializers.normal(stddev=1.0), ("length", "embed")),
        (rows, d_model),
    )


class Dropout(nn.Module):
    """Dropout drawing one random byte per element where Flax's draws a 32-bit word.

    Generating the random bits (threefry, a rolled loop on CPU) was a fifth of a training
    step on 2 cores; a quarter of the words makes the teacher's and the student's steps
    1.13-1.14x faster (benchmarks/README.md, `train_throughput.py`). The price: the
    rate is rounded to a multiple of 1/256 (0.1 drops 26/256 = 10.2%), and rates under
    1/512 drop nothing.
    """

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        threshold = round(self.rate * 256)  # drop where the byte is below it
        if deterministic or threshold == 0:
            return x
        *leading, width = x.shape
        words = -(-width // 4)
        bits = jax.random.bits(self.make_rng("dropout"), (*leading, words), jnp.uint32)
        random_bytes = jax.lax.bitcast_convert_type(bits, jnp.uint8)  # [..., words, 4]
        random_bytes = random_bytes.reshape(*leading, 4 * words)[..., :width]
        scale = 256 / (256 - threshold)  # 1 / keep probability
        return jnp.where(random_bytes >= threshold, x * scale, 0).astype(x.dtype)


class MlpBlock(nn.Module):
    """Position-wise feed-forward block: Dense(mlp) -> GELU -> dropout -> Dense(embed)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        cfg = self.config
        h = nn.Dense(
            cfg.mlp_dim, use_bias=False, dtype=cfg.dtype, name="wi",
            kernel_init=_named(_default_kernel_init, ("embed", "mlp")),
        )(x)  # [B, L, mlp]
        h = nn.gelu(h)
        h = Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        return nn.Dense(
            cfg.d_model, use_bias=False, dtype=cfg.dtype, name="wo",
            kernel_init=_named(_default_kernel_init, ("mlp", "embed")),
        )(h)  # [B, L, D]


class EncoderLayer(nn.Module):
    """Pre-norm self-attention + MLP."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, deterministic: bool) -> jax.Array:
        """x: [B, S, D]; mask: bool[B, 1, S, S]. Returns [B, S, D]."""
        dropout = Dropout(self.config.dropout_rate)
        h = _rms_norm(self.config, "pre_self_attention_norm")(x)
        h = _attention(self.config, "self_attention")(h, h, mask=mask)
        x = x + dropout(h, deterministic=deterministic)
        h = _rms_norm(self.config, "pre_mlp_norm")(x)
        h = MlpBlock(self.config, name="mlp")(h, deterministic)
        return x + dropout(h, deterministic=deterministic)


class Encoder(nn.Module):
    """Token + position embedding, `num_encoder_layers` layers, final RMSNorm."""

    config: ModelConfig
    shared_embedding: nn.Module
    num_positions: int  # max_source_len, plus one for PaDIR's [LENGTH] token

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool) -> jax.Array:
        """tokens: int32[B, S] (0 = pad). Returns the encoded source [B, S, D]."""
        cfg = self.config
        length = tokens.shape[1]
        if length > self.num_positions:
            raise ValueError(f"source length {length} > {self.num_positions} positions "
                             f"(model.max_source_len {cfg.max_source_len})")
        valid = tokens != PAD_ID  # [B, S]
        positions = _position_table(self, self.num_positions, cfg.d_model)[:length]
        x = self.shared_embedding(tokens) + positions.astype(cfg.dtype)  # [B, S, D]
        x = Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        mask = nn.make_attention_mask(valid, valid)  # [B, 1, S, S]
        for i in range(cfg.num_encoder_layers):
            x = EncoderLayer(cfg, name=f"layer_{i}")(x, mask, deterministic)
        return _rms_norm(cfg, "final_norm")(x)


def _to_heads(config: ModelConfig, name: str) -> nn.DenseGeneral:
    """A query, key or value projection [..., D] -> [..., H, Dh], named and shaped as
    `nn.MultiHeadDotProductAttention`'s, so the cached modules read its parameters."""
    return nn.DenseGeneral(
        features=(config.num_heads, config.d_model // config.num_heads), use_bias=False,
        dtype=config.dtype, kernel_init=_named(_default_kernel_init, ("embed", "heads", "kv")),
        name=name)


def _from_heads(config: ModelConfig) -> nn.DenseGeneral:
    """The output projection [..., H, Dh] -> [..., D] (`nn.MultiHeadDotProductAttention`'s
    `out`)."""
    return nn.DenseGeneral(
        features=config.d_model, axis=(-2, -1), use_bias=False, dtype=config.dtype,
        kernel_init=_named(_default_kernel_init, ("heads", "kv", "embed")), name="out")


def _attend(query: jax.Array, keys: jax.Array, values: jax.Array,
            mask: jax.Array | None) -> jax.Array:
    """`nn.dot_product_attention`'s math over keys and values laid out [B, H, Dh, L]:
    query [B, Q, H, Dh], mask bool broadcastable to [B, H, Q, L]. Returns [B, Q, H, Dh].

    Why this layout: XLA:CPU's batched matmul reads [B, H, Dh, L] as it is, and copies
    Flax's [B, L, H, Dh] into it before every product. In a decoding loop that copy was
    the cached step's largest cost (the cache and the memory's keys and values copied each
    step, 80% of a step at 64 rows); laid out here, the cache is never copied, and the
    memory's keys and values once a batch (`MemoryAttention`)."""
    depth = query.shape[-1]
    query = jnp.swapaxes(query, 1, 2) / jnp.sqrt(depth).astype(query.dtype)  # [B, H, Q, Dh]
    scores = jnp.einsum("bhqd,bhdl->bhql", query, keys)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(values.dtype)
    return jnp.einsum("bhdl,bhql->bqhd", values, weights)


class MemoryAttention(nn.Module):
    """Cross-attention over the encoder's output, its keys and values laid out for
    `_attend`. A decoding loop computes them once (`models.memory`: the `memory`
    collection, written when that collection is mutable) and every call of the loop reads
    them there: XLA hoists a loop-constant projection out of a loop, but not the copy into
    the matmul's layout. The parameters are `nn.MultiHeadDotProductAttention`'s (same
    names, shapes and math), so it reads the trained cross-attention as it is."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, encoded: jax.Array | None,
                 mask: jax.Array) -> jax.Array:
        """x: [B, T, D]; encoded: [B, S, D] (None when the `memory` collection holds the
        keys and values); mask: bool[B, 1, T, S]. Returns [B, T, D]."""
        cfg = self.config
        query = _to_heads(cfg, "query")(x)
        if self.has_variable("memory", "key"):
            keys, values = self.get_variable("memory", "key"), self.get_variable("memory", "value")
        else:
            keys, values = (jnp.transpose(_to_heads(cfg, name)(encoded), (0, 2, 3, 1))
                            for name in ("key", "value"))  # [B, H, Dh, S]
            if self.is_mutable_collection("memory") and not self.is_initializing():
                self.put_variable("memory", "key", keys)
                self.put_variable("memory", "value", values)
        h = _attend(query, keys, values, mask)
        return _from_heads(cfg)(h)  # [B, T, D]


class CachedAttention(nn.Module):
    """Causal self-attention of W new positions per row over a KV cache: row b's
    positions are start[b] .. start[b] + W - 1 (or start .. start + W - 1 for every row);
    their keys and values are written into the cache there, and each query reads the
    cache up to its own position.

    What the cached decoders run: the AR searches a step a call (W = 1, one position for
    every row), draft and verify's verifier a drafted block and one more position per
    row, its prefix's keys and values kept from earlier rounds (model/decoding/
    draft_verify.py): a row whose block was partly rejected simply starts its next block
    earlier, and what was written past it is overwritten or never read. The cache is laid
    out [B, H, Dh, L] (`_attend`). The parameters are `nn.MultiHeadDotProductAttention`'s
    (same names, shapes and math), so it reads the trained self-attention as it is.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, start: jax.Array) -> jax.Array:
        """x: [B, W, D]; start: int32[B] or int32[]. The cache holds L >= max(start) + W
        positions (its first call, which creates it, sees x of L positions). Returns
        [B, W, D]."""
        cfg = self.config
        width = x.shape[1]
        query, key, value = (_to_heads(cfg, name)(x) for name in ("query", "key", "value"))
        key, value = (jnp.transpose(y, (0, 2, 3, 1)) for y in (key, value))  # [B, H, Dh, W]
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape,
                                     value.dtype)
        if start.ndim == 0:
            def write(cache, new):
                return jax.lax.dynamic_update_slice_in_dim(cache, new, start, axis=3)
        else:
            def write(cache, new):
                return jax.vmap(lambda c, n, at: jax.lax.dynamic_update_slice_in_dim(
                    c, n, at, axis=2))(cache, new, start)
        keys = write(cached_key.value, key)  # [B, H, Dh, L]
        values = write(cached_value.value, value)
        cached_key.value, cached_value.value = keys, values
        own = start[..., None] + jnp.arange(width)  # [B, W] or [W]: each query's position
        mask = jnp.arange(keys.shape[-1]) <= own[..., None]  # [B, W, L] or [W, L]
        h = _attend(query, keys, values, mask[..., None, :, :])
        return _from_heads(cfg)(h)  # [B, W, D]


class DecoderLayer(nn.Module):
    """Pre-norm self-attention, [positional attention], cross-attention, MLP.

    Attributes:
      config: the model config.
      positional_attention: add the positional-attention sublayer (PaDIR only).
      cached: self-attention over a KV cache, new positions from `start`
        (`CachedAttention`; AR only).
    """

    config: ModelConfig
    positional_attention: bool = False
    cached: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        encoded: jax.Array,
        self_mask: jax.Array | None,
        cross_mask: jax.Array,
        positions: jax.Array | None,
        deterministic: bool,
        start: jax.Array | None = None,
    ) -> jax.Array:
        """x: [B, T, D]; encoded: [B, S, D]; self_mask: bool[B, 1, T, T] or None (cached
        decoding masks itself); cross_mask: bool[B, 1, T, S]; positions: [B, T, D] (used
        only with positional attention); start: int32[B] or int32[], the first new
        position (cached only). Returns [B, T, D]."""
        cfg = self.config
        dropout = Dropout(cfg.dropout_rate)
        h = _rms_norm(cfg, "pre_self_attention_norm")(x)
        if self.cached:
            h = CachedAttention(cfg, name="self_attention")(h, start)
        else:
            h = _attention(cfg, "self_attention")(h, h, mask=self_mask)
        x = x + dropout(h, deterministic=deterministic)
        if self.positional_attention:
            # Where to read from is decided by position alone; what is read is the tokens.
            q = _rms_norm(cfg, "positional_query_norm")(positions)
            h = _rms_norm(cfg, "pre_positional_attention_norm")(x)
            h = _attention(cfg, "positional_attention")(q, inputs_k=q, inputs_v=h, mask=self_mask)
            x = x + dropout(h, deterministic=deterministic)
        h = _rms_norm(cfg, "pre_cross_attention_norm")(x)
        h = MemoryAttention(cfg, name="cross_attention")(h, encoded, cross_mask)
        x = x + dropout(h, deterministic=deterministic)
        h = _rms_norm(cfg, "pre_mlp_norm")(x)
        h = MlpBlock(cfg, name="mlp")(h, deterministic)
        return x + dropout(h, deterministic=deterministic)


def _output_logits(config: ModelConfig, embedding: nn.Embed, y: jax.Array,
                   vocab_ids: jax.Array | None) -> jax.Array:
    # Tied projection; scaled by D^-1/2 (as T5 does) so unit-variance embeddings give
    # unit-scale logits. The scale multiplies y [..., D], not the logits [..., V]: in
    # training that saves a pass over the logits each way. Logits are float32 whatever the
    # compute dtype. With `vocab_ids` (int32[K], a shortlist: model/decoding/shortlist.py) only
    # those rows of the table are scored.
    table = embedding.embedding
    if vocab_ids is not None:
        table = jnp.take(table, vocab_ids, axis=0)  # [K, D]
    y, table = nn.dtypes.promote_dtype(y * config.d_model**-0.5, table, dtype=config.dtype)
    return project_on_table(y, table).astype(jnp.float32)


@jax.custom_vjp
def project_on_table(y: jax.Array, table: jax.Array) -> jax.Array:
    """y @ table.T: [..., D], [V, D] -> [..., V].

    The usual gradient, with the table's formed as (y^T dz)^T: left to autodiff, XLA on CPU
    forms it as dz^T y and first writes a transposed copy of the [N, V] logits' gradient,
    which costs more than the matmul (measured: the output projection and the loss, forward
    and backward, at 2,048 x 8,000 x 128: 363 ms as autodiff forms it, 235 ms so)."""
    return jnp.dot(y, table.T)


def _project_forward(y, table):
    return jnp.dot(y, table.T), (y, table)


def _project_backward(residuals, d_logits):
    y, table = residuals
    rows = d_logits.reshape(-1, d_logits.shape[-1])  # [N, V]
    d_table = jnp.dot(y.reshape(-1, y.shape[-1]).T, rows).T  # [V, D]
    return jnp.dot(d_logits, table), d_table


project_on_table.defvjp(_project_forward, _project_backward)


class NARDecoder(nn.Module):
    """The PaDIR decoder: bidirectional over the hypothesis, position i predicts target i."""

    config: ModelConfig
    shared_embedding: nn.Embed

    @nn.compact
    def __call__(
        self,
        encoded: jax.Array,
        memory_mask: jax.Array,
        hypothesis: jax.Array,
        deterministic: bool,
        valid: jax.Array | None = None,
        vocab_ids: jax.Array | None = None,
        outputs: jax.Array | None = None,
    ) -> jax.Array:
        """encoded: [B, S, D]; memory_mask: bool[B, S]; hypothesis: int32[B, T] (0 = pad);
        valid: bool[B, T], the non-pad positions (default: computed from `hypothesis`);
        vocab_ids: int32[K], score only these ids (a shortlist; default: all V);
        outputs: int32[B, O], the positions to score (default: all T; the drafter scores
        its block alone, which spares the output projection the prefix's rows).
        Decoding passes `valid` from outside its loop: then the masks, the positional
        attention weights and the cross-attention keys/values depend on loop constants
        only, and XLA computes them once, before the first pass.

        Returns logits float32[B, T, V] (or [B, T, K]; [B, O, ...] with `outputs`) for the
        target at every position.
        """
        cfg = self.config
        batch, length = hypothesis.shape
        if length > cfg.max_target_len:
            raise ValueError(f"target length {length} > max_target_len {cfg.max_target_len}")
        if valid is None:
            valid = hypothesis != PAD_ID  # [B, T]
        table = _position_table(self, cfg.max_target_len, cfg.d_model)[:length]
        positions = jnp.broadcast_to(table.astype(cfg.dtype), (batch, length, cfg.d_model))
        x = self.shared_embedding(hypothesis) + positions  # [B, T, D]
        x = Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        self_mask = nn.make_attention_mask(valid, valid)  # [B, 1, T, T]
        cross_mask = nn.make_attention_mask(valid, memory_mask)  # [B, 1, T, S]
        for i in range(cfg.num_decoder_layers):
            x = DecoderLayer(
                cfg, positional_attention=cfg.positional_attention, name=f"layer_{i}"
            )(x, encoded, self_mask, cross_mask, positions, deterministic)
        if outputs is not None:
            x = jnp.take_along_axis(x, outputs[..., None], axis=1)  # [B, O, D]
        y = _rms_norm(cfg, "final_norm")(x)
        return _output_logits(cfg, self.shared_embedding, y, vocab_ids)  # [B, T, V or K]


class ARDecoder(nn.Module):
    """The causal decoder of the AR teacher, with an optional KV cache."""

    config: ModelConfig
    shared_embedding: nn.Embed

    @nn.compact
    def __call__(
        self,
        encoded: jax.Array,
        memory_mask: jax.Array,
        inputs: jax.Array,
        target_mask: jax.Array | None,
        deterministic: bool,
        decode: bool,
        vocab_ids: jax.Array | None = None,
        start: jax.Array | None = None,
    ) -> jax.Array:
        """encoded: [B, S, D]; memory_mask: bool[B, S]; inputs: int32[B, T] right-shifted
        targets (T = 1 per call when decoding with a filled cache); target_mask: bool[B, T]
        (None = all valid; ignored when decoding); vocab_ids: as `NARDecoder`; start:
        int32[B], block mode (`CachedAttention`): row b's inputs are its positions
        start[b] .. start[b] + T - 1, over the cache of earlier blocks (positions past
        max_target_len read its last position-table row: a caller's cap keeps them out of
        the output).

        Returns logits float32[B, T, V] (or [B, T, K]).
        """
        cfg = self.config
        batch, length = inputs.shape
        table = _position_table(self, cfg.max_target_len, cfg.d_model)
        if length > cfg.max_target_len and start is None:
            raise ValueError(f"target length {length} > max_target_len {cfg.max_target_len}")
        if start is not None:  # each row at its own positions
            at = start[:, None] + jnp.arange(length)  # [B, T]
            positions = jnp.take(table, at, axis=0, mode="clip")  # [B, T, D]
            self_mask = None  # the cached attention masks by position itself
            cross_mask = nn.make_attention_mask(jnp.ones((batch, length), bool), memory_mask)
        elif decode:
            # The first call (cache creation) sees the full length; later calls one token.
            filled = self.has_variable("cache", "position")
            position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
            start = position.value  # int32[]: every row at one position
            if filled:
                position.value = start + 1
                positions = jax.lax.dynamic_slice_in_dim(table, start, 1)  # [1, D]
            else:
                positions = table[:length]
            self_mask = None  # the cached attention masks not-yet-written slots itself
            cross_mask = nn.make_attention_mask(jnp.ones((batch, length), bool), memory_mask)
        else:
            positions = table[:length]
            if target_mask is None:
                target_mask = jnp.ones((batch, length), bool)
            self_mask = nn.combine_masks(
                nn.make_causal_mask(inputs), nn.make_attention_mask(target_mask, target_mask)
            )  # [B, 1, T, T]
            cross_mask = nn.make_attention_mask(target_mask, memory_mask)  # [B, 1, T, S]
        x = self.shared_embedding(inputs) + positions.astype(cfg.dtype)  # [B, T, D]
        x = Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        for i in range(cfg.num_decoder_layers):
            x = DecoderLayer(cfg, cached=start is not None, name=f"layer_{i}")(
                x, encoded, self_mask, cross_mask, None, deterministic, start
            )
        y = _rms_norm(cfg, "final_norm")(x)
        return _output_logits(cfg, self.shared_embedding, y, vocab_ids)  # [B, T, V or K]


def _shared_embedding(config: ModelConfig, vocab_size: int) -> nn.Embed:
    return nn.Embed(
        num_embeddings=vocab_size,
        features=config.d_model,
        dtype=config.dtype,
        embedding_init=_named(nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
        name="token_embedding",
    )


class PaDIRTransformer(nn.Module):
    """The non-autoregressive student: encoder with [LENGTH] token, NAR decoder.

    Sources have S <= max_source_len; the encoder has one more position for [LENGTH].
    """

    config: ModelConfig
    vocab_size: int

    def setup(self):
        cfg = self.config
        self.token_embedding = _shared_embedding(cfg, self.vocab_size)
        self.encoder = Encoder(cfg, self.token_embedding, num_positions=cfg.max_source_len + 1)
        self.decoder = NARDecoder(cfg, self.token_embedding)
        self.length_classifier = nn.Dense(
            cfg.max_target_len,
            dtype=cfg.dtype,
            kernel_init=_named(_default_kernel_init, ("embed", "length")),
            bias_init=_named(nn.initializers.zeros, ("length",)),
        )

    def encode(self, source: jax.Array, deterministic: bool = True):
        """source: int32[B, S] ids + EOS, 0-padded.

        Returns:
          encoded: [B, S + 1, D], position 0 being the [LENGTH] token.
          memory_mask: bool[B, S + 1], the keys cross-attention may read: non-pad source
            positions, never the [LENGTH] position.
        """
        length_token = jnp.full_like(source[:, :1], LENGTH_ID)
        tokens = jnp.concatenate([length_token, source], axis=1)  # [B, S + 1]
        encoded = self.encoder(tokens, deterministic)
        memory_mask = (tokens != PAD_ID).at[:, 0].set(False)
        return encoded, memory_mask

    def length_logits(self, encoded: jax.Array) -> jax.Array:
        """encoded: [B, S + 1, D] from `encode`. Returns float32[B, max_target_len];
        class c means a target of c + 1 tokens counting EOS."""
        return self.length_classifier(encoded[:, 0]).astype(jnp.float32)

    def decode(
        self,
        encoded: jax.Array,
        memory_mask: jax.Array,
        hypothesis: jax.Array,
        deterministic: bool = True,
        valid: jax.Array | None = None,
        vocab_ids: jax.Array | None = None,
    ) -> jax.Array:
        """One refinement pass. hypothesis: int32[B, T]; valid, vocab_ids: as `NARDecoder`.
        Returns logits float32[B, T, V] (or [B, T, K])."""
        return self.decoder(encoded, memory_mask, hypothesis, deterministic, valid, vocab_ids)

    def __call__(self, source: jax.Array, hypothesis: jax.Array, deterministic: bool = True):
        """Returns (token logits float32[B, T, V], length logits float32[B, max_target_len])."""
        encoded, memory_mask = self.encode(source, deterministic)
        logits = self.decode(encoded, memory_mask, hypothesis, deterministic)
        return logits, self.length_logits(encoded)


class DrafterTransformer(nn.Module):
    """The block drafter of draft and verify: given the source and an accepted prefix, the
    next `block` tokens in one pass (SpecDec's drafter, Xia et al. 2023).

    The teacher's encoder (no [LENGTH] token: its position table fits the teacher's, so all
    of it can start from the teacher) and a NAR decoder over the prefix, a block of [MASK]s
    after it and nothing after the block; no length head: the teacher decides where the
    sentence ends.
    """

    config: ModelConfig
    vocab_size: int

    def setup(self):
        cfg = self.config
        self.token_embedding = _shared_embedding(cfg, self.vocab_size)
        self.encoder = Encoder(cfg, self.token_embedding, num_positions=cfg.max_source_len)
        self.decoder = NARDecoder(cfg, self.token_embedding)

    def encode(self, source: jax.Array, deterministic: bool = True):
        """source: int32[B, S]. Returns (encoded [B, S, D], memory_mask bool[B, S])."""
        return self.encoder(source, deterministic), source != PAD_ID

    def decode(
        self,
        encoded: jax.Array,
        memory_mask: jax.Array,
        hypothesis: jax.Array,
        deterministic: bool = True,
        valid: jax.Array | None = None,
        vocab_ids: jax.Array | None = None,
        outputs: jax.Array | None = None,
    ) -> jax.Array:
        """One pass over prefix + block: hypothesis int32[B, T]; valid, vocab_ids, outputs:
        as `NARDecoder`. Returns logits float32[B, T or O, V or K]."""
        return self.decoder(encoded, memory_mask, hypothesis, deterministic, valid, vocab_ids,
                            outputs)

    def __call__(self, source: jax.Array, hypothesis: jax.Array, deterministic: bool = True):
        """Returns the token logits float32[B, T, V] of one pass."""
        encoded, memory_mask = self.encode(source, deterministic)
        return self.decode(encoded, memory_mask, hypothesis, deterministic)


class ARTransformer(nn.Module):
    """The autoregressive teacher: encoder, causal decoder."""

    config: ModelConfig
    vocab_size: int

    def setup(self):
        self.token_embedding = _shared_embedding(self.config, self.vocab_size)
        self.encoder = Encoder(self.config, self.token_embedding, num_positions=self.config.max_source_len)
        self.decoder = ARDecoder(self.config, self.token_embedding)

    def encode(self, source: jax.Array, deterministic: bool = True):
        """source: int32[B, S]. Returns (encoded [B, S, D], memory_mask bool[B, S])."""
        return self.encoder(source, deterministic), source != PAD_ID

    def decode(
        self,
        encoded: jax.Array,
        memory_mask: jax.Array,
        inputs: jax.Array,
        target_mask: jax.Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        vocab_ids: jax.Array | None = None,
        start: jax.Array | None = None,
    ) -> jax.Array:
        """inputs: int32[B, T] right-shifted targets, or [B, 1] with `decode=True` and a
        filled cache, or a block per row at positions from `start` (`ARDecoder`);
        vocab_ids: as `NARDecoder`. Returns logits float32[B, T, V] (or K)."""
        return self.decoder(encoded, memory_mask, inputs, target_mask, deterministic, decode,
                            vocab_ids, start)

    def __call__(self, source: jax.Array, target: jax.Array, deterministic: bool = True):
        """Teacher forcing. target: int32[B, T] ids + EOS, 0-padded. Returns [B, T, V]."""
        encoded, memory_mask = self.encode(source, deterministic)
        return self.decode(
            encoded, memory_mask, shift_right(target), target != PAD_ID, deterministic
        )
