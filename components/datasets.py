"""The public corpora the shipped configs read: fetched once, checked, cached.

Configs name their corpora under the data root, `${PADIR_DATA_ROOT}/multi30k/train.en.gz`.
When the user sets PADIR_DATA_ROOT (a local copy, CI, a `gs://` bucket), the files are read
from there and nothing is fetched. When not, `padir` and `python -m pipelines.NAME` (both
load their config through `load_config`) point it at a local cache laid out like a data
root (`use_cache`: `$XDG_CACHE_HOME/padir/data`, default ~/.cache/padir/data) and fetch
there the files a config names (`required`, `fetch_all`) before the prepare stage reads
them. Artifact keys hash the placeholder, not the root, so a run on the cache and one on a
local copy of the same bytes share their artifacts.

Every fetchable file is pinned in `FILES`: a URL at a fixed commit and the sha256 of its
bytes. A download goes to a temporary file beside its destination and is renamed into
place only once its checksum matches, so an interrupted or altered download leaves nothing
that a later run would read, and a file in the cache is one that matched (it is not
checked again). Failures are one `FetchError` line naming the URL and what to do.

Tatoeba (configs/tatoeba_de_en.yaml) has no pinned public source: manythings.org replaces
its export in place. A config that names it needs PADIR_DATA_ROOT (docs/data.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import logging
import os
import urllib.error
import urllib.request
import uuid
from typing import Iterable, MutableMapping, Optional, Sequence

from components import config as config_lib
from components import logs
from components.config import DataConfig

log = logging.getLogger(__name__)

ROOT_VARIABLE = "PADIR_DATA_ROOT"
PLACEHOLDER = "${" + ROOT_VARIABLE + "}"
ADVICE = f"set {ROOT_VARIABLE} to a local copy of the data (docs/data.md)"
TIMEOUT_S = 60  # per socket operation, not per file
_BLOCK = 1 << 16

# Multi30k task 1 (github.com/multi30k/dataset), raw cased text, at a fixed commit.
MULTI30K_COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
MULTI30K_URL = f"https://github.com/multi30k/dataset/raw/{MULTI30K_COMMIT}/data/task1/raw"
MULTI30K_SHA256 = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
}


class FetchError(RuntimeError):
    """A file that could not be fetched: one line naming the URL (its secrets redacted,
    `logs.redact`) or file and what to do."""

    def __init__(self, message: str):
        super().__init__(logs.redact(message))


@dataclasses.dataclass(frozen=True)
class DataFile:
    """Where a file's pinned public copy is, and the sha256 of its bytes."""

    url: str
    sha256: str


# Names are paths under the data root, as the configs write them after `${PADIR_DATA_ROOT}/`.
FILES = {f"multi30k/{name}": DataFile(f"{MULTI30K_URL}/{name}", sha256)
         for name, sha256 in MULTI30K_SHA256.items()}


def cache_dir(environ: MutableMapping[str, str] = os.environ, name: str = "data") -> str:
    """`$XDG_CACHE_HOME/padir/<name>` (default ~/.cache/padir/<name>): the fetched data
    (`data`), the compiled XLA programs (`jax`), the CTranslate2 exports (`ctranslate2`)."""
    cache_home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "padir", name)


def use_cache(environ: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """Points PADIR_DATA_ROOT at the cache when the user did not set it (or set it empty).

    Returns:
      the cache, into which the caller fetches what a config needs; None when the user's
      data root is read as it is.
    """
    if environ.get(ROOT_VARIABLE):
        return None
    environ[ROOT_VARIABLE] = root = cache_dir(environ)
    return root


def load_config(path: str, overrides: Sequence[str] = (), *,
                reads_corpora: bool) -> config_lib.Config:
    """`config.load` for a command that takes a config (`padir`, `python -m pipelines.NAME`),
    with the data root's fallback: without PADIR_DATA_ROOT the configs' corpora are read
    from the cache (`use_cache`), and a command that reads the raw corpora (one that may run
    the prepare stage) first fetches there the files the config names.

    Raises:
      ConfigError: a bad config.
      FetchError: a file that could not be fetched, or one with no pinned source.
    """
    cache = use_cache()
    config = config_lib.load(path, overrides)
    if cache and reads_corpora:  # before any stage starts
        fetch_all(required(config.data), cache)
    return config


def required(data: DataConfig) -> list[str]:
    """The names (`FILES` keys) of the files `data`'s corpora read under the data root.

    Raises:
      FetchError: a corpus under the data root that has no pinned source (Tatoeba).
    """
    corpora = [data.train, *([data.dev] if data.dev else []), *(t.corpus for t in data.test)]
    names = []
    for corpus in corpora:
        for location in (corpus.source, corpus.target, corpus.tsv):
            if location is None or PLACEHOLDER not in location:
                continue
            name = location.removeprefix(PLACEHOLDER + "/")
            if name not in FILES:
                raise FetchError(f"{location}: no public source is pinned for this file; set "
                                 f"{ROOT_VARIABLE} to a directory that holds it (docs/data.md)")
            names.append(name)
    return sorted(set(names))


def fetch(name: str, root: str, *, base_url: Optional[str] = None) -> str:
    """The local path of `FILES[name]` under `root`, downloaded and checked if not there yet.

    Args:
      name: a `FILES` key, e.g. "multi30k/train.en.gz"; the file lands at `root/name`.
      root: a local directory laid out like a data root (the cache, or `--root`).
      base_url: a server laid out like a data root (`<base_url>/multi30k/train.en.gz`),
        instead of the file's pinned public URL (tests serve a local copy on loopback).

    Raises:
      FetchError: an HTTP error, no network, a cut connection or a checksum that differs;
        nothing is left at `root/name`.
    """
    path = os.path.join(root, name)
    if os.path.exists(path):
        return path
    pinned = FILES[name]
    url = f"{base_url.rstrip('/')}/{name}" if base_url else pinned.url
    # Beside its place (one file system, so the rename is atomic), named by no other fetch;
    # opened with `open`, not mkstemp, so that it gets the umask's mode rather than 0600.
    partial = os.path.join(os.path.dirname(path),
                           f".{os.path.basename(path)}.{uuid.uuid4().hex}.part")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        out = open(partial, "xb")
    except OSError as e:
        raise FetchError(f"cannot write into {root}: {e.strerror or e}; set XDG_CACHE_HOME to "
                         f"a writable directory, or {ADVICE}") from e
    log.info("fetching %s into %s", logs.redact_url(url), root)
    try:
        with out:
            sha256 = _download(url, out)
        if sha256 != pinned.sha256:
            raise FetchError(f"{url}: sha256 {sha256} is not the pinned {pinned.sha256} (the "
                             f"file there changed, or the download was altered); {ADVICE}")
        os.replace(partial, path)
    except BaseException:
        os.unlink(partial)
        raise
    return path


def fetch_all(names: Iterable[str], root: str, *, base_url: Optional[str] = None) -> list[str]:
    """`fetch` of each name, in order; returns the local paths."""
    return [fetch(name, root, base_url=base_url) for name in names]


def _download(url: str, out) -> str:
    """Copies the body at `url` into `out` and returns its sha256 (hex).

    Raises:
      FetchError: an HTTP error status, a network error, or fewer bytes than the server
        announced (the connection closed mid-file).
    """
    digest, received = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            announced = response.headers.get("Content-Length")
            while block := response.read(_BLOCK):
                out.write(block)
                digest.update(block)
                received += len(block)
    except urllib.error.HTTPError as e:
        raise FetchError(f"cannot download {url}: HTTP {e.code} {e.reason}; try again later, "
                         f"or {ADVICE}") from e
    except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, resets
        reason = getattr(e, "reason", None) or e
        raise FetchError(f"cannot download {url}: {reason}; check the network, "
                         f"or {ADVICE}") from e
    if announced is not None and received != int(announced):
        raise FetchError(f"cannot download {url}: the connection closed after {received} of "
                         f"{announced} bytes; try again, or {ADVICE}")
    return digest.hexdigest()
