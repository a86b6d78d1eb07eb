"""Tiny Transformers that memorise four random pairs, for the model and decoding tests.

Training dominates those tests' time, so each trained model is built once a session
(`functools.cache`) and shared: the PaDIR one by tests/test_models.py and tests/test_refinement.py,
the drafter and the AR one by tests/test_draft_verify.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from components.config import ModelConfig
from components.tokenizer import EOS_ID
from model.models import ARModel, DrafterModel, PaDIRModel

VOCAB = 40
FIRST_REAL = 6
MAX_LEN = 8
CONFIG = ModelConfig(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                     mlp_dim=64, dropout_rate=0.0, max_source_len=MAX_LEN + 1,
                     max_target_len=MAX_LEN)


def pairs(count: int, seed: int = 0) -> dict:
    """Random pairs of real pieces + EOS; targets are 3 to 7 tokens long (with EOS)."""
    rng = np.random.default_rng(seed)
    source = np.zeros((count, MAX_LEN), np.int32)
    target = np.zeros((count, MAX_LEN), np.int32)
    for i in range(count):
        n, m = rng.integers(2, 8), rng.integers(2, 7)
        source[i, :n] = rng.integers(FIRST_REAL, VOCAB, n)
        source[i, n] = EOS_ID
        target[i, :m] = rng.integers(FIRST_REAL, VOCAB, m)
        target[i, m] = EOS_ID
    return {"source": jnp.asarray(source), "target": jnp.asarray(target)}


BATCH = pairs(4)


def train(model, params, steps: int, *, learning_rate: float = 3e-3):
    """`steps` Adam steps on BATCH, in one compiled scan."""
    optimizer = optax.adam(learning_rate)

    @jax.jit
    def run(params, rng):
        def step(carry, step_rng):
            params, opt_state = carry

            def loss(p):
                return model.loss_fn(p, BATCH, step_rng)[0]

            grads = jax.grad(loss)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None

        carry = (params, optimizer.init(params))
        return jax.lax.scan(step, carry, jax.random.split(rng, steps))[0][0]

    return run(params, jax.random.key(1))


@functools.cache
def memorised_padir() -> tuple[PaDIRModel, dict]:
    """A PaDIR model that has memorised BATCH (single-stage loss): (model, params)."""
    model = PaDIRModel(CONFIG, VOCAB, FIRST_REAL, label_smoothing=0.0)
    return model, train(model, jax.jit(model.init)(jax.random.key(0), BATCH), 300)


@functools.cache
def memorised_ar() -> tuple[ARModel, dict]:
    """An AR model that has memorised BATCH: (model, params)."""
    model = ARModel(CONFIG, VOCAB, label_smoothing=0.0)
    return model, train(model, jax.jit(model.init)(jax.random.key(0), BATCH), 300)


DRAFT_BLOCK = 3


@functools.cache
def memorised_drafter() -> tuple[DrafterModel, dict]:
    """A block drafter (blocks of DRAFT_BLOCK) that has memorised BATCH: (model, params)."""
    model = DrafterModel(CONFIG, VOCAB, DRAFT_BLOCK, label_smoothing=0.0)
    return model, train(model, jax.jit(model.init)(jax.random.key(0), BATCH), 400)
