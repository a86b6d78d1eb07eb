"""benchmarks/student_gap.py on the tiny Multi30k slice with an untrained student (seconds)."""

import pytest

from benchmarks import student_gap
from components import corpus, dag
from components.config import DecodeMethod
from components.tokenizer import EOS_ID
from model import translator
from tiny_experiment import ensure, publish_untrained, tiny_config

BUCKETS = (64,)


@pytest.fixture(scope="module")
def config(tiny_workdir):
    config = tiny_config(tiny_workdir, "encode.bucket_boundaries=[64]")  # test_decode's student
    ensure(config, "prepare", "vocab")
    publish_untrained(config, "student")
    return config


@pytest.fixture(scope="module")
def loaded(config):
    return translator.load_cached(dag.output_uri(config, "student"))


@pytest.fixture(scope="module")
def sources(config, loaded):
    """Five test sources, shortest first (the order `refine_at` batches them in)."""
    pairs = list(corpus.read_split(dag.output_uri(config, "prepare"), "test2016"))[:5]
    lengths = [len(ids) for ids in loaded.tokenizer.encode([p["source"] for p in pairs])]
    return [pairs[i]["source"] for i in sorted(range(5), key=lambda i: (lengths[i], i))]


def test_the_length_heads_lengths_decode_as_the_decode_stage_does(loaded, sources):
    tokens, predicted = student_gap.refine_at(loaded, sources, iterations=2, boundaries=BUCKETS)
    method = DecodeMethod("padir_2", "padir", iterations=2)
    decoder = translator.Translator(loaded, method, batch_size=student_gap.BATCH_SIZE,
                                      boundaries=BUCKETS)
    assert tokens == [t.tokens for t in decoder.translate(sources)]
    assert [len(ids) for ids in tokens] == predicted  # EOS at the predicted length


def test_given_lengths_are_the_lengths_decoded(loaded, sources):
    lengths = [3, 7, 2, 12, 5]
    tokens, _ = student_gap.refine_at(loaded, sources, iterations=2, boundaries=BUCKETS,
                                      lengths=lengths)
    assert [len(ids) for ids in tokens] == lengths
    assert all(ids[-1] == EOS_ID and EOS_ID not in ids[:-1] for ids in tokens)


def test_collapse_repeats_keeps_the_last_token_of_a_run_of_one_word():
    assert student_gap.collapse_repeats("Ein Hund Hund, hund.") == "Ein hund."
    assert student_gap.collapse_repeats("Ein Hund . . läuft") == "Ein Hund . . läuft"
    assert student_gap.collapse_repeats("") == ""
