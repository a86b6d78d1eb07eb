"""A CTranslate2 translator in a process of its own, which never imports JAX.

CTranslate2's threads must not share their cores with another runtime's busy threads
(XLA's pool, in the process that decodes with JAX): in that process it ran ~6x slower at
batch 1 than alone. model/decoding/ctranslate2_search.py therefore starts this module as a child
process (`python -m model.decoding.ctranslate2_worker`), one per model, compute type and thread
setting, and speaks to it over its stdin and stdout in pickled messages:

    parent -> worker   {"model_dir", "device", "compute_type", "intra_threads",
                        "inter_threads"}                         once, first
    worker -> parent   ("ready", None) | ("error", traceback)
    parent -> worker   (rows, options)                           a `translate_batch` call:
                                                                 rows of pieces, its kwargs
    worker -> parent   ("ok", (hypotheses, scores, seconds)) | ("error", traceback)

`seconds` is the wall time of `translate_batch` in the worker: the pipe and the parent's
Python are outside it. The worker exits when its stdin closes. It imports only the standard
library and ctranslate2 (no project module), so that nothing in it can start JAX.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from typing import Any, BinaryIO

# CTranslate2's OpenMP threads sleep while they wait for work instead of spinning (read
# when the library loads): a spinning thread takes a core from whatever else runs there.
ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}


def _reply(replies: BinaryIO, status: str, value: Any) -> None:
    pickle.dump((status, value), replies, protocol=pickle.HIGHEST_PROTOCOL)
    replies.flush()


def serve(requests: BinaryIO, replies: BinaryIO) -> int:
    """Loads the model the first request names, then answers translate requests until
    `requests` ends. Returns the exit status."""
    settings = pickle.load(requests)
    try:
        import ctranslate2

        translator = ctranslate2.Translator(
            settings["model_dir"], device=settings["device"],
            compute_type=settings["compute_type"], intra_threads=settings["intra_threads"],
            inter_threads=settings["inter_threads"])
    except Exception:  # the parent raises it, with this traceback
        _reply(replies, "error", traceback.format_exc())
        return 1
    _reply(replies, "ready", None)
    while True:
        try:
            rows, options = pickle.load(requests)
        except EOFError:
            return 0
        try:
            started = time.perf_counter()
            results = translator.translate_batch(rows, **options)
            seconds = time.perf_counter() - started
            _reply(replies, "ok", ([result.hypotheses[0] for result in results],
                                   [result.scores[0] if result.scores else None
                                    for result in results], seconds))
        except Exception:
            _reply(replies, "error", traceback.format_exc())


def main() -> int:
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr, not the replies
    return serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    sys.exit(main())
