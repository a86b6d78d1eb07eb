"""A tiny stand-in model and a deterministic data source for the training-engine tests.

`ToyModel` implements the model interface of model/models.py (init, logical_axes, loss_fn,
predict_batch) with a bag-of-words encoder and per-position logits, small enough that a
step takes milliseconds. `batches` implements the data contract of model/train.py: the
batch at position p depends only on (seed, p), so resumption is exact by construction.

Run as a script it trains in a fresh interpreter (the kill/resume and SIGTERM tests):
    python tests/toy_training.py --workdir DIR --steps 30 [--sleep 0.05] [--out params.npz]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from components.config import MeshConfig, OptimizerConfig, TrainLoopConfig  # noqa: E402
from model.losses import LossSettings  # noqa: E402

VOCAB = 32
LENGTH = 8
TRACES = {"loss_fn": 0}  # counts traces of loss_fn (a Python side effect runs per trace)


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    max_source_len: int = LENGTH + 1
    max_target_len: int = LENGTH
    d_model: int = 16
    mlp_dim: int = 32


def _dense(features, names):
    return nn.Dense(
        features, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
    )


class ToyModule(nn.Module):
    config: ToyConfig
    vocab_size: int

    @nn.compact
    def __call__(self, source, target_len, deterministic):
        cfg = self.config
        embed = self.param(
            "embed",
            nn.with_logical_partitioning(nn.initializers.normal(0.1), ("vocab", "embed")),
            (self.vocab_size, cfg.d_model),
        )
        positions = self.param(
            "positions",
            nn.with_logical_partitioning(nn.initializers.normal(0.1), ("position", "embed")),
            (cfg.max_target_len, cfg.d_model),
        )
        mask = (source > 0)[..., None]
        pooled = jnp.sum(embed[source] * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)
        x = pooled[:, None, :] + positions[None, :target_len]  # [B, T, D]
        x = nn.Dropout(0.1, deterministic=deterministic)(x)
        h = nn.relu(_dense(cfg.mlp_dim, ("embed", "mlp"))(x))
        return _dense(self.vocab_size, ("mlp", "vocab"))(h)  # [B, T, V]


@dataclasses.dataclass(frozen=True)
class ToyModel:
    config: ToyConfig = ToyConfig()
    vocab_size: int = VOCAB

    @property
    def module(self):
        return ToyModule(self.config, self.vocab_size)

    def _variables(self, rng, batch):
        return self.module.init(
            {"params": rng}, batch["source"], batch["target"].shape[1], True
        )["params"]

    def init(self, rng, batch):
        return nn.unbox(self._variables(rng, batch))

    def logical_axes(self, batch):
        return nn.get_partition_spec(jax.eval_shape(self._variables, jax.random.key(0), batch))

    def loss_fn(self, params, batch, rng, *, settings=LossSettings(), deterministic=False):
        TRACES["loss_fn"] += 1
        target = batch["target"]
        # Noise like PaDIR's: drop source tokens at random, so the rng matters.
        noise_rng, dropout_rng = jax.random.split(rng)
        keep = jax.random.bernoulli(noise_rng, 0.8, batch["source"].shape)
        source = jnp.where(keep, batch["source"], 0)
        logits = self.module.apply(
            {"params": params}, source, target.shape[1], deterministic,
            rngs={"dropout": dropout_rng},
        )
        weights = (target > 0).astype(jnp.float32)
        losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), target[..., None], -1)[..., 0]
        total = jnp.sum(losses * weights) * settings.num_passes
        count = jnp.sum(weights)
        metrics = {
            "loss": total,
            "weights": count,
            "tokens": count,
            "accuracy": jnp.sum((jnp.argmax(logits, -1) == target) * weights),
        }
        return total / jnp.maximum(count, 1.0), metrics

    def predict_batch(self, params, batch):
        logits = self.module.apply(
            {"params": params}, batch["source"], batch["target"].shape[1], True
        )
        return jnp.argmax(logits, -1).astype(jnp.int32)


def make_batch(seed: int, position: int, batch_size: int) -> dict[str, np.ndarray]:
    """Pairs whose target is the source's real tokens reversed, then EOS (id 1), 0-padded."""
    rng = np.random.default_rng([seed, position])
    lengths = rng.integers(2, LENGTH, size=batch_size)  # real tokens, EOS excluded
    source = np.zeros((batch_size, LENGTH + 1), np.int32)
    target = np.zeros((batch_size, LENGTH), np.int32)
    for i, n in enumerate(lengths):
        tokens = rng.integers(6, VOCAB, size=n)
        source[i, :n], source[i, n] = tokens, 1
        target[i, :n], target[i, n] = tokens[::-1], 1
    return {"source": source, "target": target}


def make_batches(seed: int, batch_size: int, sleep: float = 0.0):
    def batches(start: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        position = start
        while True:
            if sleep:
                time.sleep(sleep)
            batch = make_batch(seed, position, batch_size)
            position += 1
            yield position, batch

    return batches


def with_progress(batches, path: str):
    """`batches`, writing each position it hands out to `path` (tests poll it)."""

    def wrapped(start: int):
        for position, batch in batches(start):
            with open(path, "w") as f:
                f.write(str(position))
            yield position, batch

    return wrapped


def dev_batches(batch_size: int = 8, num: int = 2) -> list[dict[str, np.ndarray]]:
    return [make_batch(seed=12345, position=i, batch_size=batch_size) for i in range(num)]


def flat_params(params: Any) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


BATCH_SIZE = 8
BATCH_SIZES = (BATCH_SIZE,)  # the toy stream has one bucket
LOOP = TrainLoopConfig(
    log_every=5, eval_every=1000, checkpoint_every=5, keep_checkpoints=3,
    best_metric="loss",
)
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, warmup_steps=3)


def data(batches, batch_sizes=BATCH_SIZES, **dev):
    """A `train.TrainData` over `batches` (`dev`: its dev fields)."""
    from model import train

    return train.TrainData(batches, tuple(batch_sizes), **dev)


def run_spec(checkpoint_dir, num_steps: int, **changes):
    """A `train.RunSpec` with the toy's optimizer, loop and seed 0, `changes` applied."""
    from model import train

    spec = train.RunSpec(num_steps=num_steps, optimizer=OPTIMIZER, loop=LOOP,
                         checkpoint_dir=str(checkpoint_dir), seed=0)
    return dataclasses.replace(spec, **changes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--progress-file", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save chatter

    from model import train

    batches = make_batches(seed=0, batch_size=BATCH_SIZE, sleep=args.sleep)
    if args.progress_file:
        batches = with_progress(batches, args.progress_file)
    result = train.train(
        ToyModel(), data(batches),
        run_spec(os.path.join(args.workdir, "checkpoints"), args.steps,
                 loop=dataclasses.replace(LOOP, checkpoint_every=args.checkpoint_every)),
        MeshConfig(),
    )
    print(f"RESULT step={int(result.state.step)} completed={result.completed} "
          f"stop_reason={result.stop_reason}", flush=True)
    if args.out:
        np.savez(args.out, **flat_params(result.state.params))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --- running in a fresh interpreter (never fork a process that has initialised JAX) ---------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.abspath(__file__)


def subprocess_env(cache_dir: str, devices: int = 1) -> dict[str, str]:
    """Environment of a child interpreter: CPU with `devices` host devices, and a compilation
    cache shared by the children of one test session (same programs, compiled once)."""
    env = dict(os.environ)
    flags = [flag for flag in env.get("XLA_FLAGS", "").split()  # the session's (conftest.py)
             if not flag.startswith("--xla_force_host_platform_device_count")]
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
        JAX_COMPILATION_CACHE_DIR=cache_dir,  # every program goes in it (conftest.py)
        PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")]),
    )
    return env


def run_python(code: str, cache_dir: str, devices: int = 1, timeout: float = 300):
    """Runs `code` in a fresh interpreter; returns the CompletedProcess (output captured)."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=subprocess_env(cache_dir, devices),
        capture_output=True, text=True, timeout=timeout,
    )
