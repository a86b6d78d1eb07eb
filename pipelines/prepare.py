"""The `prepare` stage: raw parallel text -> normalised, validated, de-duplicated splits.

Contract:
  reads:  the corpora named in the config's `data` section (no upstream artifact).
  writes: `<workdir>/prepare/<key>/` with `{split}-SSSSS-of-NNNNN.jsonl` for `train`
          (`prepare.num_shards` shards), `dev` and each test set (`test` when carved), lines
          `{"id", "source", "target"}`; `rejects-00000-of-00001.jsonl` with the reason of
          every rejected pair; `manifest.json` counts `read.<split>` (and `not_sampled.train`
          under `data.train_sample_fraction`), `kept.<split>`,
          `rejected.<reason>` and `rejected_by_split.<split>.<reason>` (Beam counters).
  The rules (normalisation, reasons, which apply to dev/test, carving, ids) are in the
  docstring of components/corpus.py. Read the output with `components.corpus.read_split`.

A structural problem fails before the pipeline starts, and nothing is written: a missing,
damaged, empty or UTF-16 file, CR-only line endings, misaligned source/target files
(`corpus.check_corpus`). Bad lines are rejected, counted and written; after the job, too
many of them fail the stage and nothing is published (`check_rejects`): more than
`prepare.max_reject_fraction` of the train pairs (duplicates aside), or any unusable line
(`corpus.STRUCTURAL`) or no usable line at all in a given dev or test set. The rejects
are then kept at `<workdir>/prepare/failed-<key>-rejects.jsonl`, named in the error.
Gzip is not splittable, so each corpus is read whole by one worker and the pairs are
reshuffled before the per-pair work.

Run locally (the in-process FnApiRunner):
    PADIR_DATA_ROOT=../shared/data python -m pipelines.prepare \\
        --config configs/multi30k_en_de.yaml
or `padir stage prepare configs/multi30k_en_de.yaml`. On Dataflow (workdir and inputs on
GCS, workers from a container built from the same lock):
    python -m pipelines.prepare --config configs/multi30k_en_de.yaml \\
        --set workdir=gs://BUCKET/padir --runner=DataflowRunner --project=PROJECT \\
        --region=REGION --temp_location=gs://BUCKET/tmp --sdk_container_image=IMAGE
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Iterator, Optional, Sequence

import apache_beam as beam
from apache_beam.metrics.metric import Metrics

from components import artifacts, corpus, dag
from components import config as config_lib
from pipelines import job, options, shards

NAMESPACE = "prepare"  # of the Beam counters that become the manifest's counts

# --- transforms ------------------------------------------------------------------------


def read_corpus(spec: corpus.CorpusSpec) -> Iterator[corpus.RawPair]:
    """The raw pairs of one corpus in its sample, counted as `read.<split>`; the lines
    outside `spec.sample_fraction`'s sample are counted as `not_sampled.<split>`."""
    read = Metrics.counter(NAMESPACE, f"read.{spec.split}")
    not_sampled = Metrics.counter(NAMESPACE, f"not_sampled.{spec.split}")
    for raw in corpus.read_pairs(spec):
        if corpus.in_sample(raw.id, spec.sample_fraction):
            read.inc()
            yield raw
        else:
            not_sampled.inc()


def tag_reject(reject: corpus.Reject) -> beam.pvalue.TaggedOutput:
    """Counts a reject (total and per split) and routes it to the rejects output."""
    Metrics.counter(NAMESPACE, f"rejected.{reject.reason}").inc()
    Metrics.counter(NAMESPACE, f"rejected_by_split.{reject.split}.{reject.reason}").inc()
    return beam.pvalue.TaggedOutput(corpus.REJECTS, reject)


class CleanPairs(beam.DoFn):
    """Raw pairs -> normalised pairs (main output) and rejects (tagged `rejects`)."""

    def __init__(self, config: config_lib.PrepareConfig):
        self._config = config

    def process(self, raw: corpus.RawPair):
        result = corpus.clean_pair(raw, self._config)
        yield tag_reject(result) if isinstance(result, corpus.Reject) else result


class KeepLowestId(beam.DoFn):
    """One group of identical pairs -> the lowest id (main output) and duplicate rejects."""

    def process(self, group):
        _, pairs = group
        kept, duplicates = corpus.drop_duplicates(pairs)
        yield kept
        for reject in duplicates:
            yield tag_reject(reject)


class DropDuplicates(beam.PTransform):
    """Pairs -> pairs with distinct (source, target) (main) and `rejects`."""

    def expand(self, pairs):
        return (
            pairs
            | "KeyByText" >> beam.Map(lambda pair: ((pair.source, pair.target), pair))
            | "GroupByText" >> beam.GroupByKey()
            | "KeepLowestId" >> beam.ParDo(KeepLowestId()).with_outputs(corpus.REJECTS,
                                                                        main="pairs")
        )


class WriteJsonl(beam.PTransform):
    """Records with `id` and `to_json()` -> `<prefix>-SSSSS-of-NNNNN.jsonl`, optionally
    counted; the same files on every run (`shards.WriteShards`)."""

    def __init__(self, prefix: str, num_shards: int, counter_name: Optional[str] = None):
        super().__init__()
        self._prefix = prefix
        self._num_shards = num_shards
        self._counter_name = counter_name

    def expand(self, records):
        if self._counter_name is not None:
            records = records | "Count" >> beam.Map(job.counted, NAMESPACE, self._counter_name)
        return (
            records
            | "ToJson" >> beam.Map(lambda record: (record.id, record.to_json()))
            | "Write" >> shards.WriteShards(self._prefix, ".jsonl", self._num_shards,
                                            shards.write_lines)
        )


def _is_held_out(pair: corpus.Pair, num_partitions: int) -> int:
    return int(pair.split != corpus.TRAIN)


def _split_index(pair: corpus.Pair, num_partitions: int, splits: tuple[str, ...], seed: int,
                 data: config_lib.DataConfig) -> int:
    return splits.index(corpus.output_split(pair, seed=seed, data=data))


# --- the job ---------------------------------------------------------------------------


def build(pipeline: beam.Pipeline, config: config_lib.Config, output_uri: str) -> None:
    """Composes the stage's steps; every output goes under `output_uri`."""
    splits = corpus.output_splits(config.data)
    cleaned = (
        pipeline
        | "ListCorpora" >> beam.Create(corpus.corpus_specs(config.data, config.prepare))
        | "ReadPairs" >> beam.FlatMap(read_corpus)
        | "Reshuffle" >> beam.Reshuffle()
        | "CleanPairs" >> beam.ParDo(CleanPairs(config.prepare)).with_outputs(corpus.REJECTS,
                                                                              main="pairs")
    )
    rejects = [cleaned[corpus.REJECTS]]
    train, held_out = cleaned.pairs | "SeparateHeldOut" >> beam.Partition(_is_held_out, 2)
    if config.prepare.deduplicate:  # train only: official dev/test sets stay as given
        deduplicated = train | "DropDuplicates" >> DropDuplicates()
        train = deduplicated.pairs
        rejects.append(deduplicated[corpus.REJECTS])
    by_split = (
        (train, held_out)
        | "MergePairs" >> beam.Flatten()
        | "AssignSplits" >> beam.Partition(_split_index, len(splits), splits, config.seed,
                                           config.data)
    )
    for split, pairs in zip(splits, by_split):
        num_shards = config.prepare.num_shards if split == corpus.TRAIN else 1
        _ = pairs | f"Write[{split}]" >> WriteJsonl(
            artifacts.join(output_uri, split), num_shards, counter_name=f"kept.{split}")
    _ = (
        rejects
        | "MergeRejects" >> beam.Flatten()
        | "WriteRejects" >> WriteJsonl(artifacts.join(output_uri, corpus.REJECTS), 1)
    )


def counter_names(config: config_lib.Config) -> list[str]:
    """The counts every manifest has, 0 if none: read per corpus, kept per split, rejected
    per reason."""
    return [*(f"read.{spec.split}" for spec in corpus.corpus_specs(config.data, config.prepare)),
            *(f"kept.{split}" for split in corpus.output_splits(config.data)),
            *(f"rejected.{reason}" for reason in corpus.REASONS)]


def check_rejects(counts: dict[str, int], config: config_lib.Config) -> None:
    """Fails a job whose input is too broken to publish (see the module docstring).

    Raises:
      corpus.CorpusError: naming the split, the counts by reason and the limit passed.
    """
    for spec in corpus.corpus_specs(config.data, config.prepare):
        split, read = spec.split, counts[f"read.{spec.split}"]
        rejected = {reason: counts.get(f"rejected_by_split.{split}.{reason}", 0)
                    for reason in corpus.REASONS}
        if split == corpus.TRAIN:
            bad = {r: n for r, n in rejected.items() if n and r != "duplicate"}
            total, limit = sum(bad.values()), config.prepare.max_reject_fraction
            if total > limit * read or total == read:
                hint = "; is the file UTF-8?" if max(bad, key=bad.get) == "invalid_utf8" else ""
                raise corpus.CorpusError(
                    f"data.train: {total} of {read} pairs rejected ({total / read:.0%}, "
                    f"prepare.max_reject_fraction is {limit}): {_by_reason(bad)}{hint}")
            continue
        unusable = {r: n for r, n in rejected.items() if n and r in corpus.STRUCTURAL}
        if unusable:
            raise corpus.CorpusError(
                f"data.{split}: {sum(unusable.values())} of {read} lines unusable "
                f"({_by_reason(unusable)}); a given {split} set is used whole or not at all")
        if counts[f"kept.{split}"] == 0:
            raise corpus.CorpusError(f"data.{split}: none of its {read} lines is usable "
                                     f"({_by_reason({r: n for r, n in rejected.items() if n})})")


def _by_reason(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in counts.items())


def failed_rejects_uri(config: config_lib.Config) -> str:
    """Where the rejects of a job that failed `check_rejects` are kept (not an artifact)."""
    key = dag.stage_key(config, "prepare")
    return artifacts.join(config.workdir, "prepare", f"failed-{key}-rejects.jsonl")


def _keep_rejects(tmp_uri: str, config: config_lib.Config) -> str:
    fs, source = artifacts.filesystem(corpus.split_pattern(tmp_uri, corpus.REJECTS))
    target = failed_rejects_uri(config)
    _, target_path = artifacts.filesystem(target)
    with fs.open(target_path, "wb") as out:
        for path in sorted(fs.glob(source)):
            out.write(fs.cat_file(path))
    return target


def finish(config: config_lib.Config, out: artifacts.PendingArtifact,
           finished: job.Finished) -> None:
    """Every pair read is kept or rejected, and not too many are rejected (`check_rejects`);
    the manifest gets the counts and the split sizes."""
    counts = finished.counts
    total = {prefix: sum(v for k, v in counts.items() if k.startswith(prefix))
             for prefix in ("read.", "kept.", "rejected.")}
    job.check_accounting("prepare", {
        "kept + rejected pairs": (total["read."], total["kept."] + total["rejected."])})
    try:
        check_rejects(counts, config)
    except corpus.CorpusError as e:
        kept = _keep_rejects(out.tmp_uri, config)
        raise corpus.CorpusError(f"{e}; nothing published, the rejects are in {kept}") from e
    out.counts.update(counts)
    out.metrics["split_sizes"] = {
        split: counts[f"kept.{split}"] for split in corpus.output_splits(config.data)}


def run(config: config_lib.Config, pipeline_args: Sequence[str] = ()) -> artifacts.Artifact:
    """Checks the inputs, runs the job and publishes its artifact (see module docstring).

    Raises:
      corpus.CorpusError: a structural problem (nothing is written), or too many rejects
        (nothing is published; the rejects are kept, see `failed_rejects_uri`).
    """
    for spec in corpus.corpus_specs(config.data, config.prepare):  # before anything is written
        logging.info("prepare: %s has %d lines", spec.split, corpus.check_corpus(spec))
    return job.run(config, "prepare", pipeline_args, inputs={},
                   build=lambda pipeline, output_uri: build(pipeline, config, output_uri),
                   namespace=NAMESPACE, counter_names=counter_names(config),
                   finish=functools.partial(finish, config))


def main(argv: Sequence[str] | None = None) -> int:
    return options.main(run, argv, __doc__)


if __name__ == "__main__":
    # Run through the importable module rather than `__main__`, so that what Beam pickles
    # refers to `pipelines.prepare.*`, which Dataflow workers can import.
    from pipelines import prepare

    sys.exit(prepare.main())
