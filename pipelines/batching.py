"""Length-sorted batches for the RunInference jobs (`distill`, `decode`).

    batches = pairs | BatchByLength(tokenizer, boundaries, batch_size=64)
    results = batches | RunInference(KeyedModelHandler(handler).with_no_batching())

Each pair (a dict with "id" and "source") is keyed by the decoder shape its batch will have
(`components.records.decoder_shape`: the padded source width S and output cap T that
model/decoding/translator.py pads to, from its token count with the model's tokenizer and length
buckets). The pairs of one shape are counted, and the shape is split into
ceil(count / `max_group_size`) groups by a stable hash of the id, so that a group holds
about `max_group_size` pairs at most however large the corpus: the one step that holds a
whole group (sorting it) stays bounded, and more groups spread over more workers.
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
from typing import Iterator, Mapping, Sequence

import apache_beam as beam

from components import corpus, records
from components import tokenizer as tokenizer_lib

# Pairs per group, about (a hash spreads them): sorted in one worker's memory at once, and
# enough that a group's batches of a few dozen hold nearly equal lengths.
MAX_GROUP_SIZE = 20_000


class KeyByDecoderShape(beam.DoFn):
    """A pair -> ((S, T), (source tokens with EOS, pair)): the decoder shape of its batch."""

    def __init__(self, tokenizer: tokenizer_lib.Tokenizer, boundaries: Sequence[int]):
        self._tokenizer = tokenizer  # pickles as its model bytes
        self._boundaries = tuple(boundaries)

    def process(self, pair: dict) -> Iterator[tuple[tuple[int, int], tuple[int, dict]]]:
        length = len(self._tokenizer.encode([pair["source"]])[0]) + 1
        yield records.decoder_shape(length, self._boundaries), (length, pair)


def split_shape(keyed: tuple[tuple[int, int], tuple[int, dict]],
                sizes: Mapping[tuple[int, int], int],
                max_group_size: int) -> tuple[tuple[int, int, int], tuple[int, dict]]:
    """((S, T), member) -> ((S, T, group), member): one of the ceil(size / `max_group_size`)
    groups of its shape (`sizes`: pairs per shape), by a stable hash of its id."""
    shape, member = keyed
    groups = -(-sizes[shape] // max_group_size)
    group = zlib.crc32(member[1]["id"].encode("utf-8")) % groups  # stable: not hash()
    return (*shape, group), member


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
                 batch_size: int, max_group_size: int = MAX_GROUP_SIZE):
        super().__init__()
        self._key = KeyByDecoderShape(tokenizer, boundaries)
        self._batch_size = batch_size
        self._max_group_size = max_group_size

    def expand(self, pairs):
        keyed = pairs | "KeyByShape" >> beam.ParDo(self._key)
        # Pairs per shape: a combine, so only the counts (one per bucket) are shuffled.
        sizes = keyed | "CountPerShape" >> beam.combiners.Count.PerKey()
        return (
            keyed
            | "SplitShapes" >> beam.Map(split_shape, beam.pvalue.AsDict(sizes),
                                        self._max_group_size)
            | "GroupByShape" >> beam.GroupByKey()
            | "CutBatches" >> beam.FlatMap(length_batches, self._batch_size)
            | "SpreadBatches" >> beam.Reshuffle()
        )
