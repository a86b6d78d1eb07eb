"""benchmarks/student_recipe.py on the tiny Multi30k slice: three arms at their fewest steps."""

import json
import types

import pytest

from benchmarks import student_recipe
from components import config as config_lib
from model import train
from model.losses import student_loss_settings
from pipelines import training
from tiny_experiment import ensure, tiny_config


def test_plan_steps_fill_the_budget_at_each_phases_step_time():
    # 630 s, phase 1 at 0.1 s, phase 2 at 0.2 s, 2 of 7 steps in phase 2: 3500 x 0.1 s
    # + 1400 x 0.2 s.
    assert student_recipe.plan_steps(630.0, 0.1, 0.2, 2 / 7) == (3500, 1400)
    assert student_recipe.plan_steps(600.0, 0.1, 0.2, 0.0) == (6000, 0)
    assert student_recipe.plan_steps(0.1, 0.1, 0.2, 0.5) == (2, 2)  # never fewer than 2


def test_the_probe_times_the_training_step_with_the_configs_loss_settings_and_average(
        monkeypatch):
    """What the probe times is the training step compiled with each phase's loss settings
    and the parameter average, a step at a time, each on the state the one before returned:
    a clock that only the step moves (a quarter of a second a step) gives exactly its time."""
    # Every loss setting away from its default (the config glances), and a model that
    # initialises in a second.
    config = config_lib.load("configs/multi30k_en_de.yaml", [
        "student.model={d_model: 32, num_heads: 2, num_encoder_layers: 1, "
        "num_decoder_layers: 1, mlp_dim: 64}", "student.num_passes=3"])
    assert config.student.glancing_ratio > 0
    compiled, ran = [], []  # (loss settings, average) of each compilation; (its index, step)
    clock = types.SimpleNamespace(perf_counter=lambda: 0.25 * len(ran))

    def compile_steps(*args, loss_settings=None, ema_decay=None, **kwargs):
        index = len(compiled)
        compiled.append((loss_settings, ema_decay))

        def train_step(state, batch):
            ran.append((index, int(state.step), state.ema_params is not None))
            return state.replace(step=state.step + 1), {}

        return train.CompiledSteps(train=train_step, eval=None, predict=None)

    monkeypatch.setattr(train, "compile_steps", compile_steps)
    monkeypatch.setattr(student_recipe, "time", clock)
    monkeypatch.setattr(training, "load_tokenizer",
                        lambda config: types.SimpleNamespace(vocab_size=64, first_real_id=6))
    assert [student_recipe.step_seconds(config, phase, length=4, steps=3)
            for phase in (1, 2)] == [0.25, 0.25]
    ema_decay = config.student.optimizer.ema_decay  # the parameter average, as trained
    assert ema_decay is not None
    assert compiled == [(student_loss_settings(config.student, 1), ema_decay),
                        (student_loss_settings(config.student, 2), ema_decay)]
    assert ran == [(index, step, True) for index in range(2) for step in range(1 + 3)]


@pytest.mark.slow  # about a minute on 2 cores: each arm's probe and phases compile
def test_two_arms_train_for_equal_time_and_are_measured(tiny_workdir, tmp_path, capsys,
                                                        monkeypatch):
    # The student learns the original pairs: a 3-step teacher's translations never reach
    # EOS, so distillation would reject them all (tests/test_training_stages.py). One length
    # bucket: one compilation per phase. A budget far below a step's time: every arm plans
    # the fewest steps (2 + 2), so the test's time does not grow with the machine's load.
    # `base` without glancing (the benchmark's has it), so that the glancing arm differs.
    config = tiny_config(tiny_workdir, "distill.enabled=false", "encode.bucket_boundaries=[64]",
                         "student.glancing_ratio=0.0")
    ensure(config, "prepare", "vocab")
    path = tmp_path / "tiny.yaml"
    path.write_text(config_lib.dump(config))
    out = tmp_path / "rows.json"
    probes = []
    probe = student_recipe.step_seconds
    monkeypatch.setattr(student_recipe, "step_seconds",
                        lambda *args, **kwargs: probes.append(args[1]) or probe(*args, **kwargs))
    assert student_recipe.main(["--config", str(path), "--arms", "base,glancing_0.5,dropout_0.3",
                                "--minutes-per-arm", "1e-5", "--json", str(out),
                                "--max-dev-sentences", "8"]) == 0
    rows = json.loads(out.read_text())["arms"]
    assert [row["arm"] for row in rows] == ["base", "glancing_0.5", "dropout_0.3"]
    # Dropout does not change a step's cost: dropout_0.3 plans from base's probes. Glancing
    # changes phase 2's only: it probes that phase alone.
    assert probes == [1, 2, 2]
    assert rows[2]["probe_step_s"] == rows[0]["probe_step_s"]
    assert rows[1]["probe_step_s"]["phase1"] == rows[0]["probe_step_s"]["phase1"]
    assert rows[2]["planned_steps"] == rows[0]["planned_steps"]
    for row in rows:
        planned = row["planned_steps"]
        assert row["phase2_fraction"] == 0.5  # the tiny config's 2 + 2 steps
        assert planned["phase1"] >= 2 and planned["phase2"] >= 2
        assert row["steps_reached"] == planned["phase1"] + planned["phase2"]
        assert row["stop_reason"] is None and row["dev_sentences"] == 8
        for figure in ("dev_bleu_padir_4", "dev_bleu_mask_predict_10", "stutter_pct",
                       "exact_length_pct"):
            assert 0 <= row[figure] <= 100
    assert len({row["student"] for row in rows}) == 3  # one student per arm
    table = capsys.readouterr().out
    assert "| base | (config as is) | 0.5 |" in table
    assert "| glancing_0.5 | student.glancing_ratio=0.5 |" in table
    # A rerun plans from the step times probed then: the same student, reused, no probe;
    # the rows of the arms it does not rerun are kept.
    monkeypatch.setattr(student_recipe, "step_seconds",
                        lambda *args, **kwargs: pytest.fail("probed again"))
    assert student_recipe.main(["--config", str(path), "--arms", "base",
                                "--minutes-per-arm", "1e-5", "--json", str(out),
                                "--max-dev-sentences", "8"]) == 0
    rerun = json.loads(out.read_text())["arms"]
    assert [row["student"] for row in rerun] == [row["student"] for row in rows]
    with pytest.raises(SystemExit):
        student_recipe.main(["--config", str(path), "--arms", "base,nonsense"])
