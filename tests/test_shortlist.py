"""Tests for model/decoding/shortlist.py: what a table holds and what a batch selects from it."""

import numpy as np

from components.tokenizer import EOS_ID, NUM_RESERVED
from model.decoding import shortlist

VOCAB = 300
R = NUM_RESERVED


def _pairs():
    """Source piece R+s translates to target piece 100+s; piece 200 is in every target."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(400):
        words = rng.choice(20, size=4, replace=False)
        source = np.append(R + words, EOS_ID)
        target = np.append(np.append(100 + words, 200), EOS_ID)
        out.append((source, target))
    return out


def test_dice_ranks_the_translation_above_a_piece_in_every_target():
    table = shortlist.build(_pairs(), VOCAB, frequent=1, per_source=2)
    for s in range(20):
        assert table.by_source[R + s, 0] == 100 + s  # Dice 1: always together
        assert table.by_source[R + s, 1] == 200  # co-occurs always, but is everywhere
    assert np.all(table.by_source[R + 50] == -1)  # never seen: nothing associated
    # Always in: the reserved ids and the most frequent target piece.
    np.testing.assert_array_equal(np.flatnonzero(table.always), list(range(R)) + [200])
    assert sorted(np.concatenate([np.flatnonzero(table.always), table.fill_order])) == list(
        range(VOCAB))


def test_a_selection_is_sorted_reserved_first_and_a_multiple_of_the_size_step():
    table = shortlist.build(_pairs(), VOCAB, frequent=5, per_source=1)
    source = np.array([[R + 3, R + 7, EOS_ID, 0], [R + 250, EOS_ID, 0, 0]])
    ids = shortlist.select(table, source)
    assert ids.dtype == np.int32 and len(ids) % shortlist.SIZE_STEP == 0
    assert np.all(np.diff(ids) > 0)
    np.testing.assert_array_equal(ids[:R], np.arange(R))
    needed = np.concatenate([np.flatnonzero(table.always),  # reserved and frequent pieces
                             [R + 3, R + 7, R + 250],  # the sources' own pieces
                             [103, 107]])  # their translations
    assert np.all(np.isin(needed, ids))
    # Filled up to the size step with the next most frequent pieces, not arbitrary ids.
    next_frequent = [i for i in table.fill_order if i not in needed]
    np.testing.assert_array_equal(
        np.setdiff1d(ids, needed), np.sort(next_frequent[:len(ids) - len(set(needed))]))


def test_a_selection_never_exceeds_the_vocabulary():
    table = shortlist.build(_pairs(), VOCAB, frequent=VOCAB)
    ids = shortlist.select(table, np.arange(R, VOCAB)[None])
    np.testing.assert_array_equal(ids, np.arange(VOCAB))
