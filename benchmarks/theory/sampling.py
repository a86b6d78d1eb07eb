"""Dependent transitions reach the mode faster: k-Gibbs against independent parallel sampling.

Paper section 2.4 (Propositions 4-5, Corollary 1) and L.7, on an exact strongly
ferromagnetic Ising model whose field favours the all-(+1) mode: chains start at x = -1 (the
smaller mode); per sampler and coupling J, the fraction of chains whose magnetisation
reaches the threshold within the step budget and the median steps it took. Writes
sampling.png and sampling.json into --out. The experiment itself lives in
theory/experiments.py (`benchmarks/` is not an installed package; `padir theory` runs
this and benchmarks/theory/masking.py together).

    python benchmarks/theory/sampling.py [--out work/theory] [--quick]
"""

from __future__ import annotations

import argparse

from components import logs
from theory import experiments


def run(out_dir: str, quick: bool = False) -> dict:
    return experiments.run_sampling(out_dir, experiments.sampling_config(quick))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="work/theory")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logs.configure()
    run(args.out, args.quick)
