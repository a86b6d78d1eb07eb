"""Exactly solvable Ising models: the paper's k-pseudolikelihood and k-Gibbs sampler, in miniature.

Convention. N spins x in {-1, +1}^N with

    p(x) = exp(x^T J x / 2 + h^T x) / Z(J, h),

J symmetric with a zero diagonal (so x^T J x / 2 = sum_{i<j} J_ij x_i x_j) and h the fields.
A positive J_ij makes spins i and j agree; a positive h_i favours x_i = +1. The parameter
vector theta is [J_ij for i < j in row-major order of the upper triangle, h_1 .. h_N], of
length N(N+1)/2: every free parameter once, so `||theta_hat - theta*||` (Euclidean) is the
estimation error.

Everything is exact by enumeration, so N is small (up to ~16): the 2^N states for the
partition function and exact sampling, the 2^k completions of a block K for its conditional
p(x_K | x_{-K}). The pieces (paper section 2):

- `k_pl_loss`: the k-pseudolikelihood, the mean over blocks K of size k (and over the data)
  of -log p(x_K | x_{-K}); with the single block K = {1..N} it is the negative
  log-likelihood, with the N singletons it is the classic pseudolikelihood (divided by N).
  Convex in theta (appendix K), minimised with optax L-BFGS by `fit_k_pl`, to convergence.
- `k_gibbs_step`: resample a uniformly random k-subset jointly from its exact conditional
  (p is invariant); `parallel_step`: resample every spin at once, each from its own
  1-conditional given the current state (what one parallel-decoding pass can implement;
  p is in general not invariant).
- `hitting_times`: steps until a chain's magnetisation first reaches a threshold.

Shapes are static (k, N, the number of chains and of steps are Python ints), chains are
vmapped and steps run in `lax` loops. Compiled handles are the `jit_*` names at the end.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Beyond this, enumerating 2^N states (or 2^k completions) is too slow to be the point.
MAX_ENUMERATED_SPINS = 20


class IsingParams(NamedTuple):
    """J float[N, N] (symmetric, zero diagonal) and h float[N]."""

    couplings: jax.Array
    fields: jax.Array


# --- parameters ---------------------------------------------------------------------------


def num_params(num_spins: int) -> int:
    """Length of theta: N(N-1)/2 couplings and N fields."""
    return num_spins * (num_spins + 1) // 2


def params_to_theta(params: IsingParams) -> jax.Array:
    """IsingParams -> theta float[N(N+1)/2] (upper triangle of J, then h)."""
    rows, cols = np.triu_indices(params.fields.shape[-1], k=1)
    return jnp.concatenate([params.couplings[rows, cols], params.fields])


def theta_to_params(theta: jax.Array, num_spins: int) -> IsingParams:
    """theta float[N(N+1)/2] -> IsingParams with J symmetric and zero on the diagonal."""
    rows, cols = np.triu_indices(num_spins, k=1)
    upper = jnp.zeros((num_spins, num_spins), theta.dtype).at[rows, cols].set(theta[: len(rows)])
    return IsingParams(couplings=upper + upper.T, fields=theta[len(rows):])


def make_params(couplings, fields) -> IsingParams:
    """IsingParams from array-likes; J is symmetrised and its diagonal dropped (checked)."""
    couplings = np.asarray(couplings, np.float32)
    fields = np.asarray(fields, np.float32)
    n = fields.shape[0]
    if couplings.shape != (n, n):
        raise ValueError(f"couplings {couplings.shape} for {n} fields: want ({n}, {n})")
    if not 1 <= n <= MAX_ENUMERATED_SPINS:
        raise ValueError(f"{n} spins: exact enumeration supports 1..{MAX_ENUMERATED_SPINS}")
    if not np.allclose(couplings, couplings.T):
        raise ValueError("couplings must be symmetric")
    couplings = couplings * (1.0 - np.eye(n, dtype=np.float32))
    return IsingParams(jnp.asarray(couplings), jnp.asarray(fields))


# --- enumeration ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _spin_states_np(num_spins: int) -> np.ndarray:
    bits = (np.arange(2**num_spins)[:, None] >> np.arange(num_spins)) & 1
    return (2 * bits - 1).astype(np.float32)


def spin_states(num_spins: int) -> jax.Array:
    """All 2^n configurations, float32[2^n, n]; row s has x_i = +1 iff bit i of s is set."""
    return jnp.asarray(_spin_states_np(num_spins))


def state_index(x: jax.Array) -> jax.Array:
    """The row of `spin_states` holding x: int32[...] for x[..., n] (inverse of spin_states)."""
    weights = 2 ** jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.sum((x > 0).astype(jnp.int32) * weights, axis=-1)


def all_subsets(num_spins: int, k: int) -> np.ndarray:
    """Every k-subset of {0..N-1}, int32[C(N, k), k] in lexicographic order."""
    return np.array(list(itertools.combinations(range(num_spins), k)), np.int32).reshape(-1, k)


def random_subsets(key: jax.Array, num_spins: int, k: int, num: int) -> jax.Array:
    """`num` independent uniformly random k-subsets, int32[num, k] (sorted within a row)."""
    keys = jax.random.split(key, num)
    return jax.vmap(lambda key: jnp.sort(_random_subset(key, num_spins, k)))(keys)


def _random_subset(key: jax.Array, num_spins: int, k: int) -> jax.Array:
    return jax.random.permutation(key, num_spins)[:k]  # int32[k]


# --- the exact distribution -----------------------------------------------------------------


def log_weight(params: IsingParams, x: jax.Array) -> jax.Array:
    """Unnormalised log-probability x^T J x / 2 + h^T x: float[...] for x float[..., N]."""
    return 0.5 * jnp.sum((x @ params.couplings) * x, axis=-1) + x @ params.fields


def log_partition(params: IsingParams) -> jax.Array:
    """log Z, exactly, by summing over the 2^N states. Scalar."""
    return jax.nn.logsumexp(log_weight(params, spin_states(params.fields.shape[0])))


def log_probs(params: IsingParams) -> jax.Array:
    """log p of every state, float[2^N] in `spin_states` order."""
    return jax.nn.log_softmax(log_weight(params, spin_states(params.fields.shape[0])))


def neg_log_likelihood(params: IsingParams, data: jax.Array) -> jax.Array:
    """Mean of -log p(x) over data float[B, N]. Scalar."""
    return log_partition(params) - jnp.mean(log_weight(params, data))


def sample_exact(key: jax.Array, params: IsingParams, num_samples: int) -> jax.Array:
    """`num_samples` independent exact draws from p, float32[num_samples, N]."""
    states = spin_states(params.fields.shape[0])
    index = jax.random.categorical(key, log_weight(params, states), shape=(num_samples,))
    return states[index]


def sample_counts(key: jax.Array, params: IsingParams, num_samples: int) -> jax.Array:
    """The histogram of `num_samples` exact draws over `spin_states` order, float32[2^N]."""
    states = spin_states(params.fields.shape[0])
    index = jax.random.categorical(key, log_weight(params, states), shape=(num_samples,))
    return jnp.zeros(states.shape[0], jnp.float32).at[index].add(1.0)


# --- block conditionals: the k-pseudolikelihood ---------------------------------------------


def block_logits(params: IsingParams, x: jax.Array, subset: jax.Array) -> jax.Array:
    """Log-weights of the 2^k completions of block K given the spins outside it.

    log p(x_K = y_c | x_{-K}) = logits[c] - logsumexp(logits), y_c = spin_states(k)[c]:
    the terms of log p(x) that involve y are y^T J_KK y / 2 + y^T (h_K + J_{K,-K} x_{-K}).

    Args:
      params: the model.
      x: float[..., N]; only the spins outside K are read.
      subset: int32[k], the block K (distinct indices).

    Returns:
      float[..., 2^k].
    """
    completions = spin_states(subset.shape[0])  # [2^k, k]
    j_block = params.couplings[subset[:, None], subset[None, :]]  # [k, k]
    # J x sums over all spins, the block's own included: take those back out.
    outside_field = (x @ params.couplings[:, subset] - x[..., subset] @ j_block
                     + params.fields[subset])  # [..., k]
    inside = 0.5 * jnp.sum((completions @ j_block) * completions, axis=-1)  # [2^k]
    return inside + outside_field @ completions.T  # [..., 2^k]


def conditional_log_prob(params: IsingParams, x: jax.Array, subset: jax.Array) -> jax.Array:
    """log p(x_K | x_{-K}), exactly (2^k completions): float[...] for x float[..., N]."""
    log_cond = jax.nn.log_softmax(block_logits(params, x, subset), axis=-1)  # [..., 2^k]
    observed = state_index(x[..., subset])  # [...]
    return jnp.take_along_axis(log_cond, observed[..., None], axis=-1)[..., 0]


def k_pl_loss(
    params: IsingParams, data: jax.Array, subsets: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """The k-pseudolikelihood loss: mean over data and blocks of -log p(x_K | x_{-K}).

    Args:
      params: the model.
      data: float[B, N] in {-1, +1}.
      subsets: int32[S, k], the blocks K; every block is scored on every example.
        `all_subsets(N, k)` gives the exact expectation over a uniform k-subset.
      weights: float[B] (default uniform), normalised here: a training set can be given as
        its histogram over the states (`data = spin_states(N)`, `weights = counts`), which
        costs 2^N rows whatever its size.

    For k >= N - 2 the minimiser is the maximum-likelihood estimate: -log p(x_K | x_{-K}) =
    -log p(x) + log p(x_{-K}), and at the MLE the model's marginals of one or two spins
    (fixed by the first and second moments, which the MLE matches) equal the data's, so the
    second term is stationary there as well.

    Returns:
      Scalar.
    """
    per_block = jax.vmap(lambda subset: conditional_log_prob(params, data, subset))(subsets)
    per_example = jnp.mean(per_block, axis=0)  # per_block: [S, B]
    if weights is None:
        return -jnp.mean(per_example)
    return -jnp.sum(weights * per_example) / jnp.sum(weights)


class FitInfo(NamedTuple):
    """How an L-BFGS fit ended: iterations taken, final loss and gradient norm (scalars)."""

    steps: jax.Array
    loss: jax.Array
    grad_norm: jax.Array


def fit_k_pl(
    data: jax.Array,
    subsets: jax.Array,
    weights: jax.Array | None = None,
    *,
    max_steps: int = 500,
    tol: float = 1e-5,
    theta0: jax.Array | None = None,
) -> tuple[jax.Array, FitInfo]:
    """Minimises `k_pl_loss` over theta with optax L-BFGS (the loss is convex and smooth).

    Runs to convergence, not for a fixed number of steps: stopping early regularises (it
    keeps theta near theta0), and by a different amount for each k, which would blur the
    comparison between k.

    Args:
      data: float[B, N] training set.
      subsets: int32[S, k] blocks (see `k_pl_loss`).
      weights: float[B] per-example weights (see `k_pl_loss`); default uniform.
      max_steps: at most this many L-BFGS iterations (each with a zoom line search).
      tol: stop once the gradient's Euclidean norm is below this.
      theta0: float[N(N+1)/2] start; default zeros (independent uniform spins).

    Returns:
      (theta_hat float[N(N+1)/2], FitInfo).
    """
    num_spins = data.shape[-1]
    if theta0 is None:
        theta0 = jnp.zeros(num_params(num_spins), jnp.float32)

    def loss(theta):
        return k_pl_loss(theta_to_params(theta, num_spins), data, subsets, weights)

    optimizer = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(loss)

    def step(carry):
        theta, state = carry
        value, grad = value_and_grad(theta, state=state)
        updates, state = optimizer.update(grad, state, theta, value=value, grad=grad,
                                          value_fn=loss)
        return optax.apply_updates(theta, updates), state

    def not_converged(carry):
        _, state = carry
        count = optax.tree_utils.tree_get(state, "count")
        grad_norm = optax.tree_utils.tree_norm(optax.tree_utils.tree_get(state, "grad"))
        return (count == 0) | ((count < max_steps) & (grad_norm >= tol))

    theta, state = jax.lax.while_loop(not_converged, step, (theta0, optimizer.init(theta0)))
    return theta, FitInfo(
        steps=optax.tree_utils.tree_get(state, "count"),
        loss=optax.tree_utils.tree_get(state, "value"),
        grad_norm=optax.tree_utils.tree_norm(optax.tree_utils.tree_get(state, "grad")))


# --- samplers -------------------------------------------------------------------------------


def k_gibbs_step(key: jax.Array, params: IsingParams, x: jax.Array, k: int) -> jax.Array:
    """One k-Gibbs transition of one chain: a uniform k-subset K, x_K ~ p(. | x_{-K}).

    Args:
      key: PRNG key.
      params: the model.
      x: float[N], the current state.
      k: block size (static), 1 <= k <= N.

    Returns:
      float[N], the next state.
    """
    subset_key, draw_key = jax.random.split(key)
    subset = _random_subset(subset_key, x.shape[-1], k)  # [k]
    choice = jax.random.categorical(draw_key, block_logits(params, x, subset))  # scalar
    return x.at[subset].set(spin_states(k)[choice])


def parallel_conditionals(params: IsingParams, x: jax.Array) -> jax.Array:
    """p(x_i = +1 | x_{-i}) for every i at once: float[..., N] for x float[..., N].

    log p(x_i = +1 | .) - log p(x_i = -1 | .) = 2 (h_i + sum_j J_ij x_j); J has a zero
    diagonal, so x_i itself does not enter.
    """
    return jax.nn.sigmoid(2.0 * (x @ params.couplings + params.fields))


def parallel_step(key: jax.Array, params: IsingParams, x: jax.Array) -> jax.Array:
    """One independent parallel transition: every x_i ~ p(x_i | x_{-i}) given the current x."""
    up = jax.random.uniform(key, x.shape) < parallel_conditionals(params, x)
    return jnp.where(up, 1.0, -1.0).astype(x.dtype)


SAMPLERS = ("k_gibbs", "parallel")


def hitting_times(
    key: jax.Array,
    params: IsingParams,
    init: jax.Array,
    *,
    sampler: str,
    k: int,
    num_steps: int,
    threshold: float,
) -> jax.Array:
    """Steps until each chain's magnetisation mean_i x_i first reaches `threshold`.

    The chains advance together in a `lax.while_loop` that stops after `num_steps` steps or
    once every chain has reached it (later steps could not change the answer).

    Args:
      key: PRNG key.
      params: the model.
      init: float[C, N], the chains' start states.
      sampler: "k_gibbs" (with block size k) or "parallel" (k is ignored).
      k: block size of the k-Gibbs sampler (static).
      num_steps: the step budget (static).
      threshold: a chain has reached the mode when mean(x) >= threshold.

    Returns:
      int32[C]: the first step t (0 = the start state) at which the chain had reached it,
      or -1 where it had not within `num_steps` steps.
    """
    if sampler == "k_gibbs":
        if not 1 <= k <= init.shape[-1]:
            raise ValueError(f"k={k} for {init.shape[-1]} spins")
        transition = functools.partial(k_gibbs_step, params=params, k=k)
    elif sampler == "parallel":
        transition = functools.partial(parallel_step, params=params)
    else:
        raise ValueError(f"unknown sampler {sampler!r}: one of {SAMPLERS}")
    num_chains = init.shape[0]

    def reached(x):
        return jnp.mean(x, axis=-1) >= threshold  # [C]

    def not_done(carry):
        t, _, hit, _ = carry
        return (t < num_steps) & jnp.any(hit < 0)

    def advance(carry):
        t, x, hit, key = carry
        key, step_key = jax.random.split(key)
        x = jax.vmap(lambda key, x: transition(key, x=x))(
            jax.random.split(step_key, num_chains), x)  # [C, N]
        hit = jnp.where((hit < 0) & reached(x), t + 1, hit)
        return t + 1, x, hit, key

    hit0 = jnp.where(reached(init), 0, -1).astype(jnp.int32)
    _, _, hit, _ = jax.lax.while_loop(not_done, advance, (jnp.int32(0), init, hit0, key))
    return hit


# --- exact transition matrices (small N; for checking the samplers) -------------------------


def k_gibbs_transition_matrix(params: IsingParams, k: int) -> jax.Array:
    """P[x, y] of one k-Gibbs step, float[2^N, 2^N], built from `block_logits`.

    P = mean over the C(N, k) blocks K of P_K, where P_K[x, y] = p(y_K | x_{-K}) if y agrees
    with x outside K, else 0.
    """
    num_spins = params.fields.shape[0]
    states = spin_states(num_spins)  # [2^N, N]
    completions = spin_states(k)  # [2^k, k]

    def block_matrix(subset):
        cond = jax.nn.softmax(block_logits(params, states, subset), axis=-1)  # [2^N, 2^k]
        targets = state_index(states[:, None, :].repeat(2**k, 1).at[:, :, subset].set(
            completions[None]))  # [2^N, 2^k]: the state x with x_K set to each completion
        rows = jnp.arange(2**num_spins)[:, None].repeat(2**k, 1)
        return jnp.zeros((2**num_spins, 2**num_spins)).at[rows, targets].add(cond)

    return jnp.mean(jax.vmap(block_matrix)(jnp.asarray(all_subsets(num_spins, k))), axis=0)


def parallel_transition_matrix(params: IsingParams) -> jax.Array:
    """P[x, y] = prod_i p(x_i = y_i | x_{-i}) of one parallel step, float[2^N, 2^N]."""
    states = spin_states(params.fields.shape[0])
    up = parallel_conditionals(params, states)  # [2^N, N]
    per_spin = jnp.where(states[None, :, :] > 0, up[:, None, :], 1.0 - up[:, None, :])
    return jnp.prod(per_spin, axis=-1)


# --- compiled handles -----------------------------------------------------------------------

jit_sample_exact = jax.jit(sample_exact, static_argnames=("num_samples",))
jit_fit_k_pl = jax.jit(fit_k_pl, static_argnames=("max_steps", "tol"))
jit_k_pl_loss = jax.jit(k_pl_loss)
jit_hitting_times = jax.jit(hitting_times, static_argnames=("sampler", "k", "num_steps"))
jit_log_probs = jax.jit(log_probs)
jit_neg_log_likelihood = jax.jit(neg_log_likelihood)
jit_k_gibbs_transition_matrix = jax.jit(k_gibbs_transition_matrix, static_argnames=("k",))
jit_parallel_transition_matrix = jax.jit(parallel_transition_matrix)
