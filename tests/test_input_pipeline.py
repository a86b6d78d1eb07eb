"""Tests of the tf.data batches (model/input_pipeline.py) on hand-written TFRecord shards."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from components import records
from model import input_pipeline

BOUNDARIES = (4, 8, 16)
BATCH_SIZES = (4, 3, 2)
SHAPES = set(zip(BATCH_SIZES, BOUNDARIES))
NUM_EXAMPLES = 53


def _example(i: int, rng: np.random.Generator) -> tuple[str, list[int], list[int]]:
    """Example i: a source of (100 + i) tokens, a target of (1000 + i) tokens, then EOS."""
    source_len, target_len = (int(n) for n in rng.integers(1, 17, size=2))
    return f"train-{i}", [100 + i] * (source_len - 1) + [1], [1000 + i] * (target_len - 1) + [1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three shards of an encode artifact's train split, and the examples they hold."""
    folder = tmp_path_factory.mktemp("encoded")
    rng = np.random.default_rng(0)
    examples = [_example(i, rng) for i in range(NUM_EXAMPLES)]
    for shard in range(3):
        with tf.io.TFRecordWriter(str(folder / f"train-{shard:05d}-of-00003.tfrecord")) as writer:
            for pair_id, source, target in examples[shard::3]:
                writer.write(records.serialize_example(pair_id, source, target))
    return input_pipeline.split_files(str(folder), "train"), examples


def _stream(files, seed=0, **kwargs):
    return input_pipeline.TrainingStream(files, boundaries=BOUNDARIES, batch_sizes=BATCH_SIZES,
                                         seed=seed, **kwargs)


def _take(stream, start, n):
    return list(itertools.islice(stream.batches(start), n))


def _rows(batch):
    """The real (non-pad) rows of a batch as (source, target) tuples without padding."""
    return [(tuple(s[s != 0]), tuple(t[t != 0]))
            for s, t in zip(batch["source"], batch["target"]) if s[0] != 0]


def _same(a, b):
    return [p for p, _ in a] == [p for p, _ in b] and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for (_, x), (_, y) in zip(a, b))


def test_split_files_and_missing_split(shards, tmp_path):
    files, _ = shards
    assert [f.rsplit("/", 1)[1] for f in files] == [
        f"train-0000{i}-of-00003.tfrecord" for i in range(3)]
    with pytest.raises(FileNotFoundError, match="dev"):
        input_pipeline.split_files(str(tmp_path), "dev")


def test_batch_sizes_for_tokens():
    assert input_pipeline.batch_sizes_for_tokens((16, 32, 64), 1024) == (64, 32, 16)
    assert input_pipeline.batch_sizes_for_tokens((16, 32, 64), 1024, multiple_of=24) == (48, 24, 24)


def test_an_epoch_has_static_shapes_and_every_example_once(shards):
    files, examples = shards
    stream = _stream(files)
    expected_counts = [0, 0, 0]
    for _, source, target in examples:
        expected_counts[BOUNDARIES.index(records.bucket_of(len(source), len(target), BOUNDARIES))] += 1
    assert stream.bucket_counts == tuple(expected_counts)
    per_epoch = stream.batches_per_epoch
    assert per_epoch == sum(-(-n // b) for n, b in zip(expected_counts, BATCH_SIZES))

    epoch = _take(stream, 0, per_epoch)
    assert [p for p, _ in epoch] == list(range(1, per_epoch + 1))
    rows = []
    for _, batch in epoch:
        assert set(batch) == {"source", "target"}
        assert batch["source"].dtype == batch["target"].dtype == np.int32
        assert batch["source"].shape == batch["target"].shape and batch["source"].shape in SHAPES
        rows += _rows(batch)
    assert sorted(rows) == sorted((tuple(s), tuple(t)) for _, s, t in examples)
    # Only the last batch of a bucket may hold pad rows: fewer than one batch per bucket.
    pad_rows = sum(b["source"].shape[0] for _, b in epoch) - len(examples)
    assert 0 <= pad_rows <= sum(size - 1 for size in BATCH_SIZES)


def test_same_seed_same_batches_other_seed_other_order(shards):
    files, _ = shards
    n = 2 * _stream(files).batches_per_epoch
    first = _take(_stream(files, seed=7), 0, n)
    assert _same(first, _take(_stream(files, seed=7), 0, n))
    tf.random.set_seed(1234)  # the order is seeded explicitly: TF's global seed plays no part
    try:
        assert _same(first, _take(_stream(files, seed=7), 0, n))
    finally:
        tf.random.set_seed(None)
    other = _take(_stream(files, seed=8), 0, n)
    assert not _same(first, other)
    # The same examples, though: the first epoch of each seed is a permutation of the split.
    per_epoch = n // 2
    assert sorted(r for _, b in first[:per_epoch] for r in _rows(b)) == sorted(
        r for _, b in other[:per_epoch] for r in _rows(b))


def test_each_epoch_is_reshuffled(shards):
    files, _ = shards
    stream = _stream(files)
    per_epoch = stream.batches_per_epoch
    batches = _take(stream, 0, 2 * per_epoch)
    first, second = ([r for _, b in part for r in _rows(b)]
                     for part in (batches[:per_epoch], batches[per_epoch:]))
    assert sorted(first) == sorted(second) and first != second


def test_resuming_at_a_position_equals_the_uninterrupted_stream(shards):
    files, _ = shards
    stream = _stream(files, seed=3)
    per_epoch = stream.batches_per_epoch
    uninterrupted = _take(stream, 0, 2 * per_epoch + 6)
    # Within the first epoch, across the first epoch boundary, exactly at it, in epoch 2.
    for start in (5, per_epoch - 2, per_epoch, 2 * per_epoch + 2):
        resumed = _take(_stream(files, seed=3), start, 4)
        assert resumed[0][0] == start + 1
        assert _same(resumed, uninterrupted[start:start + 4]), start


def test_the_stream_runs_without_tf_datas_autotuner(shards):
    """An iterator's destruction waits for the autotuner's thread; starved by training on the
    same cores, it held the end of a training run for 20-48 s. Fixed buffers instead."""
    files, _ = shards
    options = _stream(files).dataset(5).options()
    assert options.autotune.enabled is False and options.deterministic is True


def test_a_small_shuffle_window_still_sees_every_example_once(shards):
    files, examples = shards
    stream = _stream(files, shuffle_window=5)
    epoch = _take(stream, 0, stream.batches_per_epoch)
    assert sorted(r for _, b in epoch for r in _rows(b)) == sorted(
        (tuple(s), tuple(t)) for _, s, t in examples)
    assert _same(_take(stream, 3, 3), epoch[3:6])


def test_eval_batches_yield_every_example_once_with_ids(shards):
    files, examples = shards
    by_id = {pair_id: (source, target) for pair_id, source, target in examples}
    seen = []
    batches = list(input_pipeline.eval_batches(files, boundaries=BOUNDARIES,
                                                batch_sizes=BATCH_SIZES))
    for ids, batch in batches:
        assert set(batch) == {"source", "target"} and batch["source"].dtype == np.int32
        assert batch["source"].shape == batch["target"].shape and batch["source"].shape in SHAPES
        assert len(ids) == len(batch["source"])
        for pair_id, source, target in zip(ids, batch["source"], batch["target"]):
            if not pair_id:
                assert not source.any() and not target.any()  # an all-pad row
                continue
            seen.append(pair_id)
            length = len(source)
            assert list(source) == by_id[pair_id][0] + [0] * (length - len(by_id[pair_id][0]))
            assert list(target) == by_id[pair_id][1] + [0] * (length - len(by_id[pair_id][1]))
    assert sorted(seen) == sorted(by_id)
    again = input_pipeline.eval_batches(files, boundaries=BOUNDARIES, batch_sizes=BATCH_SIZES)
    assert [ids for ids, _ in again] == [ids for ids, _ in batches]  # a fixed order


def test_each_process_gets_its_slice_of_the_global_batch(shards):
    files, _ = shards
    sizes = (4, 2, 2)
    whole = _take(input_pipeline.TrainingStream(
        files, boundaries=BOUNDARIES, batch_sizes=sizes, seed=0), 0, 6)
    halves = [_take(input_pipeline.TrainingStream(
        files, boundaries=BOUNDARIES, batch_sizes=sizes, seed=0, process_index=i,
        process_count=2), 0, 6) for i in range(2)]
    for (position, batch), (p0, first), (p1, second) in zip(whole, *halves):
        assert position == p0 == p1
        for name in ("source", "target"):
            assert np.array_equal(np.concatenate([first[name], second[name]]), batch[name])
    with pytest.raises(ValueError, match="multiples of the process count"):
        input_pipeline.TrainingStream(files, boundaries=BOUNDARIES, batch_sizes=BATCH_SIZES,
                                      seed=0, process_count=2)


def test_a_pair_longer_than_the_largest_bucket_is_an_error(shards):
    files, _ = shards
    with pytest.raises(ValueError, match="longer than the largest bucket"):
        input_pipeline.TrainingStream(files, boundaries=(4, 8), batch_sizes=(4, 3),
                                      seed=0).batches_per_epoch
    with pytest.raises(tf.errors.InvalidArgumentError, match="longer than the largest bucket"):
        list(input_pipeline.eval_batches(files, boundaries=(4, 8), batch_sizes=(4, 3)))


def test_records_read_through_fsspec_are_tf_datas_own(shards):
    """The reader hands tf.data what `TFRecordDataset(files).batch(n)` would (records.py
    frames them; TensorFlow's reader cannot reach an emulated bucket): the same batches."""
    files, _ = shards
    for size in (1, 7, 4096):
        ours = input_pipeline._record_windows(files, size)
        theirs = tf.data.TFRecordDataset(files).batch(size)
        assert [list(w) for w in ours.as_numpy_iterator()] == \
            [list(w) for w in theirs.as_numpy_iterator()], size


def test_a_corrupt_record_is_an_error_naming_the_shard(shards, tmp_path):
    files, _ = shards
    data = bytearray(open(files[0].removeprefix("file://"), "rb").read())
    data[20] ^= 1  # a byte of the first record
    path = tmp_path / "train-00000-of-00001.tfrecord"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{path}: a truncated or corrupt TFRecord at byte 0"):
        list(records.read_records(str(path)))
    path.write_bytes(bytes(data[:30]))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        list(records.read_records(str(path)))
    with pytest.raises(tf.errors.OpError, match="corrupt TFRecord"):
        list(input_pipeline.read_pairs([str(path)]))
