"""The `distill` stage: the teacher's beam-search translation of every training source.

Contract:
  reads   the `prepare` artifact: `train-*.jsonl` and `dev-*.jsonl`, lines
          `{"id", "source", "target"}`; the `teacher` artifact (and, through its
          manifest, its vocabulary).
  writes  `<workdir>/distill/<key>/`, in the prepared format, so that the `encode_distilled`
          stage (pipelines/encode.py) encodes it as `encode` encodes the prepared pairs:
            train-SSSSS-of-NNNNN.jsonl   one line per kept pair, as many shards as the
                  prepared train split: `{"id", "source", "target", "score",
                  "target_tokens"}` with the prepared id and source, the teacher's
                  translation as target, its log-probability as score (summed over its
                  target_tokens tokens, EOS included);
            dev-00000-of-00001.jsonl     the prepared dev pairs, unchanged: the student's
                  dev loss and BLEU are measured against the original references;
            rejects-00000-of-00001.jsonl `{"id", "reason", "source", "target", "hypothesis",
                  "score", "source_tokens", "hypothesis_tokens"}` (target: the original;
                  hypothesis: the teacher's); reasons and filters in
                  components/distillation.py; sorted by id, as every split: the same
                  bytes on any runner and any number of workers (pipelines/shards.py);
            stats.json                   the figures of `DistillationStats.summary`;
            manifest.json   counts `read`, `kept`, `rejected.<reason>` (Beam counters; read
                  = kept + rejected, checked) and `dev`; metrics `length_ratio` and
                  `type_token_ratio` (distilled vs original targets of the kept pairs, in
                  words), `kept_fraction` and `throughput` (sentences/s of the whole job,
                  model loading and compilation included, and of the decode calls alone).

Batching (pipelines/batching.py). Sources are cut into batches of `distill.batch_size`
of one decoder shape each, sorted by length, with the teacher's tokenizer and the length
buckets `encode.bucket_boundaries` it was trained with, in groups of a bounded size
(`batching.MAX_GROUP_SIZE`), so that no worker sorts more however large the corpus; the
batches' contents do not depend on the runner, so a rerun writes the same pairs. Each
worker process restores the teacher once (pipelines/model_handler.py).

Engine (`distill.engine`, `method`): our jitted beam search, or the teacher exported to
CTranslate2 once per worker process (model/decoding/ctranslate2_search.py), the CPU engine of the
field, several times faster batched. At length_penalty 0 both write the same pairs; above,
CTranslate2's length normalisation may end a sentence on another hypothesis. The scores
are the teacher's summed log-probabilities either way.

Run it alone, locally (the in-process FnApiRunner):

    PADIR_DATA_ROOT=/path/to/data python -m pipelines.distill --config configs/multi30k_en_de.yaml

or on Dataflow (the workdir, with the teacher artifact, on GCS; one SDK process per VM so
that JAX has the VM's cores):

    python -m pipelines.distill --config configs/multi30k_en_de.yaml \\
        --set workdir=gs://BUCKET/padir --runner DataflowRunner --project PROJECT \\
        --region REGION --temp_location gs://BUCKET/tmp --sdk_container_image IMAGE \\
        --sdk_location=container --experiments=no_use_multiple_sdk_containers
"""

from __future__ import annotations

import json
import sys
from typing import Optional, Sequence

import apache_beam as beam
from apache_beam.metrics.metric import Metrics
from apache_beam.ml.inference.base import KeyedModelHandler, PredictionResult, RunInference

from components import artifacts, corpus, dag, distillation
from components import config as config_lib
from components import tokenizer as tokenizer_lib
from pipelines import batching, job, shards
from pipelines import options as options_lib
from pipelines.model_handler import TranslationModelHandler

NAMESPACE = "distill"  # of the Beam counters that become the manifest's counts
# The counts every manifest has, 0 if none.
COUNTER_NAMES = ("read", "kept", "dev", *(f"rejected.{reason}" for reason in distillation.REASONS))
STATS_FILE = "stats.json"


# distill.engine -> the decoding kind of its beam search, both scoring every hypothesis.
KINDS = {"jax": "ar_beam", "ctranslate2": "ct2_beam"}


def method(settings: config_lib.DistillConfig) -> config_lib.DecodeMethod:
    """The teacher's decoding method: beam search on the configured engine with the
    configured beam and penalty. CTranslate2 runs its greedy search at beam size 1 (as ours
    is exactly greedy there), still scored, so one kind serves every beam size."""
    kind = KINDS[settings.engine]
    return config_lib.DecodeMethod(
        f"{kind}{settings.beam_size}", kind, beam_size=settings.beam_size,
        length_penalty=settings.length_penalty)


# --- element logic and transforms --------------------------------------------------------


def judge(keyed: tuple[dict, PredictionResult],
          settings: config_lib.DistillConfig) -> distillation.Verdict:
    """(pair, its translation) -> the verdict, counted as `kept` or `rejected.<reason>`."""
    pair, result = keyed
    verdict = distillation.judge(pair, result.inference, settings)
    Metrics.counter(NAMESPACE,
                    "kept" if verdict.reason is None else f"rejected.{verdict.reason}").inc()
    return verdict


def _is_rejected(verdict: distillation.Verdict, num_partitions: int) -> int:
    return int(verdict.reason is not None)


class SummarizeDistillation(beam.CombineFn):
    """Verdicts -> their `DistillationStats` (counts only: a few numbers per worker)."""

    def create_accumulator(self):
        return distillation.DistillationStats()

    def add_input(self, accumulator, verdict):
        return accumulator.add(verdict)

    def merge_accumulators(self, accumulators):
        merged = distillation.DistillationStats()
        for accumulator in accumulators:
            merged.merge(accumulator)
        return merged

    def extract_output(self, accumulator):
        return accumulator


class CountTypes(beam.PTransform):
    """Verdicts -> (side, distinct words of the kept pairs' targets on that side).

    `Distinct` shuffles the words by value, so each worker holds only its share of the
    vocabulary, and the per-side counts are combined as numbers."""

    def expand(self, verdicts):
        return (
            verdicts
            | "TargetWords" >> beam.FlatMap(distillation.target_words)
            | "Distinct" >> beam.Distinct()
            | "CountPerSide" >> beam.combiners.Count.PerKey()
        )


def _summary(stats: distillation.DistillationStats, types: dict[str, int]) -> dict:
    return stats.summary(types)


def _to_json(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False)


# --- the job --------------------------------------------------------------------------------


def build(pipeline: beam.Pipeline, config: config_lib.Config, *, prepared_uri: str,
          teacher_uri: str, tokenizer: tokenizer_lib.Tokenizer, num_shards: int,
          output_uri: str, expected_sentences: Optional[int] = None) -> None:
    """Composes the job (see the module docstring); every output goes under `output_uri`.

    Args:
      tokenizer: the teacher's, for the batch keys (the handler loads its own copy).
      num_shards: of the distilled train split (the prepared train split's shards).
      expected_sentences: the train split's size, for the ETA of the progress log.
    """
    settings = config.distill
    # The teacher's buckets: its key includes the encode section, so these are its own.
    boundaries = config.encode.bucket_boundaries
    handler = TranslationModelHandler(teacher_uri, method(settings),
                                      batch_size=settings.batch_size, boundaries=boundaries,
                                      expected_sentences=expected_sentences)
    verdicts = (
        pipeline
        | "ReadTrain" >> beam.io.ReadFromText(corpus.split_pattern(prepared_uri, corpus.TRAIN))
        | "ParseJson" >> beam.Map(json.loads)
        | "CountRead" >> beam.Map(job.counted, NAMESPACE, "read")
        | "BatchByLength" >> batching.BatchByLength(tokenizer, boundaries,
                                                    batch_size=settings.batch_size)
        | "Translate" >> RunInference(KeyedModelHandler(handler).with_no_batching())
        | "Judge" >> beam.Map(judge, settings)
    )
    kept, rejected = verdicts | "SeparateRejects" >> beam.Partition(_is_rejected, 2)
    _ = (
        kept
        | "KeptRecords" >> beam.Map(lambda verdict: (verdict.id,
                                                     _to_json(verdict.kept_record())))
        | "WriteTrain" >> shards.WriteShards(artifacts.join(output_uri, corpus.TRAIN),
                                             ".jsonl", num_shards, shards.write_lines)
    )
    _ = (
        rejected
        | "RejectRecords" >> beam.Map(lambda verdict: (verdict.id,
                                                       _to_json(verdict.reject_record())))
        | "WriteRejects" >> shards.WriteShards(artifacts.join(output_uri, corpus.REJECTS),
                                               ".jsonl", 1, shards.write_lines)
    )
    types = verdicts | "CountTypes" >> CountTypes()
    _ = (
        verdicts
        | "Summarize" >> beam.CombineGlobally(SummarizeDistillation())
        | "AddTypes" >> beam.Map(_summary, beam.pvalue.AsDict(types))
        | "FormatStats" >> beam.Map(json.dumps, sort_keys=True)
        | "WriteStats" >> beam.io.WriteToText(
            artifacts.join(output_uri, STATS_FILE), num_shards=1, shard_name_template="")
    )
    _ = (
        pipeline
        | "ReadDev" >> beam.io.ReadFromText(corpus.split_pattern(prepared_uri, corpus.DEV))
        | "CountDev" >> beam.Map(job.counted, NAMESPACE, "dev")
        | "KeyDev" >> beam.Map(lambda line: (json.loads(line)["id"], line))
        | "WriteDev" >> shards.WriteShards(artifacts.join(output_uri, corpus.DEV), ".jsonl", 1,
                                           shards.write_lines)
    )


# --- the stage ------------------------------------------------------------------------------


def finish(out: artifacts.PendingArtifact, finished: job.Finished) -> None:
    """Every source read is kept or rejected, and every one was translated; the manifest
    gets the counts and the translations' figures."""
    counts, seconds = finished.counts, finished.seconds
    stats = artifacts.read_json(artifacts.join(out.tmp_uri, STATS_FILE))
    rejected = sum(counts[f"rejected.{reason}"] for reason in distillation.REASONS)
    job.check_accounting("distill", {
        "kept + rejected": (counts["read"], counts["kept"] + rejected),
        "translated": (counts["read"], stats["translated"]),
        "kept in the stats": (counts["kept"], stats["kept"])})
    if counts["read"] and not counts["kept"]:  # a student cannot train on nothing
        raise RuntimeError(f"distill: the teacher's translations were all rejected "
                           f"({counts}); is the teacher trained?")
    out.counts.update(counts)
    out.metrics.update(
        length_ratio=stats["length_ratio"], type_token_ratio=stats["type_token_ratio"],
        types=stats["types"],
        kept_fraction=round(counts["kept"] / counts["read"], 4) if counts["read"] else None,
        throughput={
            "sentences": counts["read"], "seconds": round(seconds, 3),
            "sentences_per_s": round(counts["read"] / seconds, 2),
            "decode_seconds": stats["decode_seconds"],
            "decode_sentences_per_s": (round(counts["read"] / stats["decode_seconds"], 2)
                                       if stats["decode_seconds"] else None)})


def run(config: config_lib.Config, pipeline_args: Sequence[str] = ()) -> artifacts.Artifact:
    """Translates the prepared train split with the teacher; publishes the distill artifact."""
    prepared = dag.require_input(config, "prepare")
    teacher = dag.require_input(config, "teacher")
    # Structural errors before any work starts.
    train_shards = corpus.split_files(prepared.uri, corpus.TRAIN)
    corpus.split_files(prepared.uri, corpus.DEV)
    tokenizer = tokenizer_lib.Tokenizer.for_artifact(teacher)
    return job.run(
        config, "distill", pipeline_args, inputs={"prepare": prepared, "teacher": teacher},
        build=lambda pipeline, output_uri: build(
            pipeline, config, prepared_uri=prepared.uri, teacher_uri=teacher.uri,
            tokenizer=tokenizer, num_shards=len(train_shards), output_uri=output_uri,
            expected_sentences=prepared.manifest["counts"].get(f"kept.{corpus.TRAIN}")),
        namespace=NAMESPACE, counter_names=COUNTER_NAMES, finish=finish)


def main(argv: Sequence[str] | None = None) -> int:
    return options_lib.main(run, argv, __doc__)


if __name__ == "__main__":
    # Run through the package so pickled functions refer to `pipelines.distill`, not `__main__`.
    from pipelines import distill as _distill

    sys.exit(_distill.main(sys.argv[1:]))
