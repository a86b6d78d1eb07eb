"""The paper's Ising experiments (section 3.1, appendix L.6-L.7), at laptop scale.

Two measurements on exactly solvable models (theory/ising.py), each writing a PNG and a JSON
of its figures into an output directory:

- `run_masking` (Theorem 1, "masking more is statistically better"): for each seed, one
  training set of `num_samples` exact draws; theta_hat_k = argmin of the k-pseudolikelihood
  (over every k-block, or `max_subsets` random ones; L-BFGS to convergence) on that same
  set for every k = 1 .. N; error ||theta_hat_k - theta*||_2 (theta: the upper triangle of
  J, then h). Mean and standard error over seeds, for a weakly coupled
  model (J_ij ~ N(0, (weak_coupling / sqrt N)^2), h_i ~ N(0, weak_field^2)), the same
  couplings scaled up to a strongly coupled random-sign one ("strong"), and a peaked
  two-mode one (ferromagnetic J_ij = peaked_coupling / N for every pair, h = 0). Every k
  sees the same data, so the differences between k are paired (and reported as such: the
  excess error over the k = N estimate, the MLE). The training sets enter as histograms
  over the 2^N states, so their size costs nothing; compiling the fit once per k does.
- `run_sampling` (Propositions 4-5, Corollary 1): a strongly ferromagnetic model (J_ij = J
  for every pair, h_i = field > 0, so the all-(+1) mode is e^{2 N field} times heavier than
  the all-(-1) one). Every chain starts at x = -1 (the smaller mode); a chain has *reached
  the larger mode* at the first step where its magnetisation mean_i x_i >= threshold.
  Per sampler (k-Gibbs for each k, the independent parallel sampler) and J: the fraction of
  chains that reached it within the step budget, and the median over all chains of the
  steps it took (a chain that did not counts as "more than the budget", so the median is
  only defined when at least half reached it). One step resamples k spins (k-Gibbs) or all
  N (parallel).

Configs are frozen dataclasses; `*_config(quick)` gives the defaults or the quick overlay
(`padir theory --quick`). Entry point: `padir theory` (`--only masking` or `--only
sampling` runs one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from theory import ising

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MaskingConfig:
    num_spins: int = 8
    num_samples: int = 2000  # the training-set size, the same for every k
    num_seeds: int = 16  # training sets (the error bars are over these); cheap: vmapped
    max_subsets: int = 64  # blocks K per k: all C(N, k) if fewer, else this many at random
    lbfgs_max_steps: int = 500  # L-BFGS runs to convergence: gradient norm < lbfgs_tol
    lbfgs_tol: float = 1e-5
    weak_coupling: float = 0.8  # std of J_ij is weak_coupling / sqrt(N)
    strong_coupling: float = 1.6  # the same couplings, scaled up: a strongly coupled glass
    weak_field: float = 0.2  # std of h_i (weak and strong models)
    peaked_coupling: float = 2.5  # J_ij = peaked_coupling / N (beyond the critical 1)
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    num_spins: int = 12
    couplings: tuple[float, ...] = (0.25, 0.35, 0.45)  # J_ij, every pair
    field: float = 1.0  # h_i, every spin: favours the all-(+1) mode
    block_sizes: tuple[int, ...] = (1, 2, 4, 6, 8, 10, 12)  # k of the k-Gibbs samplers
    num_chains: int = 256
    budget: int = 1000  # steps
    threshold: float = 0.8  # reached the larger mode: mean_i x_i >= threshold
    seed: int = 0


QUICK_MASKING = dict(num_spins=7, num_seeds=12)
QUICK_SAMPLING = dict(num_chains=64, budget=500)


def masking_config(quick: bool = False) -> MaskingConfig:
    return dataclasses.replace(MaskingConfig(), **(QUICK_MASKING if quick else {}))


def sampling_config(quick: bool = False) -> SamplingConfig:
    return dataclasses.replace(SamplingConfig(), **(QUICK_SAMPLING if quick else {}))


# --- masking more is better -----------------------------------------------------------------


def masking_models(config: MaskingConfig) -> dict[str, ising.IsingParams]:
    """The ground truths {"weak", "strong", "peaked"}, fixed by config.seed; "strong" has the
    couplings of "weak" scaled by strong_coupling / weak_coupling (random signs both)."""
    n = config.num_spins
    rng = np.random.default_rng(config.seed)
    upper = np.triu(rng.normal(0.0, 1.0 / math.sqrt(n), (n, n)), k=1)
    fields = rng.normal(0.0, config.weak_field, n)
    return {
        "weak": ising.make_params(config.weak_coupling * (upper + upper.T), fields),
        "strong": ising.make_params(config.strong_coupling * (upper + upper.T), fields),
        "peaked": ising.make_params(np.full((n, n), config.peaked_coupling / n), np.zeros(n)),
    }


def _blocks(key: jax.Array, num_spins: int, k: int, max_subsets: int) -> jax.Array:
    """The blocks K of the k-PL loss: every k-subset, or `max_subsets` uniform ones."""
    if math.comb(num_spins, k) <= max_subsets:
        return jnp.asarray(ising.all_subsets(num_spins, k))
    return ising.random_subsets(key, num_spins, k, max_subsets)


def fit_seeds(counts: jax.Array, blocks: jax.Array, max_steps: int,
              tol: float) -> tuple[jax.Array, ising.FitInfo]:
    """`ising.fit_k_pl` on every training set at once, each given as its histogram over the
    2^N states (the cost does not grow with its size): counts [S, 2^N], blocks [S, C, k] ->
    (theta_hat [S, N(N+1)/2], FitInfo of [S])."""
    states = ising.spin_states(counts.shape[-1].bit_length() - 1)  # counts: 2^N columns

    def fit(weights, subsets):
        return ising.fit_k_pl(states, subsets, weights, max_steps=max_steps, tol=tol)

    return jax.vmap(fit)(counts, blocks)


# Compiled once per k (the blocks' shape), shared by all models.
jit_fit_seeds = jax.jit(fit_seeds, static_argnames=("max_steps", "tol"))


def masking_errors(config: MaskingConfig, params: ising.IsingParams) -> tuple[np.ndarray, dict]:
    """||theta_hat_k - theta*|| for every seed and k: float[num_seeds, N] (column k-1), and
    the worst L-BFGS convergence over seeds per k {"steps": [N], "grad_norm": [N]}."""
    n = config.num_spins
    theta_star = ising.params_to_theta(params)
    data_keys = jax.random.split(jax.random.key(config.seed), config.num_seeds)
    counts = jax.vmap(lambda key: ising.sample_counts(key, params, config.num_samples))(
        data_keys)  # [seeds, 2^N]: the training sets
    errors = np.zeros((config.num_seeds, n))
    fits = {"steps": [], "grad_norm": []}
    for k in range(1, n + 1):  # k changes shapes: one compiled fit per k
        block_keys = jax.random.split(jax.random.fold_in(jax.random.key(config.seed), k),
                                      config.num_seeds)
        blocks = jnp.stack([_blocks(key, n, k, config.max_subsets) for key in block_keys])
        theta_hat, info = jit_fit_seeds(counts, blocks, max_steps=config.lbfgs_max_steps,
                                        tol=config.lbfgs_tol)
        errors[:, k - 1] = np.asarray(jnp.linalg.norm(theta_hat - theta_star, axis=-1))
        fits["steps"].append(int(info.steps.max()))
        fits["grad_norm"].append(float(info.grad_norm.max()))
        if fits["grad_norm"][-1] >= config.lbfgs_tol:
            log.warning("k=%d: L-BFGS stopped at %d steps with gradient norm %.2g (> %g)", k,
                        fits["steps"][-1], fits["grad_norm"][-1], config.lbfgs_tol)
    return errors, fits


def run_masking(out_dir: str, config: MaskingConfig) -> dict:
    """Parameter error against k for both models; writes masking.{png,json}. Returns the JSON."""
    log.info("masking: %s", config)
    start = time.perf_counter()
    figures = {}
    for name, params in masking_models(config).items():
        errors, fits = masking_errors(config, params)  # [seeds, N]
        # Paired with the maximum-likelihood estimate (k = N) on the same training set.
        gap = errors - errors[:, -1:]
        figures[name] = {
            "theta_star_norm": float(jnp.linalg.norm(ising.params_to_theta(params))),
            "k": list(range(1, config.num_spins + 1)),
            "error_mean": _round(errors.mean(0)),
            "error_se": _round(_standard_error(errors)),
            "gap_to_mle_mean": _round(gap.mean(0)),
            "gap_to_mle_se": _round(_standard_error(gap)),
            "error_per_seed": [_round(row) for row in errors],
            "lbfgs_steps_max": fits["steps"],
            "lbfgs_grad_norm_max": [float(f"{g:.3g}") for g in fits["grad_norm"]],
        }
        log.info("masking %s: error per k %s", name, figures[name]["error_mean"])
    result = {"config": dataclasses.asdict(config), "figures": figures,
              "seconds": round(time.perf_counter() - start, 1)}
    _write(out_dir, "masking", result, _plot_masking(result))
    return result


def _plot_masking(result: dict):
    columns = len(result["figures"])
    figure, canvas = _figure(figsize=(4.5 * columns, 6.4))
    config = result["config"]
    for column, (name, fig) in enumerate(result["figures"].items()):
        error_axes = figure.add_subplot(2, columns, column + 1)
        error_axes.errorbar(fig["k"], fig["error_mean"], yerr=fig["error_se"], marker="o",
                            capsize=3)
        error_axes.set_ylabel(r"$\|\hat\theta_k - \theta^*\|_2$")
        error_axes.set_title(f"{name} model: N={config['num_spins']}, "
                             f"{config['num_samples']} samples")
        # The same training sets for every k: the paired gap has much smaller error bars.
        gap_axes = figure.add_subplot(2, columns, columns + column + 1, sharex=error_axes)
        gap_axes.errorbar(fig["k"], fig["gap_to_mle_mean"], yerr=fig["gap_to_mle_se"],
                          marker="o", capsize=3, color="C1")
        gap_axes.axhline(0.0, color="grey", linewidth=1)
        gap_axes.set_ylabel(r"$\|\hat\theta_k - \theta^*\| - \|\hat\theta_N - \theta^*\|$")
        gap_axes.set_xlabel("k (spins predicted jointly)")
        for axes in (error_axes, gap_axes):
            axes.set_xticks(fig["k"])
            axes.grid(alpha=0.3)
    figure.suptitle(f"k-pseudolikelihood estimation error (top) and its excess over the MLE "
                    f"on the same data (bottom),\nmean ± s.e. over {config['num_seeds']} "
                    f"training sets")
    figure.tight_layout()
    return canvas


# --- dependent transitions reach the mode faster ---------------------------------------------


def sampling_model(config: SamplingConfig, coupling: float) -> ising.IsingParams:
    n = config.num_spins
    return ising.make_params(np.full((n, n), coupling), np.full(n, config.field))


def summarise_hits(hits: np.ndarray, budget: int) -> dict:
    """Fraction reached and median steps over chains; -1 (not reached) counts as > budget."""
    reached = hits >= 0
    censored = np.where(reached, hits, budget + 1)
    median = float(np.median(censored)) if reached.mean() >= 0.5 else None
    return {"fraction_reached": round(float(reached.mean()), 4), "median_steps": median,
            "mean_steps_if_reached": round(float(hits[reached].mean()), 2) if reached.any()
            else None}


def run_sampling(out_dir: str, config: SamplingConfig) -> dict:
    """Steps to the larger mode per sampler and J; writes sampling.{png,json}. Returns the JSON."""
    log.info("sampling: %s", config)
    if any(not 1 <= k <= config.num_spins for k in config.block_sizes):
        raise ValueError(f"block_sizes {config.block_sizes} outside 1..{config.num_spins}")
    start = time.perf_counter()
    init = -jnp.ones((config.num_chains, config.num_spins), jnp.float32)
    samplers = [("k_gibbs", k) for k in config.block_sizes] + [("parallel", 0)]
    rows = []
    for coupling in config.couplings:
        params = sampling_model(config, coupling)
        log_p = np.asarray(ising.log_probs(params))
        magnetisation = np.asarray(ising.spin_states(config.num_spins)).mean(-1)
        mass_larger = float(np.exp(log_p[magnetisation >= config.threshold]).sum())
        for sampler, k in samplers:
            key = jax.random.fold_in(jax.random.key(config.seed), k)
            hits = np.asarray(ising.jit_hitting_times(
                key, params, init, sampler=sampler, k=k, num_steps=config.budget,
                threshold=config.threshold))
            row = {"J": coupling, "sampler": sampler, "k": k if sampler == "k_gibbs" else None,
                   "p_larger_mode": mass_larger, **summarise_hits(hits, config.budget)}
            rows.append(row)
            log.info("sampling J=%s %s: reached %.2f, median steps %s", coupling, _label(row),
                     row["fraction_reached"], row["median_steps"] or f"> {config.budget}")
    result = {"config": dataclasses.asdict(config),
              "reached": f"mean_i x_i >= {config.threshold}, start x = -1", "rows": rows,
              "seconds": round(time.perf_counter() - start, 1)}
    _write(out_dir, "sampling", result, _plot_sampling(result))
    return result


def _label(row: dict) -> str:
    return f"{row['k']}-Gibbs" if row["sampler"] == "k_gibbs" else "parallel"


def _plot_sampling(result: dict):
    figure, canvas = _figure(figsize=(10, 3.8))
    config = result["config"]
    budget = config["budget"]
    parallel_x = config["num_spins"] + 2  # the parallel sampler, right of the largest k
    steps_axes = figure.add_subplot(1, 2, 1)
    fraction_axes = figure.add_subplot(1, 2, 2)
    for index, coupling in enumerate(config["couplings"]):
        style = dict(color=f"C{index}", label=f"J={coupling}")
        rows = [row for row in result["rows"] if row["J"] == coupling]
        gibbs = [row for row in rows if row["sampler"] == "k_gibbs"]
        parallel = [row for row in rows if row["sampler"] == "parallel"]
        # Chains that did not all get there: open triangles at the budget, shifted per J.
        shift = 0.25 * (index - (len(config["couplings"]) - 1) / 2)
        for group, marker in ((gibbs, "o-"), (parallel, "s")):
            xs = [row["k"] if row["k"] is not None else parallel_x for row in group]
            done = [(x, row["median_steps"]) for x, row in zip(xs, group)
                    if row["median_steps"] is not None]
            steps_axes.plot([x for x, _ in done], [m for _, m in done], marker,
                            **(style if group is gibbs else {"color": style["color"]}))
            censored = [x + shift for x, row in zip(xs, group) if row["median_steps"] is None]
            steps_axes.plot(censored, [budget] * len(censored), "^", color=style["color"],
                            fillstyle="none", markersize=8)
            fraction_axes.plot(xs, [row["fraction_reached"] for row in group], marker,
                               **(style if group is gibbs else {"color": style["color"]}))
    ticks = [*config["block_sizes"], parallel_x]
    labels = [*map(str, config["block_sizes"]), "parallel"]
    steps_axes.axhline(budget, color="grey", linestyle=":", linewidth=1)
    steps_axes.set_yscale("log")
    steps_axes.set_ylabel(f"median steps to the larger mode\n(△ at {budget}: > budget)")
    fraction_axes.set_ylabel(f"fraction of chains within {budget} steps")
    fraction_axes.set_ylim(-0.03, 1.03)
    for axes in (steps_axes, fraction_axes):
        axes.set_xticks(ticks, labels)
        axes.set_xlabel("k-Gibbs block size k  |  independent parallel sampler")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(f"From x = -1 to mean(x) ≥ {config['threshold']}: N={config['num_spins']}, "
                    f"h={config['field']}, {config['num_chains']} chains")
    figure.tight_layout()
    return canvas


# --- both, and output -----------------------------------------------------------------------


EXPERIMENTS = ("masking", "sampling")


def run(out_dir: str, quick: bool = False,
        experiments: Sequence[str] = EXPERIMENTS) -> dict[str, str]:
    """Runs the named experiments (default both); returns {name: path} of the files written."""
    for name in experiments:
        if name == "masking":
            run_masking(out_dir, masking_config(quick))
        else:
            run_sampling(out_dir, sampling_config(quick))
    return {f"{name}.{ext}": os.path.join(out_dir, f"{name}.{ext}")
            for name in experiments for ext in ("png", "json")}


def _figure(figsize):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=figsize)  # no pyplot: no global backend or figure state
    return figure, FigureCanvasAgg(figure)


def _write(out_dir: str, name: str, result: dict, canvas) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    canvas.print_figure(os.path.join(out_dir, f"{name}.png"), dpi=110)
    log.info("wrote %s", os.path.join(out_dir, f"{name}.{{json,png}}"))


def _standard_error(values: np.ndarray) -> np.ndarray:
    if values.shape[0] < 2:
        return np.zeros(values.shape[1:])
    return values.std(0, ddof=1) / math.sqrt(values.shape[0])


def _round(values) -> list[float]:
    return [round(float(v), 5) for v in values]
