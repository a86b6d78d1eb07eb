"""Length-sorted batches for the RunInference jobs (`distill`, `decode`).

    batches = pairs | BatchByLength(tokenizer, boundaries, batch_size=64, num_groups=4)
    results = batches | RunInference(KeyedModelHandler(handler).with_no_batching())

Each pair (a dict with "id" and "source") is keyed by the decoder shape its batch will have
(`components.records.decoder_shape`: the padded source width S and output cap T that
model/inference.py pads to, from its token count with the model's tokenizer and length
buckets) and by one of `num_groups` groups (a stable hash of its id, so that no single key
holds a whole shape).
Each group is ordered by source length, then id, and cut into batches of `batch_size`
(the last one of a group may be smaller), which RunInference decodes as they are. So a
batch holds sources of similar lengths and one static shape (the decoder compiles once per
shape, at most one per bucket; a batch stops when its longest row does), and its contents
do not depend on the runner: a rerun decodes the same batches. The batches are reshuffled
before inference so that a runner spreads them over its workers. The keyed examples are
(pair, source): the results come back as (pair, PredictionResult).
"""

from __future__ import annotations

import zlib
from typing import Iterator, Sequence

import apache_beam as beam

from components import corpus, records
from components import tokenizer as tokenizer_lib


class KeyByDecoderShape(beam.DoFn):
    """A pair -> ((S, T, group), (source tokens with EOS, pair)): the decoder shape of its
    batch and one of `num_groups` groups."""

    def __init__(self, tokenizer: tokenizer_lib.Tokenizer, boundaries: Sequence[int],
                 num_groups: int):
        self._tokenizer = tokenizer  # pickles as its model bytes
        self._boundaries = tuple(boundaries)
        self._num_groups = num_groups

    def process(self, pair: dict) -> Iterator[tuple[tuple[int, int, int], tuple[int, dict]]]:
        length = len(self._tokenizer.encode([pair["source"]])[0]) + 1
        group = zlib.crc32(pair["id"].encode("utf-8")) % self._num_groups  # stable: not hash()
        yield (*records.decoder_shape(length, self._boundaries), group), (length, pair)


def length_batches(group: tuple[tuple, Sequence[tuple[int, dict]]],
                   batch_size: int) -> Iterator[list[tuple[dict, str]]]:
    """One group's (source tokens, pair) members, shortest first (then by id),
    `batch_size` at a time, as RunInference's keyed examples: (pair, source)."""
    _, members = group
    ordered = [pair for _, pair in sorted(
        members, key=lambda member: (member[0], corpus.id_sort_key(member[1]["id"])))]
    for start in range(0, len(ordered), batch_size):
        yield [(pair, pair["source"]) for pair in ordered[start:start + batch_size]]


class BatchByLength(beam.PTransform):
    """Pairs -> batches of up to `batch_size` (pair, source) examples of one decoder shape,
    sorted by source length (see the module docstring)."""

    def __init__(self, tokenizer: tokenizer_lib.Tokenizer, boundaries: Sequence[int], *,
                 batch_size: int, num_groups: int):
        super().__init__()
        self._key = KeyByDecoderShape(tokenizer, boundaries, num_groups)
        self._batch_size = batch_size

    def expand(self, pairs):
        return (
            pairs
            | "KeyByShape" >> beam.ParDo(self._key)
            | "GroupByShape" >> beam.GroupByKey()
            | "CutBatches" >> beam.FlatMap(length_batches, self._batch_size)
            | "SpreadBatches" >> beam.Reshuffle()
        )
