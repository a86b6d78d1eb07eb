"""Each decoding method's floor: the plain network work of its shape, timed beside it.

The floor of one sentence's decoding at batch 1 is what any decoder of that method must do:

* **the encoder**: one jitted call of the model's encoder on the sentence's own source (no
  bucket padding); PaDIR's with its length head;
* **the search**: one jitted call that runs the method's network as a plain chain, each
  pass's (or step's) argmax feeding the next and nothing else: PaDIR-k, k passes over the
  length it chose (no width rounding, no acceptance, scores or convergence test); AR
  greedy, one cached decoder step per token it emitted, into as many cache slots (no cap,
  no stopping flags); draft and verify, both encoders, then per round one drafter pass over
  the prefix and its block and one teacher pass over the block and one more position over
  its cache (no acceptance: each round's prefix is where a fully accepted one would end).

A method at its floor spends its time in its network; `decode_speed --floor` prints each
method beside it, encoder and search apart, so that the loop around the network has a figure.

    floors = Floors(loaded.model, loaded.params)
    floor = floors.padir(source_ids, source_width=16, length=18, passes=4)  # Floor
    floor = floors.greedy(source_ids, source_width=16, steps=17)
    floor = floors.draft_verify(source_ids, source_width=16, width=32, rounds=5)  # Floors
                                                      # of the (drafter, teacher) pair

The passes and steps read the encoder's output at the method's source bucket
(`source_width`), as the method does. Every call is compiled once per shape (source
length; bucket and output length) before it is timed; the number of passes and steps is
an argument, not a shape.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from components.tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID
from model.models import masked_hypothesis
from model.transformer import argmax_last


@dataclasses.dataclass(frozen=True)
class Floor:
    """One sentence's floor: its encoder call and its chain of passes or steps, in seconds."""

    encode_seconds: float
    search_seconds: float

    @property
    def seconds(self) -> float:
        return self.encode_seconds + self.search_seconds


def padir_passes(model: Any, params: Any, encoded: Any, memory_mask: jax.Array,
                 passes: jax.Array, *, length: int) -> jax.Array:
    """`passes` plain PaDIR passes over rows of `length` positions (EOS last): each pass's
    argmax at the content positions is the next pass's input. Returns int32[B, length]."""
    rows = memory_mask.shape[0]
    hypothesis = masked_hypothesis(jnp.full((rows,), length, jnp.int32), length)  # [B, T]
    content = hypothesis == MASK_ID  # [B, T]
    memory = model.decoder_memory(params, encoded, memory_mask, hypothesis != PAD_ID)

    def body(_, hypothesis):
        logits = model.pass_logits(params, memory, hypothesis)  # [B, T, V]
        return jnp.where(content, argmax_last(logits), hypothesis)

    return jax.lax.fori_loop(0, passes, body, hypothesis)


def greedy_steps(model: Any, params: Any, encoded: Any, memory_mask: jax.Array,
                 steps: jax.Array, *, slots: int) -> jax.Array:
    """`steps` plain cached AR decoder steps into `slots` cache slots: each step's argmax is
    the next step's input. Returns the last ids int32[B, 1]."""
    cache = model.init_cache(params, encoded, memory_mask, slots)
    step = model.make_tokens_to_logits(params, model.memory(params, encoded, memory_mask),
                                       memory_mask)

    def body(_, carry):
        ids, cache = carry
        logits, cache = step(ids, cache)  # [B, V]
        return argmax_last(logits)[:, None], cache

    start = jnp.full((memory_mask.shape[0], 1), BOS_ID, jnp.int32)
    return jax.lax.fori_loop(0, steps, body, (start, cache))[0]


def draft_verify_rounds(models: tuple[Any, Any], params: tuple[Any, Any], encoded: Any,
                        rounds: jax.Array, *, width: int) -> jax.Array:
    """`rounds` plain draft-and-verify rounds: a drafter pass over a prefix and its block of
    K, then the teacher over the block and one more position (K + 1) over its cache, the
    prefix growing by K + 1 a round (to the width). Returns the last round's ids
    int32[B, K + 1]."""
    (drafter, teacher), (drafter_params, teacher_params) = models, params
    (draft_encoded, draft_mask, _), (teacher_encoded, teacher_mask, _) = encoded
    rows, block = draft_mask.shape[0], drafter.block
    cache = teacher.init_block_cache(teacher_params, teacher_encoded, teacher_mask,
                                     width + block + 1)

    draft_memory = drafter.memory(drafter_params, draft_encoded, draft_mask)
    teacher_memory = teacher.memory(teacher_params, teacher_encoded, teacher_mask)

    def body(i, carry):
        tokens, cache, _ = carry
        length = jnp.full((rows,), jnp.minimum(i * (block + 1), width - 1), jnp.int32)
        draft = drafter.draft(drafter_params, draft_memory, draft_mask, tokens[:, :width],
                              length)
        inputs = jnp.concatenate([jnp.full((rows, 1), BOS_ID, jnp.int32), draft], axis=1)
        logits, cache = teacher.block_logits(teacher_params, teacher_memory, teacher_mask,
                                             inputs, length, cache)
        ids = argmax_last(logits)  # [B, K + 1]
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, ids[:, :block], length[0], axis=1)
        return tokens, cache, ids

    tokens = jnp.full((rows, width + block + 1), EOS_ID, jnp.int32)
    ids = jnp.zeros((rows, block + 1), jnp.int32)
    return jax.lax.fori_loop(0, rounds, body, (tokens, cache, ids))[2]


# The kinds whose floor is plain PaDIR passes: each iteration re-predicts every position.
PASS_KINDS = ("refine", "mask_predict")


def models_of(translator: Any) -> tuple[Any, Any]:
    """A Translator's model and params for its `Floors`: (drafter, teacher) for draft and
    verify."""
    loaded, rescorer = translator.loaded, translator.rescorer
    if translator.method.kind == "draft_verify":
        return (loaded.model, rescorer.model), (loaded.params, rescorer.params)
    return loaded.model, loaded.params


def encode(model: Any, params: Any, source: jax.Array) -> tuple[Any, jax.Array, Any]:
    """The encoder, and a PaDIR model's length head on its output: (encoded, memory_mask,
    length logits or None); of a (drafter, teacher) pair, both encoders."""
    if isinstance(model, tuple):
        return tuple(encode(m, p, source) for m, p in zip(model, params))
    encoded, memory_mask = model.encode(params, source)
    lengths = model.length_logits(params, encoded) if hasattr(model, "length_logits") else None
    return encoded, memory_mask, lengths


def _timed(fn, *args) -> tuple[Any, float]:
    started = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - started


class Floors:
    """The floor calls of one model (an `ARModel` for `greedy`, a `PaDIRModel` for `padir`),
    or of a (drafter, teacher) pair and their params for `draft_verify`.

    Each call is run once untimed per shape it has not met (it compiles), then timed."""

    def __init__(self, model: Any, params: Any):
        self.model, self.params = model, params
        self._encode = jax.jit(functools.partial(encode, model))
        self._padir = jax.jit(functools.partial(padir_passes, model), static_argnames="length")
        self._greedy = jax.jit(functools.partial(greedy_steps, model), static_argnames="slots")
        self._draft_verify = jax.jit(functools.partial(draft_verify_rounds, model),
                                     static_argnames="width")
        self._warm: set[tuple] = set()

    def _call(self, key: tuple, fn, *args) -> tuple[Any, float]:
        if key not in self._warm:
            self._warm.add(key)
            jax.block_until_ready(fn(*args))
        return _timed(fn, *args)

    def _encoded(self, source_ids: Sequence[int], source_width: int) -> tuple[Any, float]:
        """The encoder timed on the sentence's own length; what the passes or steps read
        is its output at `source_width` (the method's bucket: one compilation of the
        search per bucket and output length, not per source length), untimed."""
        source = np.asarray([source_ids], np.int32)  # [1, S]
        _, seconds = self._call(("encode", source.shape), self._encode, self.params, source)
        padded = np.full((1, source_width), PAD_ID, np.int32)
        padded[0, :len(source_ids)] = source_ids
        return jax.block_until_ready(self._encode(self.params, padded)), seconds

    def padir(self, source_ids: Sequence[int], *, source_width: int, length: int,
              passes: int) -> Floor:
        """PaDIR-k's floor: the encoder and its length head, then `passes` plain passes
        over `length` positions (counting EOS)."""
        (encoded, memory_mask, _), encode_seconds = self._encoded(source_ids, source_width)
        fn = functools.partial(self._padir, length=length)
        _, search_seconds = self._call(("padir", source_width, length), fn, self.params,
                                       encoded, memory_mask, jnp.int32(passes))
        return Floor(encode_seconds, search_seconds)

    def greedy(self, source_ids: Sequence[int], *, source_width: int, steps: int) -> Floor:
        """AR greedy's floor: the encoder, then `steps` plain cached steps into `steps`
        cache slots."""
        (encoded, memory_mask, _), encode_seconds = self._encoded(source_ids, source_width)
        fn = functools.partial(self._greedy, slots=steps)
        _, search_seconds = self._call(("greedy", source_width, steps), fn, self.params,
                                       encoded, memory_mask, jnp.int32(steps))
        return Floor(encode_seconds, search_seconds)

    def draft_verify(self, source_ids: Sequence[int], *, source_width: int, width: int,
                     rounds: int) -> Floor:
        """Draft and verify's floor: both encoders, then `rounds` plain rounds into the
        method's width (`draft_verify_rounds`)."""
        encoded, encode_seconds = self._encoded(source_ids, source_width)
        fn = functools.partial(self._draft_verify, width=width)
        _, search_seconds = self._call(("draft_verify", source_width, width), fn, self.params,
                                       encoded, jnp.int32(rounds))
        return Floor(encode_seconds, search_seconds)

    def batch(self, kind: str, source: np.ndarray, *, width: int,
              loops: Sequence[tuple[int, int]], beam_size: int = 1) -> Floor:
        """The floor of one batch as a method of `kind` decodes it: the encoder on `source`
        int32[B, S] (padded to its bucket), then per (rows, count) of `loops` that many
        plain passes, steps or rounds over that many rows into `width` positions (PaDIR:
        the passes' length; AR: cache slots; draft and verify: its output width): the AR
        searches and draft and verify drop finished rows (model/decoding/compaction.py
        `loops`), PaDIR runs one loop over all of them. AR beam search: steps over the
        rows x `beam_size` rows of its beams (the encoder on the B rows, its output
        repeated untimed)."""
        encoded, encode_seconds = self._call(("encode", source.shape), self._encode,
                                             self.params, source)
        search_seconds = 0.0
        for rows, count in loops:
            part = jax.tree.map(lambda x: x[:rows], encoded)
            key = (kind, (rows,) + source.shape[1:], width, beam_size)
            if kind in PASS_KINDS:
                fn, args = functools.partial(self._padir, length=width), part[:2]
            elif kind == "draft_verify":
                fn, args = functools.partial(self._draft_verify, width=width), (part,)
            else:
                fn = functools.partial(self._greedy, slots=width)
                args = tuple(jnp.repeat(x, beam_size, axis=0) for x in part[:2])
            search_seconds += self._call(key, fn, self.params, *args, jnp.int32(count))[1]
        return Floor(encode_seconds, search_seconds)

    def verify_against_step(self, source_ids: Sequence[int], *, source_width: int,
                            width: int, repeats: int = 30) -> tuple[float, float]:
        """Of a (drafter, teacher) pair: the teacher's pass over a block of K + 1 positions
        over its cache, and one cached greedy step, medians of `repeats` calls at batch 1
        (seconds): a round's verification against the step it replaces."""
        (_, teacher), (_, params) = self.model, self.params
        block = self.model[0].block
        (_, (encoded, memory_mask, _)), _ = self._encoded(source_ids, source_width)
        cache = teacher.init_block_cache(params, encoded, memory_mask, width + block + 1)
        inputs = jnp.full((1, block + 1), BOS_ID, jnp.int32)
        start = jnp.full((1,), width // 2, jnp.int32)
        memory = jax.jit(teacher.memory)(params, encoded, memory_mask)
        verify = jax.jit(teacher.block_logits)
        step_cache = teacher.init_cache(params, encoded, memory_mask, width)
        step = jax.jit(lambda p, ids, c: teacher.make_tokens_to_logits(p, memory, memory_mask)(
            ids, c))

        def median(fn, *args) -> float:
            jax.block_until_ready(fn(*args))
            return float(np.median([_timed(fn, *args)[1] for _ in range(repeats)]))

        return (median(verify, params, memory, memory_mask, inputs, start, cache),
                median(step, params, inputs[:, :1], step_cache))
