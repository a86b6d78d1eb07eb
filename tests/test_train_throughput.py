"""benchmarks/train_throughput.py: the student's probes time the loss its config trains."""

import pytest

from benchmarks import train_throughput
from components import config as config_lib
from model import train
from model.losses import student_loss_settings

CONFIG = "configs/multi30k_en_de.yaml"  # the student glances
TINY = "{d_model: 32, num_heads: 2, num_encoder_layers: 1, num_decoder_layers: 1, mlp_dim: 64}"
# Every other loss setting away from its default, and models laid out in a second.
OVERRIDES = [f"teacher.model={TINY}", f"student.model={TINY}", "vocab.size=400",
             "student.num_passes=3", "student.draft_prefix_ratio=0.25"]


class Probed(Exception):
    """Raised where the probe compiles its step: what it would time is known by then."""


def test_each_phase_is_probed_with_the_configs_loss_settings(monkeypatch):
    timed = []

    def compile_steps(*args, loss_settings=None, **kwargs):
        timed.append(loss_settings)
        raise Probed

    monkeypatch.setattr(train, "compile_steps", compile_steps)
    argv = ["--config", CONFIG, "--length", "4", *(f"--set={o}" for o in OVERRIDES)]
    for models in ("teacher", "phase1", "phase2"):
        with pytest.raises(Probed):
            train_throughput.main([*argv, "--models", models])
    student = config_lib.load(CONFIG, OVERRIDES).student
    assert student.glancing_ratio > 0
    assert timed == [None, student_loss_settings(student, 1), student_loss_settings(student, 2)]
