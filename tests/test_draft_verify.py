"""Tests for model/decoding/draft_verify.py: with exact verification the output is the teacher's
greedy output token for token, whatever the draft (right, wrong, ending early or late, rows
finishing at different rounds), the teacher's cache carried across rounds, and the rounds
and accepted tokens say what it cost."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.config import ConfigError, DecodeMethod
from components.tokenizer import EOS_ID, PAD_ID
from model.decoding import beam_search, draft_verify
from tiny_models import (BATCH, FIRST_REAL, MAX_LEN, VOCAB, memorised_ar, memorised_drafter,
                         pairs)


@dataclasses.dataclass(frozen=True)
class Fixed:
    """A stand-in drafter that drafts given rows `params` int[B, T]: the block after a
    prefix of n tokens is params[b, n : n + block] (the row's last token past its end).
    The rows are its memory, so that they follow their sentences when rows are dropped."""

    block: int

    def memory(self, params, encoded, memory_mask):
        return params

    def draft(self, params, memory, memory_mask, tokens, length, passes=1, vocab_ids=None):
        at = jnp.minimum(length[:, None] + jnp.arange(self.block), memory.shape[1] - 1)
        return jnp.take_along_axis(memory, at, axis=1)


def _teacher_greedy(source):
    teacher, params = memorised_ar()
    return np.asarray(jax.jit(functools.partial(beam_search.greedy, teacher), static_argnums=3)(
        params, *teacher.encode(params, source), MAX_LEN))


def _oracle(source, draft, block, **options):
    """draft_verify of `Fixed(block)` drafting the rows `draft` int[B, T]."""
    teacher, params = memorised_ar()
    encoded = ((source, source != PAD_ID), teacher.encode(params, source))
    return draft_verify.draft_verify(Fixed(block), jnp.asarray(draft, jnp.int32), teacher,
                                     params, encoded, width=MAX_LEN, **options)


def _wrong(greedy):
    """Rows of real pieces that differ from greedy's at every position."""
    wrong = np.where(greedy == FIRST_REAL, FIRST_REAL + 1, FIRST_REAL)
    return np.where(greedy == wrong, FIRST_REAL + 2, wrong)


def _length(row) -> int:
    """Tokens of a greedy row, EOS included."""
    return int(np.sum(row != PAD_ID))


@pytest.mark.parametrize("block", [1, 2, 3, 7])
def test_a_right_draft_gains_a_block_and_the_teachers_token_a_round(block):
    greedy = _teacher_greedy(BATCH["source"])
    lengths = np.asarray([_length(row) for row in greedy])
    result = _oracle(BATCH["source"], greedy, block)
    np.testing.assert_array_equal(result.tokens, greedy)
    np.testing.assert_array_equal(result.lengths, lengths)
    np.testing.assert_array_equal(result.rounds, -(-lengths // (block + 1)))
    # Every token is drafted and accepted but the teacher's own one a round, unless the
    # round's block held the drafted EOS.
    rounds = np.asarray(result.rounds)
    own = np.where(lengths % (block + 1) == 0, rounds, rounds - 1)
    np.testing.assert_array_equal(result.accepted, lengths - own)
    np.testing.assert_array_equal(result.passes, 2 * rounds)  # a drafter + a teacher pass


def test_a_draft_that_is_always_wrong_takes_one_round_per_token():
    greedy = _teacher_greedy(BATCH["source"])
    result = _oracle(BATCH["source"], _wrong(greedy), 3)
    np.testing.assert_array_equal(result.tokens, greedy)
    np.testing.assert_array_equal(result.rounds, [_length(row) for row in greedy])
    np.testing.assert_array_equal(result.accepted, [0] * 4)


@pytest.mark.parametrize("shift", [-2, -1, 1, 2])
def test_drafts_that_end_early_or_late_still_give_greedy(shift):
    """A draft with EOS where the teacher has a piece, or a piece where it ends."""
    greedy = _teacher_greedy(BATCH["source"])
    draft = greedy.copy()
    for row, n in zip(draft, [_length(r) for r in greedy]):
        eos = int(np.clip(n - 1 + shift, 1, MAX_LEN - 1))
        row[:] = np.where(row < FIRST_REAL, FIRST_REAL, row)
        row[eos] = EOS_ID
    result = _oracle(BATCH["source"], draft, 7)
    np.testing.assert_array_equal(result.tokens, greedy)
    # One round: the draft is right up to where it or the teacher ends; then the teacher's
    # own token (EOS, or the piece the early EOS displaced), and past it a second round.
    expected = [1 if shift > 0 else 2] * 4
    np.testing.assert_array_equal(result.rounds, expected)


def test_rows_of_one_batch_finish_at_different_rounds():
    greedy = _teacher_greedy(BATCH["source"])
    draft = greedy.copy()
    draft[1, 1:] = _wrong(greedy)[1, 1:]
    draft[2, 2] = _wrong(greedy)[2, 2]
    result = _oracle(BATCH["source"], draft, 7)
    np.testing.assert_array_equal(result.tokens, greedy)
    rounds = np.asarray(result.rounds)
    assert rounds[0] == rounds[3] == 1 and rounds[2] == 2 and rounds[1] == _length(greedy[1]) - 1
    assert len(set(rounds.tolist())) == 3


def test_a_large_batch_drops_finished_rows_and_each_row_decodes_as_in_a_small_one():
    """32 rows (dropped to 8 as they finish), drafts wrong from a different position
    in each: every row's tokens, rounds and accepted tokens are those of its batch of 4
    (too few rows to drop any)."""
    greedy = _teacher_greedy(BATCH["source"])
    source = np.tile(BATCH["source"], (8, 1))
    draft, wrong = np.tile(greedy, (8, 1)), np.tile(_wrong(greedy), (8, 1))
    for row in range(len(draft)):
        draft[row, row % 7 + 1:] = wrong[row, row % 7 + 1:]
    result = _oracle(source, draft, 3)
    np.testing.assert_array_equal(result.tokens, np.tile(greedy, (8, 1)))
    for start in range(0, len(draft), 4):
        small = _oracle(source[start:start + 4], draft[start:start + 4], 3)
        np.testing.assert_array_equal(result.rounds[start:start + 4], small.rounds)
        np.testing.assert_array_equal(result.accepted[start:start + 4], small.accepted)
    assert len(set(np.asarray(result.rounds).tolist())) > 3


def test_the_trained_drafter_drafts_and_the_output_is_the_teachers_greedy():
    """The tiny drafter and teacher, on the pairs they memorised and on sources they never
    saw (where the teacher may not stop before the cap, and the drafts are poor)."""
    drafter, drafter_params = memorised_drafter()
    teacher, teacher_params = memorised_ar()
    source = jnp.concatenate([BATCH["source"], pairs(12, seed=3)["source"]])
    encoded = (drafter.encode(drafter_params, source), teacher.encode(teacher_params, source))
    greedy = _teacher_greedy(source)
    lengths = np.asarray([_length(row) for row in greedy])
    for passes in (1, 2):
        result = draft_verify.draft_verify(drafter, drafter_params, teacher, teacher_params,
                                           encoded, width=MAX_LEN, draft_passes=passes)
        np.testing.assert_array_equal(result.tokens, greedy)
        np.testing.assert_array_equal(result.lengths, lengths)
        assert np.all(np.asarray(result.rounds) <= lengths)  # never more than greedy's steps
        assert np.all(np.asarray(result.passes) == np.asarray(result.rounds) * (passes + 1))
        # The memorised pairs are drafted right: a block and the teacher's token a round.
        np.testing.assert_array_equal(np.asarray(result.rounds)[:4],
                                      -(-lengths[:4] // (drafter.block + 1)))


def test_tolerance_accepts_what_the_teacher_ranks_high_enough():
    greedy = _teacher_greedy(BATCH["source"])
    wrong = _wrong(greedy)
    # Any token within the whole vocabulary and 1e9 nats: every drafted token is accepted,
    # and the teacher adds its own after each block.
    loose = _oracle(BATCH["source"], wrong, 3, top_k=VOCAB, margin=1e9)
    np.testing.assert_array_equal(loose.accepted, 3 * np.asarray(loose.rounds) -
                                  np.maximum(0, 4 * np.asarray(loose.rounds) - MAX_LEN))
    tokens = np.asarray(loose.tokens)
    np.testing.assert_array_equal(tokens[:, :3], wrong[:, :3])
    # A zero margin accepts only the teacher's best: exact verification.
    strict = _oracle(BATCH["source"], wrong, 3, top_k=2, margin=0.0)
    np.testing.assert_array_equal(strict.tokens, greedy)


def test_draft_verify_options_are_validated():
    assert DecodeMethod("dv", "draft_verify", iterations=1).rescorer == "teacher"
    DecodeMethod("dv", "draft_verify", tolerance_top_k=3, tolerance_margin=1.0)
    with pytest.raises(ConfigError, match="tolerance_margin needs tolerance_top_k"):
        DecodeMethod("dv", "draft_verify", tolerance_margin=1.0)
    with pytest.raises(ConfigError, match="does not apply to kind refine"):
        DecodeMethod("p", "refine", tolerance_top_k=2)
