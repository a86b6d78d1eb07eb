"""benchmarks/train_throughput.py: the student's probes time the loss its config trains."""

import json
import types

import jax.numpy as jnp

from benchmarks import train_throughput
from components import config as config_lib
from model import train
from model.losses import student_loss_settings

CONFIG = "configs/multi30k_en_de.yaml"  # the student glances
TINY = "{d_model: 32, num_heads: 2, num_encoder_layers: 1, num_decoder_layers: 1, mlp_dim: 64}"
# Every other loss setting away from its default, and models laid out in a second.
OVERRIDES = [f"teacher.model={TINY}", f"student.model={TINY}", "vocab.size=400",
             "student.num_passes=3"]


def test_each_phase_times_the_training_step_with_the_configs_loss_settings(monkeypatch,
                                                                           capsys):
    """What each probe times is the training step compiled with its model's loss settings,
    a step at a time, each on the state the one before returned: a clock that only the
    step moves (a quarter of a second a step) gives exactly that step's time."""
    compiled, ran = [], []  # the loss settings of each compilation; (its index, step) a run
    clock = types.SimpleNamespace(perf_counter=lambda: 0.25 * len(ran))

    def compile_steps(*args, loss_settings=None, **kwargs):
        index = len(compiled)
        compiled.append(loss_settings)

        def train_step(state, batch):
            ran.append((index, int(state.step), batch["source"].shape))
            return state.replace(step=state.step + 1), {"objective": jnp.float32(2.5)}

        return train.CompiledSteps(train=train_step, eval=None, predict=None)

    monkeypatch.setattr(train, "compile_steps", compile_steps)
    monkeypatch.setattr(train_throughput, "time", clock)
    for ceiling in ("matmul_flops_per_s", "model_shapes_flops_per_s"):  # not the step's
        monkeypatch.setattr(train_throughput, ceiling, lambda *args, **kwargs: 1e12)
    train_throughput.main(["--config", CONFIG, "--length", "4", "--steps", "3",
                           *(f"--set={o}" for o in OVERRIDES)])
    config = config_lib.load(CONFIG, OVERRIDES)
    student = config.student
    assert student.glancing_ratio > 0
    assert compiled == [None, student_loss_settings(student, 1),
                        student_loss_settings(student, 2)]
    shape = (config.teacher.loop.tokens_per_batch // 4, 4)
    assert ran == [(index, step, shape) for index in range(3) for step in range(2 + 3)]
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(row["step_s"], row["median_step_s"], row["loss"]) for row in rows] == \
        [(0.25, 0.25, 2.5)] * 3
