"""Smoke tests of theory/experiments.py on tiny configs, and the `padir theory` wiring."""

import json
import os

import numpy as np

from flows import cli
from theory import experiments


def test_masking_writes_figures(tmp_path):
    # max_subsets=1 < C(2, 1): the k = 1 loss uses one random block per training set.
    config = experiments.MaskingConfig(num_spins=2, num_samples=200, num_seeds=2,
                                             lbfgs_max_steps=5, max_subsets=1)
    result = experiments.run_masking(str(tmp_path), config)
    for name in ("masking.png", "masking.json"):
        assert os.path.getsize(tmp_path / name) > 0
    written = json.loads((tmp_path / "masking.json").read_text())
    assert written["config"]["num_spins"] == 2
    for figure in written["figures"].values():
        assert figure["k"] == [1, 2]
        assert np.array(figure["error_per_seed"]).shape == (2, 2)
        assert figure["gap_to_mle_mean"][-1] == 0.0  # k = N is the reference
    assert set(result["figures"]) == {"weak", "strong", "peaked"}


def test_sampling_writes_figures(tmp_path):
    config = experiments.SamplingConfig(num_spins=4, couplings=(0.6,), field=0.5,
                                              block_sizes=(1, 4), num_chains=8, budget=20)
    experiments.run_sampling(str(tmp_path), config)
    written = json.loads((tmp_path / "sampling.json").read_text())
    assert os.path.getsize(tmp_path / "sampling.png") > 0
    labels = [(row["sampler"], row["k"]) for row in written["rows"]]
    assert labels == [("k_gibbs", 1), ("k_gibbs", 4), ("parallel", None)]
    # 4-Gibbs on 4 spins samples the model exactly: almost every chain is there in a step.
    assert written["rows"][1]["fraction_reached"] >= 0.5


def test_summarise_hits_censors_chains_that_did_not_arrive():
    summary = experiments.summarise_hits(np.array([3, 5, -1, -1, -1]), budget=10)
    assert summary == {"fraction_reached": 0.4, "median_steps": None,
                       "mean_steps_if_reached": 4.0}
    assert experiments.summarise_hits(np.array([3, 5, 7, -1]), 10)["median_steps"] == 6.0


def test_padir_theory_calls_the_experiments(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(experiments, "run", lambda out, quick, experiments: calls.append(
        (out, quick, experiments)) or {"x.png": "p"})
    assert cli.main(["theory", "--out", str(tmp_path), "--quick"]) == 0
    assert cli.main(["theory", "--out", str(tmp_path), "--only", "sampling"]) == 0
    assert calls == [(str(tmp_path), True, ("masking", "sampling")),
                     (str(tmp_path), False, ("sampling",))]
    assert capsys.readouterr().out.split() == ["p", "p"]
