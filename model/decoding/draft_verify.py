"""Draft and verify: the block drafter drafts, the AR teacher verifies with its cache (jitted,
batched).

SpecDec (Xia et al., Findings of EMNLP 2023), blockwise parallel decoding (Stern et al.
2018). Each round, for every row still decoding, with n tokens accepted so far:

1. the drafter (model/models.py `DrafterModel`) drafts the K = `block` tokens after the
   prefix in one pass (`draft_passes` > 1: it refines its own block);
2. the teacher runs over the block and one more position, K + 1 positions from n, its
   keys and values of the prefix kept from earlier rounds (`ARModel.block_logits`): its
   inputs are the prefix's last token (BOS for an empty prefix) and the K drafted tokens,
   so position n + i scores the token after prefix + draft[:i];
3. the draft is accepted up to its first token the teacher would not have produced (and
   no further than a drafted EOS), and the teacher's own token after the accepted ones is
   appended, so every round gains at least one token and at most K + 1. A row stops at
   EOS or when its output reaches the width T.

The next round starts its block where the accepted output ends: what the teacher's cache
holds past that (the rejected draft's keys and values) is overwritten or never read, so a
row that accepts less than its block needs no rollback. The teacher's work a round is K + 1
positions, not the output so far: a round costs about one greedy step of K + 1 rows. As
the AR searches, the rounds run over the unfinished rows only (model/decoding/
compaction.py).

Exact verification (`top_k=1`) accepts a drafted token only if it is the teacher's argmax
over target ids (ties: the lowest id, as `beam_search.greedy_search`): the output is then
the teacher's greedy output, whatever the draft, in at most as many rounds as greedy has
steps. Greedy computes the same logits one position at a time; their float32 sums may
differ in the last bit, which changes a token only where the teacher's two best logits tie
to that precision (tests/test_draft_verify.py checks equality on the tiny models).

Tolerant verification (`top_k > 1`, Xia et al.'s verification with tolerance) also accepts
a drafted token that is among the teacher's `top_k` most likely and within `margin` of the
log-probability of its best: fewer rounds, output no longer the teacher's greedy one.

Sequential calls per sentence: `rounds x (draft_passes + 1)` (`passes`), besides the two
encoders, which run once per sentence before the first round.

    encoded = drafter.encode(params, source), teacher.encode(teacher_params, source)
    result = draft_verify(drafter, params, teacher, teacher_params, encoded, width=T)
    result.tokens, result.rounds, result.accepted, result.passes

Shapes: B sentences, T output width (the output cap), K the drafter's block, V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import flax
import jax
import jax.numpy as jnp

from components.tokenizer import BOS_ID, EOS_ID, PAD_ID
from model.decoding import compaction
from model.models import place_block
from model.transformer import argmax_ids, mask_non_target_ids

Params = Any
Encoded = tuple[jax.Array, jax.Array]  # (encoded [B, S, D], memory_mask bool[B, S])


class Drafter(Protocol):
    """What `draft_verify` needs from the drafter (`DrafterModel` has it)."""

    block: int

    def draft(self, params: Params, encoded: jax.Array, memory_mask: jax.Array,
              tokens: jax.Array, length: jax.Array, passes: int = 1,
              vocab_ids: jax.Array | None = None) -> jax.Array:
        """The `block` tokens after tokens[:, :length]: int32[B, K]."""


class Verifier(Protocol):
    """What `draft_verify` needs from the AR teacher (`ARModel` has it)."""

    def init_block_cache(self, params: Params, encoded: jax.Array, memory_mask: jax.Array,
                         length: int) -> Any:
        """An empty cache of `length` positions."""

    def block_logits(self, params: Params, encoded: jax.Array, memory_mask: jax.Array,
                     inputs: jax.Array, start: jax.Array, cache: Any
                     ) -> tuple[jax.Array, Any]:
        """inputs int32[B, W] at positions start.. -> (logits float32[B, W, V], cache)."""


@flax.struct.dataclass
class DraftVerifyResult:
    """The decoding of a batch and what it cost, per sentence."""

    tokens: jax.Array  # int32[B, T]: pieces, EOS when reached within T, PAD after
    lengths: jax.Array  # int32[B]: tokens output, EOS included
    rounds: jax.Array  # int32[B]: draft-and-verify rounds
    accepted: jax.Array  # int32[B]: drafted tokens accepted (the teacher's own not counted)
    passes: jax.Array  # int32[B]: sequential decoder calls, rounds x (draft_passes + 1)


@flax.struct.dataclass
class _State:
    tokens: jax.Array  # int32[B, T + K + 1]: the accepted output, PAD after it
    length: jax.Array  # int32[B]: accepted tokens
    done: jax.Array  # bool[B]
    rounds: jax.Array  # int32[B]
    accepted: jax.Array  # int32[B]
    cache: Any  # the teacher's keys and values, positions < length valid
    rows: jax.Array  # int32[B]: each row's row of the batch


def accepted_count(draft: jax.Array, logits: jax.Array, *, top_k: int,
                   margin: float | jax.Array) -> tuple[jax.Array, jax.Array]:
    """How many drafted tokens verification accepts, and the teacher's tokens.

    Args:
      draft: int32[B, K], the drafted tokens.
      logits: float32[B, K + 1, V], the teacher's over the block (position i scores the
        token after the prefix and draft[:, :i]), not masked.
      top_k, margin: exact (top_k 1) or tolerant verification (see the module docstring).

    Returns:
      (accepted int32[B] in [0, K]: the leading drafted tokens accepted, none after a
       drafted EOS; teacher int32[B, K + 1]: the teacher's argmax over target ids).
    """
    teacher = argmax_ids(logits)  # [B, K + 1]
    if top_k == 1:
        ok = draft == teacher[:, :-1]  # [B, K]
    else:
        masked = mask_non_target_ids(logits[:, :-1])  # [B, K, V]
        drafted = jnp.take_along_axis(masked, draft[..., None], axis=-1)  # [B, K, 1]
        rank = jnp.sum(masked > drafted, axis=-1)  # [B, K]: ids strictly more likely
        best = jnp.max(masked, axis=-1)  # [B, K]; log-probability gaps are logit gaps
        ok = (rank < top_k) & (best - drafted[..., 0] <= margin)  # [B, K]
    # Nothing after a drafted EOS: it ends the sentence if it is accepted.
    after_eos = jnp.cumsum(draft == EOS_ID, axis=1) - (draft == EOS_ID) > 0  # [B, K]
    leading = jnp.cumprod(ok & ~after_eos, axis=1)  # [B, K]
    return jnp.sum(leading, axis=1).astype(jnp.int32), teacher


@functools.partial(jax.jit, static_argnames=("drafter", "verifier", "width", "draft_passes",
                                             "top_k"))
def draft_verify(
    drafter: Drafter,
    drafter_params: Params,
    verifier: Verifier,
    verifier_params: Params,
    encoded: tuple[Encoded, Encoded],
    *,
    width: int,
    draft_passes: int = 1,
    top_k: int = 1,
    margin: float | jax.Array = 0.0,
    vocab_ids: jax.Array | None = None,
) -> DraftVerifyResult:
    """Decodes a batch by draft and verify (see the module docstring).

    Args:
      drafter: the block drafter (hashable: static under jit); drafter_params its parameters.
      verifier: the AR teacher (static); verifier_params its parameters.
      encoded: the drafter's and the teacher's `encode` output for the same sources.
      width: T, the output cap (static).
      draft_passes: drafter passes per draft, >= 1 (static).
      top_k: 1 for exact verification, else the tolerant variant's top-k (static).
      margin: the tolerant variant's log-probability margin (>= 0).
      vocab_ids: a shortlist the drafter drafts over (model/decoding/shortlist.py); the teacher
        always verifies over all ids, so exactness does not depend on it.

    Returns:
      DraftVerifyResult of B rows.
    """
    if draft_passes < 1 or top_k < 1:
        raise ValueError(f"draft_passes and top_k must be >= 1, got {draft_passes}, {top_k}")
    (draft_encoded, draft_mask), (teacher_encoded, teacher_mask) = encoded
    block = drafter.block
    # Room for a block that starts at the last position of the cap, and the one after it.
    room = width + block + 1
    span = jnp.arange(block + 1)  # [K + 1]
    def cond(state: _State) -> jax.Array:
        return ~jnp.all(state.done)

    def body(state: _State, context: tuple[Any, jax.Array, Any, jax.Array]) -> _State:
        draft_memory, draft_mask, teacher_memory, teacher_mask = context
        batch = state.done.shape[0]
        draft = drafter.draft(drafter_params, draft_memory, draft_mask,
                              state.tokens[:, :width], state.length, draft_passes,
                              vocab_ids)  # [B, K]
        previous = jnp.take_along_axis(state.tokens, jnp.maximum(state.length - 1, 0)[:, None],
                                       axis=1)  # [B, 1]
        previous = jnp.where(state.length[:, None] > 0, previous, BOS_ID)
        logits, cache = verifier.block_logits(
            verifier_params, teacher_memory, teacher_mask,
            jnp.concatenate([previous, draft], axis=1), state.length, state.cache)
        accepted, teacher = accepted_count(draft, logits, top_k=top_k, margin=margin)
        # The accepted drafted tokens, then the teacher's own, unless a drafted EOS ended it.
        padded = jnp.concatenate([draft, jnp.full((batch, 1), PAD_ID, jnp.int32)], axis=1)
        ended = jnp.take_along_axis(padded, jnp.maximum(accepted - 1, 0)[:, None], axis=1)[:, 0]
        ended = (accepted > 0) & (ended == EOS_ID)  # [B]
        gained = jnp.where(ended, accepted, accepted + 1)  # [B]
        new = jnp.where(span[None, :] < accepted[:, None], padded, teacher)  # [B, K + 1]
        new = jnp.where(span[None, :] < gained[:, None], new, PAD_ID)
        new_length = jnp.minimum(state.length + gained, width)  # [B]
        written = place_block(state.tokens, new, state.length)  # [B, T + K + 1]
        written = jnp.where(jnp.arange(room)[None, :] < new_length[:, None], written, PAD_ID)
        last = jnp.take_along_axis(written, (new_length - 1)[:, None], axis=1)[:, 0]  # [B]
        active = ~state.done  # [B]
        return _State(
            tokens=jnp.where(active[:, None], written, state.tokens),
            length=jnp.where(active, new_length, state.length),
            done=state.done | (active & ((last == EOS_ID) | (new_length >= width))),
            rounds=state.rounds + active.astype(jnp.int32),
            accepted=state.accepted + jnp.where(active, accepted, 0),
            cache=cache,
            rows=state.rows,
        )

    def collect(result: DraftVerifyResult, state: _State) -> DraftVerifyResult:
        rows = DraftVerifyResult(tokens=state.tokens[:, :width], lengths=state.length,
                                 rounds=state.rounds, accepted=state.accepted,
                                 passes=state.rounds * (draft_passes + 1))
        return jax.tree.map(lambda whole, part: whole.at[state.rows].set(part), result, rows)

    batch = draft_encoded.shape[0]
    zeros = jnp.zeros((batch,), jnp.int32)
    state = _State(
        tokens=jnp.zeros((batch, room), jnp.int32), length=zeros,
        done=jnp.zeros((batch,), bool), rounds=zeros, accepted=zeros,
        cache=verifier.init_block_cache(verifier_params, teacher_encoded, teacher_mask, room),
        rows=jnp.arange(batch))
    # What the rounds read per row: both models' cross-attention keys and values, computed
    # once, and masks.
    context = (drafter.memory(drafter_params, draft_encoded, draft_mask), draft_mask,
               verifier.memory(verifier_params, teacher_encoded, teacher_mask), teacher_mask)
    return compaction.while_unfinished(
        cond, body, state, context, rows=batch, done=lambda state: state.done,
        take=compaction.take_each, collect=collect,
        result=DraftVerifyResult(tokens=jnp.zeros((batch, width), jnp.int32), lengths=zeros,
                                 rounds=zeros, accepted=zeros, passes=zeros))
