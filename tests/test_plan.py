"""flows/plan.py: which stages a run executes, decided before it starts (no Prefect)."""

import shutil

import pytest

from components import artifacts, dag
from components import config as config_lib
from flows import cli, plan

DIAMOND = {  # stage -> inputs; registration order deliberately not topological
    "report": ("left", "right"),
    "left": ("root",),
    "root": (),
    "right": ("root",),
}


def write_fake_artifact(config, stage):
    with artifacts.write(config.workdir, stage, dag.stage_key(config, stage),
                         config=dag.section_values(config, stage), inputs={}) as out:
        out.counts["pairs"] = 3
        out.metrics.update(dev={"bleu": 12.345678, "loss": 2.5}, signature="x" * 80)


@pytest.fixture
def config(tmp_path):
    return config_lib.from_dict(config_lib.Config, {
        "workdir": str(tmp_path / "work"),
        "data": {"source_lang": "en", "target_lang": "de",
                 "train": {"source": "a.en", "target": "a.de"}}})


def test_topological_order_puts_every_stage_after_its_inputs(config):
    assert plan.topological_order(DIAMOND) == ["root", "left", "right", "report"]
    assert plan.downstream("left", DIAMOND) == ["left", "report"]
    graph = dag.graph(config)
    order = plan.topological_order(graph)
    # Distillation is on by default; no default method decodes with the AR student or
    # drafts with the drafter.
    assert sorted(order) == sorted(set(dag.STAGES) - {"ar_student", "drafter"})
    for stage in order:
        assert all(order.index(up) < order.index(stage) for up in graph[stage])


def test_a_student_started_from_the_teacher_reads_the_teacher(config):
    warm = config.replace(student=config_lib.StudentConfig(init_from_teacher=True))
    assert dag.inputs(warm, "student") == ("prepare", "vocab", "encode_distilled", "teacher")
    assert dag.stage_key(warm, "student") != dag.stage_key(config, "student")
    assert dag.stage_key(warm, "teacher") == dag.stage_key(config, "teacher")


def test_the_ar_student_runs_when_a_method_decodes_with_it_on_the_students_data(config):
    assert "ar_student" not in dag.active_stages(config)
    assert "ar_student" not in dag.inputs(config, "decode")
    with pytest.raises(config_lib.ConfigError, match=r"'ar_student' is not part of this "
                       r"config's run \(no decode method has model: ar_student\)"):
        plan.plan(config, only="ar_student")
    ar = config.replace(decode=config_lib.DecodeConfig(methods=(
        config_lib.DecodeMethod("g", "ar_greedy", model="ar_student"),)))
    assert "ar_student" in [row["stage"] for row in plan.describe(ar)]  # `padir status`
    assert dag.inputs(ar, "decode") == ("prepare", "vocab", "teacher", "student", "ar_student")
    assert dag.inputs(ar, "ar_student") == dag.inputs(ar, "student") == \
        ("prepare", "vocab", "encode_distilled")
    off = ar.replace(distill=config_lib.DistillConfig(enabled=False))
    assert dag.inputs(off, "ar_student") == ("prepare", "vocab", "encode")
    warm = ar.replace(ar_student=config_lib.ARStudentConfig(init_from_teacher=True))
    assert dag.inputs(warm, "ar_student") == ("prepare", "vocab", "encode_distilled", "teacher")
    # Its section changes its key and decode's (and score's, which reads decode), nothing
    # else; and no key at all while no method decodes with it.
    for base, changed in ((ar, {"ar_student", "decode", "score"}), (config, {"ar_student"})):
        longer = base.replace(ar_student=config_lib.ARStudentConfig(steps=7))
        assert {stage for stage in dag.STAGES
                if dag.stage_key(longer, stage) != dag.stage_key(base, stage)} == changed


def test_the_drafter_runs_when_a_method_drafts_with_it_on_the_students_data(config):
    assert "drafter" not in dag.active_stages(config)
    assert "drafter" not in dag.inputs(config, "decode")
    with pytest.raises(config_lib.ConfigError, match=r"'drafter' is not part of this "
                       r"config's run \(no decode method has kind: draft_verify\)"):
        plan.plan(config, only="drafter")
    drafted = config.replace(decode=config_lib.DecodeConfig(methods=(
        config_lib.DecodeMethod("dv", "draft_verify", iterations=1),)))
    order = [row["stage"] for row in plan.describe(drafted)]  # `padir status`
    # After the students it trains beside, before decode: the flow runs one at a time.
    assert order[order.index("student") + 1:] == ["drafter", "decode", "score"]
    assert dag.inputs(drafted, "decode") == ("prepare", "vocab", "teacher", "student",
                                             "drafter")
    # It starts from the teacher by default, on the students' data.
    assert dag.inputs(drafted, "drafter") == ("prepare", "vocab", "encode_distilled", "teacher")
    off = drafted.replace(distill=config_lib.DistillConfig(enabled=False),
                          drafter=config_lib.DrafterConfig(init_from_teacher=False))
    assert dag.inputs(off, "drafter") == dag.inputs(off, "student") == \
        ("prepare", "vocab", "encode")
    # Its section changes its key and decode's (and score's), nothing else; and no key at
    # all while no method drafts with it.
    for base, changed in ((drafted, {"drafter", "decode", "score"}), (config, {"drafter"})):
        wider = base.replace(drafter=config_lib.DrafterConfig(block=4))
        assert {stage for stage in dag.STAGES
                if dag.stage_key(wider, stage) != dag.stage_key(base, stage)} == changed


def test_a_cycle_or_an_unknown_input_is_an_error():
    with pytest.raises(config_lib.ConfigError, match="cycle"):
        plan.topological_order({"a": ("b",), "b": ("a",)})
    with pytest.raises(config_lib.ConfigError, match="unknown stage 'nope'"):
        plan.topological_order({"a": ("nope",)})


def test_the_distill_switch_decides_what_the_student_trains_on(config):
    off = config.replace(distill=config_lib.DistillConfig(enabled=False))
    assert config.distill.enabled and dag.student_data(config) == "encode_distilled"
    assert dag.inputs(config, "student") == ("prepare", "vocab", "encode_distilled")
    assert dag.inputs(off, "student") == ("prepare", "vocab", "encode")
    assert dag.inputs(config, "teacher") == dag.inputs(off, "teacher") == \
        ("prepare", "vocab", "encode")
    assert set(dag.active_stages(config)) - set(dag.active_stages(off)) == {
        "distill", "encode_distilled"}
    assert [s.stage for s in plan.plan(off)] == plan.topological_order(dag.graph(off))
    assert "distill" not in [s.stage for s in plan.plan(off)]
    assert plan.downstream("distill", dag.graph(config)) == \
        ["distill", "encode_distilled", "student", "decode", "score"]
    # The switch moves the student and what reads it, never the teacher or the data.
    for stage in ("prepare", "vocab", "encode", "teacher"):
        assert dag.stage_key(off, stage) == dag.stage_key(config, stage)
    for stage in ("student", "decode", "score"):
        assert dag.stage_key(off, stage) != dag.stage_key(config, stage)
    # Off, the student's key is what it was before distillation was a stage.
    assert dag.stage_key(off, "student") == config_lib.stable_hash({
        "stage": "student",
        "sections": {name: off.section_hash(name) for name in ("student", "seed")},
        "inputs": {name: dag.stage_key(off, name) for name in ("prepare", "vocab", "encode")}})
    # A distill setting changes the distilled data and the student, not the teacher; it
    # changes nothing when distillation is off.
    beam8 = config.replace(distill=config_lib.DistillConfig(beam_size=8))
    assert dag.stage_key(beam8, "teacher") == dag.stage_key(config, "teacher")
    assert dag.stage_key(beam8, "encode_distilled") != dag.stage_key(config, "encode_distilled")
    assert dag.stage_key(beam8, "student") != dag.stage_key(config, "student")
    off8 = off.replace(distill=config_lib.DistillConfig(enabled=False, beam_size=8))
    assert dag.stage_key(off8, "student") == dag.stage_key(off, "student")
    with pytest.raises(config_lib.ConfigError, match="not part of this config's run"):
        plan.plan(off, only="distill")


def test_nothing_built_runs_everything(config):
    steps = plan.plan(config)
    assert [s.stage for s in steps] == plan.topological_order(dag.graph(config))
    assert all(s.run and s.reason == "no complete artifact" for s in steps)
    assert all(s.uri == dag.output_uri(config, s.stage) for s in steps)


def test_complete_stages_are_reused_and_a_missing_one_reruns_with_its_dependents(config):
    graph = dag.graph(config)
    for stage in plan.topological_order(graph):
        write_fake_artifact(config, stage)
    assert not any(s.run for s in plan.plan(config))
    stage = dag.STAGES["encode"].inputs[-1]  # an inner stage
    shutil.rmtree(dag.output_uri(config, stage))
    running = [s.stage for s in plan.plan(config) if s.run]
    assert running == plan.downstream(stage, graph)


def test_from_force_and_only_select_stages(config):
    graph = dag.graph(config)
    for stage in plan.topological_order(graph):
        write_fake_artifact(config, stage)
    assert [s.stage for s in plan.plan(config, from_stage="student") if s.run] == \
        plan.downstream("student", graph)
    assert [s.stage for s in plan.plan(config, force=["vocab"]) if s.run] == \
        plan.downstream("vocab", graph)
    only = plan.plan(config, only="vocab")
    assert [(s.stage, s.run) for s in only] == [("vocab", False)]
    assert plan.plan(config, only="vocab", force=["vocab"])[0].reason == "forced"
    with pytest.raises(config_lib.ConfigError, match="--only: unknown stage .vocabulary."):
        plan.plan(config, only="vocabulary")


def test_only_refuses_a_stage_whose_inputs_are_missing(config):
    with pytest.raises(config_lib.ConfigError, match="--only encode: its input stage") as error:
        plan.plan(config, only="encode")
    assert all(repr(name) in str(error.value) for name in dag.STAGES["encode"].inputs)


def test_describe_and_padir_status_show_state_key_and_headline_metrics(config, tmp_path,
                                                                       capsys):
    write_fake_artifact(config, "prepare")
    rows = {row["stage"]: row for row in plan.describe(config)}
    assert rows["prepare"]["state"] == "complete" and rows["prepare"]["next"] == "reuse"
    assert rows["prepare"]["metrics"] == {"dev.bleu": 12.3457, "dev.loss": 2.5}
    assert rows["vocab"]["state"] == "missing"
    assert rows["vocab"]["next"] == "run (no complete artifact)"

    path = tmp_path / "c.yaml"
    path.write_text(config_lib.dump(config))
    assert cli.main(["status", str(path)]) == 0
    out = capsys.readouterr().out
    width = max(map(len, dag.active_stages(config)))
    assert f"{'prepare':{width}} complete {dag.stage_key(config, 'prepare')}" in out
    assert f"{'encode_distilled':{width}} missing " in out
    assert "dev.bleu=12.3457" in out and "x" * 80 not in out
    wall = rows["prepare"]["wall_seconds"]
    assert wall is not None and rows["vocab"]["wall_seconds"] is None
    assert f"1 of {len(rows)} stages complete" in out


@pytest.mark.parametrize("seconds, shown", [
    (None, "-"), (7.46, "7.5s"), (61.4, "1m01s"), (25 * 60 + 3, "25m03s"), (3720, "1h02m")])
def test_status_shows_durations_briefly(seconds, shown):
    assert cli._duration(seconds) == shown


def test_padir_report_says_clearly_when_there_is_none_yet(config, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(config_lib.dump(config))
    assert cli.main(["report", str(path)]) == 1
    assert "no report" in capsys.readouterr().err
