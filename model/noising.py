"""On-the-fly noising of PaDIR training targets.

Every time an example is seen it gets fresh noise, drawn from the rng it is given (so a
training run is reproducible from its seed): a ratio r ~ U(0, 1) per example; each
target token that is neither pad nor EOS is noised with probability r; a noised token
becomes [MASK] (80%), a random real piece (10%) or stays as it is (10%). Drawing r per
example exposes the model to everything from a nearly clean to a fully masked input,
the latter being what the first refinement pass sees at inference.

`draft_block` noises for the block drafter of draft and verify instead (model/models.py
`DrafterModel`): a gold prefix, a block of [MASK]s, nothing after.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from components.tokenizer import EOS_ID, MASK_ID, PAD_ID


def noise_targets(
    rng: jax.Array,
    targets: jax.Array,
    *,
    vocab_size: int,
    first_real_id: int,
    mask_prob: float = 0.8,
    random_prob: float = 0.1,
) -> tuple[jax.Array, jax.Array]:
    """Noises targets for the decoder input of the loss's first pass.

    Args:
      rng: a PRNG key; the same key gives the same noise.
      targets: int32[B, T] ids followed by EOS, right-padded with PAD_ID.
      vocab_size: random pieces are drawn uniformly from [first_real_id, vocab_size).
      first_real_id: the first id that is a real piece (not reserved or control).
      mask_prob: probability that a noised token becomes MASK_ID.
      random_prob: probability that a noised token becomes a random real piece; with
        probability 1 - mask_prob - random_prob it keeps its value (but is still noised,
        i.e. still carries loss weight).

    Returns:
      noised_ids: int32[B, T], equal to `targets` outside the noised positions (pads and
        EOS are never noised).
      noised_mask: bool[B, T], True where a token was selected for noise.
    """
    if not 0 <= first_real_id < vocab_size:
        raise ValueError(f"first_real_id {first_real_id} outside [0, {vocab_size})")
    ratio_rng, select_rng, action_rng, piece_rng = jax.random.split(rng, 4)
    batch, length = targets.shape
    ratio = jax.random.uniform(ratio_rng, (batch, 1))  # [B, 1]
    eligible = (targets != PAD_ID) & (targets != EOS_ID)  # [B, T]
    noised_mask = eligible & (jax.random.uniform(select_rng, (batch, length)) < ratio)
    action = jax.random.uniform(action_rng, (batch, length))  # [B, T]
    pieces = jax.random.randint(
        piece_rng, (batch, length), first_real_id, vocab_size, dtype=targets.dtype
    )
    replacement = jnp.where(
        action < mask_prob,
        jnp.asarray(MASK_ID, targets.dtype),
        jnp.where(action < mask_prob + random_prob, pieces, targets),
    )
    noised_ids = jnp.where(noised_mask, replacement, targets)
    return noised_ids, noised_mask


def draft_block(rng: jax.Array, targets: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Draft and verify's drafting pattern (model/models.py `DrafterModel`): a gold prefix
    of p ~ U{0, ..., n - 1} of a target's n tokens (EOS counted), then `block` [MASK]s
    (cut at the width), PAD after.

    targets int32[B, T] -> (hypothesis int32[B, T], p int32[B])."""
    tokens = jnp.sum(targets != PAD_ID, axis=1)  # [B]
    start = jnp.floor(jax.random.uniform(rng, (targets.shape[0],)) * tokens).astype(jnp.int32)
    return block_input(targets, start, block), start


def block_input(tokens: jax.Array, start: jax.Array, block: int) -> jax.Array:
    """The drafter's input, in training and in drafting alike: tokens[:, :start] kept, then
    `block` [MASK]s (cut at the width), PAD after. int32[B, T], int32[B] -> int32[B, T]."""
    positions = jnp.arange(tokens.shape[1])[None, :]  # [1, T]
    return jnp.where(positions < start[:, None], tokens, jnp.where(
        positions < (start + block)[:, None], MASK_ID, PAD_ID)).astype(tokens.dtype)
