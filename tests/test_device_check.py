"""benchmarks/device_check.py on the tiny experiment: the pack holds what must travel, and the
run measures every row, probe and budget-line point from it alone, importing no TensorFlow,
Beam or Prefect."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from benchmarks import device_check
from tiny_experiment import ensure, publish_untrained, tiny_config

HEAVY = ("tensorflow", "apache_beam", "prefect")
# Run in a fresh interpreter with the heavy packages made unimportable (a lazy import on
# the run path fails loudly), then list any of them that got in anyway.
RUN = """
import json, sys
for name in {heavy!r}:
    sys.modules[name] = None
sys.path.insert(0, ".")
from benchmarks import device_check
device_check.main(["--run", {pack!r}, "--latency-sentences", "3", "--batch-size", "4",
                   "--train-steps", "2", "--budget", "1,2", "--minutes", "120",
                   "--crossover", "32x1", "--crossover-vocabs", "300", "--json", {out!r}])
loaded = sorted(n for n in sys.modules if n.split(".")[0] in {heavy!r} and sys.modules[n])
print("HEAVY", json.dumps(loaded))
"""


@pytest.fixture(scope="module")
def pack(tiny_workdir, tmp_path_factory):
    # The student on the original pairs: no distillation run just to pack its batches. One
    # length bucket (each decoder, training step and budget-line phase compiles one shape),
    # in test_ar_student's shards: test_distill needs the one-bucket originals unencoded.
    config = tiny_config(tiny_workdir, "distill.enabled=false", "encode.bucket_boundaries=[64]",
                         "encode.num_shards=2")
    ensure(config, "prepare", "vocab", "encode")
    for stage in ("teacher", "student", "ar_student", "drafter"):  # the config decodes both
        publish_untrained(config, stage)
    directory = str(tmp_path_factory.mktemp("pack"))
    sizes = device_check.pack(directory, config, train_batches=2, max_sentences=6)
    return directory, sizes, config


def test_pack_holds_params_vocabulary_test_set_and_batches_under_the_limit(pack):
    directory, sizes, _ = pack
    assert set(sizes) == {"models.json", "spm.model", "test.jsonl", "teacher_params.npz",
                          "student_params.npz", "ar_student_params.npz",
                          "drafter_params.npz", "teacher_batches.npz",
                          "student_batches.npz", "student_data.npz"}
    assert sum(sizes.values()) < device_check.PACK_LIMIT_BYTES
    with open(os.path.join(directory, "test.jsonl")) as f:
        pairs = [json.loads(line) for line in f]
    assert len(pairs) == 6 and {"id", "source", "target", "split"} <= set(pairs[0])
    about, loaded = device_check.load_pack(directory)
    assert set(loaded) == {"teacher", "student", "ar_student", "drafter"}
    assert loaded["teacher"].model.config.d_model == 32
    assert loaded["ar_student"].model.config.num_decoder_layers == 1
    assert loaded["drafter"].model.block == device_check.packed_section(about, "drafter").block
    assert device_check.packed_section(about, "student").num_passes == 2
    with np.load(os.path.join(directory, "student_batches.npz")) as batches:
        assert len(batches.files) == 4 and batches["target_0000"].dtype == np.int16


def test_pack_holds_the_students_whole_training_set_and_it_round_trips(pack):
    from components import dag
    from model import input_pipeline

    directory, _, config = pack
    encoded = dag.output_uri(config, dag.student_data(config))
    expected = list(input_pipeline.read_pairs(input_pipeline.split_files(encoded, "train")))
    with np.load(os.path.join(directory, "student_data.npz")) as flat:
        assert {flat[name].dtype for name in flat.files} == {np.dtype(np.int16)}
        packed = device_check.unpack_pairs(flat)
    assert len(packed) == len(expected) > 100
    for (source, target), (want_source, want_target) in zip(packed, expected):
        np.testing.assert_array_equal(source, want_source)
        np.testing.assert_array_equal(target, want_target)
    about, _ = device_check.load_pack(directory)
    assert about["student"]["batch_sizes"] == list(input_pipeline.batch_sizes_for_tokens(
        config.encode.bucket_boundaries, config.student.loop.tokens_per_batch))


def test_the_training_probe_times_each_phase_with_the_packed_loss_settings(pack, monkeypatch):
    """What the probe times is `train.train_step` with each phase's loss settings, a step at
    a time, each on the state the one before returned: a clock that only the step moves
    (a quarter of a second a step) gives exactly the rates of those steps."""
    from model import train
    from model.losses import student_loss_settings

    directory, _, _ = pack
    about, loaded = device_check.load_pack(directory)
    about["student"]["section"].update(num_passes=3, glancing_ratio=0.5)
    traced, ran = [], []  # the loss settings of each trace; the state's step at each run
    clock = types.SimpleNamespace(perf_counter=lambda: 0.25 * len(ran))

    def step(state, batch, *, model, tx, loss_settings=None):  # traced once per shape
        traced.append(loss_settings)
        ran_at = jax.pure_callback(lambda at: ran.append(int(at)) or at,
                                   jax.ShapeDtypeStruct((), np.int32), state.step)
        return state.replace(step=state.step + 1), {"ran_at": ran_at}

    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(device_check, "time", clock)
    rates = device_check.probe_training(directory, about, loaded, steps=3)
    student = device_check.packed_section(about, "student")
    assert list(dict.fromkeys(traced)) == [None, student_loss_settings(student, 1),
                                           student_loss_settings(student, 2)]
    runs = []
    for stage in ("teacher", "student", "student"):
        with np.load(os.path.join(directory, f"{stage}_batches.npz")) as flat:
            targets = [flat[f"target_{i:04d}"] for i in range(len(flat.files) // 2)]
        shapes = len({target.shape for target in targets})  # one compiling step each
        runs.append((shapes, sum(int((targets[i % len(targets)] != 0).sum())
                                 for i in range(3))))
    assert ran == [step for shapes, _ in runs for step in range(shapes + 3)]
    assert [(rate.name, rate.steps, rate.step_ms, rate.steps_per_s) for rate in rates] == [
        (name, 3, 250.0, 4.0) for name in ("teacher", "student phase 1", "student phase 2")]
    assert [rate.target_tokens_per_s for rate in rates] == [
        pytest.approx(tokens / 0.75) for _, tokens in runs]


def test_pair_stream_batches_every_pair_once_an_epoch_and_resumes_at_any_position():
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(6, 50, rng.integers(1, 9)), rng.integers(6, 50, rng.integers(1, 17)))
             for _ in range(23)]
    stream = device_check.PairStream(pairs, boundaries=(4, 8, 16), batch_sizes=(4, 2, 1),
                                     seed=3)
    stream_from_0 = stream.batches(0)
    run = [next(stream_from_0) for _ in range(2 * stream.batches_per_epoch)]
    assert [position for position, _ in run] == list(range(1, len(run) + 1))
    epoch = [batch for _, batch in run[:stream.batches_per_epoch]]
    rows = [(tuple(s[s != 0]), tuple(t[t != 0]))
            for batch in epoch for s, t in zip(batch["source"], batch["target"]) if s[0] != 0]
    assert sorted(rows) == sorted((tuple(s), tuple(t)) for s, t in pairs)
    for batch in epoch:  # one bucket's shape: its rows x its boundary
        assert batch["source"].shape in {(4, 4), (2, 8), (1, 16)}
        assert batch["source"].shape == batch["target"].shape
    assert [b["source"].tolist() for _, b in run[len(epoch):]] != [
        b["source"].tolist() for b in epoch]  # the next epoch is another order
    for start in (1, len(epoch), len(epoch) + 3):  # a resumed stream is the same stream
        position, batch = next(stream.batches(start))
        assert position == start + 1
        for side in ("source", "target"):
            np.testing.assert_array_equal(batch[side], run[start][1][side])


def test_budget_flag_takes_multiples_or_none():
    assert device_check.parse_args(["--run", "p"]).budget == (1, 4, 16)
    assert device_check.parse_args(["--run", "p", "--budget", "2,3"]).budget == (2, 3)
    assert device_check.parse_args(["--run", "p", "--budget", "none"]).budget == ()
    with pytest.raises(SystemExit):
        device_check.parse_args(["--run", "p", "--budget", "0,4"])


@pytest.mark.slow  # a minute on 2 cores: a training step and a decoding compile
def test_budget_line_stops_at_the_time_limit_and_skips_the_multiples_after(pack, capsys,
                                                                          monkeypatch):
    from model import train

    directory, _, _ = pack
    about, loaded = device_check.load_pack(directory)
    with open(os.path.join(directory, "test.jsonl")) as f:
        pairs = [json.loads(line) for line in f][:2]
    # The hour left of the budget line goes to the training loop, whose time is up at its
    # first step (its clock, not the machine's: the test does not race it).
    limits = []
    monkeypatch.setattr(train, "_deadline",
                        lambda loop: limits.append(loop.max_minutes) or float("-inf"))
    points = device_check.budget_line(directory, about, loaded, pairs, multiples=(500, 1000),
                                      deadline=time.monotonic() + 3600, batch_size=2)
    [point] = points
    assert len(limits) == 1 and 59 < limits[0] <= 60
    assert point.multiple == 500 and not point.completed
    assert point.trained == 1 and point.steps == 2000 and point.bleu >= 0
    out = capsys.readouterr().out
    assert "(stopped: the time limit ran out)" in out and "not trained: 1000x" in out


@pytest.mark.slow  # minutes on 2 cores: every method, probe and budget-line run compiles
def test_run_measures_every_row_and_probe_without_tensorflow_beam_or_prefect(pack, tmp_path):
    directory, _, _ = pack
    out = str(tmp_path / "device.json")
    script = RUN.format(heavy=HEAVY, pack=directory, out=out)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "HEAVY []"
    with open(out) as f:
        figures = json.load(f)
    [entry] = figures["report"]["test_sets"].values()
    rows = device_check.METHODS + (device_check.CTRANSLATE2_METHODS
                                   if importlib.util.find_spec("ctranslate2") else ())
    assert [m["method"] for m in entry["methods"]] == [m.name for m in rows]
    assert {"ar_student_beam4", "draft_verify_tolerant"} <= {m["method"] for m in entry["methods"]}
    for method in entry["methods"]:
        assert method["sentences"] == 6 and method["latency_s"]["count"] == 3
        assert method["latency_s"]["p99"] > 0 and method["throughput"]["batch_size"] == 4
    assert [rate["name"] for rate in figures["training"]] == [
        "teacher", "student phase 1", "student phase 2"]
    assert all(rate["steps_per_s"] > 0 and rate["target_tokens_per_s"] > 0
               for rate in figures["training"])
    assert "| padir_4 |" in done.stdout and "student phase 2" in done.stdout
    # The student's phases are 2 + 2 steps in the tiny config: 4 and 8 at 1x and 2x.
    assert [(p["multiple"], p["steps"], p["trained"], p["completed"])
            for p in figures["budget"]] == [(1, 4, 4, True), (2, 8, 8, True)]
    assert all(p["bleu"] >= 0 and p["train_s"] > 0 for p in figures["budget"])
    assert "budget line   2x: 8/8 steps" in done.stdout
    swept = figures["crossover"]  # the sweep's rows on this device, a floor beside each method
    methods = [row["method"] for row in swept["rows"]]
    assert methods[:8] == ["floor AR", "JAX greedy", "floor PaDIR-1", "JAX PaDIR-1",
                           "floor PaDIR-2", "JAX PaDIR-2", "floor PaDIR-4", "JAX PaDIR-4"]
    assert all(row["median_ms"] > 0 for row in swept["rows"])
    assert len(swept["crossover"]) == 2
