"""The encode stage's records: one pair's token ids as a `tf.train.Example` in TFRecord shards.

An encode artifact holds, per split (`train`, `dev`):

    {split}-SSSSS-of-NNNNN.tfrecord   one serialized tf.train.Example per pair (FEATURES below)
    rejects/{split}-00000-of-00001.jsonl   pairs over the length limits, with their reason
    stats/{split}.json                token length histograms (summarised into the manifest)

Features of an Example:

    id              bytes       the prepared pair's id (aligns outputs with references)
    source, target  int64 list  piece ids followed by EOS (1); never padded, never empty
    source_length   int64       len(source)
    target_length   int64       len(target)

The length buckets are the one rule of padded widths: a stored pair's bucket (`bucket_of`:
what training pads it to, in the encode stage's figures) and a decoded batch's shape
(`decoder_shape`: model/decoding/translator.py pads to it, pipelines/batching.py groups by it).

The element logic here is plain Python (the Beam job wraps it; tests call it directly).
TensorFlow is imported on first use only: `serialize_example` needs its protos. Shards are
framed here, written and read through fsspec (`write_shard`, `read_records`; docs/gcs.md).
"""

from __future__ import annotations

import math
import struct
from typing import Iterator, Mapping, Optional, Sequence

from components import artifacts
from components.tokenizer import EOS_ID

SPLITS = ("train", "dev")
SUFFIX = ".tfrecord"
TOO_MANY_TOKENS = "too_many_tokens"
REASONS = (TOO_MANY_TOKENS,)


def shard_prefix(artifact_uri: str, split: str) -> str:
    """The path prefix the shard writer completes with `-SSSSS-of-NNNNN.tfrecord`."""
    return artifacts.join(artifact_uri, split)


def split_pattern(artifact_uri: str, split: str) -> str:
    """The glob matching every TFRecord shard of `split` in an encode artifact."""
    return artifacts.join(artifact_uri, f"{split}-?????-of-?????{SUFFIX}")


def stats_path(artifact_uri: str, split: str) -> str:
    return artifacts.join(artifact_uri, "stats", f"{split}.json")


def with_eos(ids: Sequence[int]) -> list[int]:
    """Piece ids -> the stored sequence: the pieces, then EOS."""
    return [int(i) for i in ids] + [EOS_ID]


def check_lengths(source_len: int, target_len: int, *, max_source_len: int,
                  max_target_len: int) -> Optional[str]:
    """The reject reason of a pair of stored lengths (EOS included), or None if it fits."""
    if source_len > max_source_len or target_len > max_target_len:
        return TOO_MANY_TOKENS
    return None


# --- length buckets (`encode.bucket_boundaries`) ---------------------------------------


def bucket(length: int, boundaries: Sequence[int]) -> int:
    """The smallest boundary that holds `length` tokens: the padded width of its batch.

    Raises:
      ValueError: `length` is longer than the largest boundary.
    """
    for boundary in boundaries:
        if length <= boundary:
            return boundary
    raise ValueError(f"a length of {length} tokens exceeds the largest bucket {boundaries[-1]}")


def bucket_of(source_len: int, target_len: int, boundaries: Sequence[int]) -> int:
    """The bucket of a stored pair (training pads it to this): that of its longer side."""
    return bucket(max(source_len, target_len), boundaries)


def decoder_shape(source_tokens: int, boundaries: Sequence[int]) -> tuple[int, int]:
    """(S, T): the padded source width and the output cap of a decoded batch whose longest
    source has `source_tokens` tokens (EOS included). The source is cut to the widest
    bucket; S is the bucket that holds it, T the one that holds twice as many tokens (else
    the widest), so that targets up to twice as long as their source are never cut."""
    length = min(source_tokens, boundaries[-1])
    return bucket(length, boundaries), bucket(min(2 * length, boundaries[-1]), boundaries)


def serialize_example(pair_id: str, source: Sequence[int], target: Sequence[int]) -> bytes:
    """One encoded pair as a serialized tf.train.Example (see the module docstring)."""
    import tensorflow as tf

    def ints(values):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    example = tf.train.Example(features=tf.train.Features(feature={
        "id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[pair_id.encode("utf-8")])),
        "source": ints(source),
        "target": ints(target),
        "source_length": ints([len(source)]),
        "target_length": ints([len(target)]),
    }))
    return example.SerializeToString(deterministic=True)  # map order fixed: byte-identical shards


def write_shard(path: str, serialized: Sequence[bytes]) -> None:
    """A TFRecord shard of serialized Examples (local or gs://), framed here and written
    through fsspec: TensorFlow's own writer would reach gs:// through its GCS client, whose
    endpoint is compiled in (docs/gcs.md). The bytes are those of `tf.io.TFRecordWriter`."""
    import fsspec

    with fsspec.open(path, "wb") as f:
        for example in serialized:
            length = struct.pack("<Q", len(example))
            f.write(length + _masked_crc(length) + example + _masked_crc(example))


def read_records(path: str) -> Iterator[bytes]:
    """The records of a TFRecord shard (local or gs://) in order, checksums checked: read
    through fsspec, as `write_shard` writes them, since TensorFlow's reader would reach gs://
    through its GCS client (docs/gcs.md).

    Raises:
      ValueError: a record is truncated or fails its checksum (names the file).
    """
    import fsspec

    with fsspec.open(path, "rb") as f:
        while header := f.read(12):
            length, data, footer = header[:8], b"", b""
            if len(header) == 12 and _masked_crc(length) == header[8:]:
                data = f.read(struct.unpack("<Q", length)[0])
                footer = f.read(4)
            if len(footer) != 4 or _masked_crc(data) != footer:
                raise ValueError(f"{path}: a truncated or corrupt TFRecord at byte "
                                 f"{f.tell() - len(header) - len(data) - len(footer)}")
            yield data


def _masked_crc(data: bytes) -> bytes:
    """TFRecord's checksum: CRC-32C, rotated right by 15 bits plus a constant."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def summarize_lengths(histogram: Mapping[int, int]) -> dict:
    """{length: count} -> count, mean, p95 (nearest rank), max and the histogram itself.

    The histogram's keys become strings (JSON objects); an empty one gives None figures.
    """
    histogram = {int(k): int(v) for k, v in histogram.items() if v}
    total = sum(histogram.values())
    summary = {"count": total, "mean": None, "p95": None, "max": None,
               "histogram": {str(k): histogram[k] for k in sorted(histogram)}}
    if not total:
        return summary
    rank, seen = math.ceil(0.95 * total), 0
    for length in sorted(histogram):
        seen += histogram[length]
        if seen >= rank:
            summary["p95"] = length
            break
    summary["mean"] = round(sum(k * v for k, v in histogram.items()) / total, 3)
    summary["max"] = max(histogram)
    return summary
