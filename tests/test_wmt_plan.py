"""benchmarks/wmt_plan.py's projections on fabricated measurements (shapes only, seconds)."""

import json
import os

import jax
import pytest

from benchmarks import wmt_plan
from components import config as config_lib
from components.config import ModelConfig
from model import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ModelConfig(d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=2,
                   mlp_dim=32, dropout_rate=0.0, max_source_len=9, max_target_len=8)
VOCAB = 300  # above the 262 reserved and byte ids


@pytest.fixture(scope="module")
def plan():
    return wmt_plan


def _stages(pairs: int, cpu: dict, rss: float) -> list[dict]:
    return [{"stage": stage, "pairs": 0 if stage == "teacher" else pairs,
             "process_seconds": 1.0, "cpu_seconds": cpu.get(stage, 1.0), "stage_seconds": 1.0,
             "peak_rss_mib": rss} for stage in
            ("prepare", "vocab", "encode", "teacher", "distill", "decode")]


# The largest size first: the pick is by pairs, not by order.
SCALING = {
    "all": {"words_per_pair": 15.0,
            "stages": _stages(20_000, {"prepare": 40.0, "vocab": 60.0, "encode": 100.0}, 310)},
    "1,000": {"words_per_pair": 14.0,
              "stages": _stages(1_000, {"prepare": 9.0, "vocab": 9.0, "encode": 9.0}, 300)},
}


def _tiny_config(**sections) -> config_lib.Config:
    data = {"workdir": "/tmp/unused",
            "data": {"source_lang": "en", "target_lang": "de",
                     "train": {"source": "a.en", "target": "a.de"}},
            "vocab": {"size": VOCAB},
            "encode": {"max_source_len": 8, "max_target_len": 8, "bucket_boundaries": [8]},
            "teacher": {"model": dict(vars(TINY)), "steps": 7,
                        "loop": {"tokens_per_batch": 64}},
            "student": {"model": dict(vars(TINY)), "phase1_steps": 5, "phase2_steps": 3,
                        "num_passes": 3, "loop": {"tokens_per_batch": 32}}}
    data.update(sections)
    return config_lib.from_dict(config_lib.Config, data)


def test_workers_from_pipeline_options(plan):
    wmt = plan.load_config(os.path.join(ROOT, "configs/overlays/wmt14.yaml"), ())
    assert plan.workers(wmt.runner.options) == plan.Workers(32, "n1-standard-1", 1)
    options = ["--max_num_workers=4", "--machine_type=n2-standard-8", "--max_num_workers=10"]
    assert plan.workers(options) == plan.Workers(10, "n2-standard-8", 8)  # the last flag wins
    # One SDK process per VM: a pure-Python stage keeps one core busy.
    one = plan.workers(options + ["--experiments=no_use_multiple_sdk_containers"])
    assert one.cores == 1
    assert plan.machine_vcpus("n2-custom-4-16384") == 4
    with pytest.raises(ValueError, match="max_num_workers"):
        plan.workers(["--machine_type=n1-standard-1"])


def test_data_stages_scale_the_largest_size_by_words_and_pairs(plan):
    assert plan.largest_size(SCALING) == "all"
    on = plan.Workers(count=5, machine_type="n2-standard-4", cores=4)
    rows = plan.data_stage_rows(SCALING, words_per_pair=45.0, pairs=3_000_000, on=on)
    assert [row.stage for row in rows] == ["prepare", "vocab", "encode"]
    prepare, _, encode = rows
    assert prepare.measured_pairs == 20_000
    assert prepare.cpu_s_per_1k == pytest.approx(2.0)  # 40 s / 20k pairs
    assert (prepare.words_measured, prepare.words_assumed) == (15.0, 45.0)
    # 2 ms a pair x 3 (words) x 3M pairs = 18,000 s = 5 CPU-hours; over 5 x 4 cores.
    assert prepare.cpu_hours == pytest.approx(5.0)
    assert prepare.wall_hours == pytest.approx(5.0 / 20)
    assert encode.cpu_hours == pytest.approx(100 / 20_000 * 3 * 3_000_000 / 3600)
    assert prepare.peak_rss_mib == (300, 310)  # fewest pairs first


def test_training_flops_are_step_flops_times_steps(plan):
    from benchmarks import train_throughput
    from model.models import ARModel, PaDIRModel

    config = _tiny_config()
    steps = plan.training_steps(config, pair_tokens=8)
    teacher = ARModel(TINY, VOCAB)
    student = PaDIRModel(TINY, VOCAB, train_throughput.FIRST_REAL_ID)

    # Allocated parameters, unlike the plan's eval_shape.
    teacher, student = (model.init(jax.random.PRNGKey(0), train.example_batch(model))
                        for model in (teacher, student))
    # tokens_per_batch 64 and 32 over rows of 8 tokens: 8 and 4 rows.
    expected = [
        ("teacher (AR)", 7, 8,
         train_throughput.step_flops(teacher, TINY, VOCAB, 8, 8, 8, False, 1)[0]),
        ("student phase 1 (K=1)", 5, 4,
         train_throughput.step_flops(student, TINY, VOCAB, 4, 8, 8, True, 1)[0]),
        ("student phase 2 (K=3)", 3, 4,
         train_throughput.step_flops(student, TINY, VOCAB, 4, 8, 8, True, 3)[0]),
    ]
    assert steps == expected
    rows = plan.train_rows(steps, peak_flops_per_chip=1e6, mfu=0.5, chips=4)
    for row, (_, count, _, per_step) in zip(rows, expected):
        assert row.flops == per_step * count
        assert row.chip_hours == pytest.approx(per_step * count / 5e5 / 3600)
        assert row.wall_hours == pytest.approx(row.chip_hours / 4)


def test_distill_flops_formula(plan):
    # 2 x 10 x 5 (encoder) + 2 beams x 4 steps x 2 x (20 + 7 x 3) (decoder + output) = 756
    assert plan.sentence_flops(n_enc=10, n_dec=20, vocab=7, d_model=3, beam=2, src=5,
                               tgt=4) == 756.0
    rows = plan.distill_rows(756.0, sentences=1000, chip_flops_per_s=21.0, chips=2,
                             core_flops_per_s=None, cores=8)
    assert [row.device for row in rows] == ["TPU chip"]  # no CPU row without a measured rate
    assert rows[0].hours == pytest.approx(756_000 / 21 / 3600)
    assert rows[0].wall_hours == pytest.approx(rows[0].hours / 2)
    cpu = plan.distill_rows(756.0, 1000, 21.0, 2, core_flops_per_s=42.0, cores=8)[1]
    assert (cpu.device, cpu.units) == ("CPU core", 8)
    assert cpu.hours == pytest.approx(756_000 / 42 / 3600)


def test_teacher_sentence_flops_counts_as_step_flops_does(plan):
    from benchmarks import train_throughput
    from model.models import ARModel

    config = _tiny_config(distill={"beam_size": 3})
    model = ARModel(TINY, VOCAB)
    params = model.init(jax.random.PRNGKey(0), train.example_batch(model))
    n_enc = train_throughput._count(params["encoder"], skip=("pos_embedding",))
    n_dec = train_throughput._count(params["decoder"], skip=("pos_embedding",))
    assert plan.teacher_sentence_flops(config, tokens=6) == (
        2 * n_enc * 6 + 3 * 6 * 2 * (n_dec + VOCAB * TINY.d_model))


def test_measured_distill_argument(plan):
    measured = plan.measured_distill("58.9,2,configs/multi30k_en_de.yaml")
    assert measured == plan.MeasuredDistill(58.9, 2, "configs/multi30k_en_de.yaml")
    for bad in ("58.9,2", "fast,2,c.yaml", "0,2,c.yaml"):
        with pytest.raises(Exception, match="SENTENCES_PER_S|positive"):
            plan.measured_distill(bad)


def test_main_prints_the_three_tables(plan, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PADIR_DATA_ROOT", raising=False)
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps(SCALING))
    assert plan.main(["--scaling-json", str(path),
                      "--measured-distill", "58.9,2,configs/multi30k_en_de.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.count("### ") == 3
    for line in ("| prepare | 20,000 | 2.00 s | 15.0 -> 46.0 |", "| teacher (AR) | 40,000 |",
                 "| student phase 2 (K=2) | 20,000 |", "| TPU chip |", "| CPU core |",
                 "32 x n1-standard-1", "peak RSS MiB per process at 1,000 / all"):
        assert line in out
    assert "PADIR_DATA_ROOT" not in os.environ  # the placeholder is gone once loaded
    assert plan.main(["--scaling-json", str(path)]) == 0
    assert "| CPU core |" not in capsys.readouterr().out
