"""Masking more is (statistically) better: k-pseudolikelihood parameter error against k.

Paper section 2.2.1 (Theorem 1) and L.6, on exact Ising models: one training set per seed,
the k-PL estimate for every k = 1 .. N on that same set, ||theta_hat - theta*|| averaged
over seeds (mean ± s.e.), for a weakly coupled, a strongly coupled (random signs) and a
peaked two-mode (ferromagnetic) model. Writes
masking.png and masking.json into --out. The experiment itself lives in
theory/experiments.py (`benchmarks/` is not an installed package; `padir theory` runs
this and benchmarks/theory/sampling.py together).

    python benchmarks/theory/masking.py [--out work/theory] [--quick]
"""

from __future__ import annotations

import argparse

from components import logs
from theory import experiments


def run(out_dir: str, quick: bool = False) -> dict:
    return experiments.run_masking(out_dir, experiments.masking_config(quick))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="work/theory")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logs.configure()
    run(args.out, args.quick)
