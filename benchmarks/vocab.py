"""Vocab benchmark: Beam word counts + SentencePiece from TSV vs SentencePiece on raw text.

On Tatoeba de-en (`$PADIR_DATA_ROOT/tatoeba/deu-eng.zip`, member `deu.txt`, TSV
`English<TAB>German`), read straight from the zip (no prepare stage), this times

  (a) the vocab stage's path: the Beam word count (`pipelines.vocab.build`, FnApiRunner)
      then SentencePiece trained on `word<TAB>count` (`input_format=tsv`);
  (b) SentencePiece trained directly on the raw text (both sides, one sentence a line),

with the same trainer options (vocab size, reserved ids, identity normalisation, byte
fallback, seed, 2 threads), and prints the mean pieces per sentence (en, de) of both models
on held-out pairs (split by unique English sentence, so alternative translations of one
sentence never straddle the split).

    PADIR_DATA_ROOT=/work/shared/data python benchmarks/vocab.py [--vocab-size 8000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
import unicodedata
import zipfile

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
import sentencepiece as spm

from components import config as config_lib
from components import tokenizer as tokenizer_lib
from pipelines import vocab


def read_pairs(zip_path: str, member: str) -> tuple[list[tuple[str, str]], int]:
    """(English, German) pairs, NFC-normalised and whitespace-collapsed; and the malformed count."""
    pairs, malformed = [], 0
    with zipfile.ZipFile(zip_path) as archive, archive.open(member) as f:
        for raw in f:
            columns = raw.decode("utf-8").rstrip("\n").split("\t")
            if len(columns) < 2:
                malformed += 1
                continue
            en, de = (" ".join(unicodedata.normalize("NFC", c).split()) for c in columns[:2])
            if en and de:
                pairs.append((en, de))
            else:
                malformed += 1
    return pairs, malformed


def is_held_out(english: str, percent: int, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{english}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def count_words(config: config_lib.Config, jsonl: str, tsv: str) -> None:
    pipeline = beam.Pipeline(options=PipelineOptions([f"--runner={config.runner.name}"]))
    vocab.build(pipeline, config, jsonl, tsv)
    pipeline.run().wait_until_finish()


def train_raw(config: config_lib.Config, text_path: str, model_prefix: str) -> bytes:
    spm.set_random_generator_seed(config.seed)
    spm.SentencePieceTrainer.train(input=text_path, model_prefix=model_prefix,
                                   **tokenizer_lib.trainer_options(config.vocab))
    with open(f"{model_prefix}.model", "rb") as f:
        return f.read()


def pieces_per_sentence(model_bytes: bytes, texts: list[str]) -> float:
    tokenizer = tokenizer_lib.Tokenizer(model_bytes)
    return statistics.fmean(len(ids) for ids in tokenizer.encode(texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--held-out-percent", type=int, default=2)
    parser.add_argument("--data-root", default=os.environ.get("PADIR_DATA_ROOT", "../shared/data"))
    args = parser.parse_args()

    zip_path = os.path.join(args.data_root, "tatoeba", "deu-eng.zip")
    config = config_lib.Config(
        data=config_lib.DataConfig(  # Tatoeba's export: English<TAB>German
            source_lang="en", target_lang="de",
            train=config_lib.CorpusConfig(tsv=zip_path, member="deu.txt")),
        vocab=config_lib.VocabConfig(size=args.vocab_size),
    )
    (pairs, malformed), read_s = timed(read_pairs, zip_path, "deu.txt")
    held_out = [p for p in pairs if is_held_out(p[0], args.held_out_percent, config.seed)]
    train = [p for p in pairs if not is_held_out(p[0], args.held_out_percent, config.seed)]

    with tempfile.TemporaryDirectory(prefix="padir-bench-vocab-") as tmp:
        jsonl, raw, tsv = (os.path.join(tmp, n) for n in ("train.jsonl", "raw.txt", "wc.tsv"))
        with open(jsonl, "w", encoding="utf-8") as fj, open(raw, "w", encoding="utf-8") as fr:
            for i, (en, de) in enumerate(train):
                fj.write(json.dumps({"id": str(i), "source": en, "target": de},
                                    ensure_ascii=False) + "\n")
                fr.write(f"{en}\n{de}\n")
        _, beam_s = timed(count_words, config, jsonl, tsv)
        with open(tsv, encoding="utf-8") as f:
            distinct_words = sum(1 for _ in f)
        model_a, spm_a_s = timed(tokenizer_lib.train_sentencepiece, tsv,
                                 os.path.join(tmp, "a"), config.vocab, seed=config.seed)
        model_b, spm_b_s = timed(train_raw, config, raw, os.path.join(tmp, "b"))

    en = [p[0] for p in held_out]
    de = [p[1] for p in held_out]
    pieces = {}
    for name, model in (("a", model_a), ("b", model_b)):
        pieces[name] = (pieces_per_sentence(model, en), pieces_per_sentence(model, de))
    vocab_a = set(spm.SentencePieceProcessor(model_proto=model_a).id_to_piece(
        list(range(args.vocab_size))))
    vocab_b = set(spm.SentencePieceProcessor(model_proto=model_b).id_to_piece(
        list(range(args.vocab_size))))

    print(f"Tatoeba de-en: {len(pairs)} pairs read in {read_s:.1f} s ({malformed} malformed); "
          f"train {len(train)} pairs ({2 * len(train)} sentences, {distinct_words} distinct "
          f"words), held out {len(held_out)} pairs; vocab size {args.vocab_size}, "
          f"{config.vocab.model_type}, byte fallback {config.vocab.byte_fallback}, 2 threads")
    header = f"{'path':<44}{'beam s':>8}{'spm s':>8}{'total s':>9}{'en pcs':>8}{'de pcs':>8}"
    print(header)
    print("-" * len(header))
    print(f"{'(a) Beam word count + spm on word<TAB>count':<44}{beam_s:>8.1f}{spm_a_s:>8.1f}"
          f"{beam_s + spm_a_s:>9.1f}{pieces['a'][0]:>8.3f}{pieces['a'][1]:>8.3f}")
    print(f"{'(b) spm on raw sentences':<44}{'-':>8}{spm_b_s:>8.1f}"
          f"{spm_b_s:>9.1f}{pieces['b'][0]:>8.3f}{pieces['b'][1]:>8.3f}")
    print(f"pieces shared by both vocabularies: {len(vocab_a & vocab_b)} / {args.vocab_size} "
          f"({len(vocab_a & vocab_b) / args.vocab_size:.1%}); pcs = mean pieces per held-out "
          f"sentence")


if __name__ == "__main__":
    main()
