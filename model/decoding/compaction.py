"""Decoding the unfinished rows only: a batch's loop halves its rows as they finish.

A decoding step costs about its rows (the benchmark's teacher on 2 cores: 3.3 ms a cached
step at 64 rows, 1.8 at 32, 0.7 at 16), and a batch's rows finish at different steps, so
the searches (greedy, beam, draft and verify) run as CTranslate2 does: each time no more
than half of the rows decoding are unfinished, the unfinished ones are gathered, with their
cache and everything they read, into a batch half as large. Static shapes: one
`lax.while_loop` per batch size (B, B/2, ..., down to `MIN_ROWS`), each compiled once.
Rows are independent, so every row decodes to the same output as in the full batch.

    output = while_unfinished(cond, body, state, context, rows=B, done=lambda s: s.done,
                              take=take_each, collect=write_rows, result=empty_output)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp

# Below this many rows a step costs about the same whatever its rows.
MIN_ROWS = 8

State = TypeVar("State")
Result = TypeVar("Result")


def take_rows(tree: Any, rows: jax.Array) -> Any:
    """The rows `rows` int[M] of every leaf of `tree` with rows first; scalar leaves (a
    step counter, a shared cache index) are shared and kept."""
    return jax.tree.map(
        lambda leaf: leaf if leaf.ndim == 0 else jnp.take(leaf, rows, axis=0, mode="clip"),
        tree)


def while_unfinished(cond: Callable[[State], jax.Array],
                     body: Callable[[State, Any], State], state: State, context: Any, *,
                     rows: int, done: Callable[[State], jax.Array],
                     take: Callable[[State, Any, jax.Array], tuple[State, Any]],
                     collect: Callable[[Result, State], Result], result: Result) -> Result:
    """`lax.while_loop(cond, body, state)` over `rows` rows, dropping finished ones.

    Args:
      cond, body: the loop's, for any number of rows; `body(state, context)`.
      state: the initial state of `rows` rows: what the loop changes.
      context: what the loop reads per row and never changes (the encoder's keys and
        values): a constant of each loop, not part of its state, so that XLA computes what
        depends on it alone once a loop, not once a step.
      done: state -> bool[N], the rows that have finished.
      take: (state, context, keep int[M]) -> the state and context of rows `keep` (M <= N).
      collect: (result, state) -> result with the state's rows written (the state carries
        each of its rows' row of the batch).
      result: the initial result, of the whole batch.

    Returns:
      the result, every row written by the last loop it decoded in.
    """
    while True:
        half = rows // 2
        last = half < MIN_ROWS

        def loop_cond(state: State, half: int = half, last: bool = last) -> jax.Array:
            going = cond(state)
            return going if last else going & (jnp.sum(~done(state)) > half)

        state = jax.lax.while_loop(loop_cond, functools.partial(body, context=context), state)
        result = collect(result, state)
        if last:
            return result
        # The unfinished rows first (at most `half` of them), then finished ones to fill.
        state, context = take(state, context, jnp.argsort(done(state), stable=True)[:half])
        rows = half


def take_each(state: Any, context: Any, keep: jax.Array) -> tuple[Any, Any]:
    """`while_unfinished`'s `take` where every leaf of the state and the context has one
    row per row of the batch (`take_rows` of both)."""
    return take_rows(state, keep), take_rows(context, keep)


def loops(finished_at: Sequence[int]) -> list[tuple[int, int]]:
    """The loops `while_unfinished` runs over rows that finish after `finished_at[i]`
    steps (or rounds): (rows, steps) per loop that steps, in order. What a batch's floor
    counts (benchmarks/floors.py)."""
    rows, step, end = len(finished_at), 0, max(finished_at, default=0)
    result = []
    while step < end:
        half = rows // 2
        stop = end
        if half >= MIN_ROWS:  # the first step after which no more than half are unfinished
            stop = next(s for s in range(step, end + 1)
                        if sum(f > s for f in finished_at) <= half)
        if stop > step:
            result.append((rows, stop - step))
        if half < MIN_ROWS:
            break
        step, rows = stop, half
    return result
