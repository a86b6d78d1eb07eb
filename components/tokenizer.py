"""The joint SentencePiece vocabulary, in Python and inside tf.data, with reserved ids.

Reserved ids never collide with real pieces (unlike the original implementation):
pad 0, eos 1, unk 2, bos 3, then the control pieces [MASK] 4 and [LENGTH] 5.
Control pieces are never produced by encoding text.

With byte fallback the 256 byte pieces `<0x00>`..`<0xFF>` follow the reserved ids
(6..261), so every real piece has an id in `[first_real_id, vocab_size)`; random noise
tokens are drawn from that range.

Example:
    tokenizer = Tokenizer.for_artifact(artifact)     # a vocab artifact, or one made with it
    ids = tokenizer.encode(["Ein Hund läuft."])[0]   # pieces only, no EOS
    text = tokenizer.decode(ids + [EOS_ID, PAD_ID])   # "Ein Hund läuft."
"""

from __future__ import annotations

from typing import Iterable, Sequence

import fsspec
import sentencepiece as spm

from components import artifacts
from components.config import VocabConfig

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BOS_ID = 3
MASK_ID = 4
LENGTH_ID = 5
MASK_PIECE = "<mask>"
LENGTH_PIECE = "<length>"

NUM_RESERVED = 6  # ids 0..5 above
NUM_BYTE_PIECES = 256
# Id -> the piece SentencePiece stores there (its default names for pad/eos/unk/bos).
RESERVED_PIECES = ("<pad>", "</s>", "<unk>", "<s>", MASK_PIECE, LENGTH_PIECE)

MODEL_FILE = "spm.model"
VOCAB_FILE = "spm.vocab"


class ReservedIdError(ValueError):
    """A SentencePiece model whose reserved ids differ from the ones above."""


def whitespace_words(text: str) -> list[str]:
    """The units SentencePiece trains on: it never builds a piece across a space."""
    return text.split()


def trainer_options(config: VocabConfig, *, num_threads: int = 2) -> dict:
    """SentencePiece trainer options for the `vocab` config with our reserved ids.

    Normalisation is the identity (the prepare stage has already NFC-normalised the
    text), so `decode(encode(x)) == x` for whitespace-collapsed x.
    """
    return dict(
        vocab_size=config.size,
        model_type=config.model_type,
        character_coverage=config.character_coverage,
        byte_fallback=config.byte_fallback,
        normalization_rule_name="identity",
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        # Control symbols, not user-defined ones: user-defined pieces would match
        # the literal text "<mask>" in the input.
        control_symbols=[MASK_PIECE, LENGTH_PIECE],
        num_threads=num_threads,
        minloglevel=1,  # warnings and errors only; the INFO log is a page per run
    )


def train_sentencepiece(
    word_counts_tsv: str,
    model_prefix: str,
    config: VocabConfig,
    *,
    seed: int,
    num_threads: int = 2,
) -> bytes:
    """Trains the joint model from a local `word<TAB>count` file; returns the model bytes.

    Writes `{model_prefix}.model` and `{model_prefix}.vocab` (local paths: the trainer
    cannot write to fsspec URLs). The reserved ids are validated before returning.

    Args:
      word_counts_tsv: local file, one `word<TAB>count` per line.
      model_prefix: local path prefix of the output files.
      config: the `vocab` config section (size, model type, coverage, byte fallback).
      seed: fixes SentencePiece's random generator (a process-wide setting).
      num_threads: trainer threads.
    """
    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        input=word_counts_tsv,
        input_format="tsv",
        model_prefix=model_prefix,
        **trainer_options(config, num_threads=num_threads),
    )
    with open(f"{model_prefix}.model", "rb") as f:
        model_bytes = f.read()
    validate_reserved_ids(model_bytes)
    return model_bytes


def validate_reserved_ids(model_bytes: bytes) -> int:
    """Checks that a model's ids 0..5 are exactly the reserved pieces; returns first_real_id.

    Also checks that the byte pieces (if any) sit right after the reserved ids and that
    every later id is a real piece: not control, unknown, unused or byte, and not named
    like a reserved piece.

    Raises:
      ReservedIdError: naming the first id that breaks the layout.
    """
    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    size = sp.get_piece_size()
    if size <= NUM_RESERVED:
        raise ReservedIdError(f"model has {size} pieces, not even the {NUM_RESERVED} reserved")
    for name, actual, expected in (
        ("pad", sp.pad_id(), PAD_ID), ("eos", sp.eos_id(), EOS_ID),
        ("unk", sp.unk_id(), UNK_ID), ("bos", sp.bos_id(), BOS_ID),
    ):
        if actual != expected:
            raise ReservedIdError(f"{name} id is {actual}, expected {expected}")
    for i, piece in enumerate(RESERVED_PIECES):
        kind_ok = sp.is_unknown(i) if i == UNK_ID else sp.is_control(i)
        if sp.id_to_piece(i) != piece or not kind_ok:
            raise ReservedIdError(
                f"id {i} is {sp.id_to_piece(i)!r}, expected the reserved piece {piece!r}")
    first_real_id = NUM_RESERVED
    if sp.is_byte(NUM_RESERVED):
        for i in range(NUM_RESERVED, NUM_RESERVED + NUM_BYTE_PIECES):
            if i >= size or sp.id_to_piece(i) != f"<0x{i - NUM_RESERVED:02X}>":
                raise ReservedIdError(
                    f"byte pieces are not contiguous after the reserved ids (at id {i})")
        first_real_id = NUM_RESERVED + NUM_BYTE_PIECES
    if first_real_id >= size:
        raise ReservedIdError(f"model has no real pieces ({size} pieces in all)")
    reserved = set(RESERVED_PIECES)
    for i in range(first_real_id, size):
        if (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i)
                or sp.id_to_piece(i) in reserved):
            raise ReservedIdError(f"id {i} ({sp.id_to_piece(i)!r}) is not a real piece")
    return first_real_id


class Tokenizer:
    """A validated SentencePiece model: text <-> ids with the reserved ids above.

    Picklable (by its model bytes), so it can travel into Beam DoFns.
    """

    __slots__ = ("_model_bytes", "_processor", "_first_real_id")

    def __init__(self, model_bytes: bytes):
        """Builds a tokenizer from serialised model bytes; ReservedIdError if ids differ."""
        self._model_bytes = bytes(model_bytes)
        self._first_real_id = validate_reserved_ids(self._model_bytes)
        self._processor = spm.SentencePieceProcessor(model_proto=self._model_bytes)

    @classmethod
    def load(cls, uri: str) -> "Tokenizer":
        """Loads `spm.model` from a local path or fsspec URL (e.g. `gs://.../spm.model`)."""
        with fsspec.open(uri, "rb") as f:
            return cls(f.read())

    @classmethod
    def for_artifact(cls, artifact: artifacts.Artifact) -> "Tokenizer":
        """The vocabulary of a `vocab` artifact, or the one another artifact was made with
        (the `vocab` among its manifest's inputs: a teacher's, a student's, an encoding's)."""
        vocab = artifact.uri if artifact.stage == "vocab" else artifact.manifest["inputs"]["vocab"]
        return cls.load(artifacts.join(vocab, MODEL_FILE))

    def __reduce__(self):
        return (Tokenizer, (self._model_bytes,))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, first_real_id={self.first_real_id})"

    @property
    def model_bytes(self) -> bytes:
        return self._model_bytes

    @property
    def vocab_size(self) -> int:
        """All ids, reserved and byte pieces included (the embedding table's rows)."""
        return self._processor.get_piece_size()

    @property
    def first_real_id(self) -> int:
        """The first id of a real piece: after the reserved ids and the byte pieces."""
        return self._first_real_id

    def is_reserved(self, token_id: int) -> bool:
        """Whether `token_id` is one of pad, eos, unk, bos, mask, length."""
        return 0 <= token_id < NUM_RESERVED

    def is_byte(self, token_id: int) -> bool:
        """Whether `token_id` is a byte-fallback piece (`<0x..>`)."""
        return NUM_RESERVED <= token_id < self._first_real_id

    def id_to_piece(self, token_id: int) -> str:
        return self._processor.id_to_piece(int(token_id))

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of the pieces of each text; no EOS (or BOS) is appended: callers add it.

        Args:
          texts: a sequence of strings (not one string: wrap it in a list).
        Returns:
          One list of ids per text, each id in [NUM_RESERVED, vocab_size) or UNK_ID
          (UNK only for unseen characters when byte fallback is off).
        """
        if isinstance(texts, (str, bytes)):
            raise TypeError("encode takes a sequence of strings; wrap a single string in a list")
        return self._processor.encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of one id sequence: stops at the first EOS and skips reserved ids.

        Accepts any iterable of ints (a list, a NumPy or JAX row). Unknown pieces are
        dropped too (they are reserved id 2), so a model's output never shows ' ⁇ '.
        """
        pieces = []
        size = self.vocab_size
        for token_id in ids:
            token_id = int(token_id)
            if token_id == EOS_ID:
                break
            if not 0 <= token_id < size:
                raise ValueError(f"id {token_id} is outside the vocabulary [0, {size})")
            if token_id >= NUM_RESERVED:
                pieces.append(token_id)
        return self._processor.decode(pieces)

    def tf_tokenizer(self):
        """A `tensorflow_text.SentencepieceTokenizer` on the same model bytes.

        Its `tokenize(strings)` gives an int32 RaggedTensor with the same ids as `encode`
        (no BOS/EOS, no sampling). TensorFlow is imported here, not at module import.
        """
        import tensorflow as tf
        import tensorflow_text as tf_text

        return tf_text.SentencepieceTokenizer(
            model=self._model_bytes, out_type=tf.int32, nbest_size=0,
            add_bos=False, add_eos=False, reverse=False)
