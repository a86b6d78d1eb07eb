"""CTranslate2's threads chosen per regime by timing them: the decode stage's sweep.

CTranslate2's docs: `intra_threads` (the threads of one translation) at most the physical
cores, 1 being best for a small model at batch 1; `inter_threads` (translations in
parallel, model/decoding/ctranslate2_search.py cuts a batch into that many) for batched throughput.
Which setting wins depends on the model, the search, the machine and what else runs on it,
so the decode stage times these grids for each CTranslate2 method before it decodes, and
decodes each pass with its regime's fastest:

  latency (batch 1)  intra_threads in `thread_counts(cpus)`, inter_threads 1 (one
                     sentence: nothing to translate in parallel); the lowest median
                     latency per sentence wins;
  batched            every (intra, inter) of those counts with intra x inter <= cpus;
                     the most sentences per second win.

The sweep is timed once per machine and kept, like the export it times
(model/decoding/ctranslate2_search.py `export_dir`): `sweep_methods` writes each record
beside its export, under a key of everything that sets its figures (the method's search,
the sample, the batch sizes and buckets, the grid and this machine's CPUs), and a rerun of
the decode stage over the same model reads it back instead of timing again.

Each setting decodes the same sample (the first sentences of a test set) through the
Translator, as the stage does (its own worker process, the same output caps and options),
`REPEATS` times; the repeats are interleaved across the settings, so that a change in the
machine's load touches them all alike, and each figure is the median over its repeats. On
2 CPUs that is 2 + 3 settings; on 16, 5 + 15.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from typing import Any, Mapping, Sequence

from components.config import DecodeMethod
from model import trained_model
from model.decoding import ctranslate2_search, translator
from model.decoding.ctranslate2_search import Threads

log = logging.getLogger(__name__)

SAMPLE_SENTENCES = 64  # the first sentences of the test set by id, timed at every setting
REPEATS = 3
LATENCY, BATCHED = "latency", "batched"  # the regimes: the decode stage's passes


def thread_counts(cpus: int) -> list[int]:
    """1, 2, 4, ... below `cpus`, and `cpus`."""
    counts = [1]
    while counts[-1] * 2 < cpus:
        counts.append(counts[-1] * 2)
    return counts + ([cpus] if cpus > 1 else [])


def grid(regime: str, cpus: int) -> list[Threads]:
    """The settings timed for a regime (see the module docstring)."""
    counts = thread_counts(cpus)
    if regime == LATENCY:
        return [Threads(intra) for intra in counts]
    return [Threads(intra, inter) for intra in counts for inter in counts
            if intra * inter <= cpus]


def _figure(regime: str, translations: Sequence[Any]) -> float:
    """One repeat's figure: the median latency per sentence in ms (latency), or sentences
    per second of decode time (batched; `latency_s` sums to the batches' seconds)."""
    if regime == LATENCY:
        return 1e3 * statistics.median(t.latency_s for t in translations)
    return len(translations) / sum(t.latency_s for t in translations)


def sweep(loaded: trained_model.LoadedModel, method: DecodeMethod, sources: Sequence[str], *,
          batch_sizes: Mapping[str, int], boundaries: Sequence[int], cpus: int
          ) -> dict[str, Any]:
    """Times every setting of each regime on `sources` and picks the fastest.

    Args:
      loaded, method: a CTranslate2 method and the model it decodes.
      sources: the sample, text.
      batch_sizes: regime (`LATENCY`, `BATCHED`) -> its batch size in the stage.
      boundaries: the length buckets.
      cpus: the CPUs the grid spans.
    Returns:
      The record the decode manifest keeps: {"cpus", "sentences", "repeats", and per
      regime {"batch_size", "figure" ("median_ms" or "sentences_per_s"), "settings":
      [{"intra_threads", "inter_threads", figure}, ...], "chosen": {"intra_threads",
      "inter_threads"}}}.
    """
    started = time.perf_counter()
    regimes = {}
    for regime, batch_size in batch_sizes.items():
        translators = {threads: translator.Translator(
            loaded, method, batch_size=batch_size, boundaries=boundaries,
            ctranslate2_threads=threads) for threads in grid(regime, cpus)}
        regimes[regime] = (batch_size, translators, {threads: [] for threads in translators})
    for _ in range(REPEATS):
        for regime, (_, translators, figures) in regimes.items():
            for threads, search in translators.items():
                figures[threads].append(_figure(regime, search.translate(list(sources))))
    record: dict[str, Any] = {"cpus": cpus, "sentences": len(sources), "repeats": REPEATS}
    for regime, (batch_size, _, figures) in regimes.items():
        name = "median_ms" if regime == LATENCY else "sentences_per_s"
        medians = {threads: statistics.median(values) for threads, values in figures.items()}
        best = (min if regime == LATENCY else max)(medians, key=medians.get)
        record[regime] = {
            "batch_size": batch_size, "figure": name,
            "settings": [{**dataclasses.asdict(threads), name: value}
                         for threads, value in medians.items()],
            "chosen": dataclasses.asdict(best)}
        log.info("%s: %s %s (%s %.4g), of %d settings", method.name, regime, best, name,
                 medians[best], len(medians))
    log.info("%s: swept in %.0f s", method.name, time.perf_counter() - started)
    return record


def chosen(record: Mapping[str, Any], regime: str) -> Threads:
    """The setting a sweep record chose for a regime."""
    return Threads(**record[regime]["chosen"])


def _machine() -> str:
    """This machine's CPU model (Linux: /proc/cpuinfo), '' where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "")
    except OSError:
        return ""


def kept_sweep(loaded: trained_model.LoadedModel, method: DecodeMethod,
               sources: Sequence[str], *, batch_sizes: Mapping[str, int],
               boundaries: Sequence[int], cpus: int) -> dict[str, Any]:
    """`sweep`'s record, read from beside the method's export if this machine timed the
    same sweep before, else timed and written there (whole or not at all)."""
    table = translator.shortlist_table(loaded) if method.shortlist else None
    what = {"search": {k: v for k, v in dataclasses.asdict(method).items() if k != "name"},
            "sources": hashlib.sha256("\n".join(sources).encode()).hexdigest(),
            "batch_sizes": dict(batch_sizes), "boundaries": list(boundaries), "cpus": cpus,
            "machine": _machine(), "repeats": REPEATS,
            "grids": {regime: [dataclasses.asdict(t) for t in grid(regime, cpus)]
                      for regime in batch_sizes}}
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    folder = os.path.join(os.path.dirname(ctranslate2_search.export_dir(loaded, table)),
                          "sweeps")
    path = os.path.join(folder, f"{key}.json")
    if os.path.exists(path):
        log.info("%s: the sweep timed before on this machine (%s)", method.name, path)
        with open(path) as f:
            return json.load(f)
    record = sweep(loaded, method, sources, batch_sizes=batch_sizes, boundaries=boundaries,
                   cpus=cpus)
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".partial", delete=False) as f:
        json.dump(record, f)
    os.replace(f.name, path)
    return record


def sweep_methods(methods: Sequence[DecodeMethod], models: Mapping[str, str],
                  sources: Sequence[str], *, batch_sizes: Mapping[str, int],
                  boundaries: Sequence[int]) -> dict[str, dict[str, Any]]:
    """`kept_sweep` of every CTranslate2 method of `methods` (method name -> its record),
    on the CPUs this process may run on; `models`: stage -> artifact URI."""
    return {method.name: kept_sweep(trained_model.load_cached(models[method.stage]), method,
                                    sources, batch_sizes=batch_sizes, boundaries=boundaries,
                                    cpus=ctranslate2_search.cpus())
            for method in methods if method.kind in ctranslate2_search.KINDS}
