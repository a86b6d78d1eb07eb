"""An AR model (the teacher, or the AR student: `DecodeMethod.model`) decoded by
CTranslate2: the `ct2_greedy` and `ct2_beam` kinds.

A `Translator` (translator.py) of these kinds hands each batch to `Search` instead of its
jitted JAX calls; everything around it (tokenisation, the source cut to the widest bucket,
the output cap, filler-free batches, the records) is the Translator's, so the rows compare
with ours sentence for sentence. The model is exported once per machine and kept
(ctranslate2_export.py, float32, into `$XDG_CACHE_HOME/padir/ctranslate2`: `export_dir`;
with a vocabulary map when the method has `shortlist`) and served by a `Worker`: a child
process (ctranslate2_worker.py) that imports CTranslate2 and never JAX, one per export,
compute type (`float32`, or `int8`: weights quantised when CTranslate2 loads them) and
`Threads`, started on first use and closed when this process exits.

Why a process of its own: CTranslate2's threads that share cores with XLA's pool run it
several-fold slower (the demo's teacher at batch 1: 24 ms a sentence in the decode stage's
process, 4 ms alone). In the worker, only the parent's idle threads are beside it: the
parent waits on the pipe while the worker translates.

Search settings, against ours (model/decoding/beam_search.py):
  * the same output cap (`max_decoding_length`, EOS counted), no minimum length, and the
    ids ours masks (pad, BOS, [MASK], [LENGTH]) suppressed;
  * greedy is token for token ours (tests/test_ctranslate2.py);
  * beam search keeps `beam_size` hypotheses and stops when that many have finished, as
    ours does, but CTranslate2 4.x normalises a finished hypothesis's log-probability by
    length ** length_penalty (length counting EOS), where ours divides by the GNMT
    penalty ((5 + length) / 6) ** length_penalty. At length_penalty 0 the two are token
    for token equal; at 0.6 a sentence may end on another hypothesis;
  * `shortlist`: CTranslate2's own shortlist, its vocabulary map (`use_vmap`), built from
    the same table as ours (model/decoding/shortlist.py; ours pads its selection with frequent
    pieces to a size step, CTranslate2 does not).

Threads (`Threads`: CTranslate2's `intra_threads`, the threads of one translation, and
`inter_threads`, translations run in parallel): the decode stage chooses them per regime
by timing (model/decoding/ctranslate2_sweep.py); elsewhere (distillation, `padir translate`)
one thread a translation and as many translations at once as this process has CPUs, the
sweep's choice in both regimes for every method on the benchmark's 2-core machine (two
threads on one translation were 5-11x slower at batch 1 and 1.3-8x batched, 2026-12-07).
A batch is cut into `inter_threads` sub-batches (`max_batch_size`), which CTranslate2
translates in parallel; a batch of one is one translation on one thread.

Timing: `batch_seconds` is the wall time of the `translate_batch` call, measured in the
worker (the pieces are looked up before, the ids after, the pipe outside); it is all
search (`encode_seconds` 0). The device is the one JAX decodes on (the CPU, or CUDA where
JAX runs on a GPU).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import inspect
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, Optional, Sequence

import jax
import numpy as np

from components import datasets
from components.config import DecodeMethod
from components.tokenizer import PAD_ID
from model.decoding import ctranslate2_export, shortlist
from model.transformer import NON_TARGET_IDS

KINDS = ("ct2_greedy", "ct2_beam")
_LOCK = threading.Lock()
_WORKERS: dict[tuple, "Worker"] = {}  # (model dir, device, compute type, Threads) -> worker
# (artifact URI, with a vocabulary map) -> its export: the parameters hashed once a process.
_EXPORTS: dict[tuple[str, bool], str] = {}


class WorkerError(RuntimeError):
    """The CTranslate2 worker failed to load its model or to translate, or died."""


@dataclasses.dataclass(frozen=True)
class Threads:
    """CTranslate2's thread setting (its names)."""

    intra_threads: int
    inter_threads: int = 1

    def __str__(self) -> str:
        return f"intra {self.intra_threads} x inter {self.inter_threads}"


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def device() -> str:
    """CTranslate2's device: the kind JAX decodes on."""
    return "cuda" if jax.default_backend() == "gpu" else "cpu"


def pieces(loaded: Any) -> list[str]:
    """A loaded model's vocabulary, in id order."""
    tokenizer = loaded.tokenizer
    return [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]


class Worker:
    """A CTranslate2 translator in a child process (model/decoding/ctranslate2_worker.py).

    Raises WorkerError, with the worker's traceback, if it cannot load the model.
    """

    def __init__(self, model_dir: str, *, device: str, compute_type: str, threads: Threads):
        self.description = f"CTranslate2 worker ({model_dir}, {compute_type}, {threads})"
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "model.decoding.ctranslate2_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE)
        try:
            self._exchange({"model_dir": model_dir, "device": device,
                            "compute_type": compute_type, **dataclasses.asdict(threads)})
        except WorkerError:
            self.close()
            raise

    def translate(self, rows: Sequence[Sequence[str]], options: dict[str, Any]
                  ) -> tuple[list[list[str]], list[Optional[float]], float]:
        """`translate_batch(rows, **options)` in the worker: (best hypothesis per row, its
        score or None, seconds the call took in the worker)."""
        return self._exchange((list(rows), options))

    def _exchange(self, message: Any) -> Any:
        with self._lock:
            try:
                pickle.dump(message, self._process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self._process.stdin.flush()
                status, value = pickle.load(self._process.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as error:
                code = self._process.poll()
                raise WorkerError(f"{self.description} (pid {self._process.pid}) exited"
                                  f"{'' if code is None else f' with status {code}'}; its "
                                  "stderr is this process's") from error
        if status == "error":
            raise WorkerError(f"{self.description} failed:\n{value}")
        return value

    def close(self) -> None:
        """Ends the worker: it exits when its input closes."""
        try:
            self._process.stdin.close()
        except BrokenPipeError:  # it died with a request unsent
            pass
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()


@atexit.register
def _close_workers() -> None:
    with _LOCK:
        for worker in _WORKERS.values():
            worker.close()
        _WORKERS.clear()


def export_key(loaded: Any, vocabulary_map: Optional[shortlist.Shortlist]) -> str:
    """A hash of everything an export reads: the exporter's code, the model config, the
    parameters, the pieces and the vocabulary map."""
    digest = hashlib.sha256(inspect.getsource(ctranslate2_export).encode())
    digest.update(repr(loaded.model.config).encode())
    digest.update("\n".join(pieces(loaded)).encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(loaded.params):
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.ascontiguousarray(np.asarray(leaf, np.float32)).tobytes())
    if vocabulary_map is not None:
        for table in dataclasses.astuple(vocabulary_map):
            digest.update(np.ascontiguousarray(table).tobytes())
    return digest.hexdigest()[:16]


def export_dir(loaded: Any, vocabulary_map: Optional[shortlist.Shortlist]) -> str:
    """The CTranslate2 model directory of a loaded AR model (model/trained_model.py
    `LoadedModel`), with the vocabulary map of `vocabulary_map` if given.

    Exported once per machine and kept, like the compiled XLA programs, under
    `$XDG_CACHE_HOME/padir/ctranslate2/<export_key>` (a rerun of the decode stage, `padir
    translate` or a benchmark over the same model reuses it); written to a partial
    directory and renamed into place, so that a killed export leaves nothing a reader
    takes, and two processes exporting at once keep the first."""
    with _LOCK:
        known = (loaded.uri, vocabulary_map is not None)
        if known in _EXPORTS:
            return _EXPORTS[known]
        directory = os.path.join(datasets.cache_dir(name="ctranslate2"),
                                 export_key(loaded, vocabulary_map))
        if not os.path.isdir(directory):
            os.makedirs(os.path.dirname(directory), exist_ok=True)
            partial = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".partial-",
                                       dir=os.path.dirname(directory))
            ctranslate2_export.export(loaded.model.config, loaded.params, pieces(loaded),
                                      os.path.join(partial, "model"),
                                      vocabulary_map=vocabulary_map)
            try:
                os.rename(partial, directory)
            except OSError:  # another process put its export there first
                shutil.rmtree(partial)
        _EXPORTS[known] = os.path.join(directory, "model")
        return _EXPORTS[known]


def worker(model_dir: str, compute_type: str, threads: Threads) -> Worker:
    """The worker of a model directory, compute type and thread setting, started once per
    process."""
    key = (model_dir, device(), compute_type, threads)
    with _LOCK:
        if key not in _WORKERS:
            _WORKERS[key] = Worker(model_dir, device=key[1], compute_type=compute_type,
                                   threads=threads)
        return _WORKERS[key]


class Search:
    """One CTranslate2 method over a loaded AR model; called as the Translator calls its
    jitted pair (`Translator._call`).

    Args:
      threads: CTranslate2's threads (default: one thread a translation, `cpus()` at once).
      vocabulary_map: the shortlist table (model/decoding/shortlist.py) of a `shortlist` method.
    """

    def __init__(self, loaded: Any, method: DecodeMethod, *, threads: Optional[Threads] = None,
                 vocabulary_map: Optional[shortlist.Shortlist] = None):
        if method.kind not in KINDS:
            raise ValueError(f"{method.kind} is not a CTranslate2 kind {KINDS}")
        if method.shortlist != (vocabulary_map is not None):
            raise ValueError(f"method {method.name!r}: a vocabulary map goes with shortlist")
        self.threads = threads or Threads(1, cpus())
        self.model_dir = export_dir(loaded, vocabulary_map)
        self._worker = worker(self.model_dir, method.compute_type, self.threads)
        self._pieces = pieces(loaded)
        self._ids = {piece: i for i, piece in enumerate(self._pieces)}
        beam = method.kind == "ct2_beam"
        self._options = dict(
            beam_size=method.beam_size if beam else 1,
            length_penalty=method.length_penalty if beam else 0.0,
            min_decoding_length=0, return_end_token=True, return_scores=beam,
            use_vmap=method.shortlist,
            suppress_sequences=[[self._pieces[i]] for i in NON_TARGET_IDS])

    def request(self, source: np.ndarray, max_len: int
                ) -> tuple[list[list[str]], dict[str, Any]]:
        """The `translate_batch` call of a batch: (rows of pieces, its kwargs)."""
        rows = [[self._pieces[i] for i in row if i != PAD_ID] for row in source]
        return rows, dict(self._options, max_decoding_length=max_len,
                          max_batch_size=-(-len(rows) // self.threads.inter_threads))

    def __call__(self, source: np.ndarray, max_len: int
                 ) -> tuple[dict[str, Optional[np.ndarray]], float, float, float, int, int]:
        """source int32[B, S] (ids + EOS, 0-padded) -> ({"tokens": int32[B, max_len],
        "scores": float32[B] or None, "passes": None}, seconds, encode seconds (0), search
        seconds, width (max_len), columns scored (V))."""
        hypotheses, scores, seconds = self._worker.translate(*self.request(source, max_len))
        tokens = np.full((len(hypotheses), max_len), PAD_ID, np.int32)
        for i, hypothesis in enumerate(hypotheses):
            ids = [self._ids[piece] for piece in hypothesis]
            tokens[i, :len(ids)] = ids
        return ({"tokens": tokens,
                 "scores": (np.asarray(scores, np.float32) if self._options["return_scores"]
                            else None),
                 "passes": None}, seconds, 0.0, seconds, max_len, len(self._pieces))
