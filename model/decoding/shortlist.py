"""Vocabulary shortlists: score only the target pieces a source sentence can need.

At batch 1 on a CPU, projecting every decoder position onto all V pieces (and reading those
logits) is a third to a half of a decoding step or pass. A lexical shortlist, as Marian and
Firefox Translations decode on CPUs, restricts the output layer to the union of:

* the `FREQUENT` most frequent target pieces of the training data (function words,
  punctuation, the reserved ids: EOS must always be reachable),
* each source piece itself (the vocabulary is joint: names and numbers are copied),
* for each source piece, the `PER_SOURCE` target pieces most associated with it in the
  training pairs, by the Dice coefficient of their sentence co-occurrence
  (2 c(s, t) / (c(s) + c(t))), which ranks translations above merely frequent pieces,

padded with the next most frequent pieces to a multiple of `SIZE_STEP` (so a decoder
compiles once per size, as once per width). Ids are sorted, so the reserved ids keep their
columns: column i of the shortlisted logits is id `ids[i]`, and `ids[:NUM_RESERVED]` are
ids 0..NUM_RESERVED-1.

    table = build(pairs, vocab_size)              # pairs: (source ids, target ids) arrays
    ids = select(table, source)                   # int32[K] for a batch int32[B, S]
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from components.tokenizer import NUM_RESERVED

FREQUENT = 256  # most frequent target pieces, always in
PER_SOURCE = 32  # most associated target pieces per source piece
SIZE_STEP = 128  # a shortlist's size is a multiple of this (one compilation per size)


@dataclasses.dataclass(frozen=True)
class Shortlist:
    """The table a shortlist is selected from (`build`)."""

    always: np.ndarray  # bool[V]: the reserved ids and the `frequent` most frequent pieces
    by_source: np.ndarray  # int32[V, per_source]: per source id its associated ids, -1 pad
    fill_order: np.ndarray  # int32[V - count of always]: the other ids, most frequent first

    @property
    def vocab_size(self) -> int:
        return len(self.always)


def build(pairs: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int, *,
          frequent: int = FREQUENT, per_source: int = PER_SOURCE) -> Shortlist:
    """The table of a training corpus: pairs of (source ids, target ids), EOS included or not.

    Counts are over sentences (a piece counted once per sentence), over real pieces only.
    """
    source_counts = np.zeros(vocab_size, np.int64)
    target_counts = np.zeros(vocab_size, np.int64)
    codes = []
    for source, target in pairs:
        source = np.unique(source[source >= NUM_RESERVED]).astype(np.int64)
        target = np.unique(target[target >= NUM_RESERVED]).astype(np.int64)
        source_counts[source] += 1
        target_counts[target] += 1
        codes.append((source[:, None] * vocab_size + target[None, :]).ravel())
    codes, joint = np.unique(np.concatenate(codes or [np.zeros(0, np.int64)]),
                             return_counts=True)
    source_ids, target_ids = codes // vocab_size, codes % vocab_size
    dice = 2.0 * joint / (source_counts[source_ids] + target_counts[target_ids])
    # Best first within each source id; ties to the lower target id.
    order = np.lexsort((target_ids, -dice, source_ids))
    source_ids, target_ids = source_ids[order], target_ids[order]
    first = np.searchsorted(source_ids, source_ids, side="left")
    rank = np.arange(len(source_ids)) - first
    keep = rank < per_source
    by_source = np.full((vocab_size, per_source), -1, np.int32)
    by_source[source_ids[keep], rank[keep]] = target_ids[keep]
    real = np.arange(NUM_RESERVED, vocab_size)
    real = real[np.lexsort((real, -target_counts[real]))].astype(np.int32)  # most frequent first
    always = np.zeros(vocab_size, bool)
    always[:NUM_RESERVED] = True
    always[real[:frequent]] = True
    return Shortlist(always=always, by_source=by_source, fill_order=real[frequent:])


def select(table: Shortlist, source: np.ndarray) -> np.ndarray:
    """The sorted ids a batch may decode to: int32[K], K a multiple of `SIZE_STEP` (or V).

    source: int[B, S], a batch's source ids (padding and EOS are reserved ids, ignored).
    """
    vocab_size = table.vocab_size
    pieces = source[(source >= NUM_RESERVED) & (source < vocab_size)]
    chosen = table.always.copy()
    chosen[pieces] = True
    associated = table.by_source[pieces].ravel()
    chosen[associated[associated >= 0]] = True
    count = int(np.count_nonzero(chosen))
    size = min(vocab_size, -(-count // SIZE_STEP) * SIZE_STEP)
    if size > count:  # pad with the most frequent ids not yet in
        chosen[table.fill_order[~chosen[table.fill_order]][:size - count]] = True
    return np.flatnonzero(chosen).astype(np.int32)
