"""Tests of components/tokenizer.py: reserved ids, round trips, tf-text parity."""

import collections
import pickle
import random

import fsspec
import pytest
import sentencepiece as spm

from components import artifacts
from components import config as config_lib
from components import tokenizer as tokenizer_lib
from components.tokenizer import (BOS_ID, EOS_ID, LENGTH_ID, MASK_ID, NUM_RESERVED, PAD_ID,
                                  UNK_ID, Tokenizer)

_EN = ("a the two dog dogs cat man men woman women child children horse bird girl boy runs run "
       "jumps sits sleeps plays playing walking wearing red blue shirt in on near park street "
       "water ball grass snow beach building people young older").split()
_DE = ("ein eine der die das zwei Hund Hunde Katze Mann Männer Frau Frauen Kind Kinder Pferd "
       "Vogel Mädchen Junge läuft laufen springt sitzt schläft spielt spielen trägt rotes blaues "
       "Hemd im auf neben Park Straße Wasser Ball Gras Schnee Strand Gebäude Leute junger "
       "älterer").split()

# Latin with diacritics, non-Latin scripts (never in training) and emoji: byte fallback.
SENTENCES = [
    "A dog runs in the park.",
    "Ein Hund läuft über die Straße.",
    "Größe, Maße und Fußgänger: ÄÖÜ äöü ß.",
    "Çà et là, l'élève s'écria « déjà ! »",
    "Собака бежит по улице.",
    "犬が公園を走っている。",
    "الكلب يركض في الحديقة",
    "A dog 🐕 and a cat 🐈‍⬛ 👍🏽!",
    "<mask> <length> <s> </s> <pad> <unk> literally",
    "x",
]


def _word_counts(seed: int = 0, sentences: int = 300) -> collections.Counter:
    rng = random.Random(seed)
    counts = collections.Counter()
    for _ in range(sentences):
        for words in (_EN, _DE):
            counts.update(rng.choice(words) for _ in range(rng.randint(3, 9)))
    counts.update({"Ein": 40, "A": 40, ".": 80})
    return counts


def _train(tmp_path, name: str = "spm", seed: int = 0, **vocab) -> bytes:
    tsv = tmp_path / f"{name}.tsv"
    tsv.write_text("".join(f"{w}\t{c}\n" for w, c in sorted(_word_counts().items())))
    config = config_lib.VocabConfig(**{"size": 330, **vocab})
    return tokenizer_lib.train_sentencepiece(str(tsv), str(tmp_path / name), config, seed=seed)


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory) -> bytes:
    return _train(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def tokenizer(model_bytes) -> Tokenizer:
    return Tokenizer(model_bytes)


def test_reserved_ids_are_the_first_pieces(tokenizer):
    sp = spm.SentencePieceProcessor(model_proto=tokenizer.model_bytes)
    assert [sp.id_to_piece(i) for i in range(NUM_RESERVED)] == [
        "<pad>", "</s>", "<unk>", "<s>", "<mask>", "<length>"]
    assert (PAD_ID, EOS_ID, UNK_ID, BOS_ID, MASK_ID, LENGTH_ID) == (0, 1, 2, 3, 4, 5)
    assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (PAD_ID, EOS_ID, UNK_ID, BOS_ID)
    assert sp.piece_to_id("<mask>") == MASK_ID and sp.piece_to_id("<length>") == LENGTH_ID
    assert tokenizer.first_real_id == NUM_RESERVED + 256
    assert tokenizer.vocab_size == 330


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
@pytest.mark.parametrize("byte_fallback", [True, False])
def test_every_real_piece_is_distinct_from_reserved_ones(tmp_path, model_type, byte_fallback):
    size = 330 if byte_fallback else 100
    tokenizer = Tokenizer(_train(tmp_path, model_type=model_type, byte_fallback=byte_fallback,
                                 size=size))
    sp = spm.SentencePieceProcessor(model_proto=tokenizer.model_bytes)
    reserved = {sp.id_to_piece(i) for i in range(NUM_RESERVED)}
    assert len(reserved) == NUM_RESERVED
    expected_first = NUM_RESERVED + (256 if byte_fallback else 0)
    assert tokenizer.first_real_id == expected_first
    for i in range(NUM_RESERVED, tokenizer.vocab_size):
        assert not tokenizer.is_reserved(i)
        assert sp.id_to_piece(i) not in reserved
        assert not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))
        assert sp.is_byte(i) == (i < expected_first) == tokenizer.is_byte(i)
    assert all(tokenizer.is_reserved(i) for i in range(NUM_RESERVED))


def test_validate_rejects_sentencepiece_default_ids(tmp_path):
    tsv = tmp_path / "wc.tsv"
    tsv.write_text("".join(f"{w}\t{c}\n" for w, c in sorted(_word_counts().items())))
    spm.SentencePieceTrainer.train(input=str(tsv), input_format="tsv", vocab_size=60,
                                   model_prefix=str(tmp_path / "default"), minloglevel=2)
    model = (tmp_path / "default.model").read_bytes()  # unk 0, bos 1, eos 2, no pad
    with pytest.raises(tokenizer_lib.ReservedIdError, match="pad id is -1"):
        Tokenizer(model)


def test_literal_control_text_never_yields_reserved_ids(tokenizer):
    texts = ["<mask>", "<length>", "<mask><length>", "a <mask> dog <length> 5",
             "<s> </s> <pad> <unk>", "<MASK> [MASK] [LENGTH]"]
    for ids in tokenizer.encode(texts):
        assert ids and not any(tokenizer.is_reserved(i) for i in ids), ids
    assert tokenizer.decode(tokenizer.encode(["a <mask> dog"])[0]) == "a <mask> dog"


def test_decode_inverts_encode(tokenizer):
    encoded = tokenizer.encode(SENTENCES)
    assert len(encoded) == len(SENTENCES)
    for text, ids in zip(SENTENCES, encoded):
        assert EOS_ID not in ids and UNK_ID not in ids  # no EOS appended; bytes, never unk
        assert tokenizer.decode(ids) == text
    assert any(tokenizer.is_byte(i) for i in encoded[5])  # Japanese: byte fallback


def test_decode_stops_at_eos_and_skips_reserved(tokenizer):
    ids = tokenizer.encode(["a dog"])[0]
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID, *ids, PAD_ID]) == "a dog"
    assert tokenizer.decode([MASK_ID, LENGTH_ID, UNK_ID, *ids, PAD_ID, PAD_ID]) == "a dog"
    assert tokenizer.decode([EOS_ID, *ids]) == ""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])


def test_encode_rejects_a_bare_string(tokenizer):
    with pytest.raises(TypeError):
        tokenizer.encode("a dog")


def test_load_from_fsspec_and_pickle(model_bytes, tokenizer):
    with fsspec.open("memory://vocab/spm.model", "wb") as f:
        f.write(model_bytes)
    loaded = Tokenizer.load("memory://vocab/spm.model")
    copied = pickle.loads(pickle.dumps(tokenizer))
    for other in (loaded, copied):
        assert other.encode(SENTENCES) == tokenizer.encode(SENTENCES)
        assert other.first_real_id == tokenizer.first_real_id


def test_an_artifact_gives_its_own_vocabulary_or_the_one_it_was_made_with(model_bytes):
    with fsspec.open("memory://work/vocab/k1/spm.model", "wb") as f:
        f.write(model_bytes)
    vocab = artifacts.Artifact("vocab", "k1", "memory://work/vocab/k1", {"inputs": {}})
    teacher = artifacts.Artifact("teacher", "k2", "memory://work/teacher/k2",
                                 {"inputs": {"vocab": vocab.uri, "encode": "elsewhere"}})
    for artifact in (vocab, teacher):
        assert Tokenizer.for_artifact(artifact).model_bytes == model_bytes


def test_without_byte_fallback_unseen_characters_are_unk(tmp_path):
    tokenizer = Tokenizer(_train(tmp_path, byte_fallback=False, size=80))
    assert tokenizer.first_real_id == NUM_RESERVED
    assert UNK_ID in tokenizer.encode(["犬"])[0]


def test_training_is_deterministic(tmp_path):
    a = Tokenizer(_train(tmp_path, seed=3))
    b = Tokenizer(_train(tmp_path, seed=3))
    pieces = lambda t: [t.id_to_piece(i) for i in range(t.vocab_size)]  # noqa: E731
    assert pieces(a) == pieces(b)
    assert a.encode(SENTENCES) == b.encode(SENTENCES)


def test_tf_text_gives_identical_ids(tokenizer):
    tf_tokenizer = tokenizer.tf_tokenizer()
    tf_ids = tf_tokenizer.tokenize(SENTENCES)
    assert tf_ids.to_list() == tokenizer.encode(SENTENCES)
    detok = [t.decode("utf-8") for t in tf_tokenizer.detokenize(tf_ids).numpy().tolist()]
    assert detok == SENTENCES
