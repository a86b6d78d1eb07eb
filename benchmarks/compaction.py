"""What compacting converged rows between passes would save at batch > 1, from a decode run.

A batch of refinement decoding runs every row until its last row converges: rows that have
converged are frozen but still computed. Compacting the rows still changing into a smaller
batch before each pass would skip them, at the cost of a gather and of one compiled
program per (rows, width) instead of one per width. This replays the decode stage's
batched pass (pipelines/batching.py: per decoder shape, sorted by source length, batches of
`decode.throughput_batch_size`) with each sentence's recorded passes, and counts decoder
row-passes as decoded, with compaction into the smallest power of two or multiple of 8
that holds the rows still changing, and ideally (only those rows). Row-passes are what a
batched pass costs on a CPU, where a pass over 64 rows is compute-bound.

    python benchmarks/compaction.py configs/multi30k_en_de.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from typing import Callable, Sequence

from components import config as config_lib
from components import corpus, dag, records
from pipelines import decode

BUCKETS: dict[str, Callable[[int, int], int]] = {
    "powers of 2": lambda rows, batch: min(batch, 2 ** math.ceil(math.log2(rows))),
    "multiples of 8": lambda rows, batch: min(batch, 8 * math.ceil(rows / 8)),
    "ideal": lambda rows, batch: rows,
}


@dataclasses.dataclass(frozen=True)
class Saving:
    method: str
    mean_passes: float
    row_passes: int  # as decoded
    saved: dict[str, float]  # BUCKETS name -> fraction of row_passes saved


def batches(lines: Sequence[dict], boundaries: Sequence[int], batch_size: int
            ) -> list[list[int]]:
    """The passes of each sentence, in the decode stage's batches."""
    def shape(line: dict) -> tuple[int, int]:
        return records.decoder_shape(line["source_tokens"], boundaries)

    out = []
    for _, group in itertools.groupby(sorted(lines, key=shape), key=shape):
        ordered = sorted(group, key=lambda line: (line["source_tokens"],
                                                  corpus.id_sort_key(line["id"])))
        out += [[line["passes"] for line in ordered[i:i + batch_size]]
                for i in range(0, len(ordered), batch_size)]
    return out


def row_passes(passes: Sequence[int], bucket: Callable[[int, int], int] | None) -> int:
    """Rows computed over a batch's passes: all of them every pass (`bucket` None), or
    before pass k the bucket holding the rows that have not converged yet."""
    if bucket is None:
        return len(passes) * max(passes)
    return sum(bucket(sum(p >= k for p in passes), len(passes))
               for k in range(1, max(passes) + 1))


def saving(method: str, lines: Sequence[dict], boundaries: Sequence[int], batch_size: int
           ) -> Saving:
    grouped = batches(lines, boundaries, batch_size)
    decoded = sum(row_passes(b, None) for b in grouped)
    saved = {name: 1 - sum(row_passes(b, bucket) for b in grouped) / decoded
             for name, bucket in BUCKETS.items()}
    return Saving(method, sum(line["passes"] for line in lines) / len(lines), decoded, saved)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the config whose decode artifact to read")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    config = config_lib.load(args.config, args.set)
    uri = dag.output_uri(config, "decode")
    batch_size = config.decode.throughput_batch_size
    print(f"{uri}, batches of {batch_size}: decoder row-passes saved by compaction\n")
    print("| test set | method | mean passes | row-passes as decoded | "
          + " | ".join(BUCKETS) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(BUCKETS))
    for test_set in corpus.output_splits(config.data):
        if test_set in (corpus.TRAIN, corpus.DEV):
            continue
        for method in config.decode.methods:
            if method.kind not in ("padir", "adaptive"):  # fixed pass counts save nothing
                continue
            path = decode.output_path(uri, decode.HYPOTHESES, test_set, method.name)
            result = saving(method.name, list(corpus.read_jsonl(path)),
                            config.encode.bucket_boundaries, batch_size)
            print(f"| {test_set} | {method.name} | {result.mean_passes:.2f} | "
                  f"{result.row_passes:,} | "
                  + " | ".join(f"{100 * result.saved[name]:.1f}%" for name in BUCKETS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
