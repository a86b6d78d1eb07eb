"""benchmarks/crossover.py on a tiny shape: every row does the fixed-length work it claims,
and the crossover is read off the rows as the module says (seconds, no data)."""

import numpy as np
import pytest

from benchmarks import crossover
from components.tokenizer import EOS_ID
from model.decoding import ctranslate2_search

TINY = crossover.Shape(d_model=32, layers=1, vocab=300)
LENGTH = 6


@pytest.fixture(scope="module")
def methods():
    return crossover.JaxMethods(TINY, LENGTH, "float32")


def test_jax_greedy_never_stops_before_the_fixed_length(methods):
    source = crossover.sources(4, LENGTH, TINY.vocab)
    assert np.all(source[:, -1] == EOS_ID)
    seconds, tokens = methods.greedy(source)
    assert seconds > 0 and tokens == LENGTH  # EOS (a zero embedding row) never won


def test_jax_padir_runs_at_most_its_passes_at_the_given_length(methods):
    source = crossover.sources(3, LENGTH, TINY.vocab)
    for passes in crossover.PADIR_PASSES:
        seconds, ran = methods.refine(source, passes)
        assert seconds > 0 and 1 <= ran <= passes


def test_ctranslate2_decodes_exactly_the_fixed_length(methods, tmp_path):
    dirs = crossover._ct2_dirs(TINY, LENGTH, {"teacher": methods.ar_params,
                                              "AR student": methods.ar_params},
                               str(tmp_path))
    pieces = crossover.pieces(TINY.vocab)
    worker = ctranslate2_search.Worker(dirs["AR student"], device="cpu",
                                       compute_type="float32",
                                       threads=ctranslate2_search.Threads(1))
    try:
        rows = [[pieces[i] for i in row] for row in crossover.sources(2, LENGTH, TINY.vocab)]
        hypotheses, _, seconds = worker.translate(rows, crossover._ct2_options(LENGTH, pieces))
    finally:
        worker.close()
    assert seconds > 0 and [len(h) for h in hypotheses] == [LENGTH, LENGTH]


def _row(shape, method, kind, median, throughput, parameters=1e6):
    return {"shape": shape, "parameters": parameters, "method": method, "kind": kind,
            "median_ms": median, "p99_ms": median, "sentences_per_s": throughput,
            "passes": 1.0}


def test_speedups_are_against_the_fastest_ar_row_of_each_shape_and_regime():
    rows = [_row("small", "floor AR", "AR", 0.1, float("nan")),  # floors never compete
            _row("small", "JAX greedy", "AR", 2.0, 100.0),
            _row("small", "CT2 greedy", "AR", 1.0, 400.0),
            _row("small", "JAX PaDIR-4", "PaDIR", 4.0, 200.0),
            _row("big", "JAX greedy", "AR", 100.0, 10.0, 5e7),
            _row("big", "CT2 greedy", "AR", 50.0, 40.0, 5e7),
            _row("big", "JAX PaDIR-4", "PaDIR", 25.0, 20.0, 5e7)]
    found = crossover.speedups(rows)
    assert [(r["shape"], r["batch1"], r["batch1_against"], r["batched"]) for r in found] == [
        ("small", 0.25, "CT2 greedy", 0.5), ("big", 2.0, "CT2 greedy", 0.5)]
    assert crossover.crossover(found, "batch1").startswith(
        "batch1: JAX PaDIR-4 overtakes CT2 greedy at big (2.00x)")
    assert crossover.crossover(found, "batched").startswith(
        "batched: no crossover up to the largest shape")
    assert "| big | 50.0M | JAX PaDIR-4 | 1.0 | 25.00 |" in crossover.table(rows)
