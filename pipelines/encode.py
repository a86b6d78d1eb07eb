"""The `encode` stage: prepared pairs -> token ids (+EOS) in TFRecord shards, for tf.data.

Contract:
  reads   the `prepare` artifact: `{split}-SSSSS-of-NNNNN.jsonl` for split in train, dev,
          one `{"id", "source", "target"}` object per line; and the `vocab` artifact's
          `spm.model`.
  writes  `<workdir>/encode/<key>/` (layout and features: components/records.py):
            {split}-SSSSS-of-NNNNN.tfrecord  `encode.num_shards` shards of tf.train.Examples
                             (`id`, `source`, `target`, `source_length`, `target_length`),
                             ids = SentencePiece pieces + EOS (1);
            rejects/{split}-00000-of-00001.jsonl  pairs whose source or target, EOS
                             included, is longer than `encode.max_source_len` /
                             `max_target_len` (reason `too_many_tokens`), with their text,
                             sorted by id;
            stats/{split}.json  token length histogram, mean, p95, max per side and the
                             number of pairs per bucket boundary;
            manifest.json    counts `read.<split>`, `encoded.<split>`, `rejected.<split>`
                             (read = encoded + rejected, checked) and the stats as metrics.

Tokenisation is tensorflow-text's SentencePiece op, built once per worker in `DoFn.setup()`
and applied to batches of pairs (`BatchElements`). Its ids are those of `Tokenizer.encode`
except where two segmentations score exactly the same: tf-text's bundled SentencePiece breaks
such ties differently from the Python package (e.g. "10,000" -> '00','0' vs '0','00'; 3 of
the 58k Multi30k train sentences). Both decode to the same text.
The input patterns are a parameter of `build`, so any source of pairs in the prepared
format is encoded the same way: the `encode_distilled` stage (pipelines/encode_distilled.py)
is this job on the `distill` artifact, whose `train` pairs hold the
teacher's translations and whose `dev` pairs are the prepared ones; it writes
`<workdir>/encode_distilled/<key>/` in the layout above.

Run it alone, locally (the in-process FnApiRunner of the config's `runner` section):

    PADIR_DATA_ROOT=/path/to/data python -m pipelines.encode --config configs/multi30k_en_de.yaml

or on Dataflow (the workdir must then be a gs:// path):

    python -m pipelines.encode --config configs/multi30k_en_de.yaml \
        --set workdir=gs://BUCKET/padir --runner DataflowRunner --project PROJECT \
        --region REGION --temp_location gs://BUCKET/tmp \
        --sdk_container_image IMAGE
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Iterator, Mapping, Sequence

import apache_beam as beam
from apache_beam.metrics.metric import Metrics

from components import artifacts, corpus, dag, records
from components import config as config_lib
from components import tokenizer as tokenizer_lib
from pipelines import job, shards
from pipelines import options as options_lib

NAMESPACE = "encode"  # of the Beam counters that become the manifest's counts
REJECTS = "rejects"  # the tagged output of TokenizePairs
_MAX_BATCH = 1024  # pairs per tokenizer call: large enough to amortise the op's overhead


# --- element logic and transforms --------------------------------------------------------


class TokenizePairs(beam.DoFn):
    """A batch of prepared pairs -> encoded pairs, and rejects on the `rejects` output.

    Encoded: `{"id", "source": [ids..., EOS], "target": [ids..., EOS]}`.
    Rejected: `{"id", "reason", "source_length", "target_length", "source", "target"}`
    (lengths in tokens with EOS; source and target are the text).
    """

    def __init__(self, tokenizer: tokenizer_lib.Tokenizer, split: str, *,
                 max_source_len: int, max_target_len: int):
        self._model = tokenizer  # pickles as its model bytes; the TF op is built in setup()
        self._max_source_len = max_source_len
        self._max_target_len = max_target_len
        self._read = Metrics.counter(NAMESPACE, f"read.{split}")
        self._encoded = Metrics.counter(NAMESPACE, f"encoded.{split}")
        self._rejected = {reason: Metrics.counter(NAMESPACE, f"rejected.{split}.{reason}")
                          for reason in records.REASONS}
        self._tokenizer = None

    def setup(self):
        self._tokenizer = self._model.tf_tokenizer()

    def process(self, pairs: list[dict]) -> Iterator[dict]:
        self._read.inc(len(pairs))
        sources = self._tokenizer.tokenize([p["source"] for p in pairs]).to_list()
        targets = self._tokenizer.tokenize([p["target"] for p in pairs]).to_list()
        for pair, source_pieces, target_pieces in zip(pairs, sources, targets):
            source, target = records.with_eos(source_pieces), records.with_eos(target_pieces)
            reason = records.check_lengths(len(source), len(target),
                                           max_source_len=self._max_source_len,
                                           max_target_len=self._max_target_len)
            if reason is None:
                self._encoded.inc()
                yield {"id": pair["id"], "source": source, "target": target}
            else:
                self._rejected[reason].inc()
                yield beam.pvalue.TaggedOutput(REJECTS, {
                    "id": pair["id"], "reason": reason,
                    "source_length": len(source), "target_length": len(target),
                    "source": pair["source"], "target": pair["target"],
                })


class SummarizeLengths(beam.CombineFn):
    """Encoded pairs -> token length figures per side and pairs per bucket boundary."""

    def __init__(self, boundaries: Sequence[int]):
        self._boundaries = tuple(boundaries)

    def create_accumulator(self):
        return collections.Counter(), collections.Counter(), collections.Counter()

    def add_input(self, accumulator, pair: dict):
        sources, targets, buckets = accumulator
        sources[len(pair["source"])] += 1
        targets[len(pair["target"])] += 1
        buckets[records.bucket_of(len(pair["source"]), len(pair["target"]), self._boundaries)] += 1
        return accumulator

    def merge_accumulators(self, accumulators):
        merged = self.create_accumulator()
        for accumulator in accumulators:
            for total, part in zip(merged, accumulator):
                total.update(part)
        return merged

    def extract_output(self, accumulator) -> dict:
        sources, targets, buckets = accumulator
        return {
            "source_length": records.summarize_lengths(sources),
            "target_length": records.summarize_lengths(targets),
            "buckets": {str(b): buckets.get(b, 0) for b in self._boundaries},
        }


class EncodeSplit(beam.PTransform):
    """Prepared JSON lines of one split -> TFRecord shards, rejects and stats under `output_uri`."""

    def __init__(self, split: str, input_pattern: str, tokenizer: tokenizer_lib.Tokenizer,
                 config: config_lib.EncodeConfig, output_uri: str):
        super().__init__()
        self.split = split
        self.input_pattern = input_pattern
        self.tokenizer = tokenizer
        self.config = config
        self.output_uri = output_uri

    def expand(self, pbegin):
        outputs = (
            pbegin
            | "Read" >> beam.io.ReadFromText(self.input_pattern)
            | "ParseJson" >> beam.Map(json.loads)
            | "Batch" >> beam.BatchElements(min_batch_size=16, max_batch_size=_MAX_BATCH)
            | "Tokenize" >> beam.ParDo(TokenizePairs(
                self.tokenizer, self.split, max_source_len=self.config.max_source_len,
                max_target_len=self.config.max_target_len)).with_outputs(REJECTS, main="encoded")
        )
        _ = (
            outputs.encoded
            | "Serialize" >> beam.Map(lambda pair: (pair["id"], records.serialize_example(
                pair["id"], pair["source"], pair["target"])))
            | "WriteRecords" >> shards.WriteShards(
                records.shard_prefix(self.output_uri, self.split), records.SUFFIX,
                self.config.num_shards, records.write_shard)
        )
        _ = (
            outputs[REJECTS]
            | "FormatRejects" >> beam.Map(lambda reject: (reject["id"], json.dumps(
                reject, ensure_ascii=False, sort_keys=True)))
            | "WriteRejects" >> shards.WriteShards(
                artifacts.join(self.output_uri, "rejects", self.split), ".jsonl", 1,
                shards.write_lines)
        )
        _ = (
            outputs.encoded
            | "Summarize" >> beam.CombineGlobally(SummarizeLengths(self.config.bucket_boundaries))
            | "FormatStats" >> beam.Map(json.dumps, sort_keys=True)
            | "WriteStats" >> beam.io.WriteToText(
                records.stats_path(self.output_uri, self.split), num_shards=1,
                shard_name_template="")
        )
        return outputs


def build(pipeline: beam.Pipeline, config: config_lib.Config, *, inputs: Mapping[str, str],
          tokenizer: tokenizer_lib.Tokenizer, output_uri: str) -> None:
    """Adds one `EncodeSplit` per entry of `inputs` (split name -> glob of prepared JSON lines)."""
    for split, pattern in inputs.items():
        _ = pipeline | f"Encode[{split}]" >> EncodeSplit(
            split, pattern, tokenizer, config.encode, output_uri)


# --- the stage ------------------------------------------------------------------------------


# The counts every manifest has, 0 if none: per split, `read`, `encoded`, `rejected` (all
# reasons, summed by `finish`) and `rejected.<split>.<reason>`.
COUNTER_NAMES = tuple(name for split in records.SPLITS for name in (
    f"read.{split}", f"encoded.{split}", f"rejected.{split}",
    *(f"rejected.{split}.{reason}" for reason in records.REASONS)))


def finish(out: artifacts.PendingArtifact, finished: job.Finished) -> None:
    """Every pair read is encoded or rejected, and the stats count every encoded one; the
    manifest gets the counts and the stats."""
    counts = dict(finished.counts)
    for split in records.SPLITS:
        counts[f"rejected.{split}"] = sum(
            counts[f"rejected.{split}.{reason}"] for reason in records.REASONS)
    stats = {split: artifacts.read_json(records.stats_path(out.tmp_uri, split))
             for split in records.SPLITS}
    balances = {}
    for split in records.SPLITS:
        encoded = counts[f"encoded.{split}"]
        balances[f"{split}: encoded + rejected"] = (
            counts[f"read.{split}"], encoded + counts[f"rejected.{split}"])
        balances[f"{split}: pairs in the stats"] = (encoded, stats[split]["source_length"]["count"])
    job.check_accounting("encode", balances)
    out.counts.update(counts)
    out.metrics.update(stats)


# Encode stage -> the stage whose prepared-format pairs it encodes.
PAIRS = {"encode": "prepare", "encode_distilled": "distill"}


def run(config: config_lib.Config, pipeline_args: Sequence[str] = ()) -> artifacts.Artifact:
    """Recomputes the encode artifact from the complete prepare and vocab artifacts."""
    return encode_pairs(config, "encode", pipeline_args)


def encode_pairs(config: config_lib.Config, stage: str,
                 pipeline_args: Sequence[str]) -> artifacts.Artifact:
    """Runs this job as `stage` ("encode" or "encode_distilled") on that stage's pairs."""
    pairs = dag.require_input(config, PAIRS[stage])
    vocab = dag.require_input(config, "vocab")
    for split in records.SPLITS:  # structural errors before any work starts
        corpus.split_files(pairs.uri, split)
    patterns = {split: corpus.split_pattern(pairs.uri, split) for split in records.SPLITS}
    tokenizer = tokenizer_lib.Tokenizer.for_artifact(vocab)
    return job.run(
        config, stage, pipeline_args, inputs={pairs.stage: pairs, "vocab": vocab},
        build=lambda pipeline, output_uri: build(
            pipeline, config, inputs=patterns, tokenizer=tokenizer, output_uri=output_uri),
        namespace=NAMESPACE, counter_names=COUNTER_NAMES, finish=finish)


def main(argv: Sequence[str] | None = None) -> int:
    return options_lib.main(run, argv, __doc__)


if __name__ == "__main__":
    # Run through the package so pickled functions refer to `pipelines.encode`, not `__main__`.
    from pipelines import encode as _encode

    sys.exit(_encode.main(sys.argv[1:]))
