"""components/artifacts.py: atomic publication, completeness, local and fsspec paths."""

import json
import uuid

import fsspec
import pytest

from components import artifacts


@pytest.fixture(params=["local", "memory"])
def workdir(request, tmp_path):
    """A local workdir, and an fsspec `memory://` one standing in for `gs://`."""
    if request.param == "local":
        yield str(tmp_path / "work")
        return
    root = f"memory://test-{uuid.uuid4().hex[:8]}/work"
    yield root
    fs, path = artifacts.filesystem(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def _put(uri: str, text: str) -> None:
    with fsspec.open(uri, "w") as f:
        f.write(text)


def _names(uri: str) -> list[str]:
    fs, path = artifacts.filesystem(uri)
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
