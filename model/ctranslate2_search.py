"""The teacher decoded by CTranslate2: the `ct2_greedy` and `ct2_beam` kinds.

A `Translator` (model/translator.py) of these kinds hands each batch to `Search` instead of
its jitted JAX calls; everything around it (tokenisation, the source cut to the widest
bucket, the output cap, filler-free batches, the records) is the Translator's, so the rows
compare with ours sentence for sentence. The teacher is exported once per process and
artifact (model/ctranslate2_export.py, float32, into a temporary directory) and loaded once
per compute type: `float32`, or `int8` (weights quantised when CTranslate2 loads them).

Search settings, against ours (model/beam_search.py):
  * the same output cap (`max_decoding_length`, EOS counted), no minimum length, and the
    ids ours masks (pad, BOS, [MASK], [LENGTH]) suppressed;
  * greedy is token for token ours (tests/test_ctranslate2.py);
  * beam search keeps `beam_size` hypotheses and stops when that many have finished, as
    ours does, but CTranslate2 4.x normalises a finished hypothesis's log-probability by
    length ** length_penalty (length counting EOS), where ours divides by the GNMT
    penalty ((5 + length) / 6) ** length_penalty. At length_penalty 0 the two are token
    for token equal; at 0.6 a sentence may end on another hypothesis.

Timing, as the Translator times ours: `batch_seconds` is the wall time of the
`translate_batch` call (the pieces are looked up before, the ids after); it is all search
(`encode_seconds` 0). Threads: one translation at a time (`inter_threads` 1) over as many
threads as XLA's CPU runtime uses (`intra_threads` = the CPUs this process may run on),
which wait for work passively (`OMP_WAIT_POLICY=PASSIVE` unless set): spinning, they slow
CTranslate2 down several-fold whenever XLA's threads or another job share the cores (beam 4
on 2 shared cores: 3.7 sentences/s spinning, 160 passive).
The device is the one JAX decodes on (the CPU, or CUDA where JAX runs on a GPU).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any, Optional

import jax
import numpy as np

from components.config import DecodeMethod
from components.tokenizer import PAD_ID
from model import ctranslate2_export
from model.transformer import NON_TARGET_IDS

KINDS = ("ct2_greedy", "ct2_beam")
_LOCK = threading.Lock()
_EXPORTS: dict[str, tempfile.TemporaryDirectory] = {}  # artifact URI -> its export
_TRANSLATORS: dict[tuple[str, str], Any] = {}  # (artifact URI, compute type) -> translator


def intra_threads() -> int:
    """The threads XLA's CPU runtime computes with: the CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def device() -> str:
    """CTranslate2's device: the kind JAX decodes on."""
    return "cuda" if jax.default_backend() == "gpu" else "cpu"


def pieces(loaded: Any) -> list[str]:
    """A loaded model's vocabulary, in id order."""
    tokenizer = loaded.tokenizer
    return [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]


def load(loaded: Any, compute_type: str) -> Any:
    """A `ctranslate2.Translator` of a loaded teacher (model/translator.py `LoadedModel`),
    exported and loaded once per process."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when the library loads
    import ctranslate2

    with _LOCK:
        if loaded.uri not in _EXPORTS:
            directory = tempfile.TemporaryDirectory(prefix="padir-ct2-")
            ctranslate2_export.export(loaded.model.config, loaded.params, pieces(loaded),
                                      os.path.join(directory.name, "model"))
            _EXPORTS[loaded.uri] = directory
        key = (loaded.uri, compute_type)
        if key not in _TRANSLATORS:
            _TRANSLATORS[key] = ctranslate2.Translator(
                os.path.join(_EXPORTS[loaded.uri].name, "model"), device=device(),
                compute_type=compute_type, inter_threads=1, intra_threads=intra_threads())
        return _TRANSLATORS[key]


class Search:
    """One CTranslate2 method over a loaded teacher; called as the Translator calls its
    jitted pair (`Translator._call`)."""

    def __init__(self, loaded: Any, method: DecodeMethod):
        if method.kind not in KINDS:
            raise ValueError(f"{method.kind} is not a CTranslate2 kind {KINDS}")
        self._translator = load(loaded, method.compute_type)
        self._pieces = pieces(loaded)
        self._ids = {piece: i for i, piece in enumerate(self._pieces)}
        beam = method.kind == "ct2_beam"
        self._options = dict(
            beam_size=method.beam_size if beam else 1,
            length_penalty=method.length_penalty if beam else 0.0,
            min_decoding_length=0, return_end_token=True, return_scores=beam,
            suppress_sequences=[[self._pieces[i]] for i in NON_TARGET_IDS])

    def __call__(self, source: np.ndarray, max_len: int
                 ) -> tuple[dict[str, Optional[np.ndarray]], float, float, float, int, int]:
        """source int32[B, S] (ids + EOS, 0-padded) -> ({"tokens": int32[B, max_len],
        "scores": float32[B] or None, "passes": None}, seconds, encode seconds (0), search
        seconds, width (max_len), columns scored (V))."""
        rows = [[self._pieces[i] for i in row if i != PAD_ID] for row in source]
        started = time.perf_counter()
        results = self._translator.translate_batch(
            rows, max_batch_size=len(rows), max_decoding_length=max_len, **self._options)
        seconds = time.perf_counter() - started
        tokens = np.full((len(rows), max_len), PAD_ID, np.int32)
        for i, result in enumerate(results):
            ids = [self._ids[piece] for piece in result.hypotheses[0]]
            tokens[i, :len(ids)] = ids
        scores = (np.asarray([r.scores[0] for r in results], np.float32)
                  if self._options["return_scores"] else None)
        return ({"tokens": tokens, "scores": scores, "passes": None}, seconds, 0.0, seconds,
                max_len, len(self._pieces))

