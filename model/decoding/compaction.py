"""Decoding the unfinished rows only: a batch's loop halves its rows as they finish.

A decoding step costs about its rows (the benchmark's teacher on 2 cores: 3.3 ms a cached
step at 64 rows, 1.8 at 32, 0.7 at 16), and a batch's rows finish at different steps, so
the searches (greedy, beam, draft and verify) run as CTranslate2 does: each time no more
than half of the rows decoding are unfinished, the unfinished ones are gathered, with their
cache and everything they read, into a batch half as large. Static shapes: one
`lax.while_loop` per batch size (B, B/2, ..., down to `MIN_ROWS`), each compiled once.
Rows are independent, so every row decodes to the same output as in the full batch.

    output = while_unfinished(cond, body, state, rows=B, done=lambda s: s.done,
                              take=take_rows, collect=write_rows, result=empty_output)
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

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


def while_unfinished(cond: Callable[[State], jax.Array], body: Callable[[State], State],
                     state: State, *, rows: int, done: Callable[[State], jax.Array],
                     take: Callable[[State, jax.Array], State],
                     collect: Callable[[Result, State], Result], result: Result) -> Result:
    """`lax.while_loop(cond, body, state)` over `rows` rows, dropping finished ones.

    Args:
      cond, body: the loop's, for any number of rows.
      state: the initial state of `rows` rows.
      done: state -> bool[N], the rows that have finished.
      take: (state, keep int[M]) -> the state of rows `keep` (M <= N).
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

        state = jax.lax.while_loop(loop_cond, body, state)
        result = collect(result, state)
        if last:
            return result
        # The unfinished rows first (at most `half` of them), then finished ones to fill.
        state = take(state, jnp.argsort(done(state), stable=True)[:half])
        rows = half
