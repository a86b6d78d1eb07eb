"""A RunInference model handler for our JAX translation models (an AR model or the PaDIR
student).

    handler = TranslationModelHandler(artifact_uri, DecodeMethod("ar_beam4", "ar_beam"),
                                      batch_size=64, boundaries=(16, 32, 64))
    (pcoll_of_id_and_source_text
     | RunInference(KeyedModelHandler(handler))     # -> (id, PredictionResult)
     | beam.MapTuple(lambda pair_id, result: ...))   # result.inference: a dict, below

Examples are source sentences (text); each PredictionResult carries the source as
`example`, the artifact URI as `model_id`, and as `inference` the record of
`model.decoding.translator.Translation`: `hypothesis`, `tokens`, `score` (the beam's
length-penalised log-probability for `ar_beam`, the mean token log-probability for the NAR
kinds, None for greedy), `passes`, `source_tokens`, `truncated`, `latency_s`,
`batch_seconds`, `batch_size`. Shapes, timing and the definitions: model/decoding/translator.py.

Loading. `load_model` runs once per RunInference transform and worker process (Beam's
`shared.Shared` in the RunInference DoFn; the model is not shared across processes, since
JAX owns a process's devices). The checkpoint itself is restored once per process and
artifact however many transforms decode with it (`model.trained_model.load_cached`), and each
load builds the method's jitted decoder, which compiles once per batch shape it meets.
JAX is imported by `load_model`, in the worker, never when the pipeline is constructed.

Progress. Each worker process logs, at most every `PROGRESS_EVERY_S` seconds, how many
sentences it has translated and at what rate, and an ETA when the job's total
(`expected_sentences`) is given: a distillation of the whole training set takes long.

Batching. `batch_elements_kwargs` makes RunInference batch exactly `batch_size`
sentences (a bundle's last batch may be smaller; the decoder still runs `batch_size` rows).
Timings are only meaningful when one decode runs at a time on a worker: the in-process
FnApiRunner does that; on Dataflow use one SDK process and one harness thread per VM
(`--experiments=no_use_multiple_sdk_containers --number_of_worker_harness_threads=1`).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

from apache_beam.metrics.metric import Metrics
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from components.config import DecodeMethod

log = logging.getLogger(__name__)

NAMESPACE = "padir_inference"  # RunInference's own metrics (load time, inference counts)
# Where a job's time goes besides its timed calls, counters in milliseconds (`time_split`):
# restoring models and building translators; the first calls of each shape (compiling,
# and a decode not timed); the host's work around the calls (tokenising, padding,
# detokenising).
LOADING, COMPILING, HOST = "ms.loading", "ms.compiling", "ms.host"
_LOADING_SECONDS: collections.defaultdict = collections.defaultdict(float)  # not counted yet


def time_split(counts: dict[str, int]) -> dict[str, float]:
    """Takes the time counters out of a job's `counts`: seconds by what they timed."""
    return {name.split(".", 1)[1]: counts.pop(name, 0) / 1000
            for name in (LOADING, COMPILING, HOST)}
# load_model calls in this process, by (artifact URI, method name, batch size).
LOADS: collections.Counter = collections.Counter()
PROGRESS_EVERY_S = 60.0


class TranslationModelHandler(ModelHandler[str, PredictionResult, Any]):
    """Source text -> PredictionResult(example=source, inference=translation record).

    Args:
      artifact_uri: a published artifact of the method's stage (`DecodeMethod.stage`: the
        `teacher` or `ar_student` for the AR kinds, the `student` for the NAR kinds).
      method: the decoding method.
      batch_size: sentences per decoder call (and per RunInference batch).
      boundaries: the length buckets; default: those of the artifact's config.
      expected_sentences: how many sentences the job translates in all, for the ETA in the
        progress log (None: rate only).
      rescorer_uri: a published artifact of the method's rescorer stage (`teacher`), for a
        rescored kind; restored once per process like the model.
      ctranslate2_threads: a CTranslate2 kind's threads, {"intra_threads",
        "inter_threads"} (model/decoding/ctranslate2_search.py `Threads`; None: its default).
      time_namespace: the Beam namespace to count its time in (`time_split`; None: not
        counted).
    """

    def __init__(self, artifact_uri: str, method: DecodeMethod, *, batch_size: int,
                 boundaries: Optional[Sequence[int]] = None,
                 expected_sentences: Optional[int] = None,
                 rescorer_uri: Optional[str] = None,
                 ctranslate2_threads: Optional[Mapping[str, int]] = None,
                 time_namespace: Optional[str] = None):
        super().__init__(min_batch_size=batch_size, max_batch_size=batch_size)
        self._artifact_uri = artifact_uri
        self._method = method
        self._batch_size = batch_size
        self._boundaries = tuple(boundaries) if boundaries else None
        self._expected = expected_sentences
        self._rescorer_uri = rescorer_uri
        self._ctranslate2_threads = ctranslate2_threads
        self._time_namespace = time_namespace
        self._translated = 0
        self._started: Optional[float] = None
        self._logged = 0.0

    def load_model(self):
        """The checkpoint (restored once per process) and the method's jitted decoder."""
        from model import trained_model  # JAX starts here
        from model.decoding import translator
        from model.decoding import ctranslate2_search

        LOADS[(self._artifact_uri, self._method.name, self._batch_size)] += 1
        started = time.perf_counter()
        rescorer = (trained_model.load_cached(self._rescorer_uri) if self._rescorer_uri
                    else None)
        model = translator.Translator(
            trained_model.load_cached(self._artifact_uri), self._method,
            batch_size=self._batch_size, boundaries=self._boundaries,
            rescorer=rescorer,
            ctranslate2_threads=(ctranslate2_search.Threads(**self._ctranslate2_threads)
                                 if self._ctranslate2_threads else None))
        # Counted with the next batch this process decodes: Beam drops what a DoFn's setup
        # counts, and the instance that loads may not be the one that decodes.
        if self._time_namespace is not None:
            _LOADING_SECONDS[self._time_namespace] += time.perf_counter() - started
        return model

    def run_inference(self, batch: Sequence[str], model: Any,
                      inference_args: Optional[dict[str, Any]] = None
                      ) -> Iterable[PredictionResult]:
        if self._started is None:
            self._started = self._logged = time.monotonic()
        started, compiled = time.perf_counter(), model.compile_seconds
        translations = model.translate(list(batch))
        compiling = model.compile_seconds - compiled
        self._count_ms(LOADING, _LOADING_SECONDS.pop(self._time_namespace, 0.0))
        self._count_ms(COMPILING, compiling)
        self._count_ms(HOST, time.perf_counter() - started - compiling
                       - translations[0].batch_seconds)
        self._translated += len(batch)
        self._log_progress()
        for source, translation in zip(batch, translations):
            yield PredictionResult(source, translation.as_record(), self._artifact_uri)

    def _count_ms(self, name: str, seconds: float) -> None:
        if self._time_namespace is not None:
            Metrics.counter(self._time_namespace, name).inc(round(1000 * seconds))

    def _log_progress(self) -> None:
        now = time.monotonic()
        if now - self._logged < PROGRESS_EVERY_S:
            return
        self._logged = now
        rate = self._translated / (now - self._started)
        eta = ""
        if self._expected:
            minutes = max(0, self._expected - self._translated) / rate / 60
            eta = f" of {self._expected:,}, ETA {minutes:.0f} min (this worker's rate)"
        log.info("%s: %s sentences translated%s, %.1f sentences/s", self._method.name,
                 f"{self._translated:,}", eta, rate)

    def validate_inference_args(self, inference_args: Optional[dict[str, Any]]) -> None:
        if inference_args:
            raise ValueError("TranslationModelHandler takes no inference_args: the method "
                             f"and its options are fixed when it is built, got {inference_args}")

    def batch_elements_kwargs(self) -> Mapping[str, Any]:
        return {"min_batch_size": self._batch_size, "max_batch_size": self._batch_size}

    def share_model_across_processes(self) -> bool:
        return False

    def get_metrics_namespace(self) -> str:
        return NAMESPACE
