"""The `vocab` stage: Beam word counts of the prepared train split, then one joint SentencePiece.

Contract:
  reads   the `prepare` artifact: `train-*.jsonl` (and `dev-*.jsonl` for the coverage
          figures), one `{"id", "source", "target"}` object per line.
  writes  `<workdir>/vocab/<key>/`:
            word_counts.tsv  `word<TAB>count`, the `vocab.max_words` most frequent words of
                             both sides, by count (descending) then word;
            spm.model, spm.vocab  a joint SentencePiece model trained from that file with
                             the reserved ids of `components.tokenizer` (pad 0, eos 1, unk 2,
                             bos 3, <mask> 4, <length> 5; then the byte pieces);
            piece_lengths.tsv  `lang<TAB>pieces<TAB>sentences`: how many train sentences
                             of each language the model cuts into that many pieces;
            manifest.json    counts (train pairs, words, distinct words, vocab size) and
                             metrics (pieces per sentence on train, from that histogram;
                             unk / byte-fallback rate and character coverage on dev, per
                             language).

Two Beam jobs, which scale out: the word count, then, once SentencePiece has trained
in-process on the counts (at most `vocab.max_words` lines), the piece-length histogram of
the train split with the trained model. Training on `word<TAB>count` gives the same model
as training on the sentences: SentencePiece never builds a piece across a space. The dev
coverage figures are computed in-process: the dev split is a held-out set sized for
evaluation, which training decodes whole at every evaluation anyway.

Run it alone, locally:

    PADIR_DATA_ROOT=/path/to/data python -m pipelines.vocab --config configs/multi30k_en_de.yaml

or on Dataflow (the workdir must then be a gs:// path):

    python -m pipelines.vocab --config configs/multi30k_en_de.yaml \
        --set workdir=gs://BUCKET/padir --runner DataflowRunner --project PROJECT \
        --region REGION --temp_location gs://BUCKET/tmp \
        --sdk_container_image IMAGE
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from typing import Iterable, Iterator, Sequence

import apache_beam as beam
from apache_beam.metrics.metric import Metrics

from components import artifacts, corpus, dag
from components import config as config_lib
from components import tokenizer as tokenizer_lib
from pipelines import job
from pipelines import options as options_lib

WORD_COUNTS_FILE = "word_counts.tsv"
PIECE_LENGTHS_FILE = "piece_lengths.tsv"
NAMESPACE = "vocab"
_ENCODE_BATCH = 1024


# --- element logic and transforms --------------------------------------------------------


class ExtractWordsFn(beam.DoFn):
    """A prepared pair -> the whitespace words of its source and target sides."""

    def __init__(self):
        super().__init__()
        self.words = Metrics.counter(NAMESPACE, "words")

    def process(self, pair: dict) -> Iterator[str]:
        for side in ("source", "target"):
            words = tokenizer_lib.whitespace_words(pair[side])
            self.words.inc(len(words))
            yield from words


class ExtractWords(beam.PTransform):
    """JSON lines of prepared pairs -> words (both sides: the vocabulary is joint)."""

    def expand(self, lines):
        return (
            lines
            | "ParseJson" >> beam.Map(json.loads)
            | "SplitSides" >> beam.ParDo(ExtractWordsFn())
        )


class CountWords(beam.PTransform):
    """Words -> (word, count); a CombinePerKey, so counts are combined before the shuffle."""

    def expand(self, words):
        distinct = Metrics.counter(NAMESPACE, "distinct_words")

        def count_distinct(word_count):
            distinct.inc()
            return word_count

        return (
            words
            | "PairWithOne" >> beam.Map(lambda word: (word, 1))
            | "SumPerWord" >> beam.CombinePerKey(sum)
            | "CountDistinct" >> beam.Map(count_distinct)
        )


def frequency_order(word_count: tuple[str, int]) -> tuple[int, str]:
    """Sort key: most frequent first, ties broken by the word (deterministic)."""
    word, count = word_count
    return -count, word


def format_word_counts(word_counts: Sequence[tuple[str, int]]) -> Iterator[str]:
    """The whole `word<TAB>count` file as one element (one element keeps the order)."""
    if word_counts:
        yield "\n".join(f"{word}\t{count}" for word, count in word_counts)


class SelectTopWords(beam.PTransform):
    """(word, count) -> one text blob of the `max_words` most frequent, in frequency order."""

    def __init__(self, max_words: int):
        super().__init__()
        self.max_words = max_words

    def expand(self, word_counts):
        return (
            word_counts
            # reverse=True keeps the smallest keys: highest counts, then the first words.
            | "Top" >> beam.combiners.Top.Of(self.max_words, key=frequency_order, reverse=True)
            | "Format" >> beam.FlatMap(format_word_counts)
        )


def build(pipeline: beam.Pipeline, config: config_lib.Config, input_pattern: str,
          output_uri: str) -> None:
    """Adds the word count (the first job): prepared JSON lines at `input_pattern` ->
    `output_uri` (TSV)."""
    _ = (
        pipeline
        | "ReadTrain" >> beam.io.ReadFromText(input_pattern)
        | "ExtractWords" >> ExtractWords()
        | "CountWords" >> CountWords()
        | "SelectTopWords" >> SelectTopWords(config.vocab.max_words)
        | "WriteWordCounts" >> beam.io.WriteToText(
            output_uri, num_shards=1, shard_name_template="")
    )


class PieceLengthsFn(beam.DoFn):
    """A batch of prepared pairs -> ((lang, pieces), sentences): the batch's histogram of
    each side with the trained model (SentencePiece encodes a batch many times faster than
    its sentences one by one); counts the pairs as `train_pairs`."""

    def __init__(self, tokenizer: tokenizer_lib.Tokenizer, langs: tuple[str, str]):
        super().__init__()
        self._tokenizer = tokenizer  # pickles as its model bytes
        self._langs = langs
        self.pairs = Metrics.counter(NAMESPACE, "train_pairs")

    def process(self, pairs: list[dict]) -> Iterator[tuple[tuple[str, int], int]]:
        self.pairs.inc(len(pairs))
        for lang, side in zip(self._langs, ("source", "target")):
            lengths = collections.Counter(
                len(ids) for ids in self._tokenizer.encode([pair[side] for pair in pairs]))
            yield from (((lang, pieces), sentences) for pieces, sentences in lengths.items())


def format_histogram(entries: Sequence[tuple[tuple[str, int], int]]) -> Iterator[str]:
    """((lang, pieces), sentences) entries -> the whole TSV as one element, sorted."""
    if entries:
        yield "\n".join(f"{lang}\t{pieces}\t{sentences}"
                        for (lang, pieces), sentences in sorted(entries))


def build_piece_lengths(pipeline: beam.Pipeline, tokenizer: tokenizer_lib.Tokenizer,
                        langs: tuple[str, str], input_pattern: str, output_uri: str) -> None:
    """Adds the piece-length histogram: prepared JSON lines at `input_pattern` ->
    `output_uri` (TSV). Counting is a combine, so only (lang, pieces) entries are shuffled;
    the one gathered list holds one entry per language and distinct length."""
    _ = (
        pipeline
        | "ReadTrain" >> beam.io.ReadFromText(input_pattern)
        | "ParseJson" >> beam.Map(json.loads)
        | "Batch" >> beam.BatchElements(max_batch_size=_ENCODE_BATCH)
        | "CountPieces" >> beam.ParDo(PieceLengthsFn(tokenizer, langs))
        | "Histogram" >> beam.CombinePerKey(sum)
        | "Gather" >> beam.combiners.ToList()
        | "Format" >> beam.FlatMap(format_histogram)
        | "WritePieceLengths" >> beam.io.WriteToText(
            output_uri, num_shards=1, shard_name_template="")
    )


# --- statistics of the trained model -------------------------------------------------------


def stream_split(artifact: artifacts.Artifact, split: str) -> Iterator[dict]:
    """The pairs of one prepared split, shard by shard, in no particular order: unlike
    `corpus.read_split`, the split need not fit in memory (statistics need no order)."""
    for file in corpus.split_files(artifact.uri, split):
        yield from corpus.read_jsonl(file)


def _batches(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def summarise_lengths(histogram: collections.Counter) -> dict:
    """Mean and p95 (nearest rank) of a length histogram {length: sentences}."""
    total = sum(histogram.values())
    if not total:
        return {"mean": None, "p95": None}
    mean = sum(length * n for length, n in histogram.items()) / total
    rank, seen = math.ceil(0.95 * total), 0
    for length in sorted(histogram):
        seen += histogram[length]
        if seen >= rank:
            return {"mean": round(mean, 3), "p95": length}
    raise AssertionError("unreachable")


def vocab_characters(tokenizer: tokenizer_lib.Tokenizer) -> frozenset[str]:
    """Every character of a real piece ('▁' stands for the space)."""
    chars = set()
    for token_id in range(tokenizer.first_real_id, tokenizer.vocab_size):
        chars.update(tokenizer.id_to_piece(token_id))
    return frozenset(chars)


def coverage_stats(tokenizer: tokenizer_lib.Tokenizer, pairs: Iterable[dict],
                   langs: tuple[str, str]) -> tuple[int, dict]:
    """Unk rate, byte-fallback rate (per piece) and character coverage (per non-space
    character) per language; also returns the number of pairs."""
    chars = vocab_characters(tokenizer)
    totals = {lang: collections.Counter() for lang in langs}
    num_pairs = 0
    for batch in _batches(pairs, _ENCODE_BATCH):
        num_pairs += len(batch)
        for lang, side in zip(langs, ("source", "target")):
            texts = [p[side] for p in batch]
            t = totals[lang]
            for ids in tokenizer.encode(texts):
                t["pieces"] += len(ids)
                t["unk"] += sum(1 for i in ids if i == tokenizer_lib.UNK_ID)
                t["byte"] += sum(1 for i in ids if tokenizer.is_byte(i))
            for text in texts:
                for c in text:
                    if not c.isspace():
                        t["chars"] += 1
                        t["covered"] += c in chars
    return num_pairs, {
        lang: {
            "unk_rate": _ratio(t["unk"], t["pieces"]),
            "byte_fallback_rate": _ratio(t["byte"], t["pieces"]),
            "char_coverage": _ratio(t["covered"], t["chars"]),
        }
        for lang, t in totals.items()
    }


def _ratio(numerator: int, denominator: int) -> float | None:
    return round(numerator / denominator, 6) if denominator else None


# --- the stage ------------------------------------------------------------------------------


def _put(local_path: str, uri: str) -> None:
    fs, path = artifacts.filesystem(uri)
    fs.put_file(local_path, path)


def _fetch(uri: str, local_path: str) -> None:
    fs, path = artifacts.filesystem(uri)
    fs.get_file(path, local_path)


def piece_length_stats(config: config_lib.Config, pipeline_args: Sequence[str],
                       tokenizer: tokenizer_lib.Tokenizer, langs: tuple[str, str],
                       input_pattern: str, output_uri: str) -> tuple[int, dict]:
    """Runs the piece-length job (`build_piece_lengths`) to the end: pieces per sentence
    (mean, p95) per language; also returns the number of pairs."""
    pipeline = beam.Pipeline(options=options_lib.pipeline_options(config, pipeline_args))
    build_piece_lengths(pipeline, tokenizer, langs, input_pattern, output_uri)
    result = pipeline.run()
    result.wait_until_finish()
    num_pairs = job.counter_values(result, NAMESPACE, ("train_pairs",))["train_pairs"]
    histograms = {lang: collections.Counter() for lang in langs}
    fs, path = artifacts.filesystem(output_uri)
    with fs.open(path, "r", encoding="utf-8") as f:
        for line in f:
            lang, pieces, sentences = line.rstrip("\n").split("\t")
            histograms[lang][int(pieces)] += int(sentences)
    return num_pairs, {lang: summarise_lengths(h) for lang, h in histograms.items()}


def finish(config: config_lib.Config, pipeline_args: Sequence[str], prepared: artifacts.Artifact,
           out: artifacts.PendingArtifact, finished: job.Finished) -> None:
    """Trains SentencePiece on the word counts and runs the piece-length job with it; the
    manifest gets the counts and the model's figures on the prepared train and dev splits."""
    counts = finished.counts
    if counts["distinct_words"] == 0:
        raise ValueError(f"the train split of {prepared.uri} has no words")
    model_bytes = _train_sentencepiece(config, out)
    tokenizer = tokenizer_lib.Tokenizer(model_bytes)
    langs = (config.data.source_lang, config.data.target_lang)
    if langs[0] == langs[1]:  # the metrics are keyed by language
        langs = (f"{langs[0]}-source", f"{langs[1]}-target")
    train_pairs, pieces = piece_length_stats(
        config, pipeline_args, tokenizer, langs, corpus.split_pattern(prepared.uri, corpus.TRAIN),
        out.path(PIECE_LENGTHS_FILE))
    dev_pairs, dev = coverage_stats(tokenizer, stream_split(prepared, corpus.DEV), langs)
    out.counts.update(
        train_pairs=train_pairs,
        dev_pairs=dev_pairs,
        words=counts["words"],
        distinct_words=counts["distinct_words"],
        words_kept=min(counts["distinct_words"], config.vocab.max_words),
        vocab_size=tokenizer.vocab_size,
        first_real_id=tokenizer.first_real_id,
    )
    out.metrics.update(
        train_pieces_per_sentence=pieces,
        dev=dev,
    )
    logging.info("vocab: metrics=%s", out.metrics)


def _train_sentencepiece(config: config_lib.Config, out: artifacts.PendingArtifact) -> bytes:
    """SentencePiece from the artifact's word counts, into the artifact; its model bytes."""
    # SentencePiece records its input and output paths in the model file: a fixed local
    # directory per key (one writer: the lease) keeps reruns byte-identical.
    local_dir = os.path.join(tempfile.gettempdir(), "padir-vocab", out.key)
    shutil.rmtree(local_dir, ignore_errors=True)
    os.makedirs(local_dir)
    try:
        local_counts = f"{local_dir}/{WORD_COUNTS_FILE}"
        _fetch(out.path(WORD_COUNTS_FILE), local_counts)
        model_prefix = f"{local_dir}/spm"
        model_bytes = tokenizer_lib.train_sentencepiece(
            local_counts, model_prefix, config.vocab, seed=config.seed, num_threads=2)
        _put(f"{model_prefix}.model", out.path(tokenizer_lib.MODEL_FILE))
        _put(f"{model_prefix}.vocab", out.path(tokenizer_lib.VOCAB_FILE))
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    return model_bytes


def run(config: config_lib.Config, pipeline_args: Sequence[str] = ()) -> artifacts.Artifact:
    """Recomputes the vocab artifact from the complete prepare artifact; returns it."""
    prepared = dag.require_input(config, "prepare")
    for split in (corpus.TRAIN, corpus.DEV):  # structural errors before any work starts
        corpus.split_files(prepared.uri, split)
    return job.run(
        config, "vocab", pipeline_args, inputs={"prepare": prepared},
        build=lambda pipeline, output_uri: build(
            pipeline, config, corpus.split_pattern(prepared.uri, corpus.TRAIN),
            artifacts.join(output_uri, WORD_COUNTS_FILE)),
        namespace=NAMESPACE, counter_names=("words", "distinct_words"),
        finish=functools.partial(finish, config, pipeline_args, prepared))


def main(argv: Sequence[str] | None = None) -> int:
    return options_lib.main(run, argv, __doc__)


if __name__ == "__main__":
    # Run through the package so pickled functions refer to `pipelines.vocab`, not `__main__`.
    from pipelines import vocab as _vocab

    sys.exit(_vocab.main(sys.argv[1:]))
