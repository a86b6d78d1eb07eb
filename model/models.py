"""The model interface of the AR teacher, the PaDIR student and the block drafter (T5X
models.py style).

`ARModel`, `PaDIRModel` and `DrafterModel` wrap a Linen module with what every stage that
trains, decodes or scores needs, and nothing about optimisation or search:

    params = model.init(rng, batch)                      # plain arrays, no boxes
    loss, metrics = model.loss_fn(params, batch, rng)   # PaDIR also: settings (LossSettings)
    tokens = student.predict_batch(params, batch)        # int32[B, T]: one pass (PaDIR)

The AR searches over `ARModel`'s step (`make_tokens_to_logits`, its cache) live in
model/decoding/beam_search.py (`greedy`, `beam`, `predict_greedy`).

A batch is `{"source": int32[B, S], "target": int32[B, T]}`: ids followed by EOS,
right-padded with 0. T <= max_target_len and S <= max_source_len (PaDIR's encoder has one
more position, for the [LENGTH] token it prepends). Metrics are
sums and counts (divide `loss` by `weights`, `accuracy` by `weights`, `length_accuracy` by
`examples` after summing over steps/devices).

Sharding: `init` works under `jax.eval_shape`, and `logical_axes(batch)` gives the logical
axis names of every parameter (a tree of PartitionSpecs shaped like `init`'s output), so a
trainer can do `nn.logical_to_mesh_sharding(model.logical_axes(batch), mesh, rules)` and
`jax.jit(model.init, out_shardings=...)`.

All methods are pure and jit-able (static shapes); jit them at the call site.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from components.config import ModelConfig
from components.tokenizer import EOS_ID, MASK_ID, PAD_ID
from model import losses, noising
from model.transformer import (
    ARTransformer,
    DrafterTransformer,
    PaDIRTransformer,
    argmax_ids,
    mask_non_target_ids,
    shift_right,
)

Batch = dict[str, jax.Array]
Params = Any
# Glancing draws from fold_in(rng, GLANCING_STREAM): the noise and dropout keys (a split of
# rng) stay what they were without glancing.
GLANCING_STREAM = 1


def _init_inputs(batch: Batch) -> tuple[jax.Array, jax.Array]:
    # Only shapes matter for init; ones avoid all-pad masks.
    return (
        jnp.ones(batch["source"].shape, jnp.int32),
        jnp.ones(batch["target"].shape, jnp.int32),
    )


def output_length(config: ModelConfig, batch: Batch) -> int:
    """The output width a batch decodes into: its targets', else max_target_len."""
    return batch["target"].shape[1] if "target" in batch else config.max_target_len


def truncate_after_eos(ids: jax.Array) -> jax.Array:
    """Sets every id after the first EOS of a row to PAD_ID. int32[B, T] -> int32[B, T]."""
    is_eos = (ids == EOS_ID).astype(jnp.int32)
    eos_before = jnp.cumsum(is_eos, axis=1) - is_eos  # EOS strictly to the left
    return jnp.where(eos_before > 0, PAD_ID, ids)


def masked_hypothesis(lengths: jax.Array, max_len: int) -> jax.Array:
    """The all-[MASK] hypothesis of a given length.

    Args:
      lengths: int32[B], target lengths counting EOS, in [1, max_len].
      max_len: T.

    Returns:
      int32[B, T]: MASK_ID before position length - 1, EOS_ID there, PAD_ID after.
    """
    positions = jnp.arange(max_len)[None, :]  # [1, T]
    eos_at = (lengths - 1)[:, None]  # [B, 1]
    return jnp.where(
        positions < eos_at, MASK_ID, jnp.where(positions == eos_at, EOS_ID, PAD_ID)
    ).astype(jnp.int32)


class _BaseModel:
    """What both models share: init and logical axes."""

    config: ModelConfig
    vocab_size: int
    label_smoothing: float

    @property
    def module(self) -> nn.Module:
        raise NotImplementedError

    def _init_variables(self, rng: jax.Array, batch: Batch) -> Any:
        source, target = _init_inputs(batch)
        return self.module.init({"params": rng}, source, target, deterministic=True)["params"]

    def init(self, rng: jax.Array, batch: Batch) -> Params:
        """Fresh parameters (plain arrays). Only the shapes of `batch` are used."""
        return nn.unbox(self._init_variables(rng, batch))

    def memory(self, params: Params, encoded: jax.Array, memory_mask: jax.Array) -> Any:
        """Every decoder layer's cross-attention keys and values of `encoded`
        (`transformer.MemoryAttention`), computed once: a decoding loop's calls read them
        (the `memory` collection) instead of projecting the encoder's output each call.
        The decoder runs on one dummy position to write them; XLA drops the rest."""
        rows = encoded.shape[0]
        _, variables = self.module.apply(
            {"params": params}, encoded, memory_mask, jnp.zeros((rows, 1), jnp.int32),
            method="decode", mutable=["memory"])
        return variables["memory"]

    def logical_axes(self, batch: Batch) -> Any:
        """Logical axis names per parameter: a PartitionSpec tree shaped like `init`'s."""
        abstract = jax.eval_shape(self._init_variables, jax.random.key(0), batch)
        return nn.get_partition_spec(abstract)


@dataclasses.dataclass(frozen=True)
class ARModel(_BaseModel):
    """The autoregressive teacher.

    Attributes:
      config: the model config.
      vocab_size: V, read from the vocab artifact.
      label_smoothing: of the training cross-entropy.
    """

    config: ModelConfig
    vocab_size: int
    label_smoothing: float = 0.1

    @property
    def module(self) -> ARTransformer:
        return ARTransformer(self.config, self.vocab_size)

    def loss_fn(
        self,
        params: Params,
        batch: Batch,
        rng: jax.Array,
        *,
        deterministic: bool = False,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Teacher-forced loss per token. `rng` drives dropout."""
        logits = self.module.apply(
            {"params": params},
            batch["source"],
            batch["target"],
            deterministic=deterministic,
            rngs={"dropout": rng},
        )  # [B, T, V]
        return losses.ar_loss(logits, batch["target"], label_smoothing=self.label_smoothing)

    def encode(self, params: Params, source: jax.Array) -> tuple[jax.Array, jax.Array]:
        """source int32[B, S] -> (encoded [B, S, D], memory_mask bool[B, S])."""
        return self.module.apply({"params": params}, source, method=ARTransformer.encode)

    def target_log_probs(
        self, params: Params, encoded: jax.Array, memory_mask: jax.Array, targets: jax.Array
    ) -> jax.Array:
        """Teacher-forced log-probability of each given target token, in one decoder pass
        (no search): what rescoring another model's candidates needs.

        Args:
          encoded, memory_mask: `encode`'s output for the targets' rows.
          targets: int32[N, T] ids + EOS, 0-padded.

        Returns:
          float32[N, T]: log p(targets[:, t] | targets[:, :t], source) under the
          distribution over target ids (as the searches decode: non-target ids masked);
          0 at PAD.
        """
        logits = self.forced_logits(params, encoded, memory_mask, targets)  # [N, T, V]
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        log_probs = target_logit - jax.nn.logsumexp(logits, axis=-1)  # [N, T]
        return jnp.where(targets != PAD_ID, log_probs, 0.0)

    def forced_logits(
        self, params: Params, encoded: jax.Array, memory_mask: jax.Array, targets: jax.Array
    ) -> jax.Array:
        """Teacher-forced logits of every position in one decoder pass: position t scores
        the token after targets[:, :t] (what greedy search would compute at step t, given
        that prefix), non-target ids masked as the searches mask them.

        targets int32[N, T] ids + EOS, 0-padded -> float32[N, T, V]."""
        logits = self.module.apply(
            {"params": params}, encoded, memory_mask, shift_right(targets), targets != PAD_ID,
            method=ARTransformer.decode,
        )  # [N, T, V]
        return mask_non_target_ids(logits.astype(jnp.float32))

    def init_cache(
        self, params: Params, encoded: jax.Array, memory_mask: jax.Array, max_len: int
    ) -> Any:
        """An empty KV cache for `encoded.shape[0]` rows and `max_len` steps (no compute)."""
        return self._empty_cache(params, encoded, memory_mask, max_len, block=False)

    def init_block_cache(
        self, params: Params, encoded: jax.Array, memory_mask: jax.Array, length: int
    ) -> Any:
        """An empty cache of `length` positions for `block_logits` (no compute); `length`
        must cover the last block's end (draft and verify: the output cap plus a block)."""
        return self._empty_cache(params, encoded, memory_mask, length, block=True)

    def _empty_cache(self, params: Params, encoded: jax.Array, memory_mask: jax.Array,
                     length: int, *, block: bool) -> Any:
        """The cache the decoder creates on a first call over `length` positions (one
        step a call, or blocks: `block`), zeros, its shapes found without compute."""

        def create(params, encoded, memory_mask):
            rows = encoded.shape[0]
            mode = {"start": jnp.zeros((rows,), jnp.int32)} if block else {"decode": True}
            _, variables = self.module.apply(
                {"params": params}, encoded, memory_mask, jnp.zeros((rows, length), jnp.int32),
                method=ARTransformer.decode, mutable=["cache"], **mode,
            )
            return variables["cache"]

        shapes = jax.eval_shape(create, params, encoded, memory_mask)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def block_logits(
        self, params: Params, memory: Any, memory_mask: jax.Array, inputs: jax.Array,
        start: jax.Array, cache: Any,
    ) -> tuple[jax.Array, Any]:
        """The logits of a block of positions per row over the cache of the positions
        before it (draft and verify's verifier): row b's inputs int32[B, W] are the decoder
        inputs of its positions start[b] .. start[b] + W - 1 (the token before each: BOS
        at position 0), so that position start[b] + i scores the token after them. The
        cache must hold every position before start[b] from earlier calls; `memory` is
        `memory`'s output for the rows.

        Returns (logits float32[B, W, V], not masked: `argmax_ids` reads target ids only;
        the cache with the block's keys and values written)."""
        logits, variables = self.module.apply(
            {"params": params, "cache": cache, "memory": memory}, None, memory_mask, inputs,
            start=start, method=ARTransformer.decode, mutable=["cache"],
        )
        return logits, variables["cache"]

    def make_tokens_to_logits(
        self, params: Params, memory: Any, memory_mask: jax.Array,
        vocab_ids: jax.Array | None = None,
    ) -> Callable[[jax.Array, Any], tuple[jax.Array, Any]]:
        """The one-step callback of the AR searches (model/decoding/beam_search.py):
        (ids int32[N, 1], cache) -> (logits float32[N, V], cache).

        `memory` (`memory`'s output, computed once before the loop) and `memory_mask` must
        already have N rows. Logits of ids that are never targets (pad, BOS, control ids)
        are masked so that no search emits them. With `vocab_ids` (a shortlist, reserved
        ids first: model/decoding/shortlist.py) the logits are [N, K], column i for id
        vocab_ids[i].
        """

        def tokens_to_logits(ids: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
            logits, variables = self.module.apply(
                {"params": params, "cache": cache, "memory": memory}, None, memory_mask, ids,
                decode=True, vocab_ids=vocab_ids, method=ARTransformer.decode,
                mutable=["cache"],
            )  # [N, 1, V or K]
            return mask_non_target_ids(logits[:, 0]), variables["cache"]

        return tokens_to_logits


@dataclasses.dataclass(frozen=True)
class PaDIRModel(_BaseModel):
    """The non-autoregressive PaDIR student.

    Attributes:
      config: the model config.
      vocab_size: V, read from the vocab artifact.
      first_real_id: the first real piece id; noise draws random pieces from
        [first_real_id, vocab_size).
      label_smoothing: of the token cross-entropies (not of the length loss).
    """

    config: ModelConfig
    vocab_size: int
    first_real_id: int
    label_smoothing: float = 0.1

    @property
    def module(self) -> PaDIRTransformer:
        return PaDIRTransformer(self.config, self.vocab_size)

    def loss_fn(
        self,
        params: Params,
        batch: Batch,
        rng: jax.Array,
        *,
        settings: losses.LossSettings = losses.LossSettings(),
        deterministic: bool = False,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The K-pass unrolled loss plus the length loss (see `losses.padir_loss`).

        `rng` drives the noise, dropout and glancing; `settings` (static: the phase's,
        `losses.student_loss_settings`) say how many passes, and how the noise is drawn.
        """
        target = batch["target"]
        noise_rng, dropout_rng = jax.random.split(rng)
        noised_ids, noised_mask = noising.noise_targets(
            noise_rng, target, vocab_size=self.vocab_size, first_real_id=self.first_real_id)
        variables = {"params": params}
        encoded, memory_mask = self.module.apply(
            variables, batch["source"], deterministic,
            method=PaDIRTransformer.encode, rngs={"dropout": dropout_rng},
        )  # [B, S + 1, D], [B, S + 1]
        length_logits = self.module.apply(
            variables, encoded, method=PaDIRTransformer.length_logits
        )  # [B, max_target_len]

        def logits_fn(hypothesis: jax.Array, k: int) -> jax.Array:
            return self.module.apply(
                variables, encoded, memory_mask, hypothesis, deterministic,
                method=PaDIRTransformer.decode,
                rngs={"dropout": jax.random.fold_in(dropout_rng, k)},
            )  # [B, T, V]

        return losses.padir_loss(
            logits_fn,
            target,
            noised_ids,
            noised_mask,
            length_logits,
            num_passes=settings.num_passes,
            label_smoothing=self.label_smoothing,
            glancing_ratio=settings.glancing_ratio,
            rng=jax.random.fold_in(rng, GLANCING_STREAM),
        )

    def encode(self, params: Params, source: jax.Array) -> tuple[jax.Array, jax.Array]:
        """source int32[B, S] -> (encoded [B, S + 1, D], memory_mask bool[B, S + 1]);
        position 0 is [LENGTH], always False in memory_mask."""
        return self.module.apply({"params": params}, source, method=PaDIRTransformer.encode)

    def length_logits(self, params: Params, encoded: jax.Array) -> jax.Array:
        """float32[B, max_target_len]; class c = target length c + 1 counting EOS."""
        return self.module.apply(
            {"params": params}, encoded, method=PaDIRTransformer.length_logits
        )

    def decode_logits(
        self, params: Params, encoded: jax.Array, memory_mask: jax.Array, hypothesis: jax.Array
    ) -> jax.Array:
        """One refinement pass: hypothesis int32[B, T] -> logits float32[B, T, V].

        Ids that are never targets (pad, BOS, control ids) are masked, so an argmax or a
        softmax over these logits only ranks ids a hypothesis may hold.
        """
        logits = self.module.apply(
            {"params": params}, encoded, memory_mask, hypothesis,
            method=PaDIRTransformer.decode,
        )
        return mask_non_target_ids(logits)

    def decoder_memory(
        self, params: Params, encoded: jax.Array, memory_mask: jax.Array, valid: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """What every decoding pass over these rows reuses: cross-attention's keys and
        values (`memory`), the encoder output's mask and the hypothesis's non-pad positions
        valid bool[N, T] (fixed across passes). Passed into the loop as constants, they
        make every term that depends on them alone (masks, positional attention weights)
        loop-invariant, so XLA computes it once before the first pass (`pass_logits`)."""
        return self.memory(params, encoded, memory_mask), memory_mask, valid

    def pass_logits(
        self, params: Params, memory: tuple[jax.Array, jax.Array, jax.Array],
        hypothesis: jax.Array, vocab_ids: jax.Array | None = None,
    ) -> jax.Array:
        """One decoding pass over `decoder_memory`'s rows: hypothesis int32[N, T] ->
        logits float32[N, T, V]; with `vocab_ids` (a shortlist, reserved ids first)
        [N, T, K], column i for vocab_ids[i]. Unlike `decode_logits`, the non-target ids
        are not masked: the decoders' reading of a pass (`refinement.read_logits`) leaves
        them out, on the few columns they hold."""
        keys_values, memory_mask, valid = memory
        return self.module.apply(
            {"params": params, "memory": keys_values}, None, memory_mask, hypothesis, True,
            valid, vocab_ids, method=PaDIRTransformer.decode,
        )

    def predict_batch(self, params: Params, batch: Batch) -> jax.Array:
        """One pass from an all-[MASK] input of the predicted length.

        Returns int32[B, T] (T = target width, else max_target_len): the argmax at each
        position before the predicted EOS, EOS at it, 0 after (also 0 after any earlier
        EOS the decoder emits).
        """
        max_len = output_length(self.config, batch)
        encoded, memory_mask = self.encode(params, batch["source"])
        classes = jnp.argmax(self.length_logits(params, encoded), axis=-1)  # [B]
        lengths = jnp.clip(classes + 1, 1, max_len).astype(jnp.int32)  # [B]
        hypothesis = masked_hypothesis(lengths, max_len)  # [B, T]
        ids = argmax_ids(self.decode_logits(params, encoded, memory_mask, hypothesis))
        ids = jnp.where(hypothesis == MASK_ID, ids, hypothesis)  # keep EOS and pads
        return truncate_after_eos(ids)


@dataclasses.dataclass(frozen=True)
class DrafterModel(_BaseModel):
    """Draft and verify's block drafter: the next `block` tokens after a prefix, one pass.

    Trained on draft and verify's pattern (`noising.draft_block`): every prefix length of
    a target, the `block` tokens after it masked, nothing after the block; the loss is the
    block's tokens' (EOS included; positions past EOS carry none).

    Attributes:
      config: the model config (the drafter runs once a round over the prefix and its
        block, so its decoder's depth is what a round pays for, and what it drafts with).
      vocab_size: V, read from the vocab artifact.
      block: the tokens it drafts a pass.
      label_smoothing: of the token cross-entropy.
    """

    config: ModelConfig
    vocab_size: int
    block: int
    label_smoothing: float = 0.1

    @property
    def module(self) -> DrafterTransformer:
        return DrafterTransformer(self.config, self.vocab_size)

    def loss_fn(
        self,
        params: Params,
        batch: Batch,
        rng: jax.Array,
        *,
        deterministic: bool = False,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The block's token cross-entropy, one random prefix per example (drawing four
        over one encoding of the source learnt less at equal time: docs/history.md). `rng`
        drives the prefix and dropout."""
        noise_rng, dropout_rng = jax.random.split(rng)
        target = batch["target"]
        hypothesis, start = noising.draft_block(noise_rng, target, self.block)
        outputs = block_positions(start, self.block, target.shape[1])  # [B, K]
        logits = self.module.apply(
            {"params": params}, batch["source"], hypothesis, deterministic, outputs,
            method=_drafter_loss_logits, rngs={"dropout": dropout_rng},
        )  # [B, K, V]
        in_width = start[:, None] + jnp.arange(self.block) < target.shape[1]  # [B, K]
        targets = jnp.where(in_width, jnp.take_along_axis(target, outputs, axis=1), PAD_ID)
        return losses.ar_loss(logits, targets, label_smoothing=self.label_smoothing)

    def encode(self, params: Params, source: jax.Array) -> tuple[jax.Array, jax.Array]:
        """source int32[B, S] -> (encoded [B, S, D], memory_mask bool[B, S])."""
        return self.module.apply({"params": params}, source, method=DrafterTransformer.encode)

    def draft(
        self, params: Params, memory: Any, memory_mask: jax.Array, tokens: jax.Array,
        length: jax.Array, passes: int = 1, vocab_ids: jax.Array | None = None,
    ) -> jax.Array:
        """The `block` tokens after each row's prefix tokens[:, :length] (positions past
        the width T are not drafted: their tokens are PAD).

        Args:
          memory, memory_mask: `memory`'s output (once a batch), `encode`'s mask.
          tokens: int32[B, T], the accepted output (what follows each prefix is ignored).
          length: int32[B], the prefix's length.
          passes: >= 1; each pass after the first reads the block the one before drafted
            (the drafter refining its own block).
          vocab_ids: a shortlist to draft over (model/decoding/shortlist.py), reserved ids first.

        Returns:
          int32[B, block].
        """
        width = tokens.shape[1]
        outputs = block_positions(length, self.block, width)  # [B, K]
        in_width = length[:, None] + jnp.arange(self.block) < width  # [B, K]
        hypothesis = noising.block_input(tokens, length, self.block)  # [B, T]
        valid = hypothesis != PAD_ID  # the prefix (target ids, never PAD) and the block
        for _ in range(passes):
            logits = self.module.apply(
                {"params": params, "memory": memory}, None, memory_mask, hypothesis, True,
                valid, vocab_ids, outputs, method=DrafterTransformer.decode)  # [B, K, V or K']
            ids = argmax_ids(logits)
            if vocab_ids is not None:
                ids = jnp.take(vocab_ids, ids)
            drafted = jnp.where(in_width, ids, PAD_ID).astype(jnp.int32)  # [B, K]
            hypothesis = place_block(hypothesis, drafted, length)
        return drafted

    def predict_batch(self, params: Params, batch: Batch) -> jax.Array:
        """The drafter's own translation, a block a pass with nothing verified: what dev
        BLEU reads while it trains. Returns int32[B, T] (T = target width, else
        max_target_len): ids up to and including EOS, then 0."""
        width = output_length(self.config, batch)
        encoded, memory_mask = self.encode(params, batch["source"])
        memory = self.memory(params, encoded, memory_mask)
        rows = encoded.shape[0]

        def step(i, tokens):
            length = jnp.full((rows,), i * self.block, jnp.int32)
            drafted = self.draft(params, memory, memory_mask, tokens, length)  # [B, K]
            return place_block(tokens, drafted, length)

        tokens = jax.lax.fori_loop(0, -(-width // self.block), step,
                                   jnp.zeros((rows, width), jnp.int32))
        return truncate_after_eos(tokens)


def place_block(tokens: jax.Array, block: jax.Array, start: jax.Array) -> jax.Array:
    """`tokens` int32[B, T] with row b's `block` int32[B, K] written at positions start[b]
    .. start[b] + K - 1 (what passes the width is dropped)."""
    at = jnp.arange(tokens.shape[1])[None, :] - start[:, None]  # [B, T]
    placed = jnp.take_along_axis(block, jnp.clip(at, 0, block.shape[1] - 1), axis=1)
    return jnp.where((at >= 0) & (at < block.shape[1]), placed, tokens)


def block_positions(start: jax.Array, block: int, width: int) -> jax.Array:
    """The positions of each row's block, past the width clipped to its last:
    start int32[B] -> int32[B, block]."""
    return jnp.minimum(start[:, None] + jnp.arange(block), width - 1).astype(jnp.int32)


def _drafter_loss_logits(module: DrafterTransformer, source, hypothesis, deterministic,
                         outputs):
    encoded, memory_mask = module.encode(source, deterministic)
    return module.decode(encoded, memory_mask, hypothesis, deterministic, outputs=outputs)
