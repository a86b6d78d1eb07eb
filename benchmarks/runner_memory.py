"""Does the local runner hold a shuffle in memory? Peak RSS of a trivial pipeline, with and
without a Reshuffle, at two sizes.

The data stages' peak RSS grows with the corpus on the local FnApiRunner (README, "The cost
curve"). This separates the runner from our steps: the same pipeline of N strings, counted,
once straight through and once through a `beam.Reshuffle()`. Each run is its own process
(peak RSS only grows within one).

    python benchmarks/runner_memory.py --sizes 10000 170000
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from typing import Sequence


def pipeline_rss_mib(size: int, shuffle: bool) -> int:
    """Runs the pipeline in this process; returns its peak RSS in MiB."""
    import apache_beam as beam

    with beam.Pipeline(runner="FnApiRunner") as pipeline:
        lines = (pipeline | beam.Create([size])
                 | beam.FlatMap(lambda n: (f"pair {i} " * 8 for i in range(n))))
        if shuffle:
            lines = lines | beam.Reshuffle()
        _ = lines | beam.Map(len) | beam.CombineGlobally(sum)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[10_000, 170_000])
    parser.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)  # size, shuffle
    args = parser.parse_args(argv)
    if args.one:
        print(pipeline_rss_mib(args.one[0], bool(args.one[1])))
        return 0
    print("| strings | peak RSS MiB, straight | with a Reshuffle |\n|---:|---:|---:|")
    for size in args.sizes:
        rss = [subprocess.run([sys.executable, __file__, "--one", str(size), str(shuffle)],
                              capture_output=True, text=True, check=True).stdout.split()[-1]
               for shuffle in (0, 1)]
        print(f"| {size:,} | {rss[0]} | {rss[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
