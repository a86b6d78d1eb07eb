"""benchmarks/student_budget.py: the fit, and the tiny student at 1x and 2x its steps."""

import json

import pytest

from benchmarks import student_budget
from components import artifacts, dag
from components import config as config_lib
from tiny_experiment import ensure, tiny_config


def _rows(*points):
    return [{"multiple": m, "dev_bleu_padir_4": padir, "dev_bleu_mask_predict_10": padir + 1}
            for m, padir in points]


def test_the_fit_gives_bleu_per_doubling_and_the_steps_a_goal_would_take():
    rows = _rows((1, 20.0), (2, 22.0), (4, 24.0))
    assert student_budget.doubling_fit(rows, "padir_4") == pytest.approx((20.0, 2.0))
    # 28 is two doublings beyond 24: 16x.
    assert student_budget.multiple_for_goal((20.0, 2.0), 28.0) == pytest.approx(16.0)
    assert student_budget.multiple_for_goal((20.0, 2.0), 19.0) == 1.0  # already there
    assert student_budget.multiple_for_goal((20.0, -0.5), 28.0) is None  # never, on this line
    assert student_budget.doubling_fit(_rows((1, 20.0)), "padir_4") is None
    lines = student_budget.summary_lines(
        [{**row, "steps_reached": 4 * row["multiple"], "stop_reason": None,
          "student_minutes": 1.0, "stutter_pct": 5.0, "exact_length_pct": 20.0}
         for row in rows], teacher_bleu=29.5)
    assert "| 8 | 2x | 1.0 | 22.0 (-7.50) | 23.0 (-6.50) | 5.0 | 20.0 |" in lines
    assert ("padir_4: +2.00 BLEU per doubling of the student's steps; within 1.5 of the "
            "teacher at about 16x the steps, if the line held.") in lines


@pytest.mark.slow  # about 2 minutes on 2 cores: a tiny teacher, two students, their dev decodes
def test_each_multiple_is_its_own_student_at_that_many_steps(tiny_workdir, tmp_path,
                                                             monkeypatch):
    # The student learns the original pairs (a few-step teacher's translations never reach
    # EOS). A teacher of its own, trained here: other tests publish untrained teachers at the
    # tiny config's key, without the dev figures the stage measures.
    # One length bucket: each training step and decoder compiles one shape.
    config = tiny_config(tiny_workdir, "distill.enabled=false", "teacher.steps=2",
                         "encode.bucket_boundaries=[64]")
    ensure(config, "prepare", "vocab", "encode", "teacher")
    path = tmp_path / "tiny.yaml"
    path.write_text(config_lib.dump(config))
    out, picture = tmp_path / "budget.json", tmp_path / "budget.png"
    argv = ["--config", str(path), "--multiples", "1,2", "--json", str(out),
            "--plot", str(picture)]
    assert student_budget.main(argv) == 0
    study = json.loads(out.read_text())
    rows = study["rows"]
    assert [row["multiple"] for row in rows] == [1, 2]
    assert [row["steps_reached"] for row in rows] == [4, 8]  # 2 + 2 steps, then 4 + 4
    assert rows[1]["overrides"] == ["student.phase1_steps=4", "student.phase2_steps=4"]
    assert rows[0]["student"] != rows[1]["student"]
    teacher = artifacts.read(dag.output_uri(config, "teacher")).manifest["metrics"]
    assert study["teacher_dev_bleu_beam4"] == teacher["dev_final"]["beam4"]["bleu"]
    for row in rows:
        assert row["dev_sentences"] == rows[0]["dev_sentences"] > 0  # the whole dev set
        assert row["dev_curve"][-1]["step"] == row["steps_reached"]
    assert picture.read_bytes().startswith(b"\x89PNG")
    # A rerun measures nothing again.
    from flows import stages
    monkeypatch.setattr(stages, "run_stage", lambda *a, **k: pytest.fail("trained again"))
    assert student_budget.main(argv) == 0
    assert json.loads(out.read_text())["rows"] == rows
