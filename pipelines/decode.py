"""The `decode` stage: every decoding method on every test set, with latency and throughput.

Contract:
  reads   the `prepare` artifact's test splits (`config.data.test` by name, or the carved
          `test`): `{split}-SSSSS-of-NNNNN.jsonl` of `{"id", "source", "target"}`; the
          AR model each AR method names (`model`: the `teacher` or `ar_student` artifact)
          and the `student` artifact (NAR methods), only those the configured methods
          need (`decode.models`); each names its vocabulary.
  writes  `<workdir>/decode/<key>/`:
            hypotheses/{test_set}/{method}.jsonl   the batched pass, at
                `decode.throughput_batch_size`: one line per sentence, in id order,
                `{"id", "hypothesis", "latency_s", "passes", "source_tokens", "score",
                "hypothesis_tokens", "truncated"}`, and for draft_verify `"rounds"` and
                `"accepted"` (drafted tokens the teacher accepted) (`latency_s` is the
                batch's decode time divided by its sentences); these are the hypotheses
                that are scored;
            latency/{test_set}/{method}.jsonl   the same for the first
                `decode.latency_sentences` sentences (by id; all if null), decoded again at
                `decode.latency_batch_size` (1): per-sentence latency;
            manifest.json   counts `read.{test_set}`, `decoded.{test_set}.{method}.{pass}`
                (pass `batched` or `latency`), `truncated.{test_set}`; metrics `test_sets`,
                `methods` (in config order: name, kind, stage), `latency_sentences` (per
                test set), `throughput` (per test set and method: batch size, sentences,
                hypothesis tokens, seconds, sentences/s, tokens/s), `decode_seconds` (the
                timed decode calls of every method and pass: what of the stage's wall time
                was spent decoding), `time_split` (`time_split`: that, and where the rest
                went) and `ctranslate2_sweep`
                (per CTranslate2 method, in config order: its name, the test set sampled
                and its model/decoding/ctranslate2_sweep.py `sweep`: every thread setting timed per
                pass and the one chosen).
  With `decode.max_sentences` set, only the first N sentences of each test set (by id).

The batched pass decodes batches of similar lengths and one decoder shape
(pipelines/batching.py), as a production batch translator does: a batch costs what its
longest sentence costs. Throughput counts decode-call time only (the sum of the batches' `batch_seconds`, see
model/decoding/translator.py), not Beam's overhead; tokens/s counts hypothesis tokens, EOS included.
Sentences longer than the widest length bucket are cut to it (flagged `truncated` and
counted), never dropped. Each method x test set x pass is one RunInference, in a runner
stage of its own (`DecodeAndWrite`: one method's decodes never interleave with another's);
the checkpoints are restored once per worker process (pipelines/model_handler.py).

The CTranslate2 methods translate in a process of their own, which never imports JAX, so
that no other runtime's threads share CTranslate2's cores, and are timed there
(model/decoding/ctranslate2_search.py). Before any decode, each one's threads are chosen per pass
by a sweep: every setting of a small grid decodes the first sentences of the first test
set, and the fastest per regime decodes that pass (batch 1: the lowest median latency;
batched: the most sentences/s; model/decoding/ctranslate2_sweep.py).

Run it alone, locally (the in-process FnApiRunner, which runs one decode at a time, as the
timings need):

    PADIR_DATA_ROOT=/path/to/data python -m pipelines.decode --config configs/multi30k_en_de.yaml

or on Dataflow (the workdir must then be a gs:// path; one SDK process and one thread per
VM, so that timed decodes do not share the CPU):

    python -m pipelines.decode --config configs/multi30k_en_de.yaml \
        --set workdir=gs://BUCKET/padir --runner DataflowRunner --project PROJECT \
        --region REGION --temp_location gs://BUCKET/tmp --sdk_container_image IMAGE \
        --experiments=no_use_multiple_sdk_containers --number_of_worker_harness_threads=1
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import apache_beam as beam
from apache_beam.metrics.metric import Metrics
from apache_beam.ml.inference.base import KeyedModelHandler, PredictionResult, RunInference

from components import artifacts, corpus, dag, report
from components import config as config_lib
from components import tokenizer as tokenizer_lib
from pipelines import batching, job, model_handler
from pipelines import options as options_lib
from pipelines.model_handler import TranslationModelHandler

NAMESPACE = "decode"  # of the Beam counters that become the manifest's counts
HYPOTHESES, LATENCY = "hypotheses", "latency"  # the two passes' folders
SUFFIX = ".jsonl"


def decoded_splits(data: config_lib.DataConfig) -> tuple[str, ...]:
    """The prepared splits that are decoded: the named test sets, or the carved `test`."""
    return tuple(s for s in corpus.output_splits(data) if s not in (corpus.TRAIN, corpus.DEV))


def output_path(artifact_uri: str, folder: str, test_set: str, method: str) -> str:
    """`{artifact}/{hypotheses|latency}/{test_set}/{method}.jsonl`."""
    return artifacts.join(artifact_uri, folder, test_set, method + SUFFIX)


# --- element logic and transforms --------------------------------------------------------


def to_record(pair: dict, result: PredictionResult) -> dict:
    """(pair, PredictionResult) -> the line written for one sentence."""
    inference = result.inference
    return {
        "id": pair["id"],
        "hypothesis": inference["hypothesis"],
        "latency_s": inference["latency_s"],
        "passes": inference["passes"],
        "source_tokens": inference["source_tokens"],
        "score": inference["score"],
        "hypothesis_tokens": len(inference["tokens"]),
        "truncated": inference["truncated"],
        **{key: inference[key] for key in ("rounds", "accepted")
           if inference[key] is not None},  # draft_verify's cost
    }


def _sorted_lines(records: list[dict]) -> Iterator[str]:
    for record in sorted(records, key=lambda r: corpus.id_sort_key(r["id"])):
        yield json.dumps(record, ensure_ascii=False)


class FirstById(beam.PTransform):
    """The `n` elements with the smallest ids (all if `n` is None); `key` gives the id."""

    def __init__(self, n: Optional[int], key: Callable[[Any], str]):
        super().__init__()
        self._n = n
        self._key = key

    def expand(self, elements):
        if self._n is None:
            return elements
        key = self._key
        return (elements
                | "Smallest" >> beam.combiners.Top.Smallest(
                    self._n, key=lambda element: corpus.id_sort_key(key(element)))
                | "Flatten" >> beam.FlatMap(lambda firsts: firsts))


class ReadTestSet(beam.PTransform):
    """A prepared split -> `{"id", "source", "target"}` dicts (the first `max_sentences`
    by id, if set), counted as `read.{split}`."""

    def __init__(self, pattern: str, split: str, max_sentences: Optional[int]):
        super().__init__()
        self._pattern = pattern
        self._split = split
        self._max_sentences = max_sentences

    def expand(self, pbegin):
        return (pbegin
                | "Read" >> beam.io.ReadFromText(self._pattern)
                | "ParseJson" >> beam.Map(json.loads)
                | "FirstById" >> FirstById(self._max_sentences, key=lambda pair: pair["id"])
                | "Count" >> beam.Map(job.counted, NAMESPACE, f"read.{self._split}"))


class DecodeAndWrite(beam.PTransform):
    """(pair, source) examples, or batches of them if `batched` (pipelines/batching.py) ->
    one method's records, written in id order to `path`.

    Counts the records as `counter_name`, and the truncated sources as `truncated_counter`
    if given (truncation depends on the source only: one pass per test set counts it).

    The examples are reshuffled first, so that this decode is a runner stage of its own:
    fused with the other methods' (they read the same examples), the runner would decode
    each example by every method in turn, and a method's timing would take in the others'
    threads (XLA's pool spinning on after a JAX call, beside CTranslate2's worker) and
    caches. Apart, the in-process runner decodes one method's pass after another.
    """

    def __init__(self, handler: TranslationModelHandler, path: str, counter_name: str, *,
                 batched: bool, truncated_counter: Optional[str] = None):
        super().__init__()
        self._handler = handler
        self._path = path
        self._counter_name = counter_name
        self._batched = batched
        self._truncated_counter = truncated_counter

    def expand(self, examples):
        handler = KeyedModelHandler(self._handler)
        records = (
            examples
            | "OneMethodAtATime" >> beam.Reshuffle()
            | "RunInference" >> RunInference(
                handler.with_no_batching() if self._batched else handler)
            | "ToRecord" >> beam.MapTuple(to_record)
            | "Count" >> beam.Map(job.counted, NAMESPACE, self._counter_name)
        )
        if self._truncated_counter is not None:
            records = records | "CountTruncated" >> beam.Map(_count_truncated,
                                                             self._truncated_counter)
        return (
            records
            | "Gather" >> beam.combiners.ToList()
            | "SortById" >> beam.FlatMap(_sorted_lines)
            | "Write" >> beam.io.WriteToText(self._path, num_shards=1, shard_name_template="")
        )


def _count_truncated(record: dict, counter_name: str) -> dict:
    if record["truncated"]:
        Metrics.counter(NAMESPACE, counter_name).inc()
    return record


# --- the job --------------------------------------------------------------------------------


def build(pipeline: beam.Pipeline, config: config_lib.Config, *, prepared_uri: str,
          checkpoints: Mapping[str, str], tokenizer: tokenizer_lib.Tokenizer,
          output_uri: str, ctranslate2_threads: Mapping[tuple[str, str], Any]) -> None:
    """Adds, per test set, its reading and one `DecodeAndWrite` per method and pass.

    The batched pass decodes length-sorted batches of one decoder shape each
    (pipelines/batching.py), as a production batch translator does; the latency pass
    decodes the latency sample one RunInference batch of `latency_batch_size` at a time.

    Args:
      checkpoints: training stage -> artifact URI, for the stages the methods use.
      tokenizer: the models' (every training stage reads the vocab artifact), for the
        batches' lengths.
      ctranslate2_threads: (method name, pass: "batched" or "latency") -> the threads its
        sweep chose (`sweep_ctranslate2`: {"intra_threads", "inter_threads"}); a
        CTranslate2 method without one gets `ctranslate2_search.Search`'s default.
    """
    settings = config.decode
    boundaries = config.encode.bucket_boundaries
    for split in decoded_splits(config.data):
        pairs = pipeline | f"Read[{split}]" >> ReadTestSet(
            corpus.split_pattern(prepared_uri, split), split, settings.max_sentences)
        batches = pairs | f"BatchByLength[{split}]" >> batching.BatchByLength(
            tokenizer, boundaries, batch_size=settings.throughput_batch_size)
        sample = (pairs
                  | f"LatencySample[{split}]" >> FirstById(settings.latency_sentences,
                                                           key=lambda pair: pair["id"])
                  | f"Examples[{split}]" >> beam.Map(lambda pair: (pair, pair["source"])))
        passes = ((HYPOTHESES, "batched", settings.throughput_batch_size, batches),
                  (LATENCY, "latency", settings.latency_batch_size, sample))
        for method in settings.methods:
            for folder, name, batch_size, examples in passes:
                handler = TranslationModelHandler(
                    checkpoints[method.stage], method, batch_size=batch_size,
                    boundaries=boundaries,
                    rescorer_uri=checkpoints.get(method.rescorer),
                    ctranslate2_threads=ctranslate2_threads.get((method.name, name)),
                    time_namespace=NAMESPACE)
                first = folder == HYPOTHESES and method is settings.methods[0]
                _ = examples | f"Decode[{split}/{method.name}/{name}]" >> DecodeAndWrite(
                    handler, output_path(output_uri, folder, split, method.name),
                    f"decoded.{split}.{method.name}.{name}", batched=folder == HYPOTHESES,
                    truncated_counter=f"truncated.{split}" if first else None)


# --- the stage ------------------------------------------------------------------------------


def counter_names(config: config_lib.Config) -> list[str]:
    """The counts every manifest has, 0 if none: per test set, `read` and `truncated`, and
    `decoded` per method and pass."""
    names = []
    for split in decoded_splits(config.data):
        names += [f"read.{split}", f"truncated.{split}"]
        names += [f"decoded.{split}.{method.name}.{name}"
                  for method in config.decode.methods for name in ("batched", "latency")]
    return names


def latency_sentences(read: int, config: config_lib.Config) -> int:
    """How many of `read` sentences the latency pass decodes."""
    limit = config.decode.latency_sentences
    return read if limit is None else min(read, limit)


def sweep_ctranslate2(config: config_lib.Config, prepared_uri: str,
                      checkpoints: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Each CTranslate2 method's sweep (model/decoding/ctranslate2_sweep.py): its threads per pass,
    timed on the first sentences by id of the first test set, in this process (on
    Dataflow, where the job is launched: launch it from a machine of the workers' type).
    Method name -> its record, with the test set."""
    # JAX: in the job's process, as the handlers load it.
    from model.decoding import ctranslate2_sweep

    split = decoded_splits(config.data)[0]
    sample = min(ctranslate2_sweep.SAMPLE_SENTENCES,
                 config.decode.max_sentences or ctranslate2_sweep.SAMPLE_SENTENCES)
    sources = [pair["source"] for pair in corpus.read_split(prepared_uri, split)][:sample]
    records = ctranslate2_sweep.sweep_methods(
        config.decode.methods, checkpoints, sources,
        batch_sizes={ctranslate2_sweep.LATENCY: config.decode.latency_batch_size,
                     ctranslate2_sweep.BATCHED: config.decode.throughput_batch_size},
        boundaries=config.encode.bucket_boundaries)
    return {name: {"test_set": split, **record} for name, record in records.items()}


def finish(config: config_lib.Config, sweeps: Mapping[str, Any], sweep_seconds: list[float],
           out: artifacts.PendingArtifact, finished: job.Finished) -> None:
    """Every sentence read is decoded by every method in the batched pass, and the latency
    sample in the latency pass; the manifest gets the counts, the throughput, the
    CTranslate2 methods' sweeps and where the stage's time went."""
    counts = dict(finished.counts)
    spent = model_handler.time_split(counts)
    balances = {}
    for split in decoded_splits(config.data):
        read = counts[f"read.{split}"]
        if not read:
            raise RuntimeError(f"decode: no sentence of {split} was read")
        expected = {"batched": read, "latency": latency_sentences(read, config)}
        balances.update({name: (expected[name.rsplit(".", 1)[1]], value)
                         for name, value in counts.items()
                         if name.startswith(f"decoded.{split}.")})
    job.check_accounting("decode", balances)
    out.counts.update(counts)
    decode_seconds = sum(
        record["latency_s"] for split in decoded_splits(config.data)
        for method in config.decode.methods for folder in (HYPOTHESES, LATENCY)
        for record in corpus.read_jsonl(output_path(out.tmp_uri, folder, split, method.name)))
    out.metrics.update(
        test_sets=list(decoded_splits(config.data)),
        methods=[{"name": method.name, "kind": method.kind, "stage": method.stage}
                 for method in config.decode.methods],  # a list: config order
        latency_sentences={split: latency_sentences(counts[f"read.{split}"], config)
                           for split in decoded_splits(config.data)},
        throughput={
            split: {method.name: report.throughput(
                list(corpus.read_jsonl(output_path(out.tmp_uri, HYPOTHESES, split, method.name))),
                config.decode.throughput_batch_size)
                for method in config.decode.methods}
            for split in decoded_splits(config.data)},
        ctranslate2_sweep=[{"method": name, **record}  # a list: config order
                           for name, record in sweeps.items()],
        # The stage's minutes spent in timed decode calls, against its wall_seconds.
        decode_seconds=decode_seconds,
        time_split=time_split(decode_seconds, spent, sum(sweep_seconds), finished.seconds))
    logging.info("decode: %s", ", ".join(f"{what} {seconds:.0f} s"
                                          for what, seconds in out.metrics["time_split"].items()))


def time_split(decode_seconds: float, spent: Mapping[str, float], sweep_seconds: float,
               job_seconds: float) -> dict[str, float]:
    """The stage's seconds by what they were spent on: the timed decode calls; the first
    calls of each shape (compiling); restoring models; the host's work around the calls;
    CTranslate2's thread sweep; and the rest of the Beam job (reading, reshuffling,
    batching, writing: the job's seconds less what its handlers timed)."""
    handlers = decode_seconds + sum(spent.values())
    return {"decode calls": round(decode_seconds, 1),
            "first calls (compiling)": round(spent["compiling"], 1),
            "loading models": round(spent["loading"], 1),
            "host around the calls": round(spent["host"], 1),
            "CTranslate2 sweep": round(sweep_seconds, 1),
            "Beam and I/O": round(max(0.0, job_seconds - handlers), 1)}


def run(config: config_lib.Config, pipeline_args: Sequence[str] = ()) -> artifacts.Artifact:
    """Decodes every test set with every method; publishes the decode artifact."""
    prepared = dag.require_input(config, "prepare")
    for split in decoded_splits(config.data):  # structural errors before any work starts
        corpus.split_files(prepared.uri, split)
    needed = config.decode.models
    checkpoints = {stage: dag.require_input(config, stage) for stage in needed}
    # The models' vocabulary (every training stage reads the vocab artifact).
    tokenizer = tokenizer_lib.Tokenizer.for_artifact(checkpoints[needed[0]])
    uris = {stage: artifact.uri for stage, artifact in checkpoints.items()}
    sweeps: dict[str, dict[str, Any]] = {}
    sweep_seconds: list[float] = []

    def build_job(pipeline: beam.Pipeline, output_uri: str) -> None:
        # Under the stage's lease and before any decode, so that nothing else runs beside it.
        started = time.perf_counter()
        sweeps.update(sweep_ctranslate2(config, prepared.uri, uris))
        sweep_seconds.append(time.perf_counter() - started)
        build(pipeline, config, prepared_uri=prepared.uri, checkpoints=uris,
              tokenizer=tokenizer, output_uri=output_uri,
              ctranslate2_threads={(name, regime): record[regime]["chosen"]
                                   for name, record in sweeps.items()
                                   for regime in ("batched", "latency")})

    return job.run(
        config, "decode", pipeline_args, inputs={"prepare": prepared, **checkpoints},
        build=build_job, namespace=NAMESPACE, counter_names=counter_names(config),
        finish=functools.partial(finish, config, sweeps, sweep_seconds))


def main(argv: Sequence[str] | None = None) -> int:
    return options_lib.main(run, argv, __doc__)


if __name__ == "__main__":
    # Run through the package so pickled functions refer to `pipelines.decode`, not `__main__`.
    from pipelines import decode as _decode

    sys.exit(_decode.main(sys.argv[1:]))
