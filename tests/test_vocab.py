"""Tests of pipelines/vocab.py: the Beam word count and the stage on a tiny prepared artifact."""

import collections
import json
import random

import apache_beam as beam
import pytest
import yaml
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from components import artifacts, dag
from components import config as config_lib
from components import tokenizer as tokenizer_lib
from flows import cli
from pipelines import vocab
from tiny_experiment import publish_prepared

_EN_NOUNS = "dog cat man woman child horse bird girl boy people".split()
_DE_NOUNS = "Hund Katze Mann Frau Kind Pferd Vogel Mädchen Junge Leute".split()
_EN_VERBS = "runs jumps sits sleeps plays walks swims waits".split()
_DE_VERBS = "läuft springt sitzt schläft spielt geht schwimmt wartet".split()
_EN_PLACES = ["in the park", "on the street", "near the water", "in the snow", "on the grass"]
_DE_PLACES = ["im Park", "auf der Straße", "am Wasser", "im Schnee", "auf dem Gras"]


def _pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        noun, verb, place = rng.randrange(10), rng.randrange(8), rng.randrange(5)
        pairs.append({
            "id": f"{seed}-{i}",
            "source": f"A {_EN_NOUNS[noun]} {_EN_VERBS[verb]} {_EN_PLACES[place]}.",
            "target": f"Ein {_DE_NOUNS[noun]} {_DE_VERBS[verb]} {_DE_PLACES[place]}.",
        })
    return pairs


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "workdir": str(tmp_path / "work"),
        "seed": 0,
        "data": {"source_lang": "en", "target_lang": "de",
                 "train": {"source": "unused.en", "target": "unused.de"}},
        "vocab": {"size": 300, "max_words": 40},
    }))
    return str(path)


def test_count_words_gives_exact_counts():
    with BeamTestPipeline(runner="FnApiRunner") as p:
        counts = p | beam.Create("a b a c b a ü ü".split()) | vocab.CountWords()
        assert_that(counts, equal_to([("a", 3), ("b", 2), ("c", 1), ("ü", 2)]))


def test_extract_words_splits_both_sides():
    lines = [json.dumps({"id": "1", "source": "A dog runs.", "target": "Ein Hund läuft."}),
             json.dumps({"id": "2", "source": "x", "target": "y  z"})]
    with BeamTestPipeline(runner="FnApiRunner") as p:
        words = p | beam.Create(lines) | vocab.ExtractWords()
        assert_that(words, equal_to(["A", "dog", "runs.", "Ein", "Hund", "läuft.", "x", "y", "z"]))


def test_select_top_words_orders_by_count_then_word():
    counts = [("b", 2), ("a", 2), ("c", 5), ("d", 1), ("e", 2)]
    with BeamTestPipeline(runner="FnApiRunner") as p:
        blob = p | beam.Create(counts) | vocab.SelectTopWords(max_words=4)
        assert_that(blob, equal_to(["c\t5\na\t2\nb\t2\ne\t2"]))


def test_summarise_lengths():
    histogram = collections.Counter({3: 10, 5: 9, 40: 1})
    assert vocab.summarise_lengths(histogram) == {"mean": 5.75, "p95": 5}
    assert vocab.summarise_lengths(collections.Counter()) == {"mean": None, "p95": None}


def test_stage_smoke(config_path):
    """`padir stage vocab C` on a tiny prepared artifact: files, ids, counts, metrics."""
    config = config_lib.load(config_path)
    train = _pairs(300, seed=1)
    dev = _pairs(40, seed=2)
    dev.append({"id": "d-x", "source": "A dog 🐕 runs.", "target": "Ein Hund läuft."})
    publish_prepared(config, {"train": train, "dev": dev, "test2016": dev[:5]})

    assert cli.main(["stage", "vocab", config_path]) == 0
    artifact = artifacts.read(dag.output_uri(config, "vocab"))

    expected = collections.Counter(w for p in train for side in ("source", "target")
                                   for w in p[side].split())
    ordered = sorted(expected.items(), key=lambda wc: (-wc[1], wc[0]))[:40]
    with open(artifact.path(vocab.WORD_COUNTS_FILE), encoding="utf-8") as f:
        assert f.read() == "".join(f"{w}\t{c}\n" for w, c in ordered)

    tokenizer = tokenizer_lib.Tokenizer.load(artifact.path(tokenizer_lib.MODEL_FILE))
    assert tokenizer.vocab_size == 300 and tokenizer.first_real_id == 262
    with open(artifact.path(tokenizer_lib.VOCAB_FILE), encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 300
    for pair in dev:
        for text in (pair["source"], pair["target"]):
            assert tokenizer.decode(tokenizer.encode([text])[0]) == text

    manifest = artifact.manifest
    assert manifest["inputs"] == {"prepare": dag.output_uri(config, "prepare")}
    assert manifest["config"] == {"vocab": config_lib.to_dict(config.vocab), "seed": config.seed}
    assert manifest["counts"] == {
        "train_pairs": 300, "dev_pairs": 41, "words": sum(expected.values()),
        "distinct_words": len(expected), "words_kept": 40, "vocab_size": 300,
        "first_real_id": 262,
    }
    metrics = manifest["metrics"]
    # The piece-length job's histogram is the train split's, sentence by sentence.
    histogram = collections.Counter(
        (lang, len(ids)) for lang, side in (("en", "source"), ("de", "target"))
        for ids in tokenizer.encode([p[side] for p in train]))
    with open(artifact.path(vocab.PIECE_LENGTHS_FILE), encoding="utf-8") as f:
        piece_lengths = f.read()
    assert piece_lengths == "".join(f"{lang}\t{n}\t{c}\n"
                                    for (lang, n), c in sorted(histogram.items()))
    for lang in ("en", "de"):
        pieces = metrics["train_pieces_per_sentence"][lang]
        assert pieces == vocab.summarise_lengths(collections.Counter(
            {n: c for (side, n), c in histogram.items() if side == lang}))
        assert 5 <= pieces["mean"] <= pieces["p95"] <= 60  # 38 real pieces: near characters
        assert metrics["dev"][lang]["unk_rate"] == 0.0
    # With character_coverage 1.0 the vocab holds exactly the characters of the kept words;
    # the others (rare words cut by max_words, the dog emoji) fall back to bytes.
    kept_chars = {c for w, _ in ordered for c in w}
    for lang, side in (("en", "source"), ("de", "target")):
        chars = [c for p in dev for c in p[side] if c != " "]
        coverage = sum(c in kept_chars for c in chars) / len(chars)
        assert metrics["dev"][lang]["char_coverage"] == pytest.approx(coverage, abs=1e-6)
        assert (metrics["dev"][lang]["byte_fallback_rate"] > 0) == (coverage < 1)
    assert "🐕" not in kept_chars and metrics["dev"]["en"]["byte_fallback_rate"] > 0

    # A rerun recomputes the stage (same key) and writes the same model, byte for byte.
    with open(artifact.path(tokenizer_lib.MODEL_FILE), "rb") as f:
        model_bytes = f.read()
    rerun = vocab.run(config)
    assert rerun.uri == artifact.uri
    with open(rerun.path(tokenizer_lib.MODEL_FILE), "rb") as f:
        assert f.read() == model_bytes
    with open(rerun.path(vocab.PIECE_LENGTHS_FILE), encoding="utf-8") as f:
        assert f.read() == piece_lengths
    again = tokenizer_lib.Tokenizer.load(rerun.path(tokenizer_lib.MODEL_FILE))
    assert [again.id_to_piece(i) for i in range(300)] == [
        tokenizer.id_to_piece(i) for i in range(300)]


def test_stage_without_prepare_is_a_clear_error(config_path):
    config = config_lib.load(config_path)
    with pytest.raises(artifacts.IncompleteArtifactError, match="padir stage prepare"):
        vocab.run(config)


def test_vocab_size_leaving_no_real_pieces_is_a_config_error(config_path):
    with pytest.raises(config_lib.ConfigError, match="vocab.size"):
        config_lib.load(config_path, ["vocab.size=262"])
    assert config_lib.load(config_path, ["vocab.size=100", "vocab.byte_fallback=false"])
