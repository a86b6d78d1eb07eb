"""The pipeline on `gs://` through the real clients (gcsfs, Beam's GcsIO, orbax/tensorstore)
against fake-gcs-server on loopback (tests/gcs_emulator.py): the server's preconditions, the
lease between processes, the data stages with their corpora in the bucket (the same files,
byte for byte, as on local disk), a Beam stage SIGKILLed and rerun, a Beam stage whose
lease is taken over mid-job (exit status 3, nothing of its own left), the whole tiny DAG
through `padir run` (equal to local disk's, rerun all Cached), checkpoints (the teacher
SIGKILLed and resumed bitwise from the bucket), and the errors a bucket answers with. What the emulator cannot show: docs/gcs.md.
"""

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import fsspec
import pytest

from benchmarks import faults, leases
from components import artifacts, corpus, dag
from components import config as config_lib
from flows import flow
from pipelines import prepare
from gcs_emulator import gcs, gcs_faults, gcs_server  # noqa: F401 (fixtures)
from test_flow import FAST, task_states
from tiny_experiment import DATA_ROOT, ensure, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_STAGES = ("prepare", "vocab", "encode")


def _multipart(name: str, data: bytes) -> tuple[bytes, dict[str, str]]:
    body = (b"--B\r\nContent-Type: application/json\r\n\r\n" + json.dumps({"name": name}).encode()
            + b"\r\n--B\r\nContent-Type: application/octet-stream\r\n\r\n" + data
            + b"\r\n--B--\r\n")
    return body, {"Content-Type": "multipart/related; boundary=B"}


# --- the server's fidelity where the pipeline relies on it ---------------------------------


def test_the_server_refuses_a_second_create_if_absent(gcs):
    """What makes the lease tests mean anything: `ifGenerationMatch=0` on an existing object
    is refused with 412, on the multipart uploads that the lease and gcsfs use."""
    name = f"{uuid.uuid4().hex[:8]}/lease"
    path = f"/upload/storage/v1/b/{gcs.bucket}/o?uploadType=multipart&ifGenerationMatch=0"
    assert gcs.request("POST", path, *_multipart(name, b"first"))[0] == 200
    assert gcs.request("POST", path, *_multipart(name, b"second"))[0] == 412
    fs, key = artifacts.filesystem(gcs.uri(name))
    with pytest.raises(FileExistsError):
        fs.pipe_file(key, b"third", mode="create")
    assert fs.cat_file(key) == b"first"


def test_every_precondition_the_pipeline_relies_on_is_checked(gcs_faults):
    """GCS answers 412 to a request whose `ifGenerationMatch` misses the object's live
    generation: on every upload type, a rewrite's destination, a read and a delete. The
    tests see it from the emulator (multipart uploads) or from the proxy in front of it
    (the rest, which the emulator ignores: docs/gcs.md)."""
    gcs, _ = gcs_faults
    name = f"{uuid.uuid4().hex[:8]}/object"
    quoted = name.replace("/", "%2F")
    upload = f"/upload/storage/v1/b/{gcs.bucket}/o"
    status, body = gcs.request("POST", f"{upload}?uploadType=multipart&ifGenerationMatch=0",
                               *_multipart(name, b"first"))
    assert status == 200
    live = json.loads(body)["generation"]
    o = f"/storage/v1/b/{gcs.bucket}/o/{quoted}"
    assert gcs.request("POST", f"{upload}?uploadType=media&name={name}&ifGenerationMatch=0",
                       b"second")[0] == 412
    assert gcs.request("POST", f"{o}/rewriteTo/b/{gcs.bucket}/o/{quoted}?ifGenerationMatch=0",
                       b"{}", {"Content-Type": "application/json"})[0] == 412
    assert gcs.request("GET", f"{o}?alt=media&ifGenerationMatch=1")[0] == 412
    assert gcs.request("DELETE", f"{o}?ifGenerationMatch=1")[0] == 412
    assert gcs.request("GET", f"{o}?alt=media&ifGenerationMatch={live}") == (200, b"first")
    assert gcs.request("DELETE", f"{o}?ifGenerationMatch={live}")[0] in (200, 204)


def test_every_lease_write_and_delete_is_a_conditional_multipart_request(gcs_faults):
    gcs, proxy = gcs_faults
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    with artifacts.lease(workdir, "vocab", "k"):
        pass
    lease = [(method, path) for method, path in proxy.requests if "lease-k" in path
             or (method == "POST" and path.startswith("/upload/"))]
    assert [method for method, _ in lease] == ["POST", "DELETE"]
    assert all("ifGenerationMatch=" in path for _, path in lease)
    assert "uploadType=multipart" in lease[0][1]


# --- one writer per key, between processes -------------------------------------------------

HOLD = """
import sys, time
from components import artifacts
with artifacts.lease(sys.argv[1], "teacher", "k"):
    print("HELD", flush=True)
    time.sleep(120)
"""


def test_a_live_holder_is_named_and_a_killed_one_taken_over(gcs_faults, caplog):
    gcs, _ = gcs_faults
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, workdir], cwd=REPO,
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(artifacts.LeaseHeldError,
                           match=rf"teacher/k is being written by another run \(pid "
                                 rf"{holder.pid} on "):
            with artifacts.lease(workdir, "teacher", "k"):
                pytest.fail("took a held lease")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    fs, path = artifacts.filesystem(artifacts.lease_uri(workdir, "teacher", "k"))
    assert fs.exists(path)  # a killed run's lease stays in the bucket ...
    with caplog.at_level("WARNING", logger="components.artifacts"):
        with artifacts.lease(workdir, "teacher", "k"):  # ... and is taken over at once
            pass
    assert f"taking over the lease of a run that died (pid {holder.pid} on" in caplog.text
    fs.invalidate_cache()
    assert not fs.exists(path)


# Several runs that find the same stale lease, all taking it over at once.
TAKE = """
import sys
from components import artifacts
print("READY", flush=True)
sys.stdin.readline()
try:
    with artifacts.lease(sys.argv[1], "teacher", "k"):
        print("WON", flush=True)
        sys.stdin.readline()
except artifacts.LeaseHeldError:
    print("HELD", flush=True)
"""


def test_of_several_runs_taking_over_one_stale_lease_exactly_one_wins(gcs_faults):
    """Each reads the stale generation (a holder that died on this host) and writes over
    it on that generation: GCS lets one write through and refuses the others (412), which
    then find a live holder."""
    gcs, _ = gcs_faults
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    fs, path = artifacts.filesystem(artifacts.lease_uri(workdir, "teacher", "k"))
    died = subprocess.Popen(["true"])
    died.wait()
    fs.pipe_file(path, json.dumps({"host": socket.gethostname(), "pid": died.pid,
                                   "boot": artifacts._boot_id(),
                                   "pidns": artifacts._pid_namespace(),
                                   "run": "died"}).encode())
    takers = [subprocess.Popen([sys.executable, "-c", TAKE, workdir], cwd=REPO, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               env=dict(os.environ, PYTHONPATH=REPO)) for _ in range(4)]
    try:
        assert [taker.stdout.readline() for taker in takers] == ["READY\n"] * 4
        for taker in takers:
            taker.stdin.write("go\n")
            taker.stdin.flush()
        outcomes = sorted(taker.stdout.readline().strip() for taker in takers)
    finally:
        for taker in takers:
            taker.stdin.close()
            taker.wait(timeout=60)
    assert outcomes == ["HELD", "HELD", "HELD", "WON"]


@pytest.mark.slow  # two writers in child interpreters, one paused for twice the stale period
@pytest.mark.parametrize("at", [0.1, "publishing"])
def test_a_writer_paused_past_the_stale_period_publishes_nothing(gcs_faults, at):
    """A writer is paused (SIGSTOP) in its body, or just as it publishes, for twice the
    stale period; a second writer of the key takes the lease over and publishes, replacing
    the artifact that was there, while a reader reads it; the first resumes (SIGCONT). It
    stops or keeps the other's artifact: the published artifact is whole, the second
    writer's, and the reader never met a missing or torn file (benchmarks/leases.py runs
    this at random moments). Which of its paths the first took depends on where the pause
    fell; test_artifacts.py's publish-branch tests take each one at a chosen point."""
    gcs, _ = gcs_faults
    stale = 3.0  # its holders give up after 1.5 s without a renewal: slack for a busy CI
    plan = leases.Plan(action="pause", at=at, pause=2 * stale, second_after=0.1, body=0.3,
                       prepublished=True)
    trial = leases.run_trial(gcs.uri(uuid.uuid4().hex[:8], "work"),
                             dict(os.environ, PYTHONPATH=REPO), plan, stale)
    assert trial.violations == [] and trial.reader_anomalies == []
    assert trial.outcomes[0] in ("LOST", "KEPT", "PUBLISHED") and \
        trial.outcomes[1] == "PUBLISHED", trial.outcomes


@pytest.mark.dag
def test_a_beam_stage_whose_lease_is_taken_over_mid_job_stops_with_exit_status_3(
        gcs_faults, tmp_path, monkeypatch, capsys):
    """The prepare job on the FnApiRunner, as in production: at its 50th pair another run
    takes the lease over (as it would from a holder paused past the stale period) and
    holds it; the job's next renewal finds it, and the stage stops there, its job
    unfinished, with one line and exit status 3, leaving nothing of its own. The other run
    then publishes, and the key holds its artifact."""
    gcs, _ = gcs_faults
    config = _gs_config(gcs, tmp_path)
    path = tmp_path / "gs.yaml"
    path.write_text(config_lib.dump(config))
    key = dag.stage_key(config, "prepare")
    monkeypatch.setattr(artifacts, "LEASE_RENEW_SECONDS", 0.05)
    stopped, took, publish_theirs, theirs = threading.Event(), threading.Event(), \
        threading.Event(), {}
    stop = artifacts._Stopper.stop

    def stop_and_tell(self, reason):
        stop(self, reason)
        stopped.set()

    def other_run():
        try:
            with artifacts.write(config.workdir, "prepare", key, config={}, inputs={}) as out:
                with fsspec.open(out.path("theirs.txt"), "w") as f:
                    f.write("theirs")
                out.counts["theirs"] = 1
                theirs["tmp"] = out.tmp_uri.rsplit("/", 1)[-1]
                took.set()
                publish_theirs.wait(120)
        except BaseException as e:  # reported by the test's thread
            theirs["error"] = e
            took.set()

    other = threading.Thread(target=other_run)
    pairs, clean_pair = itertools.count(1), corpus.clean_pair

    def take_over_at_the_50th_pair(raw, settings):
        if next(pairs) == 50:
            with monkeypatch.context() as stale:
                stale.setattr(artifacts, "_is_stale", lambda holder, age: True)
                other.start()
                took.wait(60)
            stopped.wait(60)  # the stop lands at the stage's thread's next instruction
        return clean_pair(raw, settings)

    monkeypatch.setattr(artifacts._Stopper, "stop", stop_and_tell)
    monkeypatch.setattr(corpus, "clean_pair", take_over_at_the_50th_pair)
    finished = []
    monkeypatch.setattr(prepare, "finish", lambda *args: finished.append(args))
    try:
        assert prepare.main(["--config", str(path)]) == 3
        assert "error" not in theirs and stopped.is_set()
        assert finished == []  # stopped inside the job, not at its end
        assert re.fullmatch(rf"prepare: prepare/{key}: its lease was taken over by another "
                            rf"run \(pid {os.getpid()} on .+ since .+\); this run stopped\n",
                            capsys.readouterr().err)
        fs, stage_path = artifacts.filesystem(artifacts.join(config.workdir, "prepare"))
        fs.invalidate_cache()
        # Nothing of its own is left: the lease and the work are the other run's.
        assert sorted(name.rsplit("/", 1)[-1] for name in fs.ls(stage_path, detail=False)) \
            == sorted([f".lease-{key}", theirs["tmp"]])
    finally:
        publish_theirs.set()
        other.join(120)
    artifact = artifacts.require(config.workdir, "prepare", key)
    assert artifact.manifest["counts"] == {"theirs": 1}
    assert sorted(name.rsplit("/", 1)[-1] for name in fs.ls(artifact.uri, detail=False)) == \
        ["manifest.json", "theirs.txt"]
    assert sorted(fs.ls(stage_path, detail=False)) == [artifacts.filesystem(artifact.uri)[1]]


# --- the data stages on gs:// --------------------------------------------------------------


def _gs_config(gcs, tmp_path, *overrides: str) -> config_lib.Config:
    """The tiny experiment with its workdir and its training corpus in the bucket."""
    root = gcs.uri(uuid.uuid4().hex[:8])
    tmp_path.mkdir(parents=True, exist_ok=True)
    corpus = {side: f"{root}/corpora/train.{side}.gz" for side in ("en", "de")}
    config = tiny_config(str(tmp_path), "data.test=[]", *overrides, f"workdir={root}/work",
                         f"data.train.source={corpus['en']}",
                         f"data.train.target={corpus['de']}")
    for side, uri in corpus.items():
        fs, path = artifacts.filesystem(uri)
        fs.put_file(os.path.join(DATA_ROOT, "multi30k", f"train.{side}.gz"), path)
    return config


def _download(uri: str, into: str) -> str:
    fs, path = artifacts.filesystem(uri)
    fs.invalidate_cache()
    fs.get(path.rstrip("/") + "/", into.rstrip("/") + "/", recursive=True)
    return into


@pytest.mark.dag
def test_the_data_stages_write_the_same_files_on_gs_as_on_local_disk(gcs_faults, tmp_path):
    gcs, _ = gcs_faults  # the proxy answers Beam's batch requests (tests/gcs_emulator.py)
    remote = _gs_config(gcs, tmp_path / "gs")
    (tmp_path / "local").mkdir()
    local = tiny_config(str(tmp_path / "local"), "data.test=[]")
    for config in (local, remote):
        ensure(config, *DATA_STAGES)
    for stage in DATA_STAGES:
        want = dag.output_uri(local, stage)
        got = _download(dag.output_uri(remote, stage), str(tmp_path / "got" / stage))
        # The config and the manifest name the workdir and the corpora: all else is equal.
        differ = faults.differences(stage, want, got)
        if stage == "vocab":  # the model records where it was trained: a path with the key
            assert [_pieces(os.path.join(root, "spm.model")) for root in (want, got)] == \
                [_pieces(os.path.join(want, "spm.model"))] * 2
            differ.remove("spm.model")
        assert differ == ["config.yaml", "manifest.json"], (stage, differ)
        manifests = [artifacts.read(uri).manifest for uri in (want, got)]
        assert [faults._unmeasured({k: m[k] for k in ("counts", "metrics")})
                for m in manifests] == [faults._unmeasured({k: manifests[0][k]
                                                            for k in ("counts", "metrics")})] * 2
        assert manifests[0]["counts"], stage


def _pieces(path: str) -> list[tuple[str, float]]:
    """A SentencePiece model's pieces and scores (not the paths of its training run)."""
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=path)
    return [(model.id_to_piece(i), model.get_score(i)) for i in range(model.get_piece_size())]


def _cli(env, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, **kwargs)


HELD_PREPARE = """
import pathlib, sys, time
from components import corpus
from flows import cli
clean_pair, seen = corpus.clean_pair, []
def held(raw, config):
    seen.append(raw.id)
    if len(seen) == 50:  # inside the Beam job, its lease held: say so, and wait to be killed
        pathlib.Path(sys.argv[1]).touch()
        time.sleep(600)
    return clean_pair(raw, config)
corpus.clean_pair = held
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.slow  # the stage, its rerun, `padir status` and `padir gc` in child interpreters
def test_a_pipeline_job_killed_on_gs_is_rerun_to_the_same_output_and_gc_clears_it(gcs_faults,
                                                                                  tmp_path):
    gcs, _ = gcs_faults
    config = _gs_config(gcs, tmp_path)
    path = tmp_path / "gs.yaml"
    path.write_text(config_lib.dump(config))
    env = dict(os.environ, PYTHONPATH=REPO)
    assert _cli(env, "stage", "prepare", str(path)).returncode == 0
    final = dag.output_uri(config, "prepare")
    reference = _download(final, str(tmp_path / "reference"))
    fs, _ = artifacts.filesystem(final)
    fs.rm(artifacts.filesystem(final)[1], recursive=True)
    fs.invalidate_cache()
    assert not fs.exists(artifacts.filesystem(final)[1])

    inside = tmp_path / "inside-the-job"  # the held job writes it at its 50th pair
    process = subprocess.Popen([sys.executable, "-c", HELD_PREPARE, str(inside), "stage",
                                "prepare", str(path)], cwd=REPO, env=env,
                               start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    key = dag.stage_key(config, "prepare")
    deadline = time.monotonic() + 120  # a hang guard, not a race: the job waits to be killed
    while process.poll() is None and time.monotonic() < deadline and not inside.exists():
        time.sleep(0.05)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the stage ended before it was killed"
    with pytest.raises(artifacts.IncompleteArtifactError):  # no reader sees a partial output
        artifacts.require(config.workdir, "prepare", key)
    left = artifacts.leftovers(config.workdir, ["prepare"])
    assert "lease" in {item.kind for item in left}
    status = _cli(env, "status", str(path))
    assert f"leftovers of runs that died ({len(left)};" in status.stdout
    gc = _cli(env, "gc", str(path))
    assert gc.returncode == 0 and f"{len(left)} leftovers removed" in gc.stdout, gc.stdout
    assert artifacts.leftovers(config.workdir, ["prepare"]) == []

    rerun = _cli(env, "stage", "prepare", str(path))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert faults.differences("prepare", reference,
                              _download(final, str(tmp_path / "rerun"))) == []
    assert artifacts.leftovers(config.workdir, ["prepare"]) == []


# --- the whole DAG on gs:// ----------------------------------------------------------------


def _gs_dag(gcs, tmp_path, *overrides: str) -> tuple[config_lib.Config, str]:
    """test_flow's fast tiny DAG with its workdir and training corpus in the bucket, and
    the path of its config file."""
    config = _gs_config(gcs, tmp_path, *FAST, *overrides)
    path = tmp_path / "gs.yaml"
    path.write_text(config_lib.dump(config))
    return config, str(path)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_the_dag_on_gs_equals_local_disk_and_reruns_cached(gcs_faults, tmp_path, monkeypatch,
                                                           capsys):
    from flows import cli, plan
    from flows import stages as stages_lib

    gcs, _ = gcs_faults  # the proxy answers Beam's batch requests
    for name in ("PREFECT_SERVER_EPHEMERAL_ENABLED", "PREFECT_SERVER_ANALYTICS_ENABLED"):
        monkeypatch.delenv(name, raising=False)  # `padir run` sets them; restored afterwards
    remote, path = _gs_dag(gcs, tmp_path / "gs")
    order = plan.topological_order(dag.graph(remote))
    assert cli.main(["run", path]) == 0
    out = capsys.readouterr().out
    assert all(dag.output_uri(remote, stage) in out for stage in order)
    report = plan.report_path(remote)
    assert report.startswith("gs://") and f"report: {report}" in out

    assert cli.main(["status", path]) == 0
    status = capsys.readouterr().out
    assert f"{len(order)} of {len(order)} stages complete" in status
    assert "leftovers" not in status
    assert cli.main(["report", path]) == 0
    fs, report_path = artifacts.filesystem(report)
    assert capsys.readouterr().out == f"{report}\n\n{fs.cat_file(report_path).decode()}\n"

    ran = []
    monkeypatch.setattr(stages_lib, "run_stage", lambda name, *args, **kwargs: ran.append(name))
    state = flow.padir_pipeline(path, [], return_state=True)
    assert state.is_completed() and ran == []
    assert task_states(state, len(order)) == {stage: "Cached" for stage in order}
    monkeypatch.undo()

    (tmp_path / "local").mkdir()
    local = tiny_config(str(tmp_path / "local"), *FAST)
    ensure(local, *order)
    for stage in order:
        want = dag.output_uri(local, stage)
        got = _download(dag.output_uri(remote, stage), str(tmp_path / "got" / stage))
        differ = faults.differences(stage, want, got)
        if stage == "vocab":  # the model records where it was trained (see above)
            differ.remove("spm.model")
        differ = [path for path in differ if not _same_but_commit_markers(want, got, path)]
        assert differ == ["config.yaml", "manifest.json"], (stage, differ)
    with open(tmp_path / "got" / "score" / "report.json") as f:  # from the bucket's event files
        assert json.load(f)["training"]["student"]["dev_curve"]


def _same_but_commit_markers(want: str, got: str, item: str) -> bool:
    """Whether two checkpoint items hold the same files, apart from orbax's commit markers,
    which name the path they were written to."""
    def files(root: str) -> dict[str, bytes]:
        found = {}
        for folder, _, names in os.walk(root):
            for name in names:
                if name != "commit_success.txt":
                    with open(os.path.join(folder, name), "rb") as f:
                        found[os.path.relpath(os.path.join(folder, name), root)] = f.read()
        return found

    a, b = os.path.join(want, item), os.path.join(got, item)
    return item.startswith("checkpoints/") and os.path.isdir(a) and files(a) == files(b)


# --- checkpoints ---------------------------------------------------------------------------


def test_a_checkpoint_saved_to_gs_restores_bitwise(gcs):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from model import checkpoints, train

    directory = gcs.uri(uuid.uuid4().hex[:8], "checkpoints")
    params = {"w": jax.random.normal(jax.random.key(0), (4, 3)), "b": jnp.arange(3.0)}
    state = train.TrainState(step=jnp.array(7, jnp.int32), params=params,
                             opt_state={"count": jnp.ones((), jnp.int32)},
                             rng=jax.random.PRNGKey(3))
    manager = checkpoints.open_manager(directory)
    checkpoints.save(manager, state, position=11)
    manager.wait_until_finished()
    manager.close()
    manager = checkpoints.open_manager(directory)
    restored = checkpoints.restore_latest(manager, jax.eval_shape(lambda: state))
    manager.close()
    assert restored.step == 7 and restored.position.batches == 11
    for want, got in zip(jax.tree_util.tree_leaves(state),
                         jax.tree_util.tree_leaves(restored.state)):
        assert np.asarray(want).dtype == np.asarray(got).dtype
        assert np.array_equal(np.asarray(want), np.asarray(got))


# The teacher stage held at its fifth batch: steps 1-4 done, the checkpoint of step 3 (the
# tiny loop checkpoints every 3) saved, and nothing after it, until the test kills it.
HELD_STAGE = """
import sys, time
from flows import cli
from model import input_pipeline
batches = input_pipeline.TrainingStream.batches
def held(self, start_position=0):
    for i, item in enumerate(batches(self, start_position)):
        if i == 4:
            time.sleep(600)
        yield item
input_pipeline.TrainingStream.batches = held
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_the_teacher_killed_on_gs_resumes_bitwise_from_the_bucket(gcs_faults, tmp_path):
    gcs, _ = gcs_faults
    config, path = _gs_dag(gcs, tmp_path, "teacher.steps=12")
    ensure(config, *DATA_STAGES)
    env = dict(os.environ, PYTHONPATH=REPO)
    uninterrupted = _cli(env, "stage", "teacher", path)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    final = dag.output_uri(config, "teacher")
    reference = _download(final, str(tmp_path / "reference"))
    fs, _ = artifacts.filesystem(final)
    fs.rm(artifacts.filesystem(final)[1], recursive=True)

    key = dag.stage_key(config, "teacher")
    partial = artifacts.join(config.workdir, "teacher", f".partial-{key}", "checkpoints")
    committed = artifacts.filesystem(partial)[1] + "/*/commit_success.txt"  # orbax on GCS
    process = subprocess.Popen([sys.executable, "-c", HELD_STAGE, "stage", "teacher", path],
                               cwd=REPO, env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        fs.invalidate_cache()
        if fs.glob(committed):  # the checkpoint is in the bucket
            break
        time.sleep(0.05)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the stage ended before it was killed"
    fs.invalidate_cache()
    steps = sorted(int(name.split("/")[-2]) for name in fs.glob(committed))
    assert steps == [3]

    resumed = _cli(env, "stage", "teacher", path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step {max(steps)}" in resumed.stdout + resumed.stderr
    got = _download(final, str(tmp_path / "resumed"))
    assert faults.differences("teacher", reference, got) == []
    assert artifacts.leftovers(config.workdir, ["teacher"]) == []


# --- what a bucket answers with ------------------------------------------------------------


@pytest.mark.parametrize("status", [503, 429])
def test_transient_answers_are_retried_not_read_as_corruption(gcs_faults, status):
    gcs, proxy = gcs_faults
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    with artifacts.write(workdir, "vocab", "k", config={}, inputs={}) as out:
        out.counts["pieces"] = 3
    proxy.fail("GET", "manifest.json", status)  # the manifest's read
    proxy.fail("POST", "/upload/", status)  # the next write: the lease's creation
    assert artifacts.read(artifacts.location(workdir, "vocab", "k")).manifest["counts"] == \
        {"pieces": 3}
    with artifacts.lease(workdir, "vocab", "k2"):
        pass
    assert [fault.seen for fault in proxy.faults] == [1, 1]


def test_a_permission_error_names_the_object(gcs_faults):
    gcs, proxy = gcs_faults
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    with artifacts.write(workdir, "vocab", "k", config={}, inputs={}):
        pass
    proxy.fail("GET", "manifest.json", 403, times=100)
    with pytest.raises(PermissionError) as raised:
        artifacts.require(workdir, "vocab", "k")
    message = str(raised.value)
    assert "\n" not in message and message.startswith(
        f"permission denied: {artifacts.join(artifacts.location(workdir, 'vocab', 'k'), 'manifest.json')}")


def test_a_403_in_the_cli_is_one_line_naming_the_object(gcs_faults, tmp_path, capsys):
    from flows import cli

    gcs, proxy = gcs_faults
    path = tmp_path / "experiment.yaml"
    path.write_text(f"workdir: {gcs.uri(uuid.uuid4().hex[:8], 'work')}\n"
                    "data: {source_lang: en, target_lang: de,\n"
                    "       train: {source: unused.en, target: unused.de}}\n")
    config = config_lib.load(str(path))
    proxy.fail("GET", "manifest.json", 403, times=100)
    with pytest.raises(SystemExit) as exited:
        cli.main(["status", str(path)])
    assert exited.value.code == 2
    manifest = artifacts.join(dag.output_uri(config, "prepare"), "manifest.json")
    assert capsys.readouterr().err == \
        f"padir: error: permission denied: {manifest} (this account may not read it)\n"
