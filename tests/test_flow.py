"""flows/flow.py: the Prefect flow over the stage DAG, its caching, failures and retries.

One end-to-end test runs the real stages on tiny data through Prefect. The other scenarios
swap `flows.stages.run_stage` (what both the CLI and the flow call) for a fake that writes a manifest-only artifact: they test the
flow's decisions (what runs, what is cached, what a failure leaves), not the stages. All
share one temporary Prefect API (`prefect_harness`, tests/conftest.py).
"""

import os
import shutil
import time

import pytest

from components import artifacts, dag
from components import config as config_lib
from flows import cli, flow, plan
from flows import stages as stages_lib
from gcs_emulator import gcs, gcs_server  # noqa: F401 (fixtures)
from tiny_experiment import tiny_config

pytestmark = pytest.mark.usefixtures("prefect_harness")

# The tiny experiment with a few carved dev/test pairs (not Multi30k's 1000-sentence sets),
# one length bucket, phase 1 only (test_stages.py covers phase 2) and two decoding
# methods: the run is dominated by JAX compilations, and these cut their number. No
# distillation: a 3-step teacher's translations never reach EOS and would all be rejected
# (tests/test_distill.py runs those stages; the fake-stage tests below plan them).
FAST = ("data.dev=null", "data.test=[]", "data.carve_dev_fraction=0.05",
        "data.carve_test_fraction=0.05", "encode.bucket_boundaries=[64]",
        "student.phase2_steps=0", "decode.max_sentences=4", "decode.throughput_batch_size=4",
        "distill.enabled=false",
        "decode.methods=[{name: greedy, kind: ar_greedy}, "
        "{name: padir, kind: refine, iterations: 2}]")


class FakeStages:
    """Stands in for `stages.run_stage`: records each call and publishes a small artifact
    (reading its inputs first, like a real stage); raises the queued errors of a stage."""

    def __init__(self):
        self.calls: list[str] = []
        self.errors: dict[str, list[BaseException]] = {}

    def __call__(self, name, config, pipeline_args=()):
        self.calls.append(name)
        inputs = {up: dag.require_input(config, up).uri for up in dag.inputs(config, name)}
        with artifacts.write(config.workdir, name, dag.stage_key(config, name),
                             config=dag.section_values(config, name), inputs=inputs) as out:
            fs, path = artifacts.filesystem(out.path("output.txt"))
            with fs.open(path, "w") as f:
                f.write(name)
            if self.errors.get(name):
                raise self.errors[name].pop(0)
            out.counts["pairs"] = 3
            out.metrics["dev"] = {"bleu": 12.5}
            if name == plan.REPORT_STAGE:
                with fs.open(out.path(plan.REPORT_FILE), "w") as f:
                    f.write("# PaDIR report\n\n| method | BLEU |\n|---|---|\n| padir | 12.5 |\n")
        return artifacts.read(dag.output_uri(config, name))


@pytest.fixture
def fake(monkeypatch):
    stages = FakeStages()
    monkeypatch.setattr(stages_lib, "run_stage", stages)
    monkeypatch.setattr(flow, "stage_task",
                        flow.stage_task.with_options(retry_delay_seconds=0))
    return stages


@pytest.fixture
def fake_config(tmp_path) -> str:
    path = tmp_path / "fake.yaml"
    path.write_text(f"workdir: {tmp_path}/work\n"
                    "data: {source_lang: en, target_lang: de,\n"
                    "       train: {source: unused.en, target: unused.de}}\n"
                    # A method of the AR student's and one of the drafter's: every
                    # registered stage is in the run.
                    "decode: {methods: [{name: g, kind: ar_greedy, model: ar_student},\n"
                    "                   {name: dv, kind: draft_verify}]}\n")
    return str(path)


def run_flow(config_path, overrides=(), **selection):
    """The flow's final state (the flow is not raised through, so tests can inspect it)."""
    return flow.padir_pipeline(config_path, list(overrides), return_state=True,
                                   **selection)


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _of_flow_run(state):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))


def task_states(flow_state, expected: int, timeout: float = 30) -> dict[str, str]:
    """Stage -> final task run state name ("Completed", "Cached", "Failed") of a flow run.

    Polled: the API records task runs from events, a moment after the flow returns.
    """
    deadline = time.monotonic() + timeout
    with _client() as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=_of_flow_run(flow_state))
            states = {run.name: run.state.name for run in runs
                      if run.state is not None and run.state.is_final()}
            if len(states) >= expected or time.monotonic() > deadline:
                return states
            time.sleep(0.25)


def artifact_keys(flow_state) -> set[str]:
    with _client() as client:
        return {a.key for a in client.read_artifacts(flow_run_filter=_of_flow_run(flow_state))}


def order_of(config_path) -> list[str]:
    """The stages a run of this config computes, in the flow's order."""
    return plan.topological_order(dag.graph(config_lib.load(config_path)))


def downstream(config_path, stage: str) -> list[str]:
    return plan.downstream(stage, dag.graph(config_lib.load(config_path)))


# --- the real stages ----------------------------------------------------------------------


def test_every_registered_stage_names_a_function_the_cli_offers():
    for name, spec in dag.STAGES.items():
        assert callable(stages_lib.entry_point(name)), spec.entry
        assert cli.build_parser().parse_args(["stage", name, "c.yaml"]).name == name


def test_the_flow_runs_every_stage_then_reuses_them_all(tmp_path, monkeypatch):
    config = tiny_config(str(tmp_path), *FAST)
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(config_lib.dump(config))
    ran = []

    def spy(name, config, pipeline_args=(), run_stage=stages_lib.run_stage):
        ran.append(name)
        return run_stage(name, config, pipeline_args)

    monkeypatch.setattr(stages_lib, "run_stage", spy)
    order = order_of(str(config_path))
    assert not {"distill", "encode_distilled"} & set(order)  # switched off: not run

    state = run_flow(str(config_path))
    assert state.is_completed(), state.message
    uris = state.result()
    assert ran == order and list(uris) == order
    for stage in order:
        artifact = artifacts.read(uris[stage])
        assert artifact.uri == dag.output_uri(config, stage)
        assert artifact.manifest["key"] == dag.stage_key(config, stage)
        assert artifact.manifest["counts"]  # every stage reports what it did
        assert os.path.isfile(os.path.join(artifact.uri, "config.yaml"))
        assert os.path.isfile(os.path.join(config.workdir, ".prefect", "results",
                                           f"{stage}-{artifact.key}"))
    assert set(task_states(state, len(order)).values()) == {"Completed"}
    assert artifact_keys(state) >= {flow.artifact_key(stage) for stage in order}

    ran.clear()
    again = run_flow(str(config_path))
    assert again.is_completed() and again.result() == uris
    assert ran == []
    assert task_states(again, len(order)) == {stage: "Cached" for stage in order}


# --- the flow's decisions, with fake stages -----------------------------------------------


def test_a_changed_section_reruns_its_stage_and_downstream_only(fake, fake_config):
    run_flow(fake_config)
    fake.calls.clear()
    state = run_flow(fake_config, ["student.phase1_steps=7"])
    assert state.is_completed()
    assert fake.calls == downstream(fake_config, "student")
    states = task_states(state, len(dag.STAGES))
    assert {s for s, name in states.items() if name == "Cached"} == \
        set(dag.STAGES) - set(downstream(fake_config, "student"))


def test_a_deleted_output_reruns_that_stage_and_its_dependents(fake, fake_config):
    first = run_flow(fake_config).result()
    stage = dag.STAGES["encode"].inputs[-1]  # an inner stage, with dependents
    shutil.rmtree(first[stage])
    fake.calls.clear()
    state = run_flow(fake_config)
    assert fake.calls == downstream(fake_config, stage)
    assert state.result() == first  # same keys, same places
    assert artifacts.is_complete(first[stage])
    states = task_states(state, len(dag.STAGES))
    assert {s for s, name in states.items() if name == "Completed"} == \
        set(downstream(fake_config, stage))


def test_a_failing_stage_fails_the_flow_by_name_and_a_rerun_continues_from_it(fake,
                                                                             fake_config):
    config = config_lib.load(fake_config)
    failing = "encode"
    fake.errors[failing] = [ValueError("shard 3 is corrupt")]
    state = run_flow(fake_config)
    assert state.is_failed()
    assert f"stage '{failing}' failed: ValueError: shard 3 is corrupt" in state.message
    with pytest.raises(flow.StageFailed, match=f"stage '{failing}'"):
        state.result()
    order = order_of(fake_config)
    before = order[:order.index(failing)]
    assert fake.calls == before + [failing]  # nothing after it ran
    assert not artifacts.is_complete(dag.output_uri(config, failing))
    assert os.listdir(os.path.join(config.workdir, failing)) == []  # no temporary left
    assert f"padir-{failing}" not in artifact_keys(state)
    assert task_states(state, len(before) + 1)[failing] == "Failed"

    fake.calls.clear()
    rerun = run_flow(fake_config)
    assert rerun.is_completed()
    assert fake.calls == downstream(fake_config, failing)
    states = task_states(rerun, len(dag.STAGES))
    assert all(states[stage] == "Cached" for stage in before)


def test_transient_io_errors_are_retried_and_others_are_not(fake, fake_config):
    fake.errors["vocab"] = [ConnectionResetError("storage went away")]
    assert run_flow(fake_config, only=None).is_completed()
    assert fake.calls.count("vocab") == 2

    fake.calls.clear()
    fake.errors["vocab"] = [config_lib.ConfigError("vocab.size: too small")]
    state = run_flow(fake_config, force=["vocab"])
    assert state.is_failed() and fake.calls.count("vocab") == 1
    assert flow.is_transient(TimeoutError()) and flow.is_transient(OSError(5, "EIO"))
    assert not flow.is_transient(artifacts.IncompleteArtifactError("no manifest"))


def test_a_complete_artifact_built_outside_prefect_is_adopted_not_recomputed(fake,
                                                                            fake_config):
    config = config_lib.load(fake_config)
    for stage in order_of(fake_config):
        fake(stage, config)
    fake.calls.clear()
    state = run_flow(fake_config)
    assert state.is_completed() and fake.calls == []
    assert set(task_states(state, len(dag.STAGES)).values()) == {"Completed"}
    again = run_flow(fake_config)
    assert set(task_states(again, len(dag.STAGES)).values()) == {"Cached"}


def test_a_remote_workdir_keeps_its_cache_records_next_to_its_artifacts(fake, gcs, tmp_path):
    workdir = gcs.uri(tmp_path.name, "work")  # a bucket of the GCS emulator
    path = tmp_path / "remote.yaml"
    path.write_text(f"workdir: {workdir}\n"
                    "data: {source_lang: en, target_lang: de,\n"
                    "       train: {source: unused.en, target: unused.de}}\n")
    assert run_flow(str(path)).is_completed()
    fs, records = artifacts.filesystem(artifacts.join(workdir, *flow.RESULTS_DIR))
    stages = dag.active_stages(config_lib.load(str(path)))
    assert len(fs.ls(records)) == len(stages)
    fake.calls.clear()
    again = run_flow(str(path))
    assert fake.calls == []
    assert set(task_states(again, len(stages)).values()) == {"Cached"}


def test_from_and_only_select_what_runs(fake, fake_config):
    run_flow(fake_config)
    fake.calls.clear()
    assert run_flow(fake_config, from_stage="student").is_completed()
    assert fake.calls == downstream(fake_config, "student")
    fake.calls.clear()
    only = run_flow(fake_config, only="vocab", force=["vocab"])
    assert fake.calls == ["vocab"] and list(only.result()) == ["vocab"]


def test_manifests_and_the_report_become_prefect_artifacts(fake, fake_config):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    state = run_flow(fake_config)
    keys = artifact_keys(state)
    assert {flow.artifact_key(stage) for stage in dag.STAGES} | {"padir-report"} <= keys
    with _client() as client:
        (table,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["padir-vocab"])),
            flow_run_filter=_of_flow_run(state))
        (report,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["padir-report"])),
            flow_run_filter=_of_flow_run(state))
    assert table.type == "table" and "counts.pairs" in str(table.data)
    assert report.type == "markdown" and "# PaDIR report" in report.data


def test_padir_run_prints_the_outputs_and_padir_report_the_report(fake, fake_config,
                                                                  monkeypatch, capsys):
    for name in ("PREFECT_SERVER_EPHEMERAL_ENABLED", "PREFECT_SERVER_ANALYTICS_ENABLED"):
        monkeypatch.delenv(name, raising=False)  # `padir run` sets them; restored afterwards
    config = config_lib.load(fake_config)
    assert cli.main(["run", fake_config]) == 0
    out = capsys.readouterr().out
    for stage in dag.STAGES:
        assert dag.output_uri(config, stage) in out
    report = plan.report_path(config)
    assert f"report: {report}" in out

    assert cli.main(["report", fake_config]) == 0
    assert capsys.readouterr().out.startswith(f"{report}\n\n# PaDIR report")

    fake.errors["vocab"] = [ValueError("bad")]
    assert cli.main(["run", fake_config, "--force", "vocab"]) == 1
    assert "stage 'vocab' failed: ValueError: bad" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", fake_config, "--only", "nope"])


def test_with_lanes_independent_stages_run_side_by_side_each_on_its_cores(fake, fake_config,
                                                                         monkeypatch):
    """Every stage the run computes goes to a lane (`lanes.run`, here the fake stage in the
    task's thread, slowed down); the trainings after encode_distilled overlap on one core
    each and decode starts after all of them."""
    spans: dict[str, tuple[float, float, tuple[int, ...]]] = {}

    def lane(stage, config_path, overrides, cores):
        started = time.monotonic()
        time.sleep(0.3)
        fake(stage, config_lib.load(config_path, overrides))
        spans[stage] = (started, time.monotonic(), tuple(cores))

    monkeypatch.setattr(flow.lanes_lib, "run", lane)
    monkeypatch.setattr(flow.lanes_lib, "available_cores", lambda: (0, 1))
    state = run_flow(fake_config, lanes=2)
    assert state.is_completed(), state.message
    assert list(state.result()) == order_of(fake_config)
    trainings = ("student", "ar_student", "drafter")
    assert sorted(spans[stage][2] for stage in trainings) in ([(0,), (0,), (1,)],
                                                              [(0,), (1,), (1,)])
    overlapping = [(a, b) for a in trainings for b in trainings
                   if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]]
    assert overlapping and all(spans[a][2] != spans[b][2] for a, b in overlapping)
    assert spans["decode"][0] >= max(spans[stage][1] for stage in trainings)
    assert spans["teacher"][2] == spans["decode"][2] == (0, 1)  # alone: every core
    assert set(task_states(state, len(dag.STAGES)).values()) == {"Completed"}

    again = run_flow(fake_config, lanes=2)  # nothing left to compute: all cached
    assert again.is_completed() and again.result() == state.result()
    assert set(task_states(again, len(dag.STAGES)).values()) == {"Cached"}


def test_with_lanes_a_failing_stage_stops_new_starts_and_those_beside_it_finish(
        fake, fake_config, monkeypatch):
    def lane(stage, config_path, overrides, cores):
        time.sleep(0.3 if stage == "student" else 0.0)  # still running when ar_student fails
        fake(stage, config_lib.load(config_path, overrides))

    monkeypatch.setattr(flow.lanes_lib, "run", lane)
    monkeypatch.setattr(flow.lanes_lib, "available_cores", lambda: (0, 1))
    fake.errors["ar_student"] = [ValueError("diverged")]
    state = run_flow(fake_config, lanes=2)
    assert state.is_failed()
    assert "stage 'ar_student' failed: ValueError: diverged" in state.message
    assert {"student", "ar_student"} <= set(fake.calls)
    assert not {"drafter", "decode"} & set(fake.calls)  # not started after the failure
    assert artifacts.is_complete(dag.output_uri(config_lib.load(fake_config), "student"))
