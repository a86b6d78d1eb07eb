"""Autoregressive search with a KV cache: greedy and beam search (static shapes, jit-able).

`greedy` and `beam` decode an `ARModel` (model/models.py) batch after its encoder;
`predict_greedy` and `predict_beam` a batch of sources (what the training loop's dev
evaluation and the teacher's final dev decoding run). Both searches are pure functions
over a callback

    tokens_to_logits(ids int32[N, 1], cache, context) -> (logits float32[N, V], new cache)

that runs one decoder step for N rows (N = B for greedy, B * K for beam search; the
leaves of the cache and of the context, what the step reads per row and never changes,
such as the encoder's keys and values, have N rows first; scalar leaves such as the cache
index are shared by all rows), and an explicit state carried through `lax.while_loop`.
Both searches decode the rows still unfinished only (model/decoding/compaction.py): once
no more than a quarter of them are, they are gathered, with their cache and context, into a
batch a quarter as large.

Shapes: B batch, K beam size, T max output length, V vocab.

Beam search keeps, per row, K alive hypotheses and a pool of K finished ones. Each step
takes the K best one-token extensions of the alive hypotheses; an extension ending in EOS
moves to the finished pool (scored with the GNMT length penalty ((5 + len) / 6) ** alpha,
len counting EOS) and leaves its alive slot empty for that step. Taking K (not 2K, as
tensor2tensor does) candidates makes beam size 1 exactly greedy search. A row stops when
it has no alive hypothesis left, or its finished pool is full and no alive hypothesis can
still beat the worst finished one (log-probabilities only fall, and with alpha >= 0 the
penalty is largest at length T). Rows that never emit EOS return alive hypotheses of
length T scored at length T.
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp

from components.tokenizer import BOS_ID, EOS_ID, PAD_ID
from model.decoding import compaction
from model.models import ARModel, Batch, output_length
from model.transformer import argmax_last, top_k_last

TokensToLogits = Callable[[jax.Array, Any, Any], tuple[jax.Array, Any]]

# Finite so that sums of it stay comparable and NaN-free.
NEG_INF = -1.0e7


def length_penalty(length: jax.Array, alpha: float | jax.Array) -> jax.Array:
    """GNMT length penalty ((5 + length) / 6) ** alpha; scores are log-prob / penalty."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _ids(columns: jax.Array, vocab_ids: jax.Array | None) -> jax.Array:
    """Logits columns -> token ids (a shortlist maps column i to vocab_ids[i])."""
    return columns if vocab_ids is None else vocab_ids[columns]


def greedy_search(
    tokens_to_logits: TokensToLogits,
    cache: Any,
    context: Any = (),
    *,
    batch_size: int,
    max_len: int,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    vocab_ids: jax.Array | None = None,
) -> jax.Array:
    """Greedy decoding: argmax each step, a row stops at its EOS.

    The loop runs over the batch's unfinished rows only (`compaction.while_unfinished`).

    Args:
      tokens_to_logits: the one-step callback (see module docstring).
      cache: the initial (empty) cache for B rows.
      context: what the callback reads per row besides its cache, B rows.
      batch_size: B.
      max_len: T.
      vocab_ids: int32[K], the id of each logits column when the callback scores a
        shortlist (default: column i is id i).

    Returns:
      int32[B, T]: ids up to and including EOS, PAD_ID after it.
    """

    def cond(state):
        step, done = state[0], state[3]
        return (step < max_len) & ~jnp.all(done)

    def body(state, context):
        step, tokens, last, done, cache, rows = state
        logits, cache = tokens_to_logits(last, cache, context)  # [N, V]
        next_ids = _ids(argmax_last(logits), vocab_ids)  # [N]
        next_ids = jnp.where(done, PAD_ID, next_ids)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, next_ids[:, None], step, axis=1)
        done = done | (next_ids == eos_id)
        return step + 1, tokens, next_ids[:, None], done, cache, rows

    state = (
        jnp.array(0, jnp.int32),  # step
        jnp.zeros((batch_size, max_len), jnp.int32),  # tokens [N, T]
        jnp.full((batch_size, 1), bos_id, jnp.int32),  # last [N, 1]
        jnp.zeros((batch_size,), bool),  # done [N]
        cache,
        jnp.arange(batch_size),  # rows [N]: each decoding row's row of the batch
    )

    def collect(output, state):
        tokens, rows = state[1], state[-1]
        return output.at[rows].set(tokens)

    return compaction.while_unfinished(
        cond, body, state, context, rows=batch_size, done=lambda state: state[3],
        take=compaction.take_each, collect=collect,
        result=jnp.zeros((batch_size, max_len), jnp.int32))


@flax.struct.dataclass
class BeamState:
    """The loop state of `beam_search` over the N sentences decoding (sequences carry BOS
    at position 0)."""

    step: jax.Array  # int32[]: tokens generated so far
    alive_seqs: jax.Array  # int32[N, K, T + 1]
    alive_log_probs: jax.Array  # float32[N, K]; NEG_INF marks an empty slot
    finished_seqs: jax.Array  # int32[N, K, T + 1]
    finished_scores: jax.Array  # float32[N, K], length-penalised; NEG_INF if empty
    finished_flags: jax.Array  # bool[N, K]
    done: jax.Array  # bool[N]
    cache: Any  # leaves [N * K, ...]
    rows: jax.Array  # int32[N]: each sentence's row of the batch


# What a sentence's search leaves: its hypotheses, alive and finished.
_RESULT_FIELDS = ("alive_seqs", "alive_log_probs", "finished_seqs", "finished_scores",
                  "finished_flags")


def _gather_beams(x: jax.Array, beam_indices: jax.Array) -> jax.Array:
    """x: [B, K_in, ...], beam_indices: int[B, K_out] -> [B, K_out, ...]."""
    index = beam_indices.reshape(beam_indices.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def _gather_cache(cache: Any, beam_indices: jax.Array) -> Any:
    """Reorders cache leaves [B * K, ...] by int[B, K] beam indices; scalars are shared.
    A gather of whole rows: `take_along_axis` over the beam axis reads every beam of a
    sentence for each row it writes (XLA:CPU selects among them), 4x the bytes at K 4."""
    batch, beams = beam_indices.shape
    rows = (jnp.arange(batch)[:, None] * beams + beam_indices).reshape(-1)  # [B * K]
    return compaction.take_rows(cache, rows)


def _take_sentences(state: BeamState, context: Any, keep: jax.Array
                    ) -> tuple[BeamState, Any]:
    """The sentences `keep` int[M] of `state`, and their beams' rows of its cache and of
    the `context`."""
    beams = state.alive_seqs.shape[1]
    fields = {name: compaction.take_rows(getattr(state, name), keep)
              for name in _RESULT_FIELDS + ("done", "rows")}
    rows = (keep[:, None] * beams + jnp.arange(beams)).reshape(-1)  # [M * K]
    return (BeamState(step=state.step, cache=compaction.take_rows(state.cache, rows), **fields),
            compaction.take_rows(context, rows))


def beam_search(
    tokens_to_logits: TokensToLogits,
    cache: Any,
    context: Any = (),
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    alpha: float | jax.Array = 0.6,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    vocab_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Beam search with the GNMT length penalty.

    Like `greedy_search`, the loop runs over the sentences still searching only
    (`compaction.while_unfinished`), their beams' cache rows with them.

    Args:
      tokens_to_logits: the one-step callback for B * K rows (row b * K + k is beam k of
        example b). Logits of ids that must never be emitted should be masked by it.
      cache: the initial (empty) cache for B * K rows: reordered by the beams each step.
      context: what the callback reads per row besides its cache, B * K rows (the beams
        of a sentence share it: never reordered).
      batch_size: B.
      beam_size: K.
      max_len: T.
      alpha: length penalty exponent, >= 0 (0 = plain log-probability).
      vocab_ids: as `greedy_search` (probabilities are then over the shortlist).

    Returns:
      sequences int32[B, K, T] (ids up to EOS, then PAD_ID), best first, and their scores
      float32[B, K] (sorted, descending).
    """
    beams = beam_size
    final_penalty = length_penalty(max_len, alpha)

    def cond(state: BeamState) -> jax.Array:
        return (state.step < max_len) & ~jnp.all(state.done)

    def body(state: BeamState, context: Any) -> BeamState:
        step, batch = state.step, state.done.shape[0]
        ids = jax.lax.dynamic_slice_in_dim(state.alive_seqs, step, 1, axis=2)  # [N, K, 1]
        logits, cache = tokens_to_logits(ids.reshape(batch * beams, 1), state.cache, context)
        logits = logits.astype(jnp.float32).reshape(batch, beams, -1)  # [N, K, V]
        vocab = logits.shape[-1]
        # log p = logit - logsumexp: the candidates' scores without a [N, K, V] log_softmax.
        offset = state.alive_log_probs - jax.nn.logsumexp(logits, axis=-1)  # [N, K]
        candidates = logits + offset[:, :, None]  # [N, K, V]
        top_log_probs, top_index = top_k_last(candidates.reshape(batch, beams * vocab), beams)
        origin = top_index // vocab  # [N, K] alive beam each candidate extends
        token = _ids((top_index % vocab).astype(jnp.int32), vocab_ids)  # [N, K]
        seqs = _gather_beams(state.alive_seqs, origin)  # [N, K, T + 1]
        seqs = jax.lax.dynamic_update_slice_in_dim(seqs, token[:, :, None], step + 1, axis=2)
        cache = _gather_cache(cache, origin)
        # Extensions of empty slots carry ~NEG_INF and are not hypotheses.
        real = top_log_probs > NEG_INF / 2  # [N, K]
        ended = real & (token == eos_id)  # [N, K]
        alive_log_probs = jnp.where(real & ~ended, top_log_probs, NEG_INF)  # [N, K]

        new_scores = jnp.where(ended, top_log_probs / length_penalty(step + 1, alpha), NEG_INF)
        pool_seqs = jnp.concatenate([state.finished_seqs, seqs], axis=1)  # [N, 2K, T + 1]
        pool_scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)  # [N, 2K]
        pool_flags = jnp.concatenate([state.finished_flags, ended], axis=1)  # [N, 2K]
        finished_scores, keep = jax.lax.top_k(pool_scores, beams)  # [N, K]
        finished_seqs = _gather_beams(pool_seqs, keep)  # [N, K, T + 1]
        finished_flags = _gather_beams(pool_flags, keep)  # [N, K]
        # A row that is done keeps its finished pool as it was.
        frozen = state.done
        finished_seqs = jnp.where(frozen[:, None, None], state.finished_seqs, finished_seqs)
        finished_scores = jnp.where(frozen[:, None], state.finished_scores, finished_scores)
        finished_flags = jnp.where(frozen[:, None], state.finished_flags, finished_flags)

        best_alive_bound = jnp.max(alive_log_probs, axis=1) / final_penalty  # [N]
        worst_finished = jnp.min(finished_scores, axis=1)  # [N]
        no_alive = jnp.all(alive_log_probs <= NEG_INF / 2, axis=1)  # [N]
        cannot_improve = jnp.all(finished_flags, axis=1) & (worst_finished >= best_alive_bound)
        return BeamState(
            step=step + 1,
            alive_seqs=seqs,
            alive_log_probs=alive_log_probs,
            finished_seqs=finished_seqs,
            finished_scores=finished_scores,
            finished_flags=finished_flags,
            done=state.done | no_alive | cannot_improve,
            cache=cache,
            rows=state.rows,
        )

    seqs = jnp.zeros((batch_size, beams, max_len + 1), jnp.int32).at[:, :, 0].set(bos_id)
    # Only beam 0 is alive at first, so the first step does not pick K copies of one token.
    alive_log_probs = jnp.tile(
        jnp.array([0.0] + [NEG_INF] * (beams - 1), jnp.float32), (batch_size, 1)
    )
    state = BeamState(
        step=jnp.array(0, jnp.int32),
        alive_seqs=seqs,
        alive_log_probs=alive_log_probs,
        finished_seqs=seqs,
        finished_scores=jnp.full((batch_size, beams), NEG_INF, jnp.float32),
        finished_flags=jnp.zeros((batch_size, beams), bool),
        done=jnp.zeros((batch_size,), bool),
        cache=cache,
        rows=jnp.arange(batch_size),
    )
    def collect(result, state):
        return {name: value.at[state.rows].set(getattr(state, name))
                for name, value in result.items()}

    result = compaction.while_unfinished(
        cond, body, state, context, rows=batch_size, done=lambda state: state.done,
        take=_take_sentences, collect=collect,
        result={name: getattr(state, name) for name in _RESULT_FIELDS})

    # Rows with no finished hypothesis fall back to their alive ones (length T, no EOS).
    any_finished = jnp.any(result["finished_flags"], axis=1)  # [B]
    seqs = jnp.where(any_finished[:, None, None], result["finished_seqs"],
                     result["alive_seqs"])
    scores = jnp.where(any_finished[:, None], result["finished_scores"],
                       result["alive_log_probs"] / final_penalty)
    scores, order = jax.lax.top_k(scores, beams)  # [B, K], descending
    return _gather_beams(seqs, order)[:, :, 1:], scores


def _model_step(model: ARModel, params: Any, vocab_ids: jax.Array | None) -> TokensToLogits:
    """The searches' callback for `model`, its context (memory, memory_mask): `memory`'s
    cross-attention keys and values and the encoder output's mask."""

    def tokens_to_logits(ids, cache, context):
        memory, memory_mask = context
        return model.make_tokens_to_logits(params, memory, memory_mask, vocab_ids)(ids, cache)

    return tokens_to_logits


def greedy(model: ARModel, params: Any, encoded: jax.Array, memory_mask: jax.Array,
           max_len: int, vocab_ids: jax.Array | None = None) -> jax.Array:
    """Greedy decoding of an encoded batch (`ARModel.encode`); the loop stops when every
    row has emitted EOS. `vocab_ids`: a shortlist to decode over (default: all ids).
    Returns int32[B, max_len]: ids up to and including EOS, then 0."""
    return greedy_search(
        _model_step(model, params, vocab_ids),
        model.init_cache(params, encoded, memory_mask, max_len),
        (model.memory(params, encoded, memory_mask), memory_mask),
        batch_size=encoded.shape[0], max_len=max_len, vocab_ids=vocab_ids)


def beam(model: ARModel, params: Any, encoded: jax.Array, memory_mask: jax.Array,
         max_len: int, beam_size: int, length_penalty: float = 0.6,
         vocab_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Beam search of an encoded batch (GNMT length penalty exponent `length_penalty`
    >= 0; `vocab_ids` as `greedy`): the best hypothesis int32[B, max_len] and its
    length-penalised log-probability float32[B]. `beam_size` must be static under jit."""
    batch_size = encoded.shape[0]
    # Row b * K + k is beam k of example b.
    encoded = jnp.repeat(encoded, beam_size, axis=0)  # [B * K, S, D]
    memory_mask = jnp.repeat(memory_mask, beam_size, axis=0)  # [B * K, S]
    seqs, scores = beam_search(
        _model_step(model, params, vocab_ids),
        model.init_cache(params, encoded, memory_mask, max_len),
        (model.memory(params, encoded, memory_mask), memory_mask),
        batch_size=batch_size, beam_size=beam_size, max_len=max_len, alpha=length_penalty,
        vocab_ids=vocab_ids)  # [B, K, T], [B, K]
    return seqs[:, 0], scores[:, 0]


def predict_greedy(model: ARModel, params: Any, batch: Batch) -> jax.Array:
    """Greedy decoding of `batch["source"]` into its target width (else max_target_len):
    int32[B, T]."""
    encoded, memory_mask = model.encode(params, batch["source"])
    return greedy(model, params, encoded, memory_mask, output_length(model.config, batch))


def predict_beam(model: ARModel, params: Any, batch: Batch, beam_size: int,
                 length_penalty: float = 0.6) -> tuple[jax.Array, jax.Array]:
    """Beam search of `batch["source"]` (as `beam`) into its target width (else
    max_target_len)."""
    encoded, memory_mask = model.encode(params, batch["source"])
    return beam(model, params, encoded, memory_mask, output_length(model.config, batch),
                beam_size, length_penalty)
