"""The training engine: schedule, cadence, metrics, one trace per shape, NaN, evaluation,
and end-to-end runs of the real teacher and student models (tiny configs)."""

import dataclasses
import functools
import math
import os
import time

import jax
import numpy as np
import pytest

import toy_training as toy
from components.config import (
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    StudentConfig,
    TeacherConfig,
    TrainLoopConfig,
)
from model import checkpoints, sharding, train
from model.losses import LossSettings


def test_every_fires_on_multiples_and_the_last_step():
    fired = [s for s in range(1, 12) if train.every(s, 4, last_step=11)]
    assert fired == [4, 8, 11]


@pytest.mark.parametrize("decay", ["rsqrt", "cosine"])
def test_schedule_warms_up_then_decays(decay):
    cfg = OptimizerConfig(learning_rate=1e-3, warmup_steps=10, decay=decay)
    schedule = train.learning_rate_schedule(cfg, total_steps=100)
    rates = [float(schedule(c)) for c in range(100)]  # count c: the rate of update c + 1
    assert rates[0] == pytest.approx(1e-4)
    assert rates[9] == pytest.approx(1e-3)  # peak at the end of warmup
    assert all(a <= b for a, b in zip(rates[:9], rates[1:10]))
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    if decay == "rsqrt":
        assert rates[39] == pytest.approx(1e-3 * math.sqrt(10 / 40))
    else:
        assert rates[99] == pytest.approx(0.0, abs=1e-12)


def test_summarize_follows_the_losses_conventions():
    sums = {"loss": 6.0, "weights": 3.0, "accuracy": 2.0, "loss_pass2": 8.0,
            "weights_pass2": 4.0, "tokens": 5.0, "length_accuracy": 1.0, "examples": 2.0,
            "objective": 4.0, "grad_norm": 2.0}
    out = train.summarize(sums, steps=2)
    assert out["loss"] == 2.0 and out["accuracy"] == pytest.approx(2 / 3)
    assert out["loss_pass2"] == 2.0 and out["length_accuracy"] == 0.5
    assert out["objective"] == 2.0 and out["grad_norm"] == 1.0
    assert out["tokens"] == 5.0 and out["examples"] == 2.0


def test_train_step_traces_once_across_steps():
    model = toy.ToyModel()
    tx, _ = train.make_optimizer(toy.OPTIMIZER, 10)
    placement = train.place(model, tx, MeshConfig())
    state = placement.create_state(seed=0)
    steps = train.compile_steps(model, tx, placement.state_shardings,
                                placement.batch_sharding, loss_settings=LossSettings())
    before = toy.TRACES["loss_fn"]
    for position in range(4):
        batch = sharding.shard_batch(toy.make_batch(0, position, 8),
                                     placement.batch_sharding)
        state, _ = steps.train(state, batch)
    assert toy.TRACES["loss_fn"] - before == 1
    assert steps.train._cache_size() == 1
    assert int(state.step) == 4


class NaNModel(toy.ToyModel):
    """The toy model whose loss is NaN on any batch holding token 5."""

    def loss_fn(self, params, batch, rng, **kwargs):
        loss, metrics = super().loss_fn(params, batch, rng, **kwargs)
        poisoned = jax.numpy.any(batch["source"] == 5)
        return jax.numpy.where(poisoned, jax.numpy.nan, loss), metrics


def test_nan_loss_fails_fast_naming_the_step(tmp_path):
    clean = toy.make_batches(seed=0, batch_size=8)

    def batches(start):
        for position, batch in clean(start):
            if position == 4:  # the 4th batch: step 4
                batch["source"][0, 0] = 5
            yield position, batch

    with pytest.raises(train.NonFiniteLossError, match="at step 4"):
        train.train(
            NaNModel(), toy.data(batches),
            toy.run_spec(tmp_path / "ckpt", 20,
                         loop=dataclasses.replace(toy.LOOP, checkpoint_every=3)),
            MeshConfig(),
        )
    # The step-3 checkpoint was written before the NaN; nothing after it.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["3"]


def _detokenize(ids):
    return " ".join(f"w{i}" for i in ids)


def _references(dev):
    refs = []
    for batch in dev:
        for source, target in zip(batch["source"], batch["target"]):
            if source.any():  # all-pad rows are padding
                ids = target.tolist()
                refs.append(_detokenize(ids[: ids.index(1)]))
    return refs


def test_dev_evaluation_bleu_tensorboard_and_best_checkpoint(tmp_path):
    dev = toy.dev_batches()
    dev[-1]["source"][-2:] = 0  # two padding rows: no references for them
    dev[-1]["target"][-2:] = 0
    references = _references(dev)
    assert len(references) == 14
    loop = TrainLoopConfig(log_every=2, eval_every=3, checkpoint_every=100,
                           keep_checkpoints=1, best_metric="bleu")
    def run():
        return train.train(
            toy.ToyModel(),
            toy.data(toy.make_batches(seed=0, batch_size=8), dev_batches=dev,
                     detokenize=_detokenize, references=references),
            toy.run_spec(tmp_path / "ckpt", 7, loop=loop, log_dir=str(tmp_path / "tb")),
            MeshConfig(),
        )

    result = run()
    metrics = result.dev_metrics
    assert result.completed and set(metrics) >= {"loss", "accuracy", "bleu", "tokens"}
    assert 0.0 <= metrics["bleu"] <= 100.0 and 0.0 <= metrics["accuracy"] <= 1.0
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    manager = checkpoints.open_manager(str(tmp_path / "ckpt"), keep=1, best_metric="bleu",
                                       read_only=True)
    steps, best = sorted(manager.all_steps()), manager.best_step()
    manager.close()
    # evaluated at 3, 6, 7: the latest (7) and the best by dev BLEU are kept
    assert 7 in steps and best in steps and set(steps) <= {3, 6, 7}
    # A rerun (say, after a kill during publication) finds training done: same metrics.
    again = run()
    assert again.completed and again.dev_metrics == pytest.approx(dict(metrics))


def test_time_budget_checkpoints_and_stops(tmp_path):
    result = train.train(
        toy.ToyModel(), toy.data(toy.make_batches(seed=0, batch_size=8)),
        toy.run_spec(tmp_path / "ckpt", 50, deadline=time.monotonic()), MeshConfig(),
    )
    assert not result.completed and result.stop_reason == "time budget"
    assert int(result.state.step) == 1 and result.position == 1
    assert (tmp_path / "ckpt" / "1").is_dir()


def test_parameter_average_warms_up_then_decays_at_its_rate():
    average, params = {"w": np.zeros(3, np.float32)}, {"w": np.ones(3, np.float32)}
    first = train.update_average(average, params, np.int32(0), decay=0.999)
    np.testing.assert_allclose(first["w"], 0.9)  # rate (1 + 0) / (10 + 0) = 0.1 at the start
    late = train.update_average(average, params, np.int32(100_000), decay=0.999)
    np.testing.assert_allclose(late["w"], 0.001, rtol=1e-4)  # float32 rounding of 1 - 0.999


def test_parameter_average_resumes_exactly_and_is_what_readers_restore(tmp_path):
    """With optimizer.ema_decay the average trains along, resumes bit for bit, and is the
    checkpoint's `params` (what evaluation, decoding and publication read)."""
    averaged = dataclasses.replace(toy.OPTIMIZER, ema_decay=0.9)

    def run(directory, steps):
        return train.train(toy.ToyModel(), toy.data(toy.make_batches(seed=0, batch_size=8)),
                           toy.run_spec(directory, steps, optimizer=averaged), MeshConfig())

    straight = run(tmp_path / "straight", 12)
    run(tmp_path / "resumed", 6)
    resumed = run(tmp_path / "resumed", 12)
    for got, want in ((resumed.state.params, straight.state.params),
                      (resumed.state.ema_params, straight.state.ema_params)):
        for name, value in toy.flat_params(want).items():
            np.testing.assert_array_equal(toy.flat_params(got)[name], value)
    average, raw = toy.flat_params(straight.state.ema_params), toy.flat_params(straight.state.params)
    assert any(not np.allclose(average[name], raw[name]) for name in raw)
    placement = train.place(toy.ToyModel(), train.make_optimizer(averaged, 12)[0], MeshConfig())
    restored, _, step = checkpoints.restore_params(str(tmp_path / "straight"),
                                                   placement.abstract_state.params)
    assert step == 12
    for name, value in toy.flat_params(restored).items():
        np.testing.assert_array_equal(value, average[name])


def test_bleu_needs_references():
    with pytest.raises(ValueError, match="references"):
        train.train(
            toy.ToyModel(), toy.data(toy.make_batches(seed=0, batch_size=8),
                                     dev_batches=toy.dev_batches()),
            toy.run_spec("/nonexistent", 1,
                         loop=dataclasses.replace(toy.LOOP, best_metric="bleu")),
            MeshConfig(),
        )
    with pytest.raises(ValueError, match="both references and detokenize"):
        toy.data(toy.make_batches(seed=0, batch_size=8), references=["a"])


# --- the real models ----------------------------------------------------------------------

TINY = ModelConfig(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                   mlp_dim=64, max_source_len=toy.LENGTH + 2, max_target_len=toy.LENGTH)
TINY_LOOP = TrainLoopConfig(log_every=2, eval_every=2, checkpoint_every=2,
                            keep_checkpoints=1, best_metric="loss")


def test_teacher_trains_with_the_real_ar_model(tmp_path):
    from model.decoding import beam_search
    from model.models import ARModel

    cfg = TeacherConfig(model=TINY, optimizer=toy.OPTIMIZER, loop=TINY_LOOP, steps=3,
                        label_smoothing=0.1)
    dev = toy.dev_batches()
    model = ARModel(cfg.model, toy.VOCAB, label_smoothing=cfg.label_smoothing)
    result = train.train_teacher(
        model, toy.data(toy.make_batches(seed=0, batch_size=8), dev_batches=dev,
                        detokenize=_detokenize, references=_references(dev)),
        cfg, MeshConfig(), checkpoint_dir=str(tmp_path / "teacher"), seed=0,
        predict=functools.partial(beam_search.predict_greedy, model),
    )
    assert result.completed and int(result.state.step) == 3
    assert np.isfinite(result.dev_metrics["loss"]) and "bleu" in result.dev_metrics


@pytest.mark.slow  # about a minute on 2 cores: both phases of the real model
def test_student_trains_both_phases_with_the_real_padir_model(tmp_path):
    from model.decoding import refinement
    from model.models import PaDIRModel

    # With an average of the parameters and a warm start, as the benchmark trains it: the
    # warm start (phase 1) and the init checkpoint (phase 2) start both parameter trees.
    cfg = StudentConfig(model=TINY, optimizer=dataclasses.replace(toy.OPTIMIZER, ema_decay=0.9),
                        loop=TINY_LOOP, phase1_steps=2, phase2_steps=2, num_passes=2)
    model = PaDIRModel(cfg.model, toy.VOCAB, first_real_id=6,
                       label_smoothing=cfg.label_smoothing)
    dev = toy.dev_batches()
    result = train.train_student(
        model, toy.data(toy.make_batches(seed=0, batch_size=8), dev_batches=dev,
                        detokenize=_detokenize, references=_references(dev)),
        cfg, MeshConfig(), checkpoint_dir=str(tmp_path / "student"), seed=0,
        predict=refinement.dev_predict(model),
        warm_start=lambda params: jax.tree.map(lambda x: x + 0.01, params),
    )
    assert result.completed and int(result.state.step) == 2
    assert "bleu" in result.dev_metrics and "bleu_tok_lc" in result.dev_metrics
    # phase 2 continued phase 1's data stream: positions 3, 4 after phase 1's 1, 2
    assert result.position == 4
    assert {"loss_pass2", "length_accuracy"} <= set(result.dev_metrics)
    assert os.path.isdir(tmp_path / "student" / "phase1" / "2")
    assert os.path.isdir(tmp_path / "student" / "phase2" / "2")
