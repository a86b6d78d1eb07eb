"""Tests for model/draft_verify.py: with exact verification the output is the teacher's
greedy output token for token, whatever the draft (right, wrong, too short, too long, rows
finishing at different rounds), and the rounds and accepted tokens say what it cost."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.config import ConfigError, DecodeMethod
from components.tokenizer import EOS_ID, PAD_ID
from model import draft_verify, refinement
from tiny_models import BATCH, FIRST_REAL, MAX_LEN, VOCAB, memorised_ar, memorised_padir, pairs


@dataclasses.dataclass(frozen=True)
class Drafter:
    """A stand-in student that drafts given tokens: position t of every pass predicts
    params["draft"][b, t] (a real piece), whatever the hypothesis."""

    def decoder_memory(self, params, encoded, memory_mask, valid):
        return encoded  # the draft tokens, int32[B, T]

    def pass_logits(self, params, memory, hypothesis, vocab_ids=None):
        return 20.0 * jax.nn.one_hot(memory, VOCAB)  # [B, T, V]


def _teacher_greedy(source):
    teacher, params = memorised_ar()
    return np.asarray(jax.jit(teacher.greedy, static_argnums=3)(
        params, *teacher.encode(params, source), MAX_LEN))


def _oracle(source, draft, lengths, **options):
    """draft_verify of `Drafter` drafting `draft` int[B, T] with predicted `lengths`."""
    teacher, params = memorised_ar()
    candidates = refinement.Candidates(encoded=jnp.asarray(draft, jnp.int32),
                                       memory_mask=source != PAD_ID,
                                       lengths=jnp.asarray(lengths, jnp.int32)[:, None])
    rescoring = refinement.Rescoring(candidates, teacher.encode(params, source))
    return draft_verify.draft_verify(Drafter(), {}, teacher, params, rescoring, width=MAX_LEN,
                                     **options)


def _pieces(greedy):
    """The greedy rows with EOS and PAD replaced by real pieces: a draft that is right at
    every content position and says nothing of where the sentence ends."""
    return np.where(greedy < FIRST_REAL, FIRST_REAL, greedy)


def _length(row) -> int:
    """Tokens of a greedy row, EOS included."""
    return int(np.sum(row != PAD_ID))


def test_a_right_draft_of_the_right_length_takes_one_round():
    greedy = _teacher_greedy(BATCH["source"])
    lengths = [_length(row) for row in greedy]
    result = _oracle(BATCH["source"], _pieces(greedy), lengths)
    np.testing.assert_array_equal(result.tokens, greedy)
    np.testing.assert_array_equal(result.rounds, [1] * 4)
    np.testing.assert_array_equal(result.accepted, lengths)  # every token, EOS included
    np.testing.assert_array_equal(result.passes, [2] * 4)  # one student + one teacher pass
    np.testing.assert_array_equal(result.lengths, lengths)


def test_a_draft_that_is_always_wrong_takes_one_round_per_token():
    greedy = _teacher_greedy(BATCH["source"])
    wrong = np.where(greedy == FIRST_REAL, FIRST_REAL + 1, FIRST_REAL)  # never the teacher's
    wrong = np.where(_pieces(greedy) == wrong, FIRST_REAL + 2, wrong)
    result = _oracle(BATCH["source"], wrong, [MAX_LEN] * 4)
    np.testing.assert_array_equal(result.tokens, greedy)
    np.testing.assert_array_equal(result.rounds, [_length(row) for row in greedy])
    np.testing.assert_array_equal(result.accepted, [0] * 4)


@pytest.mark.parametrize("offset", [-3, -1, 1, 3])
def test_drafts_shorter_or_longer_than_the_output_still_give_greedy(offset):
    greedy = _teacher_greedy(BATCH["source"])
    lengths = np.clip([_length(row) + offset for row in greedy], 2, MAX_LEN)
    result = _oracle(BATCH["source"], _pieces(greedy), lengths)
    np.testing.assert_array_equal(result.tokens, greedy)
    # Too short: the prefix reaches the predicted length, the draft grows past it (one
    # more round); too long: the teacher's EOS replaces a drafted piece in the first round.
    expected = [1 if length == _length(row) or offset > 0 else 2
                for row, length in zip(greedy, lengths)]
    np.testing.assert_array_equal(result.rounds, expected)


def test_rows_of_one_batch_finish_at_different_rounds():
    greedy = _teacher_greedy(BATCH["source"])
    draft = _pieces(greedy).copy()
    draft[1, 1:] = np.where(draft[1, 1:] == FIRST_REAL, FIRST_REAL + 1, FIRST_REAL)  # wrong
    draft[2, 2] = FIRST_REAL + 1 if draft[2, 2] != FIRST_REAL + 1 else FIRST_REAL + 2
    result = _oracle(BATCH["source"], draft, [_length(row) for row in greedy])
    np.testing.assert_array_equal(result.tokens, greedy)
    rounds = np.asarray(result.rounds)
    assert rounds[0] == rounds[3] == 1 and rounds[2] == 2 and rounds[1] == _length(greedy[1]) - 1
    assert len(set(rounds.tolist())) == 3


def test_the_trained_student_drafts_and_the_output_is_the_teachers_greedy():
    """The tiny student and teacher, on the pairs they memorised and on sources they never
    saw (where the teacher may not stop before the cap, and the drafts are poor)."""
    student, student_params = memorised_padir()
    teacher, teacher_params = memorised_ar()
    source = jnp.concatenate([BATCH["source"], pairs(12, seed=3)["source"]])
    candidates = refinement.predict_candidates(student, student_params, source,
                                               num_length_candidates=1, length_offsets=(0,))
    rescoring = refinement.Rescoring(candidates, teacher.encode(teacher_params, source))
    greedy = _teacher_greedy(source)
    for passes in (1, 2):
        result = draft_verify.draft_verify(student, student_params, teacher, teacher_params,
                                           rescoring, width=MAX_LEN, draft_passes=passes)
        np.testing.assert_array_equal(result.tokens, greedy)
        lengths = np.asarray([_length(row) for row in greedy])
        np.testing.assert_array_equal(result.lengths, lengths)
        assert np.all(np.asarray(result.rounds) <= lengths)  # never more than greedy's steps
        assert np.all(np.asarray(result.passes) == np.asarray(result.rounds) * (passes + 1))
    # The memorised pairs are drafted right: fewer rounds than tokens.
    assert np.all(np.asarray(result.rounds)[:4] < lengths[:4])


def test_tolerance_accepts_what_the_teacher_ranks_high_enough():
    greedy = _teacher_greedy(BATCH["source"])
    wrong = np.where(_pieces(greedy) == FIRST_REAL, FIRST_REAL + 1, FIRST_REAL)
    lengths = [_length(row) for row in greedy]
    # Any token within the whole vocabulary and 1e9 nats: the draft is the output.
    loose = _oracle(BATCH["source"], wrong, lengths, top_k=VOCAB, margin=1e9)
    np.testing.assert_array_equal(loose.rounds, [1] * 4)
    positions = np.arange(MAX_LEN)[None, :]
    expected = np.where(positions < np.asarray(lengths)[:, None] - 1, wrong,
                        np.where(positions == np.asarray(lengths)[:, None] - 1, EOS_ID, PAD_ID))
    np.testing.assert_array_equal(loose.tokens, expected)
    # A zero margin accepts only the teacher's best: exact verification.
    strict = _oracle(BATCH["source"], wrong, lengths, top_k=2, margin=0.0)
    np.testing.assert_array_equal(strict.tokens, greedy)


def test_draft_verify_options_are_validated():
    assert DecodeMethod("dv", "draft_verify", iterations=1).rescorer == "teacher"
    DecodeMethod("dv", "draft_verify", tolerance_top_k=3, tolerance_margin=1.0)
    with pytest.raises(ConfigError, match="tolerance_margin needs tolerance_top_k"):
        DecodeMethod("dv", "draft_verify", tolerance_margin=1.0)
    with pytest.raises(ConfigError, match="does not apply to kind refine"):
        DecodeMethod("p", "refine", tolerance_top_k=2)
