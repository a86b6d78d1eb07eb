"""Non-autoregressive decoders for the PaDIR student (jitted, static shapes, batched).

Decoding is two jitted calls with a host decision between them, because the output width
that a batch needs is known only once its lengths are predicted:

    candidates = predict_candidates(model, params, source, num_length_candidates=1,
                                    length_offsets=(-1, 0, 1), max_len=32)
    width = output_width(candidates.lengths, max_len=32)     # host: a multiple of 8
    result = refine(model, params, candidates, width=width, max_iterations=4)
    result = mask_predict(model, params, candidates, width=width, iterations=10)
    result = refine_rescored(model, params, teacher, teacher_params,
                             Rescoring(candidates, teacher.encode(teacher_params, source)),
                             width=width, max_iterations=4)   # the teacher picks the candidate
    result = adaptive(model, params, candidates, width=width, tokens_per_step=2)
    result.tokens, result.scores, result.passes, result.lengths

`predict_candidates` runs the encoder and the length head once per batch; each decoder then
compiles once per width it meets (a handful: `WIDTH_STEP` apart). A pass's cost grows with
its rows (candidates x width), so the width follows the longest candidate, not the source.

The model is anything with the `NARModel` protocol (`PaDIRModel` has it); tests plug in
oracles whose logits do not depend on a network. What a pass reuses (the encoder output's
cross-attention keys and values, positional attention) is computed once per batch by
`model.decoder_memory` and read by every pass.

Shapes: B sentences, C = num_length_candidates * len(length_offsets) candidates per
sentence, N = B * C flattened rows (row b * C + c is candidate c of sentence b), T output
width, V vocabulary.

Definitions shared by the three decoders:

* **Candidate lengths** (counting EOS): the `num_length_candidates` most likely length
  classes among the feasible ones (lengths 2..max_len: at least one token before EOS), each
  plus every offset, clipped to [2, max_len]. Clipping can make two candidates equal; they
  are decoded anyway (static shapes), and ties in score go to the first.
* **Width**: T >= every candidate length of the batch. Positions past a row's EOS are PAD,
  which no attention reads, so a row decodes to the same tokens at any such T.
* **Layout**: for a candidate of length L, positions 0..L-2 hold tokens ("content"),
  position L-1 holds EOS, positions >= L hold PAD, in every hypothesis and in the output.
* **Distribution**: the logits are restricted to target ids (`mask_non_target_ids`: never
  PAD, BOS, MASK, LENGTH); probabilities are the softmax over them. With a shortlist
  (`vocab_ids`, model/decoding/shortlist.py) every decoder scores only those ids: logits are
  [N, T, K], column i is id vocab_ids[i], and the softmax is over the shortlist.
* **Output tokens** at content positions are real pieces only (ids >= NUM_RESERVED: never
  EOS or UNK inside a sentence), so a decoded row is `pieces..., EOS, PAD...`.
* **Score** of a candidate: the mean over its L positions (content and EOS) of the
  log-probability of the output token; for refinement under the row's final pass, for
  Mask-Predict and adaptive order when the token was (last) predicted, EOS's under the
  row's last pass. The candidate with the best score is returned for each sentence.
* **Passes** per sentence: the decoder passes run while any of its candidates was still
  decoding (they run together as one batch, so a sentence costs its slowest candidate).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import flax
import jax
import jax.numpy as jnp
import numpy as np

from components.tokenizer import EOS_ID, MASK_ID, NUM_RESERVED
from model.models import masked_hypothesis
from model.transformer import NON_TARGET_IDS, mask_non_target_ids, max_and_argmax, sum_exp

Params = Any
LogitsFn = Callable[[jax.Array], jax.Array]

MIN_LENGTH = 2  # counting EOS: a candidate has at least one token
WIDTH_STEP = 8  # output widths are multiples of this: few compilations, little padding


class NARModel(Protocol):
    """What the decoders need from a model (`PaDIRModel` has it).

    `config.max_target_len` is the number of length classes; `encode` may return any
    pytree whose leaves have B rows first (the decoders repeat each row C times).
    """

    config: Any  # .max_target_len
    vocab_size: int
    first_real_id: int

    def encode(self, params: Params, source: jax.Array) -> tuple[Any, jax.Array]:
        """source int32[B, S] -> (encoded, memory_mask), leaves with B rows first."""

    def length_logits(self, params: Params, encoded: Any) -> jax.Array:
        """float32[B, max_target_len]; class c is a length of c + 1 counting EOS."""

    def decoder_memory(
        self, params: Params, encoded: Any, memory_mask: jax.Array, valid: jax.Array
    ) -> Any:
        """What every pass over N rows reuses; valid bool[N, T] marks the non-PAD positions
        (the same in every pass)."""

    def pass_logits(self, params: Params, memory: Any, hypothesis: jax.Array,
                    vocab_ids: jax.Array | None = None) -> jax.Array:
        """One decoder pass: hypothesis int32[N, T] -> logits float32[N, T, V]; with a
        shortlist vocab_ids int32[K] (reserved ids first), [N, T, K] for those ids. The
        non-target ids are not masked: `read_logits` leaves them out."""


@flax.struct.dataclass
class Candidates:
    """A batch encoded once, with its candidate lengths (`predict_candidates`)."""

    encoded: Any  # model.encode's output, leaves with B rows first
    memory_mask: jax.Array  # bool[B, S']
    lengths: jax.Array  # int32[B, C], counting EOS


@flax.struct.dataclass
class DecodeResult:
    """The chosen candidate of each sentence."""

    tokens: jax.Array  # int32[B, T]: real pieces, EOS at lengths - 1, PAD after
    scores: jax.Array  # float32[B]: mean log-probability over the L tokens (EOS included)
    passes: jax.Array  # int32[B]: decoder passes run (see each decoder)
    lengths: jax.Array  # int32[B]: chosen length, counting EOS


# --- candidates and width -----------------------------------------------------------


def candidate_lengths(
    length_logits: jax.Array, num_candidates: int, offsets: tuple[int, ...], max_len: int
) -> jax.Array:
    """The candidate lengths of each sentence (see the module docstring).

    Args:
      length_logits: float[B, K]; class c is a length of c + 1 counting EOS.
      num_candidates: k, how many of the most likely feasible classes to take.
      offsets: added to each of them, e.g. (-1, 0, 1).
      max_len: the longest length allowed.

    Returns:
      int32[B, k * len(offsets)]: candidate i * len(offsets) + j is the i-th most likely
      length plus offsets[j], clipped to [MIN_LENGTH, max_len].
    """
    lengths = jnp.arange(1, length_logits.shape[-1] + 1)  # [K]
    feasible = (lengths >= MIN_LENGTH) & (lengths <= max_len)  # [K]
    logits = jnp.where(feasible, length_logits.astype(jnp.float32), -jnp.inf)  # [B, K]
    _, top = jax.lax.top_k(logits, num_candidates)  # [B, k]
    lengths = (top + 1)[:, :, None] + jnp.asarray(offsets, jnp.int32)  # [B, k, O]
    lengths = jnp.clip(lengths, MIN_LENGTH, max_len)  # [B, k, O]
    return lengths.reshape(lengths.shape[0], -1).astype(jnp.int32)  # [B, C]


@functools.partial(
    jax.jit, static_argnames=("model", "num_length_candidates", "length_offsets", "max_len")
)
def predict_candidates(
    model: NARModel,
    params: Params,
    source: jax.Array,
    *,
    num_length_candidates: int,
    length_offsets: tuple[int, ...],
    max_len: int | None = None,
) -> Candidates:
    """Encodes a batch and picks its candidate lengths: the first of the two calls.

    Args:
      model: a `NARModel` (hashable: static under jit).
      params: the model's parameters.
      source: int32[B, S] ids + EOS, 0-padded.
      num_length_candidates: k most likely lengths (static).
      length_offsets: a tuple added to each, e.g. (-1, 0, 1) (static).
      max_len: the longest candidate (static; default `model.config.max_target_len`).
    """
    max_len = model.config.max_target_len if max_len is None else max_len
    if not MIN_LENGTH <= max_len <= model.config.max_target_len:
        raise ValueError(
            f"max_len {max_len} outside [{MIN_LENGTH}, {model.config.max_target_len}]")
    feasible = max_len - MIN_LENGTH + 1  # lengths MIN_LENGTH..max_len
    if not 1 <= num_length_candidates <= feasible:
        raise ValueError(f"num_length_candidates {num_length_candidates} outside [1, {feasible}]")
    encoded, memory_mask = model.encode(params, source)  # leaves [B, ...]
    lengths = candidate_lengths(
        model.length_logits(params, encoded), num_length_candidates, tuple(length_offsets),
        max_len)  # [B, C]
    return Candidates(encoded=encoded, memory_mask=memory_mask, lengths=lengths)


def output_width(lengths: Any, max_len: int) -> int:
    """The width T of a batch (host side): its longest candidate length rounded up to a
    multiple of `WIDTH_STEP`, at most `max_len`. lengths: int[B, C], on device or host."""
    longest = int(np.max(np.asarray(lengths)))
    return min(max_len, -(-longest // WIDTH_STEP) * WIDTH_STEP)


# --- shared pieces ------------------------------------------------------------------


def _layout(lengths: jax.Array, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """lengths int32[N] -> (content, eos, valid) bool[N, T]."""
    positions = jnp.arange(width)[None, :]  # [1, T]
    eos_at = (lengths - 1)[:, None]  # [N, 1]
    return positions < eos_at, positions == eos_at, positions <= eos_at


@flax.struct.dataclass
class PassReading:
    """What the decoders read from one pass's logits, without a [N, T, V] log-softmax:
    a max and argmax over the real pieces, a max over the few reserved ids, one exp-sum."""

    prediction: jax.Array  # int32[N, T]: argmax over all target ids (ties: lowest id)
    best_real: jax.Array  # int32[N, T]: the most likely real piece (id >= NUM_RESERVED)
    best_real_log_prob: jax.Array  # float32[N, T]
    eos_log_prob: jax.Array  # float32[N, T]


def read_logits(logits: jax.Array, vocab_ids: jax.Array | None = None) -> PassReading:
    """float[N, T, V] logits -> PassReading (probabilities over target ids only).

    The logits are the network's own (`NARModel.pass_logits`: non-target ids not masked);
    every reduction leaves the reserved ids out on the vocabulary's first block alone
    (`transformer.max_and_argmax`), because a mask over [N, T, V] fused into a reduction
    costs XLA:CPU several times the reduction. With a shortlist, logits are [N, T, K] and
    column i is id vocab_ids[i] (ids sorted, so the reserved ids keep their columns);
    probabilities are then over the shortlist.
    """
    logits = logits.astype(jnp.float32)
    real_max, index = max_and_argmax(logits, range(NUM_RESERVED))  # [N, T]: a column
    reserved = mask_non_target_ids(logits[..., :NUM_RESERVED])  # [N, T, R]: EOS, UNK
    reserved_max = jnp.max(reserved, axis=-1)  # [N, T]
    top = jnp.maximum(real_max, reserved_max)  # [N, T]: the max over all target ids
    log_sum = jnp.log(sum_exp(logits, top, NON_TARGET_IDS))  # [N, T]
    best_real = index if vocab_ids is None else vocab_ids[index]  # [N, T]: its id
    prediction = jnp.where(
        reserved_max >= real_max, jnp.argmax(reserved, axis=-1).astype(jnp.int32), best_real)
    return PassReading(
        prediction=prediction,
        best_real=best_real,
        best_real_log_prob=(real_max - top) - log_sum,  # [N, T]
        eos_log_prob=(logits[..., EOS_ID] - top) - log_sum,  # [N, T]
    )


def _logits_fn(model: NARModel, params: Params, candidates: Candidates, width: int,
               vocab_ids: jax.Array | None) -> tuple[LogitsFn, jax.Array]:
    """Repeats the encoding per candidate and builds the pass-invariant memory once.

    Returns (logits_fn: int32[N, T] -> float[N, T, V] (or [N, T, K] for a shortlist
    vocab_ids int32[K]), lengths int32[N]).
    """
    lengths = candidates.lengths.reshape(-1)  # [N]
    repeats = candidates.lengths.shape[1]
    encoded, memory_mask = jax.tree.map(
        lambda x: jnp.repeat(x, repeats, axis=0), (candidates.encoded, candidates.memory_mask)
    )  # leaves [N, ...]
    _, _, valid = _layout(lengths, width)  # [N, T]
    memory = model.decoder_memory(params, encoded, memory_mask, valid)

    def logits_fn(hypothesis: jax.Array) -> jax.Array:
        return model.pass_logits(params, memory, hypothesis, vocab_ids)  # [N, T, V or K]

    return logits_fn, lengths


def _choose(
    tokens: jax.Array,
    token_log_probs: jax.Array,
    passes: jax.Array,
    lengths: jax.Array,
    batch_size: int,
) -> DecodeResult:
    """Scores the N candidates and keeps the best one per sentence.

    tokens int32[N, T], token_log_probs float32[N, T] (0 where not counted), passes and
    lengths int32[N] -> DecodeResult of B rows.
    """
    _, _, valid = _layout(lengths, tokens.shape[1])  # [N, T]
    total = jnp.sum(jnp.where(valid, token_log_probs, 0.0), axis=1)  # [N]
    scores = (total / lengths).reshape(batch_size, -1)  # [B, C]
    best = jnp.argmax(scores, axis=1)  # [B]

    def pick(x: jax.Array) -> jax.Array:  # [N, ...] -> [B, ...], the best candidate's
        split = x.reshape((batch_size, scores.shape[1]) + x.shape[1:])  # [B, C, ...]
        index = best.reshape((batch_size, 1) + (1,) * (x.ndim - 1))  # [B, 1, ...]
        return jnp.take_along_axis(split, index, axis=1)[:, 0]

    return DecodeResult(
        tokens=pick(tokens),  # [B, T]
        scores=pick(scores.reshape(-1)),  # [B]
        passes=jnp.max(passes.reshape(batch_size, -1), axis=1).astype(jnp.int32),  # [B]
        lengths=pick(lengths),  # [B]
    )


# --- PaDIR refinement ---------------------------------------------------------------


def accept_predictions(
    predictions: jax.Array, initial: jax.Array, content: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The next refinement input: accepted predictions, the initial token elsewhere.

    A prediction at a content position is *rejected* if it is a reserved id
    (< NUM_RESERVED: EOS or UNK inside the sentence; PAD and the control ids cannot win
    the masked argmax, but would be rejected too), and *stutters* if it equals the
    prediction at the position to its left (so "a a a" keeps the first "a" only).
    Rejected and stuttering positions go back to their initial token, [MASK]. EOS and
    PAD positions always keep their initial token.

    Args:
      predictions: int32[N, T], the argmax over target ids of the last pass.
      initial: int32[N, T], the initial hypothesis (initial tokens, EOS, PAD).
      content: bool[N, T], the positions before EOS.

    Returns:
      (hypothesis int32[N, T], accepted bool[N, T]).
    """
    left = jnp.pad(predictions[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # [N, T]
    rejected = predictions < NUM_RESERVED  # [N, T]
    stutter = predictions == left  # [N, T]
    accepted = content & ~rejected & ~stutter  # [N, T]
    return jnp.where(accepted, predictions, initial), accepted


@flax.struct.dataclass
class RefineState:
    """The loop state of `refine`."""

    step: jax.Array  # int32[]: passes run so far (on the whole batch)
    hypothesis: jax.Array  # int32[N, T]: the next pass's input
    tokens: jax.Array  # int32[N, T]: the output of the row's last pass
    token_log_probs: jax.Array  # float32[N, T]: of `tokens` under that pass
    passes: jax.Array  # int32[N]: passes run while the row was not converged
    converged: jax.Array  # bool[N]


def refine_loop(
    logits_fn: LogitsFn, initial: jax.Array, lengths: jax.Array, max_iterations: int,
    vocab_ids: jax.Array | None = None,
) -> RefineState:
    """Runs refinement passes on N rows until each is converged or T passes have run.

    Args:
      logits_fn: hypothesis int32[N, T] -> logits float[N, T, V] (or [N, T, K] over the
        shortlist `vocab_ids`, see `read_logits`).
      initial: int32[N, T], the initial hypothesis (initial tokens, EOS, PAD).
      lengths: int32[N], counting EOS (consistent with `initial`).
      max_iterations: the most passes.

    Returns:
      The final RefineState (see `refine` for the definitions).
    """
    num_rows, width = initial.shape
    content, eos, _ = _layout(lengths, width)  # [N, T] each

    def cond(state: RefineState) -> jax.Array:
        return (state.step < max_iterations) & ~jnp.all(state.converged)

    def body(state: RefineState) -> RefineState:
        reading = read_logits(logits_fn(state.hypothesis), vocab_ids)  # [N, T] each
        hypothesis, _ = accept_predictions(reading.prediction, initial, content)  # [N, T]
        tokens = jnp.where(content, reading.best_real, initial)  # [N, T]: pieces, EOS, PAD
        token_log_probs = jnp.where(
            content, reading.best_real_log_prob, jnp.where(eos, reading.eos_log_prob, 0.0)
        )  # [N, T]
        active = ~state.converged  # [N]
        changed = jnp.any(hypothesis != state.hypothesis, axis=1)  # [N]
        keep = active[:, None]  # [N, 1]
        return RefineState(
            step=state.step + 1,
            hypothesis=jnp.where(keep, hypothesis, state.hypothesis),  # [N, T]
            tokens=jnp.where(keep, tokens, state.tokens),  # [N, T]
            token_log_probs=jnp.where(keep, token_log_probs, state.token_log_probs),  # [N, T]
            passes=state.passes + active.astype(jnp.int32),  # [N]
            converged=state.converged | (active & ~changed),  # [N]
        )

    state = RefineState(
        step=jnp.array(0, jnp.int32),
        hypothesis=initial,  # [N, T]
        tokens=initial,  # [N, T]
        token_log_probs=jnp.zeros((num_rows, width), jnp.float32),  # [N, T]
        passes=jnp.zeros((num_rows,), jnp.int32),  # [N]
        converged=jnp.zeros((num_rows,), bool),  # [N]
    )
    return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames=("model", "width", "max_iterations"))
def refine(
    model: NARModel,
    params: Params,
    candidates: Candidates,
    *,
    width: int,
    max_iterations: int,
    vocab_ids: jax.Array | None = None,
) -> DecodeResult:
    """PaDIR decoding by parallel iterative refinement.

    Each candidate starts from [MASK] before its EOS. Each iteration is one decoder pass that re-predicts every position (argmax over target
    ids); the next input keeps the accepted predictions and puts the initial token back
    where a prediction was rejected or stuttered (`accept_predictions`). EOS stays at the
    candidate length.

    Convergence is per row: a row whose pass leaves its hypothesis unchanged (a fixed
    point) is converged and frozen while the other rows go on; the loop stops when all
    rows are converged or after `max_iterations` passes.

    Output: the row's last pass's most likely real piece at every content position (where
    the prediction was accepted this is the prediction itself; where it was rejected or
    stuttered it is the best real piece, so the output holds no reserved id), EOS, PAD.

    Passes: per row, every pass run until it converged, the confirming pass (the one that
    left the row unchanged) included; a row that converges at pass t (an oracle: t = 2)
    counts t, one that never converges `max_iterations`. Per sentence: the maximum over
    its candidates, i.e. the decoder runs it cost.

    Args:
      model: a `NARModel` (hashable: static under jit).
      params: the model's parameters.
      candidates: from `predict_candidates`.
      width: T >= every candidate length (static; `output_width`).
      max_iterations: the most passes, >= 1 (static).
      vocab_ids: int32[K], a shortlist to decode over (model/decoding/shortlist.py: sorted, the
        reserved ids first); default all ids.

    Returns:
      DecodeResult of B rows.
    """
    state, lengths = _refine_rows(model, params, candidates, width=width,
                                  max_iterations=max_iterations, vocab_ids=vocab_ids)
    return _choose(state.tokens, state.token_log_probs, state.passes, lengths,
                   candidates.lengths.shape[0])


def _refine_rows(model: NARModel, params: Params, candidates: Candidates, *, width: int,
                 max_iterations: int, vocab_ids: jax.Array | None
                 ) -> tuple[RefineState, jax.Array]:
    """`refine` of every candidate, before the choice: (final RefineState of N rows,
    lengths int32[N])."""
    if max_iterations < 1:
        raise ValueError(f"max_iterations must be >= 1, got {max_iterations}")
    logits_fn, lengths = _logits_fn(model, params, candidates, width, vocab_ids)  # [N]
    initial = masked_hypothesis(lengths, width)  # [N, T]: MASK, EOS, PAD
    return refine_loop(logits_fn, initial, lengths, max_iterations, vocab_ids), lengths


# --- length candidates rescored by an AR model --------------------------------------


class Rescorer(Protocol):
    """What `refine_rescored` needs from the AR teacher (`ARModel` has it)."""

    def encode(self, params: Params, source: jax.Array) -> tuple[Any, jax.Array]:
        """source int32[B, S] -> (encoded, memory_mask), leaves with B rows first."""

    def target_log_probs(self, params: Params, encoded: Any, memory_mask: jax.Array,
                         targets: jax.Array) -> jax.Array:
        """Teacher-forced: targets int32[N, T] -> log-probabilities float32[N, T]."""


@flax.struct.dataclass
class Rescoring:
    """A batch's candidates with the rescorer's encoding of the same sources."""

    candidates: Candidates
    encoded: Any  # (encoded, memory_mask) of `Rescorer.encode`, leaves with B rows first

    @property
    def lengths(self) -> jax.Array:
        """int32[B, C]: the candidates' lengths (what `output_width` reads)."""
        return self.candidates.lengths


@functools.partial(
    jax.jit, static_argnames=("model", "rescorer", "width", "max_iterations"))
def refine_rescored(
    model: NARModel,
    params: Params,
    rescorer: Rescorer,
    rescorer_params: Params,
    rescoring: Rescoring,
    *,
    width: int,
    max_iterations: int,
    vocab_ids: jax.Array | None = None,
) -> DecodeResult:
    """Noisy parallel decoding (Gu et al. 2018; fairseq's
    `--iter-decode-with-external-reranker`): `refine` every length candidate as one batch,
    score each finished candidate with the AR `rescorer` in one teacher-forced pass (no
    search), keep the one the rescorer finds most likely.

    Score: the rescorer's mean log-probability over the candidate's L tokens (EOS
    included), the refinement's own score replaced. Passes: the refinement's (as `refine`)
    plus the rescorer's one pass. The shortlist `vocab_ids` restricts the refinement; the
    rescorer scores over all ids. With one candidate per sentence the tokens are
    `refine`'s.

    Args:
      model, params, width, max_iterations, vocab_ids: as `refine`.
      rescorer: the AR model (hashable: static under jit); rescorer_params its parameters.
      rescoring: the candidates and the rescorer's encoding of their sources.

    Returns:
      DecodeResult of B rows.
    """
    candidates = rescoring.candidates
    state, lengths = _refine_rows(model, params, candidates, width=width,
                                  max_iterations=max_iterations,
                                  vocab_ids=vocab_ids)  # [N, T] rows, lengths [N]
    encoded, memory_mask = jax.tree.map(
        lambda x: jnp.repeat(x, candidates.lengths.shape[1], axis=0), rescoring.encoded
    )  # leaves [N, ...]
    log_probs = rescorer.target_log_probs(rescorer_params, encoded, memory_mask,
                                          state.tokens)  # [N, T]
    return _choose(state.tokens, log_probs, state.passes + 1, lengths,
                   candidates.lengths.shape[0])


def predict_refined(model: NARModel, params: Params, batch: dict[str, jax.Array], *,
                    max_iterations: int) -> jax.Array:
    """`refine` of a batch at its own target width from the most likely length: the
    decoding a student's dev BLEU is measured with during training (the test set's PaDIR-k
    with one length candidate, in one jittable call). Returns int32[B, T]."""
    width = batch["target"].shape[1]
    candidates = predict_candidates(model, params, batch["source"], num_length_candidates=1,
                                    length_offsets=(0,), max_len=width)
    return refine(model, params, candidates, width=width, max_iterations=max_iterations).tokens


# The student's dev BLEU during training is of PaDIR-4 (the refinement the test set's
# headline figure decodes with), not of a single pass.
DEV_ITERATIONS = 4


def dev_predict(model: NARModel) -> Callable[[Params, dict[str, jax.Array]], jax.Array]:
    """The student's dev decoding while it trains: `predict_refined` at DEV_ITERATIONS."""
    return functools.partial(predict_refined, model, max_iterations=DEV_ITERATIONS)


# --- Mask-Predict ---------------------------------------------------------------------


def lowest_ranked(values: jax.Array, candidates: jax.Array, counts: jax.Array) -> jax.Array:
    """Per row, the `counts` candidate positions with the lowest values (ties: leftmost).

    Args:
      values: float[N, T].
      candidates: bool[N, T], the positions that may be selected.
      counts: int[N] or int[], how many to select (fewer if fewer candidates).

    Returns:
      bool[N, T].
    """
    key = jnp.where(candidates, values, jnp.inf)  # [N, T]
    order = jnp.argsort(key, axis=1, stable=True)  # [N, T]
    rank = jnp.argsort(order, axis=1, stable=True)  # [N, T]: rank of each position
    return candidates & (rank < jnp.reshape(counts, (-1, 1)))  # [N, T]


@flax.struct.dataclass
class MaskPredictState:
    """The loop state of `mask_predict`."""

    step: jax.Array  # int32[]: passes run so far
    hypothesis: jax.Array  # int32[N, T]: tokens, MASK where to predict next
    token_log_probs: jax.Array  # float32[N, T]: of each token when last predicted


@functools.partial(jax.jit, static_argnames=("model", "width", "iterations"))
def mask_predict(
    model: NARModel,
    params: Params,
    candidates: Candidates,
    *,
    width: int,
    iterations: int,
    vocab_ids: jax.Array | None = None,
) -> DecodeResult:
    """Mask-Predict (Ghazvininejad et al. 2019) with a length beam.

    Pass 1 predicts every content position of the all-[MASK] hypothesis. After pass t
    (t = 1..T-1) the n = floor(L * (T - t) / T) content tokens with the lowest probability
    (each token keeps the probability it had when it was last predicted; ties: leftmost)
    are re-masked and pass t + 1 predicts them again, L being the number of content
    positions (the length without EOS). Predictions are the most likely real piece; their
    probability is under the full target distribution (so mass on EOS or UNK lowers
    confidence). Every sentence uses exactly T passes (a pass with n = 0 for a short row
    still runs in the batch).

    Args:
      model, params, candidates, width, vocab_ids: as `refine`.
      iterations: T >= 1 (static).

    Returns:
      DecodeResult of B rows; `passes` is T.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    batch_size = candidates.lengths.shape[0]
    logits_fn, lengths = _logits_fn(model, params, candidates, width, vocab_ids)  # [N]
    content, eos, _ = _layout(lengths, width)  # [N, T] each
    num_content = lengths - 1  # [N]

    def cond(state: MaskPredictState) -> jax.Array:
        return state.step < iterations

    def body(state: MaskPredictState) -> MaskPredictState:
        reading = read_logits(logits_fn(state.hypothesis), vocab_ids)  # [N, T] each
        predict = content & (state.hypothesis == MASK_ID)  # [N, T]
        hypothesis = jnp.where(predict, reading.best_real, state.hypothesis)  # [N, T]
        token_log_probs = jnp.where(
            predict, reading.best_real_log_prob, state.token_log_probs)  # [N, T]
        token_log_probs = jnp.where(eos, reading.eos_log_prob, token_log_probs)  # [N, T]
        done = state.step + 1  # passes after this one
        remask = (num_content * (iterations - done)) // iterations  # [N]
        chosen = lowest_ranked(token_log_probs, content, remask)  # [N, T]
        return MaskPredictState(
            step=done,
            hypothesis=jnp.where(chosen, MASK_ID, hypothesis),  # [N, T]
            token_log_probs=token_log_probs,  # [N, T]
        )

    num_rows = lengths.shape[0]
    state = MaskPredictState(
        step=jnp.array(0, jnp.int32),
        hypothesis=masked_hypothesis(lengths, width),  # [N, T]
        token_log_probs=jnp.zeros((num_rows, width), jnp.float32),  # [N, T]
    )
    state = jax.lax.while_loop(cond, body, state)
    passes = jnp.full((num_rows,), iterations, jnp.int32)  # [N]
    return _choose(state.hypothesis, state.token_log_probs, passes, lengths, batch_size)


# --- adaptive order ---------------------------------------------------------------------


def certainty(log_probs: jax.Array) -> jax.Array:
    """How sure the model is of the real piece it would emit at each position: the margin
    p1 - p2 between the probabilities of the two most likely real pieces (Kim et al.
    2025, section 4.1), under the full target distribution, restricted to real pieces
    because only a real piece is ever emitted at a content position.

    float32[N, T, V] log-probabilities -> float32[N, T].
    """
    # top_k of the log-probabilities, then exp of the two: the same values (exp is monotonic),
    # but XLA:CPU fuses an exp feeding top_k into its sort comparator, ~30x slower.
    top, _ = jax.lax.top_k(log_probs[..., NUM_RESERVED:], 2)  # [N, T, 2]
    top = jnp.exp(top)  # [N, T, 2]
    return top[..., 0] - top[..., 1]


@flax.struct.dataclass
class AdaptiveState:
    """The loop state of `adaptive`."""

    step: jax.Array  # int32[]: passes run on the batch
    hypothesis: jax.Array  # int32[N, T]: tokens, MASK where still masked
    token_log_probs: jax.Array  # float32[N, T]: of each token when it was unmasked
    passes: jax.Array  # int32[N]


@functools.partial(
    jax.jit, static_argnames=("model", "width", "tokens_per_step")
)
def adaptive(
    model: NARModel,
    params: Params,
    candidates: Candidates,
    *,
    width: int,
    tokens_per_step: int,
    vocab_ids: jax.Array | None = None,
) -> DecodeResult:
    """Adaptive-order unmasking (Kim et al. 2025, "Train for the Worst, Plan for the Best").

    From the all-[MASK] hypothesis, each pass unmasks, among the still-masked content
    positions, the K = `tokens_per_step` with the highest `certainty` (ties: leftmost),
    each with its most likely real piece; the other masked positions stay masked. A row
    with L content positions (length without EOS) is done after ceil(L / K) passes and is
    frozen while longer rows go on; the loop runs at most ceil((T - 1) / K) passes.

    Args:
      model, params, candidates, width, vocab_ids: as `refine`.
      tokens_per_step: K >= 1 (static).

    Returns:
      DecodeResult of B rows; `passes` is ceil(L / K) of its longest candidate.
    """
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    batch_size = candidates.lengths.shape[0]
    logits_fn, lengths = _logits_fn(model, params, candidates, width, vocab_ids)  # [N]
    content, eos, _ = _layout(lengths, width)  # [N, T] each
    max_steps = -(-(width - 1) // tokens_per_step)

    def cond(state: AdaptiveState) -> jax.Array:
        masked = content & (state.hypothesis == MASK_ID)  # [N, T]
        return (state.step < max_steps) & jnp.any(masked)

    def body(state: AdaptiveState) -> AdaptiveState:
        logits = mask_non_target_ids(logits_fn(state.hypothesis).astype(jnp.float32))
        log_probs = jax.nn.log_softmax(logits, axis=-1)  # [N, T, V]: top-2 needs them
        masked = content & (state.hypothesis == MASK_ID)  # [N, T]
        active = jnp.any(masked, axis=1)  # [N]
        reading = read_logits(logits, vocab_ids)  # [N, T] each
        chosen = lowest_ranked(
            -certainty(log_probs), masked, jnp.asarray(tokens_per_step)
        )  # [N, T]: the K most certain masked positions
        token_log_probs = jnp.where(chosen, reading.best_real_log_prob, state.token_log_probs)
        token_log_probs = jnp.where(
            eos & active[:, None], reading.eos_log_prob, token_log_probs
        )  # [N, T]
        return AdaptiveState(
            step=state.step + 1,
            hypothesis=jnp.where(chosen, reading.best_real, state.hypothesis),  # [N, T]
            token_log_probs=token_log_probs,  # [N, T]
            passes=state.passes + active.astype(jnp.int32),  # [N]
        )

    num_rows = lengths.shape[0]
    state = AdaptiveState(
        step=jnp.array(0, jnp.int32),
        hypothesis=masked_hypothesis(lengths, width),  # [N, T]
        token_log_probs=jnp.zeros((num_rows, width), jnp.float32),  # [N, T]
        passes=jnp.zeros((num_rows,), jnp.int32),  # [N]
    )
    state = jax.lax.while_loop(cond, body, state)
    return _choose(state.hypothesis, state.token_log_probs, state.passes, lengths, batch_size)
