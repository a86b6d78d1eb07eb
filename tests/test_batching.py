"""Length-sorted batches of the RunInference jobs (pipelines/batching.py)."""

import collections

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from components import corpus, dag, records
from components.tokenizer import Tokenizer
from pipelines import batching
from tiny_experiment import ensure, publish_untrained, tiny_config


def test_batches_are_cut_shortest_first_then_by_id():
    members = [(length, {"id": f"train:{i:06d}", "source": f"s{i}"})
               for length, i in ((9, 5), (7, 3), (9, 2), (7, 8), (8, 1))]
    batches = list(batching.length_batches(((16, 32, 0), members), 2))
    assert [[pair["id"][-1] for pair, _ in batch] for batch in batches] == \
        [["3", "8"], ["1", "2"], ["5"]]
    assert all(source == pair["source"] for batch in batches for pair, source in batch)


def test_a_shape_is_split_into_groups_of_about_max_group_size_by_id():
    sizes = {(16, 32): 1000, (32, 64): 99}
    groups = collections.Counter(
        batching.split_shape((shape, (7, {"id": f"train:{i:06d}"})), sizes, 100)[0]
        for shape, size in sizes.items() for i in range(size))
    assert {key[2] for key in groups if key[:2] == (16, 32)} == set(range(10))
    assert {key[2] for key in groups if key[:2] == (32, 64)} == {0}
    assert max(groups.values()) < 130  # about 100: a hash spreads them
    again = batching.split_shape(((16, 32), (7, {"id": "train:000005"})), sizes, 100)
    assert again == batching.split_shape(((16, 32), (7, {"id": "train:000005"})), sizes, 100)


@pytest.fixture(scope="module")
def config(tiny_workdir):
    config = tiny_config(tiny_workdir, "encode.bucket_boundaries=[64]")  # test_distill's teacher
    ensure(config, "prepare", "vocab")
    publish_untrained(config, "teacher")
    return config


def test_batch_by_length_keeps_every_pair_once_in_sorted_batches_of_one_shape(config):
    tokenizer = Tokenizer.for_artifact(dag.require_input(config, "teacher"))
    pairs = list(corpus.read_split(dag.output_uri(config, "prepare"), "train"))[:80]
    boundaries = (16, 32, 64)

    def describe(batch):
        lengths = [len(tokenizer.encode([source])[0]) + 1 for _, source in batch]
        keys = [(length, corpus.id_sort_key(pair["id"]))
                for length, (pair, _) in zip(lengths, batch)]
        shapes = {records.decoder_shape(length, boundaries) for length in lengths}
        return len(batch) <= 4, len(shapes), keys == sorted(keys)

    with BeamTestPipeline(runner="FnApiRunner") as p:
        batches = p | beam.Create(pairs) | batching.BatchByLength(
            tokenizer, boundaries, batch_size=4, max_group_size=10)
        ids = batches | beam.FlatMap(lambda batch: [pair["id"] for pair, _ in batch])
        assert_that(ids, equal_to([pair["id"] for pair in pairs]), label="EveryPairOnce")
        assert_that(batches | beam.Map(describe) | beam.Distinct(), equal_to([(True, 1, True)]),
                    label="OneShapeSorted")
        # Only a group's last batch is short: at most one per group, and a shape of n
        # pairs has ceil(n / 10) groups (80 pairs, 3 shapes: at most 8 + 3).
        short = batches | beam.Filter(lambda batch: len(batch) < 4) | beam.combiners.Count.Globally()
        assert_that(short | beam.Map(lambda n: n <= 80 // 10 + 3), equal_to([True]),
                    label="FewShort")
