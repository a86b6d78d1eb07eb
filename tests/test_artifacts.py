"""components/artifacts.py: atomic publication, completeness, leases, on local disk and on
`gs://` (a GCS emulator on loopback, tests/gcs_emulator.py)."""

import contextlib
import fcntl
import json
import logging
import os
import posixpath
import socket
import subprocess
import threading
import time
import uuid

import fsspec
import pytest

from components import artifacts
from gcs_emulator import gcs, gcs_faults, gcs_server  # noqa: F401 (fixtures)


@pytest.fixture(params=["local", "gcs"])
def workdir(request, tmp_path):
    """A local workdir, and one in a bucket of the GCS emulator, behind the proxy that
    checks the preconditions GCS documents and the emulator ignores (tests/gcs_emulator.py)."""
    if request.param == "local":
        return str(tmp_path / "work")
    return request.getfixturevalue("gcs_faults")[0].uri(uuid.uuid4().hex[:8], "work")


def _put(uri: str, text: str) -> None:
    with fsspec.open(uri, "w") as f:
        f.write(text)


def _names(uri: str) -> list[str]:
    """The entries of a directory; none if it does not exist (a bucket has no empty ones)."""
    fs, path = artifacts.filesystem(uri)
    fs.invalidate_cache()
    if not fs.exists(path):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def _publish(workdir: str, key: str, files: dict[str, str]) -> artifacts.Artifact:
    with artifacts.write(workdir, "prepare", key, config={"prepare": {"max_chars": 5}},
                         config_yaml="seed: 0\n", inputs={"raw": "somewhere"}) as out:
        for name, text in files.items():
            _put(out.path(name), text)
        out.counts["read.train"] = 3
        out.metrics["split_sizes"] = {"train": 3}
    return artifacts.require(workdir, "prepare", key)


def test_publish_moves_files_and_writes_the_manifest_last(workdir):
    artifact = _publish(workdir, "k1", {"train-00000-of-00001.jsonl": "{}\n"})
    assert artifact.uri == artifacts.location(workdir, "prepare", "k1")
    assert _names(artifact.uri) == ["config.yaml", "manifest.json", "train-00000-of-00001.jsonl"]
    assert _names(artifacts.join(workdir, "prepare")) == ["k1"]  # the temporary dir is gone
    manifest = artifact.manifest
    assert (manifest["stage"], manifest["key"]) == ("prepare", "k1")
    assert manifest["inputs"] == {"raw": "somewhere"}
    assert manifest["config"] == {"prepare": {"max_chars": 5}}
    assert manifest["counts"] == {"read.train": 3}
    assert manifest["metrics"] == {"split_sizes": {"train": 3}}
    assert manifest["wall_seconds"] >= 0 and manifest["created"]
    with fsspec.open(artifact.path("manifest.json")) as f:
        assert json.load(f) == manifest
    with fsspec.open(artifact.path("config.yaml"), "r") as f:
        assert f.read() == "seed: 0\n"
    assert artifacts.is_complete(artifact.uri)


def test_failure_leaves_no_manifest_and_no_temporary_dir(workdir):
    with pytest.raises(RuntimeError, match="crash"):
        with artifacts.write(workdir, "prepare", "k1", config={}, inputs={}) as out:
            _put(out.path("train-00000-of-00001.jsonl"), "half a file")
            raise RuntimeError("crash")
    assert _names(artifacts.join(workdir, "prepare")) == []
    assert not artifacts.is_complete(artifacts.location(workdir, "prepare", "k1"))
    with pytest.raises(artifacts.IncompleteArtifactError):
        artifacts.require(workdir, "prepare", "k1")


def test_a_failed_rerun_keeps_the_previous_output(workdir):
    _publish(workdir, "k1", {"a.txt": "old"})
    with pytest.raises(KeyboardInterrupt):
        with artifacts.write(workdir, "prepare", "k1", config={}, inputs={}) as out:
            _put(out.path("a.txt"), "new")
            raise KeyboardInterrupt  # BaseException too
    artifact = artifacts.require(workdir, "prepare", "k1")
    with fsspec.open(artifact.path("a.txt"), "r") as f:
        assert f.read() == "old"


def test_require_names_the_stage(workdir):
    with pytest.raises(artifacts.IncompleteArtifactError,
                       match="input stage 'vocab' has no complete output.*padir stage vocab"):
        artifacts.require(workdir, "vocab", "abc")


def test_a_directory_without_manifest_is_refused(workdir):
    partial = artifacts.location(workdir, "prepare", "k1")
    _put(artifacts.join(partial, "train-00000-of-00001.jsonl"), "{}\n")
    assert not artifacts.is_complete(partial)
    with pytest.raises(artifacts.IncompleteArtifactError, match="no manifest.json"):
        artifacts.read(partial)
    # A later successful run replaces the partial directory.
    artifact = _publish(workdir, "k1", {"b.txt": "x"})
    assert "train-00000-of-00001.jsonl" not in _names(artifact.uri)


def test_forced_rerun_replaces_the_old_output(workdir):
    first = _publish(workdir, "k1", {"old.txt": "1", "same.txt": "old"})
    second = _publish(workdir, "k1", {"same.txt": "new"})
    assert second.uri == first.uri
    assert _names(second.uri) == ["config.yaml", "manifest.json", "same.txt"]
    with fsspec.open(second.path("same.txt"), "r") as f:
        assert f.read() == "new"
    assert _names(artifacts.join(workdir, "prepare")) == ["k1"]


def test_a_forced_rerun_without_an_atomic_swap_moves_the_old_output_aside(tmp_path,
                                                                          monkeypatch):
    """Where the kernel cannot swap two directories (macOS, some filesystems), the old
    output is renamed aside, the new one into place, and the old one removed."""
    monkeypatch.setattr(artifacts, "_exchange", lambda first, second: False)
    workdir = str(tmp_path / "work")
    _publish(workdir, "k1", {"old.txt": "1"})
    artifact = _publish(workdir, "k1", {"new.txt": "2"})
    assert _names(artifact.uri) == ["config.yaml", "manifest.json", "new.txt"]
    assert _names(artifacts.join(workdir, "prepare")) == ["k1"]


def test_a_reader_survives_forced_reruns_of_what_it_reads(workdir):
    """A reader reads a published artifact over and over while reruns of its key replace
    it: every file it reads is there and whole (locally the directories are swapped in one
    step; on gs:// each object is overwritten in place, the manifest last)."""
    files = {f"part-{i}": "same" for i in range(4)}
    first = _publish(workdir, "k1", files)
    fs, path = artifacts.filesystem(first.uri)
    stop, seen, errors = threading.Event(), [], []

    def read():
        while not stop.is_set():
            try:
                artifacts.require(workdir, "prepare", "k1")
                seen.append([fs.cat_file(f"{path}/{name}") for name in files])
            except Exception as e:  # noqa: BLE001 (any failure is the finding)
                errors.append(repr(e))
            time.sleep(0.001)  # the writer's turn

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(5):
            _publish(workdir, "k1", files)
    finally:
        stop.set()
        reader.join()
    assert errors == [] and seen and all(read == [b"same"] * 4 for read in seen)


def test_join_keeps_the_scheme():
    assert artifacts.join("gs://bucket/work/", "prepare", "k") == "gs://bucket/work/prepare/k"
    assert artifacts.location("/w", "vocab", "k") == "/w/vocab/k"


def test_resumable_work_survives_a_failure_and_is_reused(workdir):
    with pytest.raises(RuntimeError):
        with artifacts.write(workdir, "teacher", "k", config={}, inputs={},
                             resumable=True) as out:
            _put(out.path("checkpoints", "100"), "step 100")
            raise RuntimeError("preempted")
    assert not artifacts.is_complete(artifacts.location(workdir, "teacher", "k"))
    with pytest.raises(artifacts.IncompleteArtifactError):
        artifacts.require(workdir, "teacher", "k")
    with artifacts.write(workdir, "teacher", "k", config={}, inputs={}, resumable=True) as out:
        with fsspec.open(out.path("checkpoints", "100"), "r") as f:
            assert f.read() == "step 100"  # the rerun sees the earlier run's work
    artifact = artifacts.require(workdir, "teacher", "k")
    assert _names(artifacts.join(workdir, "teacher")) == ["k"]
    assert _names(artifact.path("checkpoints")) == ["100"]


# --- one writer per key, atomic manifests ----------------------------------------------------


def test_a_second_publisher_of_the_key_fails_naming_the_holder(workdir, monkeypatch):
    """The first publisher pauses just before its publish; the second, meanwhile, neither
    nests its tree in the first one's nor deletes it: it fails at once."""
    paused, resume = threading.Event(), threading.Event()
    for held in (artifacts._LocalLease, artifacts._GcsLease):
        def slow_publish(self, *args, _publish=held.publish, **kwargs):
            paused.set()
            assert resume.wait(30)
            _publish(self, *args, **kwargs)

        monkeypatch.setattr(held, "publish", slow_publish)
    first = threading.Thread(target=_publish, args=(workdir, "k1", {"first.txt": "1"}))
    first.start()
    assert paused.wait(30)
    try:
        with pytest.raises(artifacts.LeaseHeldError,
                           match=rf"prepare/k1 is being written by another run \(pid "
                                 rf"{os.getpid()} on {socket.gethostname()} since"):
            _publish(workdir, "k1", {"second.txt": "2"})
    finally:
        resume.set()
        first.join()
    artifact = artifacts.require(workdir, "prepare", "k1")
    assert _names(artifact.uri) == ["config.yaml", "first.txt", "manifest.json"]
    assert _names(artifacts.join(workdir, "prepare")) == ["k1"]  # lease released, no tmp


def test_a_second_trainer_of_the_key_leaves_the_first_ones_work_alone(workdir):
    with artifacts.write(workdir, "teacher", "k", config={}, inputs={}, resumable=True) as out:
        _put(out.path("checkpoints", "5"), "step 5")
        with pytest.raises(artifacts.LeaseHeldError, match="teacher/k is being written"):
            with artifacts.write(workdir, "teacher", "k", config={}, inputs={},
                                 resumable=True):
                pytest.fail("the second trainer got in")
        with fsspec.open(out.path("checkpoints", "5"), "r") as f:
            assert f.read() == "step 5"
    assert _names(artifacts.require(workdir, "teacher", "k").path("checkpoints")) == ["5"]


def test_a_remote_lease_is_stale_by_the_servers_clock_not_its_holders(gcs_faults, caplog):
    """The holder started (by its own clock) long ago, but the server saw its lease object
    written just now: it is live; once the server has not seen it rewritten for the stale
    period, it is taken over."""
    gcs, proxy = gcs_faults
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    lease = artifacts.lease_uri(workdir, "prepare", "k1")
    _put(lease, json.dumps({"host": "elsewhere", "pid": 7, "run": "theirs",
                            "started": "2020-01-01T00:00:00+00:00"}))
    with pytest.raises(artifacts.LeaseHeldError, match="pid 7 on elsewhere since 2020-01-01"):
        _publish(workdir, "k1", {"a.txt": "x"})
    proxy.ahead = artifacts.LEASE_STALE_SECONDS + 1  # its `Date` counts whole seconds
    with caplog.at_level(logging.WARNING, logger="components.artifacts"):
        _publish(workdir, "k1", {"a.txt": "x"})
    assert "taking over the lease of a run that died (pid 7 on elsewhere" in caplog.text
    assert _names(artifacts.join(workdir, "prepare")) == ["k1"]


def test_the_same_host_shortcut_needs_the_same_boot_and_pid_namespace(monkeypatch):
    """A dead pid frees a lease at once only if it names a process of this very host: a
    container sharing the hostname but not the pid namespace would see a live holder's pid
    as dead."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    here = {"host": socket.gethostname(), "pid": dead.pid, "boot": artifacts._boot_id(),
            "pidns": artifacts._pid_namespace()}
    assert here["boot"] and here["pidns"]  # Linux: both are known
    assert artifacts._is_stale(here, age=0.0)
    assert not artifacts._is_stale(dict(here, pidns="pid:[1]"), age=0.0)
    assert not artifacts._is_stale(dict(here, boot="another-boot"), age=0.0)
    assert not artifacts._is_stale({"host": here["host"], "pid": dead.pid}, age=0.0)
    assert not artifacts._is_stale(dict(here, pid=os.getpid()), age=0.0)
    assert artifacts._is_stale({}, age=artifacts.LEASE_STALE_SECONDS)


@pytest.mark.parametrize("content", ["", '{"stage": "prepare", "ke'])
def test_an_empty_or_truncated_manifest_is_incomplete_not_a_crash(workdir, content, caplog):
    artifact = _publish(workdir, "k1", {"a.txt": "x"})
    _put(artifact.path("manifest.json"), content)
    with caplog.at_level(logging.WARNING, logger="components.artifacts"):
        assert not artifacts.is_complete(artifact.uri)
    assert "manifest.json does not parse" in caplog.text
    with pytest.raises(artifacts.IncompleteArtifactError, match="does not parse"):
        artifacts.read(artifact.uri)
    with pytest.raises(artifacts.IncompleteArtifactError,
                       match="'prepare' has an unreadable manifest.json.*padir stage prepare"):
        artifacts.require(workdir, "prepare", "k1")
    assert artifacts.is_complete(_publish(workdir, "k1", {"b.txt": "y"}).uri)  # rerun heals it


def test_the_manifest_is_never_seen_half_written(tmp_path, monkeypatch):
    """Locally it is written under a temporary name and renamed, inside the temporary
    directory that is then renamed into place whole: a kill before leaves nothing there."""
    def killed(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _publish(str(tmp_path), "k1", {"a.txt": "x"})
    final = artifacts.location(str(tmp_path), "prepare", "k1")
    assert not os.path.exists(final)
    assert os.listdir(tmp_path / "prepare") == []


def test_a_gcs_publish_that_fails_half_way_leaves_nothing_readable(gcs_faults, caplog):
    """On GCS a publication copies object by object, the manifest last; the copies after
    the first are refused (403, not retried): what was copied is never read. The commit
    stays in the lease object, released for the next run of the key, which finishes it
    before its own."""
    gcs, proxy = gcs_faults
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    proxy.fail("POST", "/rewriteTo/", 403, times=10, after=1)  # one object is copied
    with pytest.raises(OSError, match="Forbidden"):
        _publish(workdir, "k1", {"a.txt": "old", "b.txt": "old"})
    final = artifacts.location(workdir, "prepare", "k1")
    assert not artifacts.is_complete(final)
    assert len(_names(final)) == 1  # the object copied before the failure
    fs, lease = artifacts.filesystem(artifacts.lease_uri(workdir, "prepare", "k1"))
    recorded = json.loads(fs.cat_file(lease))
    assert recorded["released"] and recorded["publishing"]["source"] in fs.ls(
        artifacts.filesystem(artifacts.join(workdir, "prepare"))[1], detail=False)
    proxy.faults.clear()
    with caplog.at_level(logging.WARNING, logger="components.artifacts"):
        artifact = _publish(workdir, "k1", {"c.txt": "new"})
    assert "finishing the publication of the run taken over from" in caplog.text
    assert _names(artifact.uri) == ["c.txt", "config.yaml", "manifest.json"]
    assert _names(artifacts.join(workdir, "prepare")) == ["k1"]  # tmp and lease are gone


# --- a writer that lost its lease: the fenced publish ----------------------------------------


def _take_lease_over(workdir: str, key: str) -> None:
    """What another run that took the lease over leaves: a lease that is not this run's
    (locally a new lock file: only its holder's death, or a hand, frees a held one)."""
    uri = artifacts.lease_uri(workdir, "prepare", key)
    if workdir.startswith("gs://"):
        _put(uri, json.dumps({"host": "elsewhere", "pid": 1, "run": "theirs"}))
    else:
        os.unlink(uri)
        _put(uri, "{}")


def test_a_writer_that_lost_its_lease_publishes_nothing(workdir):
    with pytest.raises(artifacts.LeaseLost, match="prepare/k1: its lease .* published nothing"):
        with artifacts.write(workdir, "prepare", "k1", config={}, inputs={}) as out:
            _put(out.path("a.txt"), "mine")
            _take_lease_over(workdir, "k1")
    assert not artifacts.is_complete(artifacts.location(workdir, "prepare", "k1"))
    assert _names(artifacts.join(workdir, "prepare")) == [".lease-k1"]  # theirs; no tmp


def test_a_writer_that_lost_its_lease_keeps_the_artifact_another_run_published(workdir,
                                                                              caplog):
    """Content-keyed: the run that took over published the key first; the loser neither
    removes nor mixes into that artifact, discards its own output and reads the other's."""
    with caplog.at_level(logging.WARNING, logger="components.artifacts"):
        with artifacts.write(workdir, "prepare", "k1", config={}, inputs={}) as out:
            _put(out.path("mine.txt"), "mine")
            _take_lease_over(workdir, "k1")
            theirs = artifacts.location(workdir, "prepare", "k1")
            _put(artifacts.join(theirs, "theirs.txt"), "theirs")
            _put(artifacts.join(theirs, "manifest.json"),
                 json.dumps({"stage": "prepare", "key": "k1"}))
    assert "another run published this key while this one ran" in caplog.text
    artifact = artifacts.require(workdir, "prepare", "k1")
    assert _names(artifact.uri) == ["manifest.json", "theirs.txt"]
    assert artifact.manifest == {"stage": "prepare", "key": "k1"}
    assert _names(artifacts.join(workdir, "prepare")) == [".lease-k1", "k1"]


def _take_over(other: contextlib.ExitStack, workdir: str, monkeypatch):
    """Another run takes the lease of prepare/k1 and holds it until `other` closes: on
    gs:// as from a holder paused past the stale period (finishing the publication
    recorded in it first); locally after a hand removed the lease file."""
    if not workdir.startswith("gs://"):
        os.unlink(artifacts.lease_uri(workdir, "prepare", "k1"))
    with monkeypatch.context() as stale:
        stale.setattr(artifacts, "_is_stale", lambda holder, age: True)
        return other.enter_context(artifacts.lease(workdir, "prepare", "k1"))


@pytest.mark.parametrize("at", ["before", "between", "after"])
def test_a_gcs_publish_whose_lease_is_taken_over_before_between_or_after_its_copies(
        gcs_faults, monkeypatch, caplog, at):
    """A publish on gs:// commits (records its copies in its lease object), then copies
    object by object, the manifest last. Taken over before the commit, it publishes
    nothing; between two copies, the run that took over finishes the recorded publication
    and the old holder stops at its next copy; after the copies, the publication stands
    and the new holder's lease is left alone."""
    workdir = gcs_faults[0].uri(uuid.uuid4().hex[:8], "work")
    other, taken, copied = contextlib.ExitStack(), [], []
    publish, copy = artifacts._GcsLease.publish, artifacts._GcsLease._copy

    def take_over_first(self, *args, **kwargs):
        taken.append(_take_over(other, workdir, monkeypatch))
        return publish(self, *args, **kwargs)

    def copy_then_take_over(self, source, destination, generation):
        copy(self, source, destination, generation)
        copied.append(posixpath.basename(destination))
        if not taken and (at == "between" or copied[-1] == artifacts.MANIFEST):
            taken.append(None)  # the copies of the run taking over come through here too
            taken[0] = _take_over(other, workdir, monkeypatch)

    if at == "before":
        monkeypatch.setattr(artifacts._GcsLease, "publish", take_over_first)
    else:
        monkeypatch.setattr(artifacts._GcsLease, "_copy", copy_then_take_over)
    final = artifacts.location(workdir, "prepare", "k1")
    mine = {"a.txt": "mine", "b.txt": "mine"}
    with other, caplog.at_level(logging.WARNING, logger="components.artifacts"):
        if at == "after":
            _publish(workdir, "k1", mine)
        else:
            with pytest.raises(artifacts.LeaseLost) as lost:
                _publish(workdir, "k1", mine)
        if at == "before":
            assert str(lost.value).endswith("before this run published; it published nothing")
            assert copied == [] and not artifacts.is_complete(final)
        else:  # published whole: by this run, or finished by the run that took over
            assert copied[0] == "a.txt" and artifacts.is_complete(final)
            assert _names(final) == ["a.txt", "b.txt", "config.yaml", "manifest.json"]
            with fsspec.open(artifacts.join(final, "b.txt"), "r") as f:
                assert f.read() == "mine"
        if at == "between":
            assert str(lost.value) == ("prepare/k1: its lease was taken over while this run "
                                       "published; the new holder finishes the publication")
            assert "finishing the publication of the run taken over from" in caplog.text
            # This run's first copy; the rest made by the run that took over (its copy of
            # a.txt refused, as made); then this run's copy of b.txt refused, and it stopped.
            assert copied == ["a.txt", "b.txt", "config.yaml", "manifest.json"]
        if at == "after":
            assert copied == ["a.txt", "b.txt", "config.yaml", "manifest.json"]
            assert "the lease was taken over meanwhile; left to its new holder" in caplog.text
        assert taken[0].holds()  # the new holder's lease, left alone
        assert _names(artifacts.join(workdir, "prepare")) == \
            [".lease-k1"] + ([] if at == "before" else ["k1"])  # no temporary directory
    assert _names(artifacts.join(workdir, "prepare")) == ([] if at == "before" else ["k1"])


@pytest.mark.parametrize("at", ["before", "during", "after"])
def test_a_local_publish_whose_lease_is_lost_before_during_or_after_its_rename(
        tmp_path, monkeypatch, caplog, at):
    """Locally the publish is one rename, its lease checked and the rename made under the
    stage's lock. A lease lost before it publishes nothing; between the check and the
    rename no run can take the lease (it waits for the lock, and then finds the artifact
    published); after it, the publication stands and the new holder's lease file is left
    alone."""
    workdir = str(tmp_path / "work")
    stage_dir, final = tmp_path / "work" / "prepare", artifacts.location(workdir, "prepare", "k1")
    other, taken, found = contextlib.ExitStack(), [], []
    publish, rename = artifacts._LocalLease.publish, artifacts._rename_into_free

    def take_over_around(self, *args, **kwargs):
        if at == "before":
            taken.append(_take_over(other, workdir, monkeypatch))
        publish(self, *args, **kwargs)
        if at == "after":
            taken.append(_take_over(other, workdir, monkeypatch))

    def rename_while_another_run_waits(source, destination):
        fd = os.open(stage_dir, os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # the lock every run takes its lease under
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        os.unlink(artifacts.lease_uri(workdir, "prepare", "k1"))
        waiting.start()
        return rename(source, destination)

    def take_the_lease():
        with artifacts.lease(workdir, "prepare", "k1"):
            found.append(artifacts.is_complete(final))

    waiting = threading.Thread(target=take_the_lease)
    if at == "during":
        monkeypatch.setattr(artifacts, "_rename_into_free", rename_while_another_run_waits)
    else:
        monkeypatch.setattr(artifacts._LocalLease, "publish", take_over_around)
    with other, caplog.at_level(logging.WARNING, logger="components.artifacts"):
        if at == "before":
            with pytest.raises(artifacts.LeaseLost,
                               match="its lease file .* was removed or replaced while this "
                                     "run wrote; it published nothing"):
                _publish(workdir, "k1", {"a.txt": "mine"})
            assert not artifacts.is_complete(final)
            assert sorted(os.listdir(stage_dir)) == [".lease-k1"]  # theirs; no tmp
        else:
            assert _names(_publish(workdir, "k1", {"a.txt": "mine"}).uri) == \
                ["a.txt", "config.yaml", "manifest.json"]
        if at == "during":
            waiting.join(60)
            assert found == [True]  # it took the lease once the artifact was in place
        if at == "after":
            assert sorted(os.listdir(stage_dir)) == [".lease-k1", "k1"]
        if taken:
            assert taken[0].holds()  # the new holder's lease file, left alone
    assert os.listdir(stage_dir) == ([] if at == "before" else ["k1"])


# --- renewals on gs:// --------------------------------------------------------------------


def _is_lease_write(method: str, path: str) -> bool:
    """A write of the lease object: its creation ("0") or a renewal."""
    return method == "POST" and "uploadType=multipart" in path and "ifGenerationMatch=" in path


def _lease_writes(proxy) -> list[str]:
    return [path for method, path in proxy.requests if _is_lease_write(method, path)]


def _renewals(monkeypatch, count: int) -> tuple[list[bool], threading.Event]:
    """What each renewal of a lease found (True: renewed; False: another holder), and an
    event set once `count` renewals have succeeded: a test waits for renewals, not for time."""
    found, renewed = [], threading.Event()
    renew = artifacts._GcsLease.renew

    def counted(self, timeout):
        found.append(renew(self, timeout))
        if found.count(True) >= count:
            renewed.set()
        return found[-1]

    monkeypatch.setattr(artifacts._GcsLease, "renew", counted)
    return found, renewed


def test_a_remote_lease_is_renewed_on_its_generation(gcs_faults, monkeypatch):
    gcs, proxy = gcs_faults
    monkeypatch.setattr(artifacts, "LEASE_RENEW_SECONDS", 0.05)
    _, renewed = _renewals(monkeypatch, 3)
    with artifacts.lease(gcs.uri(uuid.uuid4().hex[:8], "work"), "vocab", "k") as held:
        first = held.generation
        assert renewed.wait(60)
        assert held.generation != first
    writes = _lease_writes(proxy)
    assert writes[0].endswith("ifGenerationMatch=0") or "ifGenerationMatch=0&" in writes[0]
    assert len(writes) >= 4 and all("ifGenerationMatch=0" not in w for w in writes[1:])


def test_a_renewal_whose_answer_was_lost_is_recognised_as_its_own(gcs_faults, monkeypatch,
                                                                  caplog):
    """The renewal reaches the bucket but its answer is lost (a 503 in its place); the
    client retries it, and the retry finds the generation changed (412): by this run's own
    write, which the lease recognises, and renews on."""
    gcs, proxy = gcs_faults
    monkeypatch.setattr(artifacts, "LEASE_RENEW_SECONDS", 0.05)
    monkeypatch.setattr(artifacts, "LEASE_STALE_SECONDS", 30.0)
    proxy.fail("POST", "uploadType=multipart", 503, after=1, forward=True)
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    found, renewed = _renewals(monkeypatch, 4)
    with caplog.at_level(logging.WARNING, logger="components.artifacts"):
        with artifacts.lease(workdir, "vocab", "k") as held:
            assert renewed.wait(60)
            assert held.lost is None
    assert all(found)
    writes = _lease_writes(proxy)
    assert writes[1] == writes[2]  # the client's retry, on the generation already replaced
    # Created; the first renewal made, its answer lost; the retry refused, as the renewal
    # was made; renewed on from the generation the retry found.
    answers = [status for method, path, status in proxy.answers if _is_lease_write(method, path)]
    assert answers[:4] == [200, 503, 412, 200] and len(writes) >= 6
    assert "could not renew" not in caplog.text and "taken over" not in caplog.text
    fs, path = artifacts.filesystem(artifacts.lease_uri(workdir, "vocab", "k"))
    assert not fs.exists(path)  # released: the generation it renewed was its own


def _work(done: list[str]) -> None:
    """A stage's work, which its lease's renewer stops: a minute at least, ticking."""
    for _ in range(6000):
        time.sleep(0.01)
    done.append("the work ran to its end")


def test_a_lease_taken_over_stops_its_old_holder_which_leaves_it_alone(gcs_faults,
                                                                       monkeypatch):
    gcs, _ = gcs_faults
    monkeypatch.setattr(artifacts, "LEASE_RENEW_SECONDS", 0.05)
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    fs, path = artifacts.filesystem(artifacts.lease_uri(workdir, "vocab", "k"))
    theirs = json.dumps({"host": "elsewhere", "pid": 1, "run": "theirs",
                         "started": "2026-12-01T00:00:00+00:00"})
    found, _ = _renewals(monkeypatch, 1)
    done = []
    with pytest.raises(artifacts.LeaseLost) as lost:
        with artifacts.lease(workdir, "vocab", "k"):
            fs.pipe_file(path, theirs.encode())  # another run took it over meanwhile
            _work(done)
    assert done == []
    assert found.count(False) == 1 and found[-1] is False  # stopped by the first to find it
    assert str(lost.value) == ("vocab/k: its lease was taken over by another run (pid 1 on "
                               "elsewhere since 2026-12-01T00:00:00+00:00); this run stopped")
    assert lost.value.__cause__ is None and "\n" not in str(lost.value)
    assert fs.cat_file(path).decode() == theirs  # neither renewed nor released by it


@pytest.mark.parametrize("error", [
    OSError("connection reset"), TimeoutError(), "HttpError", "ClientError",
    ValueError("Bad Request")])
def test_renewals_that_keep_failing_stop_the_stage_before_a_takeover(gcs, monkeypatch,
                                                                     error):
    """Whatever the client raises once its own retries are spent, renewals are retried
    until half the stale period has passed since the last one that succeeded, then the
    stage stops with one line, long before another run could take the lease over."""
    import aiohttp
    import gcsfs.retry

    error = {"HttpError": gcsfs.retry.HttpError({"code": 503, "message": "unavailable"}),
             "ClientError": aiohttp.ClientConnectionError("refused")}.get(error, error)
    monkeypatch.setattr(artifacts, "LEASE_RENEW_SECONDS", 0.05)
    monkeypatch.setattr(artifacts, "LEASE_STALE_SECONDS", 2.0)
    clock = _Clock()
    monkeypatch.setattr(artifacts, "time", clock)
    tried = []  # (when, the time it was given) of each renewal

    def fails(self, timeout):
        tried.append((clock.now, timeout))
        clock.now += 0.25  # a renewal that takes a quarter of a second, then fails
        raise error

    monkeypatch.setattr(artifacts._GcsLease, "renew", fails)
    done = []
    with pytest.raises(artifacts.LeaseLost,
                       match=r"^vocab/k: its lease went 1 s without a renewal \(.*\); "
                             "stopped before another run could take it over$"):
        with artifacts.lease(gcs.uri(uuid.uuid4().hex[:8], "work"), "vocab", "k") as held:
            _work(done)
    assert done == []
    # Retried until half the stale period since the last write, none given time past it.
    assert held.written == 0.0 and tried == [(0.0, 1.0), (0.25, 0.75), (0.5, 0.5), (0.75, 0.25)]
    assert clock.now == artifacts.LEASE_STALE_SECONDS / 2  # where the stage was stopped


class _Clock:
    """components/artifacts.py's `time`, its monotonic clock moved by the test alone."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    time = staticmethod(time.time)
