"""theory/ising.py against brute-force enumeration written independently here (numpy loops)."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from theory import ising


def random_params(num_spins: int, seed: int, scale: float = 0.6) -> ising.IsingParams:
    rng = np.random.default_rng(seed)
    upper = np.triu(rng.normal(0.0, scale, (num_spins, num_spins)), k=1)
    return ising.make_params(upper + upper.T, rng.normal(0.0, 0.4, num_spins))


def enumerate_probs(params: ising.IsingParams) -> tuple[np.ndarray, np.ndarray]:
    """(states [2^N, N], p [2^N]) by direct summation of sum_{i<j} J_ij x_i x_j + h.x."""
    couplings, fields = np.asarray(params.couplings, np.float64), np.asarray(params.fields)
    n = len(fields)
    states = np.asarray(ising.spin_states(n), np.float64)
    weights = np.array([math.exp(sum(couplings[i, j] * x[i] * x[j]
                                     for i in range(n) for j in range(i + 1, n)) + fields @ x)
                        for x in states])
    return states, weights / weights.sum()


def test_theta_round_trip_and_convention():
    params = random_params(5, seed=0)
    theta = ising.params_to_theta(params)
    assert theta.shape == (ising.num_params(5),) == (15,)
    back = ising.theta_to_params(theta, 5)
    np.testing.assert_allclose(back.couplings, params.couplings)
    np.testing.assert_allclose(back.fields, params.fields)
    assert np.allclose(np.diag(back.couplings), 0) and np.allclose(back.couplings, back.couplings.T)
    # x^T J x / 2 + h^T x is log p(x) + log Z, with the partition function summed by hand.
    states, probs = enumerate_probs(params)
    np.testing.assert_allclose(np.exp(ising.jit_log_probs(params)), probs, rtol=1e-5, atol=1e-7)


def test_make_params_rejects_asymmetric_couplings():
    with pytest.raises(ValueError, match="symmetric"):
        ising.make_params(np.triu(np.ones((3, 3)), k=1), np.zeros(3))


def test_k_pl_with_k_equal_n_is_the_exact_negative_log_likelihood():
    params = random_params(5, seed=1)
    data = ising.jit_sample_exact(jax.random.key(0), params, num_samples=300)
    states, probs = enumerate_probs(params)
    index = np.asarray(ising.state_index(data))
    expected = -np.mean(np.log(probs[index]))
    loss = ising.jit_k_pl_loss(params, data, jnp.asarray(ising.all_subsets(5, 5)))
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(ising.jit_neg_log_likelihood(params, data), expected, rtol=1e-5)
    # The same training set as its histogram over the 2^N states.
    counts = np.bincount(index, minlength=32)
    histogram_loss = ising.jit_k_pl_loss(params, ising.spin_states(5),
                                         jnp.asarray(ising.all_subsets(5, 5)), counts)
    np.testing.assert_allclose(histogram_loss, expected, rtol=1e-5)


def test_k_pl_with_k_one_is_the_classic_pseudolikelihood():
    params = random_params(5, seed=2)
    data = np.asarray(ising.jit_sample_exact(jax.random.key(1), params, num_samples=200),
                      np.float64)
    couplings, fields = np.asarray(params.couplings, np.float64), np.asarray(params.fields)
    # Classic PL: sum_i -log p(x_i | x_-i), p(x_i | x_-i) = 1 / (1 + exp(-2 x_i a_i)).
    classic = np.mean([sum(math.log1p(math.exp(-2 * x[i] * (fields[i] + sum(
        couplings[i, j] * x[j] for j in range(5) if j != i)))) for i in range(5)) for x in data])
    loss = ising.jit_k_pl_loss(params, jnp.asarray(data, jnp.float32),
                           jnp.asarray(ising.all_subsets(5, 1)))
    np.testing.assert_allclose(loss, classic / 5, rtol=1e-5)  # k_pl_loss averages over blocks


def test_block_conditional_matches_ratio_of_joint_probabilities():
    params = random_params(5, seed=3)
    states, probs = enumerate_probs(params)
    subset = np.array([1, 3, 4])
    x = states[11]
    same_outside = np.all(np.delete(states, subset, axis=1) == np.delete(x, subset), axis=1)
    expected = probs[11] / probs[same_outside].sum()
    got = jax.jit(ising.conditional_log_prob)(params, jnp.asarray(x, jnp.float32),
                                              jnp.asarray(subset))
    np.testing.assert_allclose(np.exp(got), expected, rtol=1e-5)


def brute_force_k_gibbs_matrix(params: ising.IsingParams, k: int) -> np.ndarray:
    states, probs = enumerate_probs(params)
    n, size = states.shape[1], len(states)
    blocks = list(itertools.combinations(range(n), k))
    matrix = np.zeros((size, size))
    for block in blocks:
        outside = [i for i in range(n) if i not in block]
        for a in range(size):
            same = np.all(states[:, outside] == states[a, outside], axis=1)
            matrix[a, same] += probs[same] / probs[same].sum() / len(blocks)
    return matrix


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_k_gibbs_transition_leaves_the_exact_distribution_invariant(k):
    params = random_params(4, seed=4, scale=1.0)
    _, pi = enumerate_probs(params)
    matrix = np.asarray(ising.jit_k_gibbs_transition_matrix(params, k=k), np.float64)
    np.testing.assert_allclose(matrix, brute_force_k_gibbs_matrix(params, k), atol=1e-6)
    np.testing.assert_allclose(matrix.sum(1), 1.0, atol=1e-5)
    np.testing.assert_allclose(pi @ matrix, pi, atol=1e-6)


def test_parallel_transition_does_not_leave_a_coupled_model_invariant():
    coupled = ising.make_params(np.full((4, 4), 0.5), np.full(4, 0.2))  # ferromagnetic
    _, pi = enumerate_probs(coupled)
    matrix = np.asarray(ising.jit_parallel_transition_matrix(coupled), np.float64)
    np.testing.assert_allclose(matrix.sum(1), 1.0, atol=1e-5)
    total_variation = 0.5 * np.abs(pi @ matrix - pi).sum()
    assert total_variation > 0.03, total_variation  # 0.06
    # With independent spins (J = 0) the one-spin conditionals are the marginals: invariant.
    independent = ising.make_params(np.zeros((4, 4)), coupled.fields)
    _, pi0 = enumerate_probs(independent)
    np.testing.assert_allclose(pi0 @ np.asarray(ising.jit_parallel_transition_matrix(independent)),
                               pi0, atol=1e-6)


@pytest.mark.parametrize("sampler,k", [("k_gibbs", 2), ("parallel", 0)])
def test_sampler_steps_follow_their_transition_matrix(sampler, k):
    """One step from a fixed state, 20000 times: frequencies match the matrix row."""
    params = random_params(3, seed=5, scale=1.0)
    start = 5
    x = jnp.broadcast_to(ising.spin_states(3)[start], (20000, 3))
    keys = jax.random.split(jax.random.key(2), 20000)
    if sampler == "k_gibbs":
        step = jax.vmap(lambda key, x: ising.k_gibbs_step(key, params, x, k))
        row = np.asarray(ising.jit_k_gibbs_transition_matrix(params, k=k))[start]
    else:
        step = jax.vmap(lambda key, x: ising.parallel_step(key, params, x))
        row = np.asarray(ising.jit_parallel_transition_matrix(params))[start]
    counts = np.bincount(np.asarray(ising.state_index(jax.jit(step)(keys, x))), minlength=8)
    np.testing.assert_allclose(counts / 20000, row, atol=0.015)


def test_k_pl_is_convex_in_theta():
    n, k = 4, 2
    data = ising.jit_sample_exact(jax.random.key(3), random_params(n, seed=6), num_samples=200)
    blocks = jnp.asarray(ising.all_subsets(n, k))
    hessian = jax.jit(jax.hessian(
        lambda theta: ising.k_pl_loss(ising.theta_to_params(theta, n), data, blocks)))
    for seed in range(3):
        theta = jax.random.normal(jax.random.key(seed), (ising.num_params(n),))
        eigenvalues = np.linalg.eigvalsh(np.asarray(hessian(theta), np.float64))
        assert eigenvalues.min() >= -1e-5 * max(1.0, eigenvalues.max()), eigenvalues


def test_exact_sampling_frequencies_match_probabilities():
    params = random_params(4, seed=7)
    _, probs = enumerate_probs(params)
    num = 40000
    samples = ising.jit_sample_exact(jax.random.key(4), params, num_samples=num)
    histograms = [np.bincount(np.asarray(ising.state_index(samples)), minlength=16),
                  np.asarray(jax.jit(ising.sample_counts, static_argnums=2)(
                      jax.random.key(5), params, num))]
    for counts in histograms:
        assert counts.sum() == num
        chi_square = np.sum((counts - num * probs) ** 2 / (num * probs))
        assert chi_square < 37.7, chi_square  # the 0.999 quantile of chi-square, 15 d.o.f.


def test_fit_recovers_theta_and_k_pl_with_k_n_minus_2_is_the_mle():
    """For a pairwise model, k >= N - 2 gives the MLE: log p(x_K | x_-K) = log p(x) -
    log p(x_-K), and at the MLE the 1- and 2-spin marginals p(x_-K) match the data's."""
    n = 4
    params = random_params(n, seed=8)
    # 20000 samples, as their histogram over the 16 states.
    counts = jax.jit(ising.sample_counts, static_argnums=2)(jax.random.key(5), params, 20000)
    theta_hat, info = ising.jit_fit_k_pl(ising.spin_states(n),
                                         jnp.asarray(ising.all_subsets(n, 2)), counts)
    assert info.grad_norm < 1e-5 and info.steps < 500
    assert jnp.linalg.norm(theta_hat - ising.params_to_theta(params)) < 0.1
    # The MLE is the one model whose moments E x_i and E x_i x_j are the data's.
    states, probs = enumerate_probs(ising.theta_to_params(theta_hat, n))
    freqs = np.asarray(counts, np.float64) / 20000
    np.testing.assert_allclose(probs @ states, freqs @ states, atol=2e-4)
    np.testing.assert_allclose(np.einsum("s,si,sj->ij", probs, states, states),
                               np.einsum("s,si,sj->ij", freqs, states, states), atol=2e-4)


def test_hitting_times():
    n = 6
    strong = ising.make_params(np.full((n, n), 0.8), np.full(n, 1.0))
    init = -jnp.ones((16, n))
    # N-Gibbs samples p exactly: the +1 mode holds all but ~e^{-12} of the mass.
    hits = ising.jit_hitting_times(jax.random.key(0), strong, init, sampler="k_gibbs", k=n,
                                   num_steps=50, threshold=0.8)
    assert np.all(np.asarray(hits) == 1)
    # Each spin of x = -1 flips with p = sigmoid(2 (1 - 0.8 * 5)) ~ 0.0025: stuck.
    hits = ising.jit_hitting_times(jax.random.key(0), strong, init, sampler="parallel", k=0,
                                   num_steps=50, threshold=0.8)
    assert np.all(np.asarray(hits) == -1)
    hits = ising.jit_hitting_times(jax.random.key(0), strong, -init, sampler="parallel", k=0,
                                   num_steps=50, threshold=0.8)
    assert np.all(np.asarray(hits) == 0)
    with pytest.raises(ValueError, match="unknown sampler"):
        ising.hitting_times(jax.random.key(0), strong, init, sampler="gibbs", k=1,
                            num_steps=5, threshold=0.8)
