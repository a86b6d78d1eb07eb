"""components/artifacts.py: atomic publication, completeness, leases, on local disk and on
`gs://` (a GCS emulator on loopback, tests/gcs_emulator.py)."""

import json
import logging
import os
import socket
import threading
import time
import uuid

import fsspec
import pytest

from components import artifacts
from gcs_emulator import gcs, gcs_faults, gcs_server  # noqa: F401 (fixtures)


@pytest.fixture(params=["local", "gcs"])
def workdir(request, tmp_path):
    """A local workdir, and one in a bucket of the GCS emulator."""
    if request.param == "local":
        return str(tmp_path / "work")
    return request.getfixturevalue("gcs").uri(uuid.uuid4().hex[:8], "work")


def _put(uri: str, text: str) -> None:
    with fsspec.open(uri, "w") as f:
        f.write(text)


def _names(uri: str) -> list[str]:
    """The entries of a directory; none if it does not exist (a bucket has no empty ones)."""
    fs, path = artifacts.filesystem(uri)
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
    """The first publisher pauses between its existence check and its move; the second,
    meanwhile, neither nests its tree in the first one's nor deletes it: it fails at once."""
    paused, resume = threading.Event(), threading.Event()
    move = artifacts._move_into_place

    def slow_move(fs, tmp_path, final_path):
        paused.set()
        assert resume.wait(30)
        move(fs, tmp_path, final_path)

    monkeypatch.setattr(artifacts, "_move_into_place", slow_move)
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


def test_a_stale_remote_lease_is_taken_over_a_live_one_is_not(gcs, caplog):
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    lease = artifacts.lease_uri(workdir, "prepare", "k1")
    holder = {"host": "elsewhere", "pid": 7, "started": "2026-01-01T00:00:00+00:00"}
    _put(lease, json.dumps(dict(holder, renewed=time.time())))
    with pytest.raises(artifacts.LeaseHeldError, match="pid 7 on elsewhere since 2026-01-01"):
        _publish(workdir, "k1", {"a.txt": "x"})
    _put(lease, json.dumps(dict(holder, renewed=time.time() - artifacts.LEASE_STALE_SECONDS)))
    with caplog.at_level(logging.WARNING, logger="components.artifacts"):
        _publish(workdir, "k1", {"a.txt": "x"})
    assert "taking over the lease of a run that died (pid 7 on elsewhere" in caplog.text
    assert _names(artifacts.join(workdir, "prepare")) == ["k1"]


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
    """Locally it is written under a temporary name and renamed; a kill before the rename
    leaves no manifest.json at all."""
    def killed(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _publish(str(tmp_path), "k1", {"a.txt": "x"})
    final = artifacts.location(str(tmp_path), "prepare", "k1")
    assert "manifest.json" not in os.listdir(final)
    assert not artifacts.is_complete(final)


def test_a_gcs_publish_that_fails_half_way_leaves_nothing_readable(gcs_faults):
    """On GCS a directory moves object by object (the emulator lacks `moveTo`: a copy and a
    delete each); the copies after the first are refused (403, not retried): what was
    moved is never read, and a rerun replaces it."""
    gcs, proxy = gcs_faults
    workdir = gcs.uri(uuid.uuid4().hex[:8], "work")
    proxy.fail("POST", "/rewriteTo/", 403, times=10, after=1)  # one object moves
    with pytest.raises(OSError, match="Forbidden"):
        _publish(workdir, "k1", {"a.txt": "old", "b.txt": "old"})
    final = artifacts.location(workdir, "prepare", "k1")
    assert not artifacts.is_complete(final)
    assert _names(artifacts.join(workdir, "prepare")) == ["k1"]  # tmp and lease are gone
    assert len(_names(final)) == 1  # the object moved before the failure
    proxy.faults.clear()
    artifact = _publish(workdir, "k1", {"c.txt": "new"})
    assert _names(artifact.uri) == ["c.txt", "config.yaml", "manifest.json"]
