"""benchmarks/drafter_study.py: what a row says about the rounds."""

import pytest

from benchmarks import drafter_study


def test_round_shares_count_sentences_by_their_mean_accepted_tokens_a_round():
    records = [{"rounds": 4, "accepted": 0}, {"rounds": 2, "accepted": 4},
               {"rounds": 1, "accepted": 8}, {"rounds": 3, "accepted": 3}]
    shares = drafter_study.round_shares(records, block=8)
    # Over all rounds, as the report counts it: a one-round sentence weighs one round.
    assert shares["accepted_per_round"] == pytest.approx((0 + 4 + 8 + 3) / (4 + 2 + 1 + 3))
    assert shares["none"] == 0.25  # the first
    assert shares["half_or_more"] == 0.25  # the third: 8 a round; 2 is under half of 8
    assert shares["whole"] == 0.25


def test_an_arm_is_a_list_of_overrides():
    args = drafter_study.parse_args(["--arms", "drafter.block=4 drafter.steps=10", "base",
                                     "--passes", "1,2"])
    assert args.arms == ["drafter.block=4 drafter.steps=10", "base"]
    assert args.passes == "1,2"
