"""Stage artifacts: `<workdir>/<stage>/<key>/`, complete only once `manifest.json` parses.

One writer per key (docs/failures.md): a stage takes the key's lease (`lease`) before it
writes anything, so that a second run of the same key (a cron run overlapping a manual
one, two trainers) fails at once with one line naming the holder. The lease saves
duplicate work; what keeps a published artifact whole is the publish itself, a commit that
a run which lost its lease cannot make (its fencing token), and which never removes or
mixes into an artifact that another run published:
  local disk  the finished directory, manifest included, is renamed to its final path; a
              rename onto a directory that holds files fails, so it lands only where no
              artifact is, or where the one it started from was moved aside (a forced
              rerun). The lease is a kernel lock that only the holder's death releases.
  gs://       the run records what it publishes (each object, and the generation each
              destination must still have) in its lease object, a write conditional on the
              lease generation it holds; then it copies each object on that condition, the
              manifest last. A run that takes a lease over first finishes the publication
              recorded in it, so the run it took over from can write nothing more.
Content-keyed: a run that finds its key published by another run meanwhile discards its
own output and the stage reads the published one. Readers accept a directory only if its
manifest parses, so a crash at any point leaves nothing that a later stage would read.
Paths may be local or `gs://` (gcsfs; tested against a GCS emulator, docs/gcs.md).

Example:
    with artifacts.write(workdir, "prepare", key, config=cfg, inputs={}) as out:
        write_files_under(out.tmp_uri)
        out.counts["read"] = 29000
    prepared = artifacts.require(workdir, "prepare", key)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import email.utils
import errno
import fcntl
import json
import logging
import os
import posixpath
import re
import shutil
import socket
import threading
import time
import uuid
from typing import Any, Iterator, Mapping, Sequence

import fsspec
from fsspec.implementations.local import LocalFileSystem

from components import logs

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
    """A stage stopped early: on request (SIGTERM), its partial work kept to resume from; or
    because it lost its lease (`LeaseLost`)."""


class LeaseLost(StageStopped):
    """This run lost its key's lease (taken over, or not renewed in time) and stopped: the
    publish it had not committed is one it can no longer make."""


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
        It is still never read by another stage: it is not at the final location.
      publisher: False on every process of a multi-host run but process 0: it writes into
        the same resumable directory (orbax's shards), but takes no lease, creates nothing
        and publishes nothing; process 0 does, once all processes agreed inside the body
        that they are done.

    Raises:
      LeaseHeldError: another run holds this key's lease (before anything is written).
      LeaseLost: the lease was lost before this run committed its publication.
    """
    suffix = "" if resumable else f"-{uuid.uuid4().hex[:8]}"
    tmp_uri = join(workdir, stage, f".{'partial' if resumable else 'tmp'}-{key}{suffix}")
    fs, tmp_path = filesystem(tmp_uri)
    _, final_path = filesystem(location(workdir, stage, key))
    pending = PendingArtifact(stage=stage, key=key, tmp_uri=tmp_uri)
    if not publisher:
        yield pending
        return
    with lease(workdir, stage, key) as held:
        fs.invalidate_cache()  # listings cached before the lease may predate another run's
        replaces = held.published(final_path)  # what a forced rerun may replace
        fs.makedirs(tmp_path, exist_ok=True)
        started = time.time()
        try:
            yield pending
            if config_yaml:
                with fs.open(join(tmp_path, CONFIG), "w") as f:
                    f.write(config_yaml)
            manifest = {
                "stage": stage,
                "key": key,
                "inputs": logs.redact_values(dict(inputs)),
                "config": logs.redact_values(dict(config)),
                "counts": pending.counts,
                "metrics": pending.metrics,
                "wall_seconds": round(time.time() - started, 3),
                "created": _now(),
            }
            _write_atomically(fs, join(tmp_path, MANIFEST),
                              json.dumps(manifest, indent=2, sort_keys=True))
            held.publish(tmp_path, final_path, replaces=replaces, temporary=not resumable)
        except BaseException:
            # A committed publication's source is left to whoever finishes it (the lease).
            if not resumable and not held.committed and fs.exists(tmp_path):
                fs.rm(tmp_path, recursive=True)
            raise


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


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


def _kept_theirs(name: str) -> None:
    log.warning("%s: another run published this key while this one ran; its artifact is "
                "kept and this run's output discarded", name)


# --- the one-writer lease ------------------------------------------------------------------

LEASE_RENEW_SECONDS = 60.0
# A remote lease whose object the server has not seen rewritten for this long belonged to a
# run that died (or stalled) and may be taken over; its holder stops renewing and cancels
# its stage after half of it (`_renew`), so that a live holder is never taken over.
LEASE_STALE_SECONDS = 600.0


def lease_uri(workdir: str, stage: str, key: str) -> str:
    return join(workdir, stage, f".lease-{key}")


@contextlib.contextmanager
def lease(workdir: str, stage: str, key: str) -> Iterator["_LocalLease | _GcsLease"]:
    """Holds the one-writer lease of `<stage>/<key>` while the body runs; yields the held
    lease, whose `publish` is the only way `write` puts an artifact in place.

    Locally the lease is an exclusive `flock` on `<stage>/.lease-<key>`, which holds the
    holder's host, pid and start time: the kernel releases it when the holder dies, and the
    next run reports the dead holder it takes over from. On `gs://` it is an object created
    only if absent (a GCS generation precondition) and rewritten every minute on the
    generation it holds. One the server has not seen rewritten for `LEASE_STALE_SECONDS`
    (its own `updated` time against its own clock), or held by a process that no longer
    exists on this very host (same boot and pid namespace), belonged to a run that died and
    is taken over, by a write on the generation read, so that of several takers one wins.
    A holder whose renewals fail, or find another holder, stops its stage (`LeaseLost`).

    Raises:
      LeaseHeldError: one line naming the holder.
      LeaseLost: the body was stopped because the lease was lost.
    """
    fs, path = filesystem(lease_uri(workdir, stage, key))
    name = f"{stage}/{key}"
    held = _local_lease(path, name) if _is_local(fs) else _remote_lease(fs, path, name)
    with held as handle:
        yield handle


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _holder() -> dict[str, Any]:
    """Who holds a lease. `boot` and `pidns` say whether a pid names a process of this
    very host: containers share hostnames, and pids, only within one pid namespace."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "boot": _boot_id(),
            "pidns": _pid_namespace(), "started": _now(), "run": uuid.uuid4().hex}


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


class _LocalLease:
    """A held local lease (an open, flocked lease file) and the publish it fences."""

    committed = False  # the rename is the commit: after it there is no source left

    def __init__(self, path: str, name: str, fd: int):
        self.path, self.name, self.fd = path, name, fd

    def holds(self) -> bool:
        """Whether the lease file is still the one this run locked (not removed by hand)."""
        try:
            return os.fstat(self.fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def published(self, final_path: str) -> tuple[int, int] | None:
        """Which complete artifact is at `final_path` (its directory's and its manifest's
        inodes), or None."""
        if not is_complete(final_path):
            return None
        try:
            return os.stat(final_path).st_ino, os.stat(join(final_path, MANIFEST)).st_ino
        except FileNotFoundError:
            return None

    def publish(self, tmp_path: str, final_path: str, *, replaces: Any,
                temporary: bool) -> None:
        """Renames the finished `tmp_path` to `final_path`, which must not hold an artifact
        other than `replaces` (the one found when the lease was taken)."""
        with _stage_lock(os.path.dirname(self.path)):
            self._publish(tmp_path, final_path, replaces, temporary)

    def _publish(self, tmp_path: str, final_path: str, replaces: Any, temporary: bool):
        if not self.holds():
            if self.published(final_path) not in (None, replaces):
                if temporary:
                    shutil.rmtree(tmp_path, ignore_errors=True)
                _kept_theirs(self.name)
                return
            raise LeaseLost(f"{self.name}: its lease file {self.path} was removed or replaced "
                            "while this run wrote; it published nothing")
        if _rename_into_free(tmp_path, final_path):
            return
        if self.published(final_path) not in (None, replaces):
            if temporary:
                shutil.rmtree(tmp_path, ignore_errors=True)
            _kept_theirs(self.name)
            return
        # A forced rerun, or a publication cut short by a crash: the new directory takes the
        # old one's place in one step where the kernel can swap them; else the old one goes
        # aside first. A reader that opened the old one's files keeps them either way.
        if _exchange(tmp_path, final_path):
            shutil.rmtree(tmp_path, ignore_errors=True)
            return
        aside = f"{final_path}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final_path, aside)
        os.rename(tmp_path, final_path)
        shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def _stage_lock(directory: str) -> Iterator[None]:
    """An exclusive `flock` on a stage's directory while a local lease is taken or a
    publish checks its lease and renames: a lease file removed by hand then lets another run
    in only before or after a publish, never between its check and its rename."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(first: str, second: str) -> bool:
    """Swaps two directories in one step (Linux's `renameat2` with RENAME_EXCHANGE), so that
    a reader never finds neither: whether it could (not without the call, as on macOS, nor
    on a filesystem that refuses it)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second),
                 _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), first, None, second)


def _rename_into_free(source: str, destination: str) -> bool:
    """Renames a directory to `destination` unless a directory with files is there (the
    kernel checks it in the same step): whether it moved."""
    try:
        os.rename(source, destination)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


@contextlib.contextmanager
def _local_lease(path: str, name: str) -> Iterator[_LocalLease]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _stage_lock(os.path.dirname(path)):
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
            os.close(fd)  # the holder released (unlinked) the file between open and flock
    held = _LocalLease(path, name, fd)
    try:
        previous = _parse_holder(os.pread(fd, 4096, 0))
        if previous:
            log.warning("%s: taking over the lease of a run that died (%s)",
                        name, _describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        os.fsync(fd)
        yield held
    finally:
        if held.holds():  # not if it was removed or replaced by hand meanwhile
            os.unlink(path)  # before the unlock: a waiting run then retries on a fresh file
        os.close(fd)


@contextlib.contextmanager
def _remote_lease(fs: fsspec.AbstractFileSystem, path: str, name: str) -> Iterator["_GcsLease"]:
    held = _GcsLease(fs, path, name)
    held.acquire()
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(held, stop), daemon=True,
                               name=f"lease {name}")
    renewer.start()
    try:
        try:
            held.finish_recorded()  # a publication that the run taken over from committed
            if not held.stopper.arm():
                raise LeaseLost(held.lost)
            yield held
        finally:
            held.stopper.disarm()
    except BaseException as e:
        if held.lost is None or held.settled or isinstance(e, LeaseLost):
            raise
        raise LeaseLost(held.lost) from (None if isinstance(e, _Stopped) else e)
    finally:
        stop.set()
        renewer.join()
        held.release()
    if held.lost is not None and not held.settled:
        raise LeaseLost(held.lost)  # the body ended before the stop reached it


def _is_stale(holder: Mapping[str, Any], age: float) -> bool:
    """Whether a remote lease's holder is gone: its object not rewritten for
    `LEASE_STALE_SECONDS` by the server's clock (`age`), released with a publication for
    the next run to finish (`_GcsLease.release`), or its holder a process that no
    longer exists on this very host (a killed run: its key is free at once, as a local
    lock is, instead of ten minutes later)."""
    if age >= LEASE_STALE_SECONDS or holder.get("released"):
        return True
    pid = holder.get("pid")
    same_host = holder.get("boot") and holder.get("pidns") and \
        (holder["boot"], holder["pidns"]) == (_boot_id(), _pid_namespace())
    if not same_host or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _server_age(meta: Mapping[str, Any], headers: Mapping[str, str]) -> float:
    """Seconds since the server last wrote an object: its `updated` time against the `Date`
    of the server's answer, one clock (to the second)."""
    now = email.utils.parsedate_to_datetime(headers["Date"])
    return (now - datetime.datetime.fromisoformat(meta["updated"])).total_seconds()


class _Stopped(BaseException):
    """Raised in the stage's thread by its lease's renewer: not an `Exception`, so that no
    handler of the stage's libraries takes it for one of theirs."""


class _Stopper:
    """Stops the thread that holds a lease, while the stage's body runs, by raising
    `_Stopped` in it: the stage may be inside Beam or JAX, whose loops have no hook to stop
    them, and CPython raises it at that thread's next bytecode. Never during a publish:
    its commit is conditional, and a step cut in two could not tell what it did."""

    def __init__(self):
        self.thread = threading.get_ident()
        self.lock = threading.Lock()
        self.armed = False
        self.reason: str | None = None

    def stop(self, reason: str) -> None:
        with self.lock:
            if self.reason is None:
                self.reason = reason
                if self.armed:
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread),
                                                               ctypes.py_object(_Stopped))
                self.armed = False

    def arm(self) -> bool:
        """Whether armed: False if a stop came first."""
        with self.lock:
            self.armed = self.reason is None
            return self.armed

    def disarm(self) -> None:
        """No stop from now on; one raised but not yet delivered is withdrawn."""
        with self.lock:
            self.armed = False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread), None)


class _GcsLease:
    """A lease object and the publications it fences, through the GCS JSON API with
    generation preconditions (gcsfs's `pipe_file` can only make a write conditional on
    absence). Its writes are multipart uploads: the upload type whose preconditions every
    GCS server checks (docs/gcs.md). `holder` is what the object holds: the holder's
    identity, a `run` id that tells this run's writes from any other's, and, between the
    commit of a publication and its end, the publication (`publish`)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, name: str):
        import gcsfs.core  # a dependency of the package, imported only for gs:// workdirs

        if not isinstance(fs, gcsfs.core.GCSFileSystem):
            raise ValueError(f"{path}: a workdir is local or gs://, not {fs.protocol}")
        self.fs, self.path, self.name = fs, path, name
        self.bucket, self.key, _ = fs.split_path(path)
        self.upload_url = f"{gcsfs.core._location()}/upload/storage/v1/b/{self.bucket}/o"
        self.holder = _holder()
        self.run = self.holder["run"]
        self.generation: str | None = None
        self.written = 0.0  # when the write of the live generation started (monotonic)
        self.lock = threading.Lock()  # the renewer's writes and the commit's, one at a time
        self.stopper = _Stopper()
        self.taken_by: dict[str, Any] = {}  # the holder a failed write found
        self.committed = False  # this run's publication is recorded in the lease
        # Nothing of this run's publication is left for it to do: made, or another run's
        # artifact kept, or left to the run that took the lease over.
        self.settled = False

    @property
    def lost(self) -> str | None:
        """Why this run lost the lease, if it did."""
        return self.stopper.reason

    # -- the object ---------------------------------------------------------------------

    def _write(self, holder: Mapping[str, Any], if_generation: str,
               timeout: float | None) -> str | None:
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
                json_out=True, timeout=timeout)
        except FileExistsError:  # 412: the precondition failed
            return None
        return str(written["generation"])

    def read(self, timeout: float | None = None) -> tuple[dict[str, Any], str | None, float]:
        """The holder, the generation it was read from and its age by the server's clock;
        ({}, None, 0.0) if there is none."""
        try:
            headers, meta = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key,
                                         timeout=timeout)
            meta = json.loads(meta)
            _, data = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, alt="media",
                                   ifGenerationMatch=meta["generation"], timeout=timeout)
        except (FileNotFoundError, FileExistsError):  # gone, or rewritten while read
            return {}, None, 0.0
        return _parse_holder(data), str(meta["generation"]), _server_age(meta, headers)

    def delete(self, generation: str | None) -> bool:
        """Deletes `generation` of the object; False if it is not the live one."""
        try:
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key,
                         ifGenerationMatch=generation)
        except (FileNotFoundError, FileExistsError):
            return False
        return True

    def _swap(self, holder: dict[str, Any], if_generation: str,
              timeout: float | None = None) -> bool:
        """Writes `holder` over generation `if_generation` ("0": absent); whether it is
        now the live one. A 412 whose object holds this run's own `holder` is a write of
        ours whose answer was lost and that the client retried; one holding an older
        write of ours that landed late is written over once more."""
        started = time.monotonic()
        for _ in range(3):
            generation = self._write(holder, if_generation, timeout)
            if generation is None:
                current, live, _ = self.read(timeout)
                if live is None or current.get("run") != self.run:
                    self.taken_by = current
                    return False
                if current != holder:
                    if_generation = live
                    continue
                generation = live
            self.generation, self.holder, self.written = generation, holder, started
            return True
        return False

    def lost_to(self) -> str:
        """Who has the lease now, as a failed write found it."""
        if not self.taken_by:
            return "deleted"
        return f"taken over by another run ({_describe(self.taken_by)})"

    def renew(self, timeout: float) -> bool:
        with self.lock:
            return self._swap(self.holder, self.generation, timeout)

    def holds(self) -> bool:
        current, _, _ = self.read()
        return current.get("run") == self.run

    # -- taking and releasing ----------------------------------------------------------------

    def acquire(self) -> None:
        """Creates the object, or takes over a stale one (carrying over the publication
        recorded in it, which `finish_recorded` then finishes)."""
        for _ in range(3):
            if self._swap(self.holder, "0"):
                return
            previous, generation, age = self.read()
            if generation is None:
                continue  # released meanwhile: create it again
            if not _is_stale(previous, age):
                raise _held_error(self.name, previous)
            log.warning("%s: taking over the lease of a run that died (%s)",
                        self.name, _describe(previous))
            recorded = previous.get("publishing")
            if self._swap(dict(self.holder, publishing=recorded) if recorded else self.holder,
                          generation):
                return
            # another run took it over first (or its holder renewed it): named below
        raise _held_error(self.name, self.read()[0])

    def finish_recorded(self) -> None:
        recorded = self.holder.get("publishing")
        if recorded is None:
            return
        log.warning("%s: finishing the publication of the run taken over from", self.name)
        self._materialize(recorded)
        with self.lock:
            self._swap({k: v for k, v in self.holder.items() if k != "publishing"},
                       self.generation)

    def release(self) -> None:
        """Deletes the object if it is still ours. A publication committed but not made (a
        step failed, not for the lease) is handed over instead: the object, marked
        released, keeps it for the next run of the key, which takes it over at once and
        finishes it before anything else (`finish_recorded`)."""
        recorded = self.holder.get("publishing")
        try:
            if recorded and not self.settled:
                released = self._swap(dict(self.holder, released=True), self.generation)
                if released:
                    log.warning("%s: this run's publication failed after its commit; the "
                                "next run of this key finishes it", self.name)
            else:
                released = self.delete(self.generation)
        except Exception as e:  # whatever the client raises: the lease then goes stale
            log.warning("%s: could not release the lease (%s); it goes stale in %d s",
                        self.name, logs.redact(str(e).splitlines()[0]), LEASE_STALE_SECONDS)
            return
        if not released and self.lost is None:
            log.warning("%s: the lease was taken over meanwhile; left to its new holder",
                        self.name)

    # -- publishing ----------------------------------------------------------------------

    def published(self, final_path: str) -> str | None:
        """Which complete artifact is at `final_path` (its manifest's generation), or None."""
        try:
            generation = self.fs.info(join(final_path, MANIFEST))["generation"]
        except FileNotFoundError:
            return None
        return str(generation) if is_complete(self.fs.unstrip_protocol(final_path)) else None

    def _objects(self, prefix: str) -> dict[str, str]:
        """Object name under `prefix` -> its generation."""
        self.fs.invalidate_cache(prefix)
        found = self.fs.find(prefix, detail=True)
        return {name[len(prefix) + 1:]: str(info["generation"]) for name, info in found.items()
                if name.startswith(f"{prefix}/") and name != f"{prefix}/"}

    def publish(self, tmp_path: str, final_path: str, *, replaces: str | None,
                temporary: bool) -> None:
        """Commits, then makes, the publication of `tmp_path` at `final_path`, which must
        not hold an artifact other than `replaces` (the one found when the lease was taken).

        The commit records in the lease object, on the generation this run holds, every
        object to copy with the generation its destination has now (0: none), and every
        object of `final_path` to delete (a replaced artifact's files that this one lacks);
        each copy and delete is then made on that generation, the manifest copied last."""
        self.stopper.disarm()
        self.fs.invalidate_cache()
        if self._keep_theirs(tmp_path, final_path, replaces=replaces, temporary=temporary):
            return
        source, there = self._objects(tmp_path), self._objects(final_path)
        names = sorted(source, key=lambda name: (name == MANIFEST, name))
        recorded = {"source": tmp_path, "final": final_path, "temporary": temporary,
                    "copy": [[name, there.get(name, "0")] for name in names],
                    "delete": sorted([name, generation] for name, generation in there.items()
                                     if name not in source)}
        with self.lock:
            self.committed = self._swap(dict(self.holder, publishing=recorded),
                                        self.generation)
        if not self.committed:
            if self._keep_theirs(tmp_path, final_path, replaces=replaces, temporary=temporary):
                return
            raise LeaseLost(f"{self.name}: its lease was {self.lost_to()} before this run "
                            "published; it published nothing")
        self._materialize(recorded)
        self.settled = True

    def _keep_theirs(self, tmp_path: str, final_path: str, *, replaces: str | None,
                     temporary: bool) -> bool:
        """If another run published `final_path` meanwhile: discards this run's output,
        keeps theirs, and says so (True)."""
        if self.published(final_path) in (None, replaces):
            return False
        if temporary:
            self.fs.rm(tmp_path, recursive=True)
        _kept_theirs(self.name)
        self.settled = True
        return True

    def _materialize(self, recorded: Mapping[str, Any]) -> None:
        """Makes a recorded publication, whoever recorded it: each step on its generation,
        so that a step already made (by this run's retried request, or by the run that
        recorded it) fails with 412 or 404, and is passed over while this run holds the
        lease; without it, this run stops."""
        source, final = recorded["source"], recorded["final"]
        for name, generation in recorded["copy"]:
            self._step(self._copy, join(source, name), join(final, name), generation)
        for name, generation in recorded["delete"]:
            bucket, key, _ = self.fs.split_path(join(final, name))
            self._step(self.fs.call, "DELETE", "b/{}/o/{}", bucket, key,
                       ifGenerationMatch=generation)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(source, recursive=True)
        self.fs.invalidate_cache()

    def _step(self, do, *args, **kwargs) -> None:
        try:
            do(*args, **kwargs)
        except (FileExistsError, FileNotFoundError):
            if not self.holds():
                self.settled = True  # whoever holds the lease now finishes it
                raise LeaseLost(f"{self.name}: its lease was taken over while this run "
                                "published; the new holder finishes the publication") from None

    def _copy(self, source: str, destination: str, generation: str) -> None:
        from_bucket, from_key, _ = self.fs.split_path(source)
        to_bucket, to_key, _ = self.fs.split_path(destination)
        params: dict[str, str] = {"ifGenerationMatch": generation}
        while True:  # a large object may take several calls
            out = self.fs.call("POST", "b/{}/o/{}/rewriteTo/b/{}/o/{}", from_bucket, from_key,
                               to_bucket, to_key, headers={"Content-Type": "application/json"},
                               json_out=True, **params)
            if out["done"]:
                return
            params["rewriteToken"] = out["rewriteToken"]


def _renew(held: _GcsLease, stop: threading.Event) -> None:
    """Rewrites the lease every `LEASE_RENEW_SECONDS` (at least four times per stale
    period) until `stop`. A renewal that finds another holder stops the stage at once;
    renewals that fail are retried until half of `LEASE_STALE_SECONDS` has passed since the
    start of the last one that succeeded (the server saw it after that), and then stop the
    stage: long before any run could take the lease over from it."""
    every = min(LEASE_RENEW_SECONDS, LEASE_STALE_SECONDS / 4)
    last = held.written  # the server wrote it after this
    due = last + every
    error = ""
    while True:
        deadline = last + LEASE_STALE_SECONDS / 2
        if stop.wait(max(0.0, min(due, deadline) - time.monotonic())):
            return
        start = time.monotonic()
        if start >= deadline:
            held.stopper.stop(f"{held.name}: its lease went {start - last:.0f} s without a "
                              f"renewal ({error or 'this process was held up'}); stopped "
                              "before another run could take it over")
            return
        try:
            if not held.renew(timeout=deadline - start):
                held.stopper.stop(f"{held.name}: its lease was {held.lost_to()}; this run "
                                  "stopped")
                return
            last = held.written
        except Exception as e:  # gcsfs's HttpError, aiohttp's ClientError, OSError, ...
            error = logs.redact(f"{type(e).__name__}: {e}".splitlines()[0])
            log.warning("%s: could not renew the lease (%s); retrying", held.name, error)
        due = start + every


# --- what runs that died leave behind --------------------------------------------------------

# Names beside the artifacts in `<stage>/`, as `write`, `_LocalLease.publish` and `lease` make them.
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
