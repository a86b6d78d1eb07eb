"""Does the local runner hold a shuffle in memory? Peak RSS of a trivial pipeline, with and
without a Reshuffle, at two sizes, in both of FnApiRunner's modes.

The data stages' peak RSS grows with the corpus on the local FnApiRunner (benchmarks/README.md,
`scaling.py`). This separates the runner from our steps: the same pipeline of N strings, counted,
once straight through and once through a `beam.Reshuffle()`. In the default mode the
runner and its worker share one process; with `--direct_running_mode=multi_processing` the
worker is a process of its own, as on Dataflow, and its peak is measured apart from the
runner's. Each run is its own process (peak RSS only grows within one).

    python benchmarks/runner_memory.py --sizes 10000 170000
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from typing import Sequence

MODES = {"in_memory": [], "multi_processing": ["--direct_running_mode=multi_processing",
                                               "--direct_num_workers=1"]}


def pipeline_rss_mib(size: int, shuffle: bool, mode: str) -> tuple[int, int]:
    """Runs the pipeline from this process; returns the peak RSS in MiB of this process
    and of its largest worker process (0 in the default mode, which has none)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    options = PipelineOptions(["--runner=FnApiRunner", *MODES[mode]])
    with beam.Pipeline(options=options) as pipeline:
        lines = (pipeline | beam.Create([size])
                 | beam.FlatMap(lambda n: (f"pair {i} " * 8 for i in range(n))))
        if shuffle:
            lines = lines | beam.Reshuffle()
        _ = lines | beam.Map(len) | beam.CombineGlobally(sum)
    # The workers have exited and been reaped by now: RUSAGE_CHILDREN holds their peak.
    return tuple(resource.getrusage(who).ru_maxrss // 1024
                 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[10_000, 170_000])
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # size, shuffle, mode
    args = parser.parse_args(argv)
    if args.one:
        print(*pipeline_rss_mib(int(args.one[0]), args.one[1] == "1", args.one[2]))
        return 0
    print("| strings | one process: straight | with a Reshuffle | worker process: straight "
          "| with a Reshuffle | its runner: straight | with a Reshuffle |\n" + "|---:" * 7 + "|")
    for size in args.sizes:
        peaks = {}
        for mode in MODES:
            for shuffle in (0, 1):
                out = subprocess.run([sys.executable, __file__, "--one", str(size), str(shuffle),
                                      mode], capture_output=True, text=True, check=True).stdout
                peaks[mode, shuffle] = out.split()[-2:]  # [runner, worker]
        row = [peaks["in_memory", s][0] for s in (0, 1)]
        row += [peaks["multi_processing", s][1] for s in (0, 1)]
        row += [peaks["multi_processing", s][0] for s in (0, 1)]
        print(f"| {size:,} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
