"""Stage artifacts: `<workdir>/<stage>/<key>/`, complete only once `manifest.json` parses.

One writer per key: a stage takes the key's lease (`lease`) before it writes anything, so a
second run of the same key (a cron run overlapping a manual one, two trainers) fails at once
with one line naming the holder, instead of sharing or deleting the first one's work.
Holding it, the stage writes everything into a temporary sibling directory, which is moved
to its final place only when the stage succeeded; the manifest is written last, atomically
(a temporary name renamed locally, one object write on GCS). Readers accept a directory only
if its manifest parses, so a crash at any point leaves nothing that a later stage would
read. Paths may be local or `gs://` (gcsfs; tested against a GCS emulator, docs/gcs.md).

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
import fcntl
import json
import logging
import os
import posixpath
import re
import socket
import threading
import time
import uuid
from typing import Any, Iterator, Mapping, Sequence

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CONFIG = "config.yaml"


class IncompleteArtifactError(FileNotFoundError):
    """An input artifact is missing or was never completed (no manifest)."""


class CorruptManifestError(IncompleteArtifactError):
    """A manifest that does not parse (cut short by a kill): the artifact is incomplete."""


class LeaseHeldError(RuntimeError):
    """Another run is writing the same artifact key."""


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
    """True if `uri` has a manifest that parses; one that does not is logged and is False."""
    try:
        _load_manifest(uri)
    except CorruptManifestError as e:
        log.warning("%s", e)
        return False
    except IncompleteArtifactError:
        return False
    return True


def read(uri: str) -> Artifact:
    """The artifact at `uri`; IncompleteArtifactError if its manifest is missing or corrupt."""
    manifest = _load_manifest(uri)
    return Artifact(stage=manifest["stage"], key=manifest["key"], uri=uri, manifest=manifest)


def _load_manifest(uri: str) -> dict[str, Any]:
    fs, path = filesystem(uri)
    try:  # one read, no listing: gcsfs answers `open` from listings it cached earlier
        manifest = json.loads(fs.cat_file(join(path, MANIFEST)))
    except FileNotFoundError:
        raise IncompleteArtifactError(
            f"{uri} is not a complete artifact (no {MANIFEST}); run its stage first"
        ) from None
    except PermissionError:
        raise
    except OSError as e:
        if not str(e).startswith("Forbidden"):  # gcsfs's 403; retryable errors were retried
            raise
        raise PermissionError(
            f"permission denied: {join(uri, MANIFEST)} (this account may not read it)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptManifestError(
            f"{uri}: {MANIFEST} does not parse ({e}); incomplete: run its stage again"
        ) from None
    if not isinstance(manifest, dict) or not {"stage", "key"} <= manifest.keys():
        raise CorruptManifestError(f"{uri}: {MANIFEST} lacks stage and key; run its stage again")
    return manifest


def require(workdir: str, stage: str, key: str) -> Artifact:
    """The complete artifact of `stage` with `key`, or a clear error naming the stage."""
    uri = location(workdir, stage, key)
    try:
        return read(uri)
    except CorruptManifestError as e:
        raise CorruptManifestError(
            f"input stage '{stage}' has an unreadable {MANIFEST} at {uri}: "
            f"run `padir stage {stage}` again"
        ) from e
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
    publisher: bool = True,
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
      publisher: False on every process of a multi-host run but process 0: it writes into
        the same resumable directory (orbax's shards), but takes no lease, creates nothing
        and publishes nothing; process 0 does, once all processes agreed inside the body
        that they are done.

    Raises:
      LeaseHeldError: another run holds this key's lease (before anything is written).
    """
    suffix = "" if resumable else f"-{uuid.uuid4().hex[:8]}"
    tmp_uri = join(workdir, stage, f".{'partial' if resumable else 'tmp'}-{key}{suffix}")
    fs, tmp_path = filesystem(tmp_uri)
    pending = PendingArtifact(stage=stage, key=key, tmp_uri=tmp_uri)
    if not publisher:
        yield pending
        return
    with lease(workdir, stage, key):
        fs.invalidate_cache()  # listings cached before the lease may predate another run's
        fs.makedirs(tmp_path, exist_ok=True)
        started = time.time()
        try:
            yield pending
            if config_yaml:
                with fs.open(join(tmp_path, CONFIG), "w") as f:
                    f.write(config_yaml)
            _, final_path = filesystem(location(workdir, stage, key))
            _move_into_place(fs, tmp_path, final_path)
            manifest = {
                "stage": stage,
                "key": key,
                "inputs": dict(inputs),
                "config": dict(config),
                "counts": pending.counts,
                "metrics": pending.metrics,
                "wall_seconds": round(time.time() - started, 3),
                "created": _now(),
            }
            _write_atomically(fs, join(final_path, MANIFEST),
                              json.dumps(manifest, indent=2, sort_keys=True))
        except BaseException:
            if not resumable and fs.exists(tmp_path):
                fs.rm(tmp_path, recursive=True)
            raise


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _move_into_place(fs: fsspec.AbstractFileSystem, tmp_path: str, final_path: str) -> None:
    """Moves the finished directory to `final_path`, replacing what is there (a forced
    rerun, or a publication that died before its manifest; the lease rules out another
    writer). Locally both moves are renames: the old output disappears for an instant
    only, and a directory that reappeared makes the rename fail instead of nesting in it."""
    if _is_local(fs):
        if os.path.exists(final_path):
            old = f"{final_path}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final_path, old)
            os.rename(tmp_path, final_path)
            fs.rm(old, recursive=True)
        else:
            os.rename(tmp_path, final_path)
        return
    if fs.exists(final_path):
        fs.rm(final_path, recursive=True)
    if fs.exists(tmp_path):  # a bucket has no empty directories: nothing written, nothing moved
        fs.mv(tmp_path, final_path, recursive=True)


def _write_atomically(fs: fsspec.AbstractFileSystem, path: str, text: str) -> None:
    """Writes a file that readers see whole or not at all: locally a temporary name
    renamed over it; on object stores one object write, which is atomic."""
    if not _is_local(fs):
        fs.pipe_file(path, text.encode())
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- the one-writer lease ------------------------------------------------------------------

LEASE_RENEW_SECONDS = 60.0
LEASE_STALE_SECONDS = 600.0  # a remote lease not renewed for this long: its holder died


def lease_uri(workdir: str, stage: str, key: str) -> str:
    return join(workdir, stage, f".lease-{key}")


@contextlib.contextmanager
def lease(workdir: str, stage: str, key: str) -> Iterator[None]:
    """Holds the one-writer lease of `<stage>/<key>` while the body runs.

    Locally the lease is an exclusive `flock` on `<stage>/.lease-<key>`, which holds the
    holder's host, pid and start time: the kernel releases it when the holder dies, and the
    next run reports the dead holder it takes over from. On `gs://` it is an object created
    only if absent (a GCS generation precondition), renewed every minute; one not renewed
    for `LEASE_STALE_SECONDS`, or held by a process of this host that no longer exists,
    belonged to a run that died and is taken over.

    Raises:
      LeaseHeldError: one line naming the holder.
    """
    fs, path = filesystem(lease_uri(workdir, stage, key))
    name = f"{stage}/{key}"
    held = _local_lease(path, name) if _is_local(fs) else _remote_lease(fs, path, name)
    with held:
        yield


def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _now(),
            "renewed": time.time()}


def _describe(holder: Mapping[str, Any]) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} "
            f"since {holder.get('started', '?')}")


def _parse_holder(data: bytes) -> dict[str, Any]:
    try:
        holder = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _held_error(name: str, holder: Mapping[str, Any]) -> LeaseHeldError:
    return LeaseHeldError(
        f"{name} is being written by another run ({_describe(holder)}): "
        "wait for it to finish, or stop it"
    )


@contextlib.contextmanager
def _local_lease(path: str, name: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse_holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise _held_error(name, holder) from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder released (unlinked) the file between our open and flock
    try:
        previous = _parse_holder(os.pread(fd, 4096, 0))
        if previous:
            log.warning("%s: taking over the lease of a run that died (%s)",
                        name, _describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        os.fsync(fd)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):  # removed by hand meanwhile
            os.unlink(path)  # before the unlock: a waiting run then retries on a fresh file
        os.close(fd)


@contextlib.contextmanager
def _remote_lease(fs: fsspec.AbstractFileSystem, path: str, name: str) -> Iterator[None]:
    """The lease as a GCS object. Every write and delete of it is conditional on the object
    generation it expects (`ifGenerationMatch`), so that two runs never both hold it: the
    creation on 0 (absent), the renewal and the release on the holder's own generation, a
    takeover's delete on the stale generation it read. A renewal that finds another
    generation (a run took the lease over after ten missed renewals) stops renewing."""
    lease = _GcsLease(fs, path)
    holder = _holder()
    if lease.create(holder) is None:
        previous, stale_generation = lease.read()
        if previous == holder:  # our own creation, retried after its answer was lost
            lease.generation = stale_generation
        elif stale_generation is not None and not _is_stale(previous):
            raise _held_error(name, previous)
        else:
            if stale_generation is not None:
                log.warning("%s: taking over the lease of a run that died (%s)",
                            name, _describe(previous))
                if not lease.delete(stale_generation):
                    raise _held_error(name, lease.read()[0])
            if lease.create(holder) is None:
                raise _held_error(name, lease.read()[0])
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(lease, holder, stop), daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        if not lease.delete(lease.generation):
            log.warning("%s: the lease was taken over meanwhile; left to its new holder", name)


def _is_stale(holder: Mapping[str, Any]) -> bool:
    """Whether a remote lease's holder is gone: not renewed for `LEASE_STALE_SECONDS`, or
    a process of this host that no longer exists (a killed run: its key is free at once,
    as a local lock is, instead of ten minutes later)."""
    if time.time() - holder.get("renewed", 0.0) >= LEASE_STALE_SECONDS:
        return True
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class _GcsLease:
    """One lease object, written and deleted through the GCS JSON API with generation
    preconditions (gcsfs's `pipe_file` can only make a write conditional on absence).
    Writes are multipart uploads: the upload type whose preconditions every GCS server
    checks (fake-gcs-server ignores them on `uploadType=media`; docs/gcs.md)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str):
        import gcsfs.core  # a dependency of the package, imported only for gs:// workdirs

        if not isinstance(fs, gcsfs.core.GCSFileSystem):
            raise ValueError(f"{path}: a workdir is local or gs://, not {fs.protocol}")
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)
        self.upload_url = f"{gcsfs.core._location()}/upload/storage/v1/b/{self.bucket}/o"
        self.generation: str | None = None

    def create(self, holder: Mapping[str, Any]) -> str | None:
        """Creates the object if absent: its generation, or None if it exists."""
        return self._write(holder, "0")

    def renew(self, holder: Mapping[str, Any]) -> str | None:
        """Rewrites our own generation: the new one, or None if it is not ours any more."""
        return self._write(holder, self.generation)

    def _write(self, holder: Mapping[str, Any], if_generation: str) -> str | None:
        body = b"".join([
            b"--==0==\nContent-Type: application/json; charset=UTF-8\n\n",
            json.dumps({"name": self.key}).encode(),
            b"\n--==0==\nContent-Type: application/json\n\n",
            json.dumps(holder).encode(),
            b"\n--==0==--"])
        try:
            written = self.fs.call(
                "POST", self.upload_url, uploadType="multipart", ifGenerationMatch=if_generation,
                headers={"Content-Type": 'multipart/related; boundary="==0=="'}, data=body,
                json_out=True)
        except FileExistsError:  # 412: the precondition failed
            return None
        self.generation = str(written["generation"])
        return self.generation

    def read(self) -> tuple[dict[str, Any], str | None]:
        """The holder and the generation it was read from; ({}, None) if there is none."""
        try:
            meta = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, json_out=True)
            _, data = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media",
                                   ifGenerationMatch=meta["generation"])
        except (FileNotFoundError, FileExistsError):  # gone, or rewritten while read
            return {}, None
        return _parse_holder(data), str(meta["generation"])

    def delete(self, generation: str | None) -> bool:
        """Deletes `generation` of the object; False if it is not the live one."""
        try:
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key,
                         ifGenerationMatch=generation)
        except (FileNotFoundError, FileExistsError):
            return False
        return True


def _renew(lease: _GcsLease, holder: dict[str, Any], stop: threading.Event) -> None:
    while not stop.wait(LEASE_RENEW_SECONDS):
        holder["renewed"] = time.time()
        try:
            if lease.renew(holder) is None:
                log.error("the lease %s was taken over by another run: stop this one",
                          lease.path)
                return
        except OSError as e:  # a missed renewal is harmless unless ten in a row are missed
            log.warning("could not renew the lease %s: %s", lease.path, e)


# --- what runs that died leave behind --------------------------------------------------------

# Names beside the artifacts in `<stage>/`, as `write`, `_move_into_place` and `lease` make them.
_LEFTOVER_NAMES = {
    "tmp": re.compile(r"\.tmp-(?P<key>[0-9a-f]+)-[0-9a-f]{8}"),
    "partial": re.compile(r"\.partial-(?P<key>[0-9a-f]+)"),
    "old": re.compile(r"(?P<key>[0-9a-f]+)\.old-[0-9a-f]{8}"),
    "lease": re.compile(r"\.lease-(?P<key>[0-9a-f]+)"),
    "incomplete": re.compile(r"(?P<key>[0-9a-f]+)"),
}


@dataclasses.dataclass(frozen=True)
class Leftover:
    """An entry of `<stage>/` that no complete artifact owns: never read by a stage."""

    stage: str
    key: str
    uri: str
    kind: str  # a key of `_LEFTOVER_NAMES`: "partial" is work a rerun resumes from


def leftovers(workdir: str, stages: Sequence[str]) -> list[Leftover]:
    """What runs of `stages` that died (SIGKILL, power loss) left in `workdir`: temporary,
    partial and replaced directories, lease files, and final directories whose manifest is
    missing or does not parse. A run in progress shows its own too (its lease is held)."""
    found = []
    for stage in stages:
        fs, stage_path = filesystem(join(workdir, stage))
        fs.invalidate_cache(stage_path)  # other processes' runs since this one last listed
        if not fs.isdir(stage_path):
            continue
        for path in sorted(fs.ls(stage_path, detail=False)):
            name = posixpath.basename(path.rstrip("/"))
            uri = join(workdir, stage, name)
            for kind, pattern in _LEFTOVER_NAMES.items():
                match = pattern.fullmatch(name)
                if match and (kind != "incomplete" or (fs.isdir(path) and not is_complete(uri))):
                    found.append(Leftover(stage, match["key"], uri, kind))
                    break
    return found
