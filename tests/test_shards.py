"""pipelines/shards.py: a split's shard files depend on its records only."""

import glob
import os

import apache_beam as beam
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline

from pipelines import shards


def _write(records, prefix, num_shards):
    with BeamTestPipeline(runner="FnApiRunner") as p:
        _ = (p
             | beam.Create(records, reshuffle=False)
             | beam.Reshuffle()  # as a runner's bundles would: the order reaching the writer varies
             | shards.WriteShards(prefix, ".jsonl", num_shards, shards.write_lines))
    return {os.path.basename(path): open(path, "rb").read()
            for path in sorted(glob.glob(f"{prefix}-*"))}


def test_each_record_is_in_the_shard_of_its_id_sorted_by_id(tmp_path):
    records = [(f"train:{i:06d}", f'{{"id": "train:{i:06d}"}}') for i in range(40)]
    files = _write(records[::-1], str(tmp_path / "train"), 3)

    assert sorted(files) == [f"train-0000{i}-of-00003.jsonl" for i in range(3)]
    for index in range(3):
        lines = files[f"train-0000{index}-of-00003.jsonl"].decode().splitlines()
        assert lines == [payload for record_id, payload in records
                         if shards.shard_index(record_id, 3) == index]


def test_the_same_records_in_another_order_give_the_same_bytes(tmp_path):
    records = [(f"dev:{i:06d}", f"line {i}") for i in range(30)]
    first = _write(records, str(tmp_path / "a" / "dev"), 4)
    second = _write(records[7:] + records[:7], str(tmp_path / "b" / "dev"), 4)
    assert first == second


def test_every_shard_is_written_even_when_empty(tmp_path):
    files = _write([("test:000001", "only")], str(tmp_path / "test"), 5)
    assert len(files) == 5
    assert sorted(files.values()) == [b""] * 4 + [b"only\n"]


def test_shard_index_is_a_hash_of_the_id_fixed_across_processes():
    """A hash of the id's bytes, not Python's `hash` (salted by PYTHONHASHSEED): the golden
    indices hold in any process."""
    assert [shards.shard_index(f"train:{i:06d}", 4) for i in range(8)] == [1, 0, 2, 0, 1, 0, 2, 3]
