"""Losses: token cross-entropy, the AR loss, the PaDIR K-pass unrolled loss, the length loss;
and the student's loss settings per phase (`LossSettings`, `student_loss_settings`).

Normalisation is explicit and per token: `cross_entropy` returns (sum of losses, sum of
weights) and the objectives divide one by the other per pass. (The original sums, which
only suits Adafactor's update clipping; with Adam the loss scale should not grow with the
batch's token count.) Metrics are returned as sums and counts so that a trainer can add
them over steps and devices before dividing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from components.config import StudentConfig
from components.tokenizer import EOS_ID, PAD_ID
from model.transformer import argmax_ids, best_target_logit


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The static settings of the student's loss in one phase (`PaDIRModel.loss_fn`):
    hashable, so that a jitted step takes them as a static argument. Built from the config
    by `student_loss_settings` only, so that whatever trains or times a phase computes the
    same loss; the config checks each value.
    """

    num_passes: int = 1  # K, the unrolled decoder passes (`padir_loss`)
    glancing_ratio: float = 0.0  # GLAT at passes k > 1 (`glance`); 0 is off


def student_loss_settings(cfg: StudentConfig, phase: int) -> LossSettings:
    """The student's loss in phase 1 (one pass) or phase 2 (`cfg.num_passes` unrolled,
    with its glancing); the noise is the same in both."""
    if phase not in (1, 2):
        raise ValueError(f"the student trains in phase 1 or 2, not {phase}")
    if phase == 1:
        return LossSettings()
    return LossSettings(num_passes=cfg.num_passes, glancing_ratio=cfg.glancing_ratio)


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """Weighted token cross-entropy with label smoothing.

    With smoothing, the target distribution puts 1 - label_smoothing on the target and
    spreads the rest evenly over the other V - 1 ids; the loss is the KL divergence to
    it (its entropy is subtracted), so a perfect model scores 0 with or without smoothing.

    Args:
      logits: float[B, T, V].
      targets: int32[B, T].
      weights: float or bool[B, T]; 0 excludes a position.
      label_smoothing: in [0, 1).

    Returns:
      (sum of weighted losses, sum of weights), float32 scalars.
    """
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    entropy = -(confidence * jnp.log(confidence))
    if low > 0:
        entropy -= (vocab_size - 1) * low * jnp.log(low)
    loss = _smoothed_nll(logits.astype(jnp.float32), targets, label_smoothing) - entropy
    weights = weights.astype(jnp.float32)
    return jnp.sum(loss * weights), jnp.sum(weights)


# The cross-entropy over the vocabulary, forward and backward, by hand. Differentiated by
# JAX, the log-softmax and the smoothed one-hot target each materialise [B, T, V] arrays in
# both directions: on CPU those passes over the logits cost more than the output
# projection's three matmuls (benchmarks/README.md, `train_throughput.py`). Here the
# forward pass is three reductions and a gather per position, and the gradient
# (softmax - smoothed target) one elementwise pass.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _smoothed_nll(logits: jax.Array, targets: jax.Array, label_smoothing: float) -> jax.Array:
    """-sum_v q_v log softmax(logits)_v per position, q the smoothed target.
    float32[..., V], int32[...] -> float32[...]."""
    return _smoothed_nll_forward(logits, targets, label_smoothing)[0]


def _smoothed_nll_forward(logits, targets, label_smoothing):
    # sum_v q_v = 1, so -sum_v q_v (logits_v - lse) = lse - sum_v q_v logits_v.
    vocab_size = logits.shape[-1]
    low = label_smoothing / (vocab_size - 1)
    top = jnp.max(logits, axis=-1, keepdims=True)
    lse = top[..., 0] + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = lse - (1.0 - label_smoothing - low) * target_logit
    if low > 0:
        nll = nll - low * jnp.sum(logits, axis=-1)
    return nll, (logits, lse, targets)


def _smoothed_nll_backward(label_smoothing, residuals, upstream):
    logits, lse, targets = residuals
    vocab_size = logits.shape[-1]
    low = label_smoothing / (vocab_size - 1)
    is_target = jnp.arange(vocab_size, dtype=targets.dtype) == targets[..., None]
    smoothed = jnp.where(is_target, 1.0 - label_smoothing, low)
    return (jnp.exp(logits - lse[..., None]) - smoothed) * upstream[..., None], None


_smoothed_nll.defvjp(_smoothed_nll_forward, _smoothed_nll_backward)


def correct_tokens(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted count of positions whose target has the highest logit among the ids a
    target can hold (a tie counts as correct). Scalar.

    The target's logit against the best one: two reductions, where an argmax would write
    [B, T, V] masked logits and indices (measured: 8% of a teacher's training step)."""
    logits = jax.lax.stop_gradient(logits)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = target_logit >= best_target_logit(logits)
    return jnp.sum(correct * weights.astype(jnp.float32))


def _normalise(total: jax.Array, count: jax.Array) -> jax.Array:
    return total / jnp.maximum(count, 1.0)


def ar_loss(
    logits: jax.Array, targets: jax.Array, *, label_smoothing: float = 0.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Teacher-forced AR loss over all non-pad targets.

    Args:
      logits: float[B, T, V] from the right-shifted input.
      targets: int32[B, T] ids + EOS, 0-padded.

    Returns:
      (loss per token, metrics {loss, weights, tokens, accuracy} as sums/counts).
    """
    weights = targets != PAD_ID
    total, count = cross_entropy(logits, targets, weights, label_smoothing)
    metrics = {
        "loss": total,
        "weights": count,
        "tokens": count,
        "accuracy": correct_tokens(logits, targets, weights),
    }
    return _normalise(total, count), metrics


def next_pass_input(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The decoder input of the next pass: the previous pass's argmax, no gradient.

    Args:
      logits: float[B, T, V] of the previous pass.
      targets: int32[B, T]; only its pad positions are used (they are set to PAD_ID, as
        at inference, where everything after the hypothesis length is pad).

    Returns:
      int32[B, T].
    """
    ids = argmax_ids(jax.lax.stop_gradient(logits))  # [B, T]
    return jnp.where(targets == PAD_ID, PAD_ID, ids)


def glance(
    rng: jax.Array, logits: jax.Array, targets: jax.Array, ratio: float
) -> jax.Array:
    """Glancing sampling (GLAT, Qian et al. 2021): which gold tokens to reveal to the next
    pass, more where the previous pass was more wrong.

    A row with H errors (non-pad positions whose argmax is not the target) reveals
    round(ratio * H) of its non-pad positions, drawn uniformly without replacement.

    Args:
      rng: a PRNG key.
      logits: float[B, T, V] of the previous pass.
      targets: int32[B, T] ids + EOS, 0-padded.
      ratio: in [0, 1].

    Returns:
      bool[B, T], True where the gold token is revealed (never at PAD).
    """
    non_pad = targets != PAD_ID  # [B, T]
    wrong = non_pad & (argmax_ids(jax.lax.stop_gradient(logits)) != targets)  # [B, T]
    count = jnp.floor(ratio * jnp.sum(wrong, axis=1) + 0.5).astype(jnp.int32)  # [B]
    key = jnp.where(non_pad, jax.random.uniform(rng, targets.shape), jnp.inf)  # [B, T]
    rank = jnp.argsort(jnp.argsort(key, axis=1), axis=1)  # [B, T]: a random order per row
    return non_pad & (rank < count[:, None])


def length_loss(
    length_logits: jax.Array, targets: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of the length classifier, mean over (non-empty) examples.

    Args:
      length_logits: float[B, C]; class c is a target of c + 1 tokens counting EOS.
      targets: int32[B, T].

    Returns:
      (mean loss, metrics {length_loss, length_accuracy, examples} as sums/counts).
    """
    num_classes = length_logits.shape[-1]
    lengths = jnp.sum(targets != PAD_ID, axis=-1)  # [B]
    classes = jnp.clip(lengths - 1, 0, num_classes - 1)
    present = (lengths > 0).astype(jnp.float32)  # all-pad rows fill a short batch
    log_probs = jax.nn.log_softmax(length_logits.astype(jnp.float32), axis=-1)
    losses = -jnp.take_along_axis(log_probs, classes[:, None], axis=-1)[:, 0]  # [B]
    total = jnp.sum(losses * present)
    count = jnp.sum(present)
    correct = jnp.sum((jnp.argmax(length_logits, axis=-1) == classes) * present)
    metrics = {"length_loss": total, "length_accuracy": correct, "examples": count}
    return _normalise(total, count), metrics


def padir_loss(
    logits_fn: Callable[[jax.Array, int], jax.Array],
    targets: jax.Array,
    noised_ids: jax.Array,
    noised_mask: jax.Array,
    length_logits: jax.Array,
    *,
    num_passes: int = 1,
    label_smoothing: float = 0.0,
    glancing_ratio: float = 0.0,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The PaDIR K-pass unrolled loss plus the length loss.

    Pass 1 decodes the noised gold target and is weighted on the noised positions and
    EOS. Pass k > 1 decodes `next_pass_input` of pass k - 1 (argmax, no gradient, pads
    zeroed) and is weighted on all non-pad targets, so the model learns to repair its own
    first-pass output as it must at inference. Each pass is normalised per token, passes
    are summed with equal weight, the length loss is added.

    With `glancing_ratio` > 0 (GLAT), pass k > 1 also sees gold tokens where `glance`
    reveals them (in proportion to pass k - 1's errors; the other positions keep its
    argmax) and is weighted on the positions not revealed: a pass that was mostly wrong
    learns from an easier input, one that was mostly right from its own output. The count
    revealed is `tokens - weights_pass{k}`.

    Args:
      logits_fn: (hypothesis int32[B, T], pass k) -> logits float[B, T, V]; k (1-based, a
        Python int) lets the caller draw separate dropout per pass.
      targets: int32[B, T] ids + EOS, 0-padded.
      noised_ids, noised_mask: from `noising.noise_targets`.
      length_logits: float[B, C] from the length classifier.
      num_passes, glancing_ratio: static, from `LossSettings` (whose
        values the config checked).
      label_smoothing: for the token cross-entropies (not the length loss).
      rng: a PRNG key, needed by glancing (pass k draws from fold_in(rng, k)).

    Returns:
      (loss, metrics). Metrics are sums/counts: `loss`, `weights`, `accuracy` for pass 1;
      `loss_pass{k}`, `weights_pass{k}`, `accuracy_pass{k}` for k > 1; `tokens` (non-pad
      targets); `length_loss`, `length_accuracy`, `examples`.
    """
    if glancing_ratio > 0 and rng is None:
        raise ValueError("glancing needs an rng")
    non_pad = targets != PAD_ID
    hypothesis = noised_ids
    weights = noised_mask | (targets == EOS_ID)
    objective = jnp.zeros((), jnp.float32)
    metrics = {"tokens": jnp.sum(non_pad.astype(jnp.float32))}
    for k in range(1, num_passes + 1):
        if k > 1:
            hypothesis = next_pass_input(logits, targets)
            weights = non_pad
            if glancing_ratio > 0:
                revealed = glance(jax.random.fold_in(rng, k), logits, targets,
                                  glancing_ratio)  # [B, T]
                hypothesis = jnp.where(revealed, targets, hypothesis)
                weights = non_pad & ~revealed
        logits = logits_fn(hypothesis, k)  # [B, T, V]
        total, count = cross_entropy(logits, targets, weights, label_smoothing)
        objective = objective + _normalise(total, count)
        suffix = "" if k == 1 else f"_pass{k}"
        metrics[f"loss{suffix}"] = total
        metrics[f"weights{suffix}"] = count
        metrics[f"accuracy{suffix}"] = correct_tokens(logits, targets, weights)
    mean_length_loss, length_metrics = length_loss(length_logits, targets)
    metrics.update(length_metrics)
    return objective + mean_length_loss, metrics
