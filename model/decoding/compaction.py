"""Decoding the unfinished rows only: a batch's loop shrinks as its rows finish.

A decoding step costs about its rows (the benchmark's teacher on 2 cores: 3.3 ms a cached
step at 64 rows, 1.8 at 32, 0.7 at 16), and a batch's rows finish at different steps, so
the searches (greedy, beam, draft and verify) run as CTranslate2 does: once no more than a
`SHRINK`th of the rows decoding are unfinished, the unfinished ones are gathered, with
their cache and everything they read, into a batch that many times smaller. Static shapes:
one `lax.while_loop` per batch size (B, B/4, ... while at least `MIN_ROWS`), each compiled
(and traced) once. Rows are independent, so every row decodes to the same output as in the
full batch.

Over test2016's batches of 64 (the teacher's greedy outputs), stepping every row to its
batch's longest output is 2.0x the row-steps of stepping each to its own end. By the step
costs above, halving (64, 32, 16, 8) would save 43% of the steps' time with four loops a
program, quartering (64, 16) 37% with two: the decode stage compiles and traces every
loop of some 230 programs (the demo's decode stage with four loops: 183 s against 113
without any, 10 s of them decoding), so two.

    output = while_unfinished(cond, body, state, context, rows=B, done=lambda s: s.done,
                              take=take_each, collect=write_rows, result=empty_output)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, TypeVar

import jax
import jax.numpy as jnp

SHRINK = 4  # a loop's rows over the next one's
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
        fewer = rows // SHRINK
        last = fewer < MIN_ROWS

        def loop_cond(state: State, fewer: int = fewer, last: bool = last) -> jax.Array:
            going = cond(state)
            return going if last else going & (jnp.sum(~done(state)) > fewer)

        state = jax.lax.while_loop(loop_cond, functools.partial(body, context=context), state)
        result = collect(result, state)
        if last:
            return result
        # The unfinished rows first (at most `fewer` of them), then finished ones to fill.
        state, context = take(state, context, jnp.argsort(done(state), stable=True)[:fewer])
        rows = fewer


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
        fewer = rows // SHRINK
        stop = end
        if fewer >= MIN_ROWS:  # the first step after which no more than `fewer` are unfinished
            stop = next(s for s in range(step, end + 1)
                        if sum(f > s for f in finished_at) <= fewer)
        if stop > step:
            result.append((rows, stop - step))
        if fewer < MIN_ROWS:
            break
        step, rows = stop, fewer
    return result
