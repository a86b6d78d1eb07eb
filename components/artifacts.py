"""Stage artifacts: `<workdir>/<stage>/<key>/`, complete only once `manifest.json` exists.

A stage writes everything into a temporary sibling directory, which is moved to its final
place only when the stage succeeded; the manifest is written last. Readers accept a
directory only if its manifest exists, so a crash at any point leaves nothing that a later
stage would read. Paths may be local or any fsspec URL (`gs://`, `memory://`).

Example:
    with artifacts.write(workdir, "prepare", key, config=cfg, inputs={}) as out:
        write_files_under(out.tmp_uri)
        out.counts["read"] = 29000
    prepared = artifacts.require(workdir, "prepare", key)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import posixpath
import time
import uuid
from typing import Any, Iterator, Mapping

import fsspec

MANIFEST = "manifest.json"
CONFIG = "config.yaml"


class IncompleteArtifactError(FileNotFoundError):
    """An input artifact is missing or was never completed (no manifest)."""


class StageStopped(RuntimeError):
    """A stage stopped early on request (SIGTERM); its partial work is kept to resume from."""


def join(base: str, *parts: str) -> str:
    """Joins URL-or-path components with '/', keeping the scheme of `base`."""
    return posixpath.join(base.rstrip("/"), *parts)


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path


def glob(pattern: str) -> list[str]:
    """The paths matching `pattern` (local or fsspec), sorted."""
    fs, path = filesystem(pattern)
    return sorted(fs.glob(path))


def read_json(uri: str) -> Any:
    fs, path = filesystem(uri)
    with fs.open(path, "r") as f:
        return json.load(f)


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A complete stage output."""

    stage: str
    key: str
    uri: str
    manifest: Mapping[str, Any]

    def path(self, *parts: str) -> str:
        return join(self.uri, *parts)


def location(workdir: str, stage: str, key: str) -> str:
    return join(workdir, stage, key)


def is_complete(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(join(path, MANIFEST))


def read(uri: str) -> Artifact:
    """The artifact at `uri`; IncompleteArtifactError if it has no manifest."""
    fs, path = filesystem(uri)
    manifest_path = join(path, MANIFEST)
    if not fs.exists(manifest_path):
        raise IncompleteArtifactError(
            f"{uri} is not a complete artifact (no {MANIFEST}); run its stage first"
        )
    with fs.open(manifest_path, "r") as f:
        manifest = json.load(f)
    return Artifact(stage=manifest["stage"], key=manifest["key"], uri=uri, manifest=manifest)


def require(workdir: str, stage: str, key: str) -> Artifact:
    """The complete artifact of `stage` with `key`, or a clear error naming the stage."""
    uri = location(workdir, stage, key)
    try:
        return read(uri)
    except IncompleteArtifactError as e:
        raise IncompleteArtifactError(
            f"input stage '{stage}' has no complete output at {uri}: run `padir stage {stage}` first"
        ) from e


@dataclasses.dataclass
class PendingArtifact:
    """What a stage fills while it runs: files under `tmp_uri`, counts and metrics."""

    stage: str
    key: str
    tmp_uri: str
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def path(self, *parts: str) -> str:
        return join(self.tmp_uri, *parts)


@contextlib.contextmanager
def write(
    workdir: str,
    stage: str,
    key: str,
    *,
    config: Mapping[str, Any],
    config_yaml: str = "",
    inputs: Mapping[str, str],
    resumable: bool = False,
) -> Iterator[PendingArtifact]:
    """Context manager that publishes a stage's output atomically (see module docstring).

    Args:
      config: the stage's resolved config sections, recorded in the manifest.
      config_yaml: the whole resolved experiment config, written as config.yaml.
      inputs: stage name -> URI of each input artifact.
      resumable: work in `<stage>/.partial-<key>/`, kept when the stage fails or is
        stopped, so that a rerun resumes from what it holds (training checkpoints).
        It is still never read by another stage: it has no manifest and is not at the
        final location.
    """
    final_uri = location(workdir, stage, key)
    suffix = "" if resumable else f"-{uuid.uuid4().hex[:8]}"
    tmp_uri = join(workdir, stage, f".{'partial' if resumable else 'tmp'}-{key}{suffix}")
    fs, tmp_path = filesystem(tmp_uri)
    fs.makedirs(tmp_path, exist_ok=True)
    pending = PendingArtifact(stage=stage, key=key, tmp_uri=tmp_uri)
    started = time.time()
    try:
        yield pending
        if config_yaml:
            with fs.open(join(tmp_path, CONFIG), "w") as f:
                f.write(config_yaml)
        _, final_path = filesystem(final_uri)
        if fs.exists(final_path):  # a forced rerun, or a crash between move and manifest
            fs.rm(final_path, recursive=True)
        fs.mv(tmp_path, final_path, recursive=True)
        manifest = {
            "stage": stage,
            "key": key,
            "inputs": dict(inputs),
            "config": dict(config),
            "counts": pending.counts,
            "metrics": pending.metrics,
            "wall_seconds": round(time.time() - started, 3),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        with fs.open(join(final_path, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
    except BaseException:
        if not resumable and fs.exists(tmp_path):
            fs.rm(tmp_path, recursive=True)
        raise
