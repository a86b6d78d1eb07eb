"""Draft and verify: the PaDIR student drafts, the AR teacher verifies (jitted, batched).

Blockwise parallel decoding (Stern et al. 2018) and SpecDec (Xia et al. 2023) with the
PaDIR student as the drafter. Each round, for every row still decoding:

1. the student drafts every position after the accepted prefix: the prefix is clamped,
   the rest is [MASK] up to the draft length, then EOS; `draft_passes` refinement passes
   (as `refinement.refine`, the prefix never changing) give a real piece per position;
2. the teacher scores prefix + draft in one teacher-forced pass;
3. the draft is accepted up to its first token that the teacher would not have produced,
   and the teacher's own token at that position is appended, so every round gains at
   least one token. A row stops at the teacher's EOS (drafted and accepted, or appended)
   or when its output reaches the width T.

Exact verification (`top_k=1`) accepts a drafted token only if it is the teacher's argmax
over target ids (ties: the lowest id, as `beam_search.greedy_search`): the output is then
the teacher's greedy output, whatever the draft, in at most as many rounds as greedy has
steps. Both compute the same logits, the teacher-forced pass over all T positions at once
and greedy one position at a time with a KV cache; their float32 sums may differ in the
last bit, which changes a token only where the teacher's two best logits tie to that
precision (tests/test_draft_verify.py checks equality on the tiny models).

Tolerant verification (`top_k > 1`, Xia et al.'s verification with tolerance) also accepts
a drafted token that is among the teacher's `top_k` most likely and within `margin` of
the log-probability of its best: fewer rounds, output no longer the teacher's greedy one.

Draft length: the student's length head (the most likely length, counting EOS). When the
accepted prefix reaches it before the teacher's EOS, the next draft is `GROWTH` tokens
past the prefix (the width permitting).

Sequential calls per sentence: `rounds x (draft_passes + 1)` (`passes`), besides the two
encoders, which run once per sentence before the first round.

    candidates = refinement.predict_candidates(student, params, source,
                                               num_length_candidates=1, length_offsets=(0,))
    rescoring = refinement.Rescoring(candidates, teacher.encode(teacher_params, source))
    result = draft_verify(student, params, teacher, teacher_params, rescoring, width=T)
    result.tokens, result.rounds, result.accepted, result.passes

Shapes: B sentences, T output width (the output cap), V vocabulary.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import flax
import jax
import jax.numpy as jnp

from components.tokenizer import EOS_ID, MASK_ID, PAD_ID
from model.refinement import NARModel, Rescoring, accept_predictions, read_logits
from model.transformer import argmax_last

Params = Any
# Tokens drafted past the prefix when the student's predicted length has run out: a short
# block, since the sentence is near its end once the length head has underestimated it.
GROWTH = 4


class Verifier(Protocol):
    """What `draft_verify` needs from the AR teacher (`ARModel` has it)."""

    def forced_logits(self, params: Params, encoded: Any, memory_mask: jax.Array,
                      targets: jax.Array) -> jax.Array:
        """Teacher-forced: targets int32[B, T] -> float32[B, T, V], position t the logits of
        the token after targets[:, :t], non-target ids masked."""


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
    tokens: jax.Array  # int32[B, T]: the accepted output, PAD after it
    length: jax.Array  # int32[B]: accepted tokens
    done: jax.Array  # bool[B]
    rounds: jax.Array  # int32[B]
    accepted: jax.Array  # int32[B]


def draft_lengths(predicted: jax.Array, prefix: jax.Array, width: int) -> jax.Array:
    """The length of each row's draft, counting EOS: the predicted length while it leaves at
    least one position after the prefix for EOS, else `GROWTH` tokens past the prefix; at
    most the width. predicted, prefix int32[B] -> int32[B]."""
    grown = jnp.where(predicted > prefix, predicted, prefix + 1 + GROWTH)
    return jnp.minimum(grown, width).astype(jnp.int32)


def accepted_prefix(candidate: jax.Array, logits: jax.Array, start: jax.Array,
                    end: jax.Array, *, top_k: int, margin: float | jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
    """Where verification stops, and the teacher's token there.

    Args:
      candidate: int32[B, T], the prefix then the draft (EOS at end - 1, PAD after).
      logits: float32[B, T, V], the teacher's forced logits over `candidate`.
      start: int32[B], the first drafted position (the prefix's length).
      end: int32[B], the draft's length (EOS included).
      top_k, margin: exact (top_k 1) or tolerant verification (see the module docstring).

    Returns:
      (first int32[B]: the first drafted position not accepted, `end` if all were;
       teacher int32[B, T]: the teacher's argmax at every position).
    """
    teacher = argmax_last(logits)  # [B, T]
    if top_k == 1:
        ok = candidate == teacher  # [B, T]
    else:
        drafted = jnp.take_along_axis(logits, candidate[..., None], axis=-1)  # [B, T, 1]
        rank = jnp.sum(logits > drafted, axis=-1)  # [B, T]: ids strictly more likely
        best = jnp.max(logits, axis=-1)  # [B, T]; log-probability gaps are logit gaps
        ok = (rank < top_k) & (best - drafted[..., 0] <= margin)  # [B, T]
    positions = jnp.arange(candidate.shape[1])[None, :]  # [1, T]
    rejected = ~ok & (positions >= start[:, None]) & (positions < end[:, None])  # [B, T]
    first = jnp.where(jnp.any(rejected, axis=1), argmax_last(rejected), end)  # [B]
    return first.astype(jnp.int32), teacher


@functools.partial(jax.jit, static_argnames=("model", "verifier", "width", "draft_passes",
                                             "top_k"))
def draft_verify(
    model: NARModel,
    params: Params,
    verifier: Verifier,
    verifier_params: Params,
    rescoring: Rescoring,
    *,
    width: int,
    draft_passes: int = 1,
    top_k: int = 1,
    margin: float | jax.Array = 0.0,
    vocab_ids: jax.Array | None = None,
) -> DraftVerifyResult:
    """Decodes a batch by draft and verify (see the module docstring).

    Args:
      model: the student (a `NARModel`, hashable: static under jit); params its parameters.
      verifier: the AR teacher (static); verifier_params its parameters.
      rescoring: the student's candidates (one length per sentence: the first is used) and
        the teacher's encoding of the same sources (`refinement.Rescoring`).
      width: T, the output cap (static).
      draft_passes: student passes per draft, >= 1 (static).
      top_k: 1 for exact verification, else the tolerant variant's top-k (static).
      margin: the tolerant variant's log-probability margin (>= 0).
      vocab_ids: a shortlist the student drafts over (model/shortlist.py); the teacher
        always verifies over all ids, so exactness does not depend on it.

    Returns:
      DraftVerifyResult of B rows.
    """
    if draft_passes < 1 or top_k < 1:
        raise ValueError(f"draft_passes and top_k must be >= 1, got {draft_passes}, {top_k}")
    candidates = rescoring.candidates
    teacher_encoded, teacher_mask = rescoring.encoded
    batch = candidates.lengths.shape[0]
    predicted = candidates.lengths[:, 0]  # [B], counting EOS
    positions = jnp.arange(width)[None, :]  # [1, T]

    def draft(state: _State, length: jax.Array) -> jax.Array:
        """The prefix, then the student's draft up to `length` (EOS there): int32[B, T]."""
        prefix = positions < state.length[:, None]  # [B, T]
        content = ~prefix & (positions < (length - 1)[:, None])  # [B, T]: drafted pieces
        initial = jnp.where(prefix, state.tokens, jnp.where(
            content, MASK_ID, jnp.where(positions == (length - 1)[:, None], EOS_ID, PAD_ID)))
        memory = model.decoder_memory(params, candidates.encoded, candidates.memory_mask,
                                      positions < length[:, None])
        hypothesis, pieces = initial, initial
        for _ in range(draft_passes):
            reading = read_logits(model.pass_logits(params, memory, hypothesis, vocab_ids),
                                  vocab_ids)
            hypothesis, _ = accept_predictions(reading.prediction, initial, content)
            pieces = jnp.where(content, reading.best_real, initial)  # [B, T]
        return pieces.astype(jnp.int32)

    def cond(state: _State) -> jax.Array:
        return ~jnp.all(state.done)

    def body(state: _State) -> _State:
        length = draft_lengths(predicted, state.length, width)  # [B]
        candidate = draft(state, length)  # [B, T]
        logits = verifier.forced_logits(verifier_params, teacher_encoded, teacher_mask,
                                        candidate)  # [B, T, V]
        first, teacher = accepted_prefix(candidate, logits, state.length, length,
                                         top_k=top_k, margin=margin)  # [B], [B, T]
        # Accepted drafted tokens before `first`; the teacher's own token at it.
        own = (positions == first[:, None]) & (first < length)[:, None]  # [B, T]
        kept = positions < first[:, None]  # [B, T]
        tokens = jnp.where(kept, candidate, jnp.where(own, teacher, PAD_ID))  # [B, T]
        new_length = jnp.where(first < length, first + 1, first)  # [B]
        last = jnp.take_along_axis(tokens, (new_length - 1)[:, None], axis=1)[:, 0]  # [B]
        active = ~state.done  # [B]
        keep = active[:, None]
        return _State(
            tokens=jnp.where(keep, tokens, state.tokens),
            length=jnp.where(active, new_length, state.length),
            done=state.done | (active & ((last == EOS_ID) | (new_length >= width))),
            rounds=state.rounds + active.astype(jnp.int32),
            accepted=state.accepted + jnp.where(active, first - state.length, 0),
        )

    zeros = jnp.zeros((batch,), jnp.int32)
    state = jax.lax.while_loop(cond, body, _State(
        tokens=jnp.zeros((batch, width), jnp.int32), length=zeros,
        done=jnp.zeros((batch,), bool), rounds=zeros, accepted=zeros))
    return DraftVerifyResult(tokens=state.tokens, lengths=state.length, rounds=state.rounds,
                             accepted=state.accepted,
                             passes=state.rounds * (draft_passes + 1))
