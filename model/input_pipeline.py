"""Training and evaluation batches from the encode stage's TFRecord shards (tf.data).

Reading. The shards' records are read through fsspec (`records.read_records`, local or gs://)
and handed to tf.data in vectors, as `tf.data.TFRecordDataset(files).batch(n)` would yield
them: TensorFlow's own GCS client has Google's endpoint compiled in, so no emulator can stand
in for a bucket under it (docs/gcs.md), and one reader serves both.

Shapes. Every batch has one of a few static shapes: an example goes to the smallest bucket
boundary L >= max(len(source), len(target)), and bucket i batches `batch_sizes[i]` examples
into int32 `source` and `target` arrays of shape [batch_sizes[i], L], right-padded with PAD
(0). A jitted step therefore compiles once per bucket.

Partial batches are filled up, not dropped. The last batch of each bucket in an epoch is
completed with all-pad rows, so every example is seen exactly once per epoch (and once by the
eval reader). A row is padding iff `source[:, 0] == PAD` (a real one holds at least EOS): the
trainer weights targets by `target != PAD`, which gives pad rows no weight, and must also
give no weight to their length loss (their target length is 0). That costs at most one
partly empty batch per bucket per epoch.

Order. Epoch e is a deterministic pipeline of its own: the shards in an order shuffled by
(seed, e), their records shuffled in windows of `shuffle_window` (the whole split when it is
smaller), then bucketed and batched. The shuffles are stateless TF ops seeded explicitly, so
the order depends on (seed, epoch, the artifact's files) only, not on TF's global seed, on
what else the process did, or on tf.data's threading (the pipeline is `deterministic`).

Resumption. A position is the number of batches yielded since training began. The number of
batches in an epoch, sum_i ceil(n_i / batch_sizes[i]), does not depend on the order, so
position p is batch p % n of epoch p // n (n = batches per epoch), and `batches(p)` starts
epoch p // n and skips p % n batches: exactly the stream an uninterrupted run yields after p,
at the cost of at most one epoch of input work, with nothing to save but one integer.
(Checkpointing the tf.data iterator would be exact too, but stores the shuffle buffer, i.e. up
to the whole split, in every checkpoint.)

Evaluation reads a split once, unshuffled, with the same buckets, and yields the pair ids of
each batch's rows ("" for pad rows) beside the batch, so outputs align with references.

Several JAX processes: each runs the same deterministic pipeline and keeps its equal slice
of every global batch (`process_index`, `process_count`), as the trainer expects.

Example:
    stream = TrainingStream(split_files(encoded.uri, "train"), boundaries=(16, 32, 64),
                            batch_sizes=batch_sizes_for_tokens((16, 32, 64), 4096), seed=0)
    for position, batch in stream.batches(restored_position):
        state, metrics = train_step(state, batch)   # batch["source"]: int32[B, L]
    dev = list(eval_batches(split_files(encoded.uri, "dev"), boundaries=(16, 32, 64),
                            batch_sizes=(64, 32, 16)))   # [(ids, batch), ...]
"""

from __future__ import annotations

import math
from typing import Iterator, Sequence

import numpy as np
import tensorflow as tf

from components import artifacts, records
from components.tokenizer import PAD_ID

Batch = dict[str, np.ndarray]

SHUFFLE_WINDOW = 1 << 17  # records shuffled together: tens of MB for pairs of <= 64 tokens
_MAX_EPOCHS = 1 << 40  # "forever"
_PARSE_BATCH = 4096  # records parsed by one op where no shuffle window sets the batch
# Batches made ahead of the step that takes them, and parses run at once (dev set): fixed,
# since autotuning is off (`_options`). A batch takes milliseconds, a step a tenth of a
# second or more.
_PREFETCH_BATCHES = 2
_PARALLEL_PARSES = 2


def split_files(artifact_uri: str, split: str) -> list[str]:
    """The TFRecord shards of `split` in an encode artifact, sorted (local or gs://).

    Raises:
      FileNotFoundError: the artifact has no shards for `split`.
    """
    pattern = records.split_pattern(artifact_uri, split)
    fs, path = artifacts.filesystem(pattern)
    files = [fs.unstrip_protocol(file) for file in sorted(fs.glob(path))]
    if not files:
        raise FileNotFoundError(f"no encoded shards match {pattern}")
    return files


def batch_sizes_for_tokens(boundaries: Sequence[int], tokens_per_batch: int,
                           multiple_of: int = 1) -> tuple[int, ...]:
    """Rows per bucket so that a batch holds about `tokens_per_batch` tokens per side.

    Each size is rounded down to a multiple of `multiple_of` (e.g. the number of data-parallel
    devices) and is at least `multiple_of`.
    """
    return tuple(max(multiple_of, tokens_per_batch // b // multiple_of * multiple_of)
                 for b in boundaries)


def _check_buckets(boundaries: Sequence[int], batch_sizes: Sequence[int], process_index: int,
                   process_count: int) -> None:
    if not boundaries or list(boundaries) != sorted(set(boundaries)) or min(boundaries) < 1:
        raise ValueError(f"boundaries must be strictly increasing positive lengths: {boundaries}")
    if len(batch_sizes) != len(boundaries) or min(batch_sizes) < 1:
        raise ValueError(f"need one positive batch size per boundary {list(boundaries)}, "
                         f"got {list(batch_sizes)}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if any(size % process_count for size in batch_sizes):
        raise ValueError(f"batch sizes {list(batch_sizes)} must be multiples of the "
                         f"process count {process_count}")


def _process_rows(batch: Batch, process_index: int, process_count: int) -> Batch:
    """This process's equal share of the rows of a global batch (a view, no copy)."""
    if process_count == 1:
        return batch
    rows = len(batch["source"]) // process_count
    return {name: value[process_index * rows:(process_index + 1) * rows]
            for name, value in batch.items()}


def _record_windows(files: Sequence[str] | tf.Tensor, size: int) -> tf.data.Dataset:
    """The serialized records of `files`, in file order, as string vectors of `size` (the
    last one shorter): what `tf.data.TFRecordDataset(files).batch(size)` yields. `files`
    may be a tensor (inside a `flat_map`)."""

    def windows(paths, size):
        window = []
        for path in paths:
            for record in records.read_records(path.decode("utf-8")):
                window.append(record)
                if len(window) == size:
                    yield np.array(window, dtype=object)
                    window = []
        if window:
            yield np.array(window, dtype=object)

    return tf.data.Dataset.from_generator(
        windows, args=(files, size), output_signature=tf.TensorSpec([None], tf.string))


def _options() -> tf.data.Options:
    options = tf.data.Options()
    options.deterministic = True  # the default, stated: parallel map keeps the input order
    # No autotuning: an iterator's destruction waits for the autotuner's thread, which, when
    # training keeps the cores busy, held the end of a training run for 20-48 s (5 of 8
    # timed runs of the demo's student, on 2 cores).
    options.autotune.enabled = False
    return options


def _parse(serialized: tf.Tensor, *, with_id: bool, max_len: int) -> dict[str, tf.Tensor]:
    """A vector of serialized Examples -> int32 `source` and `target` rows (and the `id`),
    as ragged [N, None] tensors: one vectorised parse per window, unbatched afterwards."""
    features = {side: tf.io.RaggedFeature(tf.int64) for side in ("source", "target")}
    if with_id:
        features["id"] = tf.io.FixedLenFeature([], tf.string)
    parsed = tf.io.parse_example(serialized, features)
    examples = {side: tf.cast(parsed[side], tf.int32) for side in ("source", "target")}
    longest = tf.reduce_max(tf.concat([examples["source"].row_lengths(),
                                       examples["target"].row_lengths(), [0]], axis=0))
    # An example no bucket holds is an error (the encode config and these boundaries disagree),
    # never silently dropped.
    check = tf.debugging.assert_less_equal(
        longest, tf.cast(max_len, longest.dtype),
        message=f"an encoded pair is longer than the largest bucket {max_len}")
    with tf.control_dependencies([check]):
        examples = {side: tf.identity(rows) for side, rows in examples.items()}
    if with_id:
        examples["id"] = parsed["id"]
    return examples


def _as_tensors(example: dict) -> dict[str, tf.Tensor]:
    """Unbatched ragged rows arrive as rank-0-ragged specs, which `padded_batch` refuses; passing
    them through a function gives plain tensors."""
    return dict(example)


def _bucket_and_batch(examples: tf.data.Dataset, boundaries: Sequence[int],
                      batch_sizes: Sequence[int]) -> tf.data.Dataset:
    """Examples -> full batches of static shape [batch_sizes[i], boundaries[i]] per field."""
    bounds = tf.constant(boundaries, tf.int64)
    sizes = tf.constant(batch_sizes, tf.int64)

    def bucket(example):
        longest = tf.maximum(tf.size(example["source"], tf.int64),
                             tf.size(example["target"], tf.int64))
        return tf.searchsorted(bounds, longest[None], side="left", out_type=tf.int64)[0]

    def batch(key, window):
        length, size = bounds[key], sizes[key]
        shapes = {name: (tf.reshape(length, [1]) if name in ("source", "target")
                         else tf.constant([], tf.int64))
                  for name in window.element_spec}

        def fill(rows):  # the last batch of a bucket: append all-pad rows
            real = tf.shape(rows["source"], out_type=tf.int64)[0]
            filled = {}
            for name, value in rows.items():
                paddings = [[0, size - real]] + [[0, 0]] * (len(value.shape) - 1)
                pad = b"" if value.dtype == tf.string else PAD_ID
                filled[name] = tf.pad(value, paddings, constant_values=pad)
            return filled

        return window.padded_batch(size, padded_shapes=shapes).map(fill)

    return examples.group_by_window(bucket, batch, window_size_func=lambda key: sizes[key])


class TrainingStream:
    """The infinite, shuffled, bucketed batches of one split, resumable at any position.

    Args:
      files: the split's TFRecord shards (`split_files`).
      boundaries: the padded lengths, ascending (`encode.bucket_boundaries`).
      batch_sizes: rows per batch, one per boundary (`batch_sizes_for_tokens`).
      seed: fixes the order of every epoch (epoch e is shuffled by (seed, e)).
      shuffle_window: records shuffled together; a split larger than this is shuffled as
        shard order x consecutive windows, which is only as good as the shards are mixed.
      process_index, process_count: with several JAX processes each yields its own equal
        slice of every global batch (`batch_sizes` are global, multiples of the count);
        every process runs the same deterministic pipeline, so positions agree.
    """

    def __init__(self, files: Sequence[str], *, boundaries: Sequence[int],
                 batch_sizes: Sequence[int], seed: int, shuffle_window: int = SHUFFLE_WINDOW,
                 process_index: int = 0, process_count: int = 1):
        _check_buckets(boundaries, batch_sizes, process_index, process_count)
        if not files:
            raise ValueError("no files to read")
        self.files = tuple(files)
        self.boundaries = tuple(int(b) for b in boundaries)
        self.batch_sizes = tuple(int(b) for b in batch_sizes)
        self.seed = int(seed)
        self.shuffle_window = int(shuffle_window)
        self.process_index, self.process_count = process_index, process_count
        self._bucket_counts: tuple[int, ...] | None = None

    @property
    def bucket_counts(self) -> tuple[int, ...]:
        """Examples per bucket (one pass over the stored lengths, on first use)."""
        if self._bucket_counts is None:
            features = {name: tf.io.FixedLenFeature([], tf.int64)
                        for name in ("source_length", "target_length")}
            lengths = (_record_windows(list(self.files), _PARSE_BATCH)
                       .map(lambda rows: tf.io.parse_example(rows, features))
                       .with_options(_options()))
            counts = np.zeros(len(self.boundaries) + 1, np.int64)
            for chunk in lengths.as_numpy_iterator():
                longest = np.maximum(chunk["source_length"], chunk["target_length"])
                keys = np.searchsorted(self.boundaries, longest, side="left")
                counts += np.bincount(keys, minlength=len(counts))
            if counts[-1]:
                raise ValueError(f"{counts[-1]} encoded pairs are longer than the largest bucket "
                                 f"{self.boundaries[-1]}")
            self._bucket_counts = tuple(int(n) for n in counts[:-1])
        return self._bucket_counts

    @property
    def batches_per_epoch(self) -> int:
        return sum(math.ceil(n / b) for n, b in zip(self.bucket_counts, self.batch_sizes))

    def epoch_dataset(self, epoch: int) -> tf.data.Dataset:
        """The batches of one epoch, in order."""
        return self._epoch(tf.constant(epoch, tf.int64)).with_options(_options())

    def _epoch(self, epoch: tf.Tensor) -> tf.data.Dataset:
        """`epoch_dataset` for an int64 scalar tensor (also inside `flat_map`)."""
        seed = tf.stack([tf.constant(self.seed, tf.int64), epoch])
        files = tf.random.experimental.stateless_shuffle(tf.constant(self.files), seed=seed)

        def shuffle_and_parse(index, window):
            window_seed = tf.random.experimental.stateless_fold_in(seed, index)
            window = tf.random.experimental.stateless_shuffle(window, seed=window_seed)
            return _parse(window, with_id=False, max_len=self.boundaries[-1])

        examples = (
            _record_windows(files, self.shuffle_window)
            .enumerate()
            .map(shuffle_and_parse)
            .unbatch()
            .map(_as_tensors)
        )
        return _bucket_and_batch(examples, self.boundaries, self.batch_sizes)

    def dataset(self, start_position: int = 0) -> tf.data.Dataset:
        """The global batches from `start_position` on, forever (`batches` iterates it)."""
        if start_position < 0:
            raise ValueError(f"start_position must be >= 0, got {start_position}")
        per_epoch = self.batches_per_epoch
        if per_epoch == 0:
            raise ValueError(f"no examples in {list(self.files)}")
        epoch, offset = divmod(start_position, per_epoch)
        return (
            tf.data.Dataset.range(epoch, _MAX_EPOCHS)
            .flat_map(self._epoch)
            .skip(offset)
            .prefetch(_PREFETCH_BATCHES)
            .with_options(_options())
        )

    def batches(self, start_position: int = 0) -> Iterator[tuple[int, Batch]]:
        """Yields (position after the batch, {"source": int32[B, L], "target": int32[B, L]})
        forever, starting at `start_position` (the position saved with a checkpoint).

        B is this process's share of `batch_sizes[i]` and L is `boundaries[i]` for some i.
        """
        position = start_position
        for batch in self.dataset(start_position).as_numpy_iterator():
            position += 1
            yield position, _process_rows(batch, self.process_index, self.process_count)


def read_pairs(files: Sequence[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every (source ids, target ids) pair of the shards, EOS included, in file order."""
    examples = (
        _record_windows(sorted(files), _PARSE_BATCH)
        .map(lambda window: _parse(window, with_id=False, max_len=np.iinfo(np.int32).max))
        .unbatch()
    )
    for example in examples.with_options(_options()).as_numpy_iterator():
        yield example["source"], example["target"]


def eval_batches(files: Sequence[str], *, boundaries: Sequence[int], batch_sizes: Sequence[int],
                 process_index: int = 0, process_count: int = 1
                 ) -> Iterator[tuple[list[str], Batch]]:
    """Every example of a split exactly once, in a fixed order, in bucketed full batches.

    Yields:
      (ids, batch): `ids` are the pair ids of the global batch's rows in row order, "" for
      the all-pad rows that fill a bucket's last batch (so the references of the real rows,
      in order, are `[reference[i] for i in ids if i]`); `batch` is
      {"source": int32[B, L], "target": int32[B, L]}, this process's slice of the global
      batch, laid out as in training.
    """
    _check_buckets(boundaries, batch_sizes, process_index, process_count)
    examples = (
        _record_windows(sorted(files), _PARSE_BATCH)
        .map(lambda window: _parse(window, with_id=True, max_len=max(boundaries)),
             num_parallel_calls=_PARALLEL_PARSES)
        .unbatch()
        .map(_as_tensors)
    )
    batches = _bucket_and_batch(examples, boundaries, batch_sizes)
    for batch in batches.with_options(_options()).prefetch(_PREFETCH_BATCHES).as_numpy_iterator():
        ids = [pair_id.decode("utf-8") for pair_id in batch.pop("id")]
        yield ids, _process_rows(batch, process_index, process_count)
