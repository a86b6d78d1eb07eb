"""The experiment config: one typed schema, YAML in, `--set a.b=c` overrides.

Every stage reads a narrow, frozen section of it (`config.prepare`, `config.vocab`, ...).
Defaults live here and nowhere else. Unknown keys and wrong types are errors that name
the offending key. Parsing a config imports nothing heavy (no JAX, TF or Beam).

`${VAR}` in string values is read from the environment (e.g. `${PADIR_DATA_ROOT}`), so
configs stay machine-independent. A missing variable is an error at load, naming the key.
Corpus locations (`CorpusConfig`) keep the placeholder: a URL may carry an access token,
and the config is written next to every artifact, into manifests, logs and Prefect; they
are expanded (`expand_env`) only where a file is opened. Artifact keys hash the
placeholder, so they do not change with the machine or a rotated token. Every other
string is expanded when the file is loaded.

Errors in the file (YAML syntax, an `include:` loop, a missing file, a `!!python` tag, a
bad `--set`) are `ConfigError`s of one line that name the file, line or key; a value is
shown cut to a few dozen characters, never whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import reprlib
import types
import typing
from typing import Any, ClassVar, Literal, Optional, Sequence

import yaml



class ConfigError(ValueError):
    """A config that cannot be used: the message names the key."""


# --- data ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    """One parallel corpus: two line-aligned files (plain or .gz), or one TSV.

    Paths may be local, `gs://`, or `http(s)://`. A TSV may sit inside a .zip
    (`tsv: deu-eng.zip`, `member: deu.txt`); `tsv_columns` says which columns hold
    source and target (Tatoeba's export is `English<TAB>German`). A TSV line with other
    than `tsv_num_columns` columns is rejected as malformed (default: just enough columns
    for `tsv_columns`; newer Tatoeba exports add a third, attribution column).
    """

    source: Optional[str] = None
    target: Optional[str] = None
    tsv: Optional[str] = None
    member: Optional[str] = None
    tsv_columns: tuple[int, int] = (0, 1)
    tsv_num_columns: Optional[int] = None

    def validate(self, where: str) -> None:
        files = self.source is not None or self.target is not None
        if files and self.tsv is not None:
            raise ConfigError(f"{where}: give either source+target or tsv, not both")
        if files and (self.source is None or self.target is None):
            raise ConfigError(f"{where}: source and target must both be given")
        if not files and self.tsv is None:
            raise ConfigError(f"{where}: give source+target files or a tsv")
        if self.member is not None and self.tsv is None:
            raise ConfigError(f"{where}.member: only valid with tsv")
        if min(self.tsv_columns) < 0 or self.tsv_columns[0] == self.tsv_columns[1]:
            raise ConfigError(f"{where}.tsv_columns: two different column indices >= 0")
        if self.tsv_num_columns is not None and self.tsv_num_columns <= max(self.tsv_columns):
            raise ConfigError(f"{where}.tsv_num_columns: must exceed every index in tsv_columns")

    @property
    def expected_columns(self) -> int:
        """How many tab-separated columns a well-formed TSV line has."""
        return self.tsv_num_columns or max(self.tsv_columns) + 1


@dataclasses.dataclass(frozen=True)
class TestSetConfig:
    """A named held-out set (e.g. Multi30k test2016)."""

    name: str
    corpus: CorpusConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the raw parallel text comes from.

    If `dev` is not given, a dev split is carved from train deterministically (by the seed,
    hashing the `carve_by` side so that all translations of one sentence land in one split:
    `target` where a corpus has several sources per target, as Tatoeba de->en has several
    German sentences per English one). Likewise a test split named "test" when `test` is
    empty. `max_train_pairs` reads only the first N training pairs (the demo's slice);
    `train_sample_fraction` keeps each training line with that probability, by a hash of
    its line number: a subset spread over the whole file, for corpora sorted by length
    (Tatoeba) where the first N lines are the shortest.

    `source_lang` and `target_lang` (language codes) are required: they label the metrics,
    and a default pair would mislabel any other.
    """

    source_lang: str = ""  # required (checked below): "" is "not given"
    target_lang: str = ""
    train: CorpusConfig = CorpusConfig()
    dev: Optional[CorpusConfig] = None
    test: tuple[TestSetConfig, ...] = ()
    carve_dev_fraction: float = 0.02
    carve_test_fraction: float = 0.02
    carve_by: Literal["source", "target"] = "source"
    max_train_pairs: Optional[int] = None
    train_sample_fraction: float = 1.0

    def __post_init__(self):
        for name, side in (("source_lang", "source"), ("target_lang", "target")):
            if not getattr(self, name):
                raise ConfigError(f"data.{name} is required: the language code of the {side} "
                                  "side (e.g. en), which labels the metrics")
        if self.carve_by not in ("source", "target"):  # also when built in code, not parsed
            raise ConfigError("data.carve_by: expected 'source' or 'target'")
        for name in ("carve_dev_fraction", "carve_test_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"data.{name}: expected a fraction in [0, 1)")
        if self.carve_dev_fraction + self.carve_test_fraction >= 1.0:
            raise ConfigError("data.carve_dev_fraction + data.carve_test_fraction must be < 1")
        if self.max_train_pairs is not None and self.max_train_pairs < 1:
            raise ConfigError("data.max_train_pairs: expected a positive integer or null")
        if not 0.0 < self.train_sample_fraction <= 1.0:
            raise ConfigError("data.train_sample_fraction: expected a fraction in (0, 1]")
        names = [test_set.name for test_set in self.test]
        for i, name in enumerate(names):
            # Split names become file names (`{name}-00000-of-00001.jsonl`) and id prefixes.
            if not re.fullmatch(r"[A-Za-z0-9_.]+", name) or name in ("train", "dev", "rejects"):
                raise ConfigError(f"data.test[{i}].name: {name!r} is not a usable split name")
            if names.index(name) != i:
                raise ConfigError(f"data.test[{i}].name: {name!r} is given twice")


# --- stages ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """Normalisation and filtering of raw pairs (every rejection is counted and written)."""

    max_chars: int = 1000  # per side, after normalisation
    max_length_ratio: float = 3.0  # longer/shorter side, in characters
    min_chars_for_ratio: int = 10  # the ratio test skips pairs whose shorter side is tiny
    deduplicate: bool = True
    num_shards: int = 4  # train shards; dev and test sets are written as one file each
    # A longer line is rejected as `oversized` and read no further (bounded memory), in
    # every split: a file with CR-only endings or no newline is one giant line.
    max_line_bytes: int = 1 << 16
    # The stage fails, publishing nothing, when more of the train pairs read than this are
    # rejected for bad input (duplicates do not count): a wrong encoding or a wrong file.
    max_reject_fraction: float = 0.5

    def __post_init__(self):
        if min(self.max_chars, self.min_chars_for_ratio, self.num_shards,
               self.max_line_bytes) < 1:
            raise ConfigError("prepare.max_chars, min_chars_for_ratio, num_shards and "
                              "max_line_bytes must be >= 1")
        if self.max_length_ratio < 1.0:
            raise ConfigError("prepare.max_length_ratio: expected a number >= 1")
        if not 0.0 <= self.max_reject_fraction <= 1.0:
            raise ConfigError("prepare.max_reject_fraction: expected a fraction in [0, 1]")


@dataclasses.dataclass(frozen=True)
class VocabConfig:
    """A joint SentencePiece model trained from Beam word counts of both sides."""

    size: int = 8000
    model_type: Literal["unigram", "bpe"] = "unigram"
    character_coverage: float = 1.0
    byte_fallback: bool = True  # unseen characters become byte pieces, never <unk>
    max_words: int = 2_000_000  # distinct words fed to SentencePiece (most frequent)

    def __post_init__(self):
        # 6 reserved ids (components.tokenizer), then 256 byte pieces with byte fallback:
        # caught here rather than by SentencePiece after the word count has run.
        reserved = 6 + (256 if self.byte_fallback else 0)
        if self.size <= reserved:
            raise ConfigError(
                f"vocab.size: {self.size} leaves no real pieces after {reserved} reserved"
                f"{' and byte' if self.byte_fallback else ''} ids")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ConfigError(f"vocab.character_coverage: must be in (0, 1], got {self.character_coverage}")
        if self.max_words < 1:
            raise ConfigError(f"vocab.max_words: must be positive, got {self.max_words}")


@dataclasses.dataclass(frozen=True)
class EncodeConfig:
    """Token ids of the training pairs, as TFRecord shards the tf.data reader buckets.

    Lengths count tokens including the EOS the stage appends; longer pairs are rejected
    (`too_many_tokens`), counted and written. Batches are padded to the smallest of
    `bucket_boundaries` that fits both sides, so training sees only these static shapes;
    the largest boundary must hold the longest pair the length limits admit.
    """

    max_source_len: int = 64
    max_target_len: int = 64
    bucket_boundaries: tuple[int, ...] = (16, 32, 64)
    num_shards: int = 4

    def __post_init__(self):
        bounds = self.bucket_boundaries
        if not bounds or any(b <= 0 for b in bounds) or list(bounds) != sorted(set(bounds)):
            raise ConfigError("encode.bucket_boundaries: expected strictly increasing positive "
                              f"lengths, got {list(bounds)}")
        longest = max(self.max_source_len, self.max_target_len)
        if bounds[-1] < longest:
            raise ConfigError(
                f"encode.bucket_boundaries: the largest boundary {bounds[-1]} is shorter than "
                f"max_source_len/max_target_len ({longest})")
        if min(self.max_source_len, self.max_target_len) < 1 or self.num_shards < 1:
            raise ConfigError("encode: max_source_len, max_target_len and num_shards must be >= 1")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The Transformer family shared by the AR teacher and the PaDIR student.

    The defaults are the small configuration that trains on 2 CPU cores; the paper's
    67M model is d_model 512, 8 heads, 6+6 layers, MLP 2048 (configs/overlays/tpu.yaml).
    The vocabulary size is not here: it is read from the vocab artifact.
    """

    d_model: int = 256
    num_heads: int = 4
    num_encoder_layers: int = 3
    num_decoder_layers: int = 3
    mlp_dim: int = 1024
    dropout_rate: float = 0.1
    max_source_len: int = 64  # tokens, including EOS (PaDIR adds a position for [LENGTH])
    max_target_len: int = 64  # tokens, including EOS; also the number of length classes
    positional_attention: bool = True  # PaDIR decoder only
    dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self):
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ConfigError("model.dropout_rate: expected a value in [0, 1)")


# --- training (teacher and student share one engine: model/train.py) --------------------


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW: linear warmup to `learning_rate`, then rsqrt or cosine decay; global-norm clipping.

    Weight decay applies to matrices only (never to norm scales or biases). With `ema_decay`,
    an exponential moving average of the parameters is what the run evaluates, selects its
    best checkpoint by and publishes (the averaging of the last checkpoints that small-data
    recipes use, kept continuously); the raw parameters only train on.
    """

    learning_rate: float = 5e-4  # peak, reached at the end of warmup
    warmup_steps: int = 1000
    decay: Literal["rsqrt", "cosine"] = "rsqrt"  # cosine decays to 0 at the last step
    b1: float = 0.9
    b2: float = 0.98
    weight_decay: float = 0.01
    clip_norm: float = 1.0  # global gradient norm
    ema_decay: Optional[float] = None  # e.g. 0.999; None: evaluate the raw parameters

    def __post_init__(self):
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.clip_norm <= 0:
            raise ConfigError("optimizer: learning_rate and clip_norm must be > 0, warmup_steps >= 0")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ConfigError(f"optimizer.ema_decay must lie in (0, 1), got {self.ema_decay}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1) or self.weight_decay < 0:
            raise ConfigError("optimizer: b1, b2 must lie in [0, 1) and weight_decay >= 0")


@dataclasses.dataclass(frozen=True)
class TrainLoopConfig:
    """Cadences and budgets of one training run (counted in optimizer steps).

    Every evaluation is also checkpointed, with its dev metrics, so that the best checkpoint
    by `best_metric` can be kept besides the latest `keep_checkpoints`.
    """

    tokens_per_batch: int = 4096  # padded tokens per side per step, global (all devices and
    # hosts); each length bucket gets tokens_per_batch // boundary rows
    log_every: int = 100
    eval_every: int = 1000  # dev loss, token accuracy and BLEU
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2  # the latest N, plus the best by `best_metric`
    best_metric: Literal["bleu", "loss"] = "bleu"  # dev BLEU (max) or dev loss per token (min)
    max_minutes: Optional[float] = None  # wall budget of one invocation: checkpoint, then stop

    def __post_init__(self):
        if self.tokens_per_batch < 1 or self.keep_checkpoints < 1:
            raise ConfigError("loop: tokens_per_batch and keep_checkpoints must be >= 1")
        if min(self.log_every, self.eval_every, self.checkpoint_every) < 1:
            raise ConfigError("loop: log_every, eval_every and checkpoint_every must be >= 1")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ConfigError("loop.max_minutes: expected a positive number or null")


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """The AR teacher: trained on the original (not distilled) pairs."""

    SECTION: ClassVar[str] = "teacher"  # the key that errors name

    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    loop: TrainLoopConfig = TrainLoopConfig()
    steps: int = 20000
    label_smoothing: float = 0.1  # part of the teacher's loss, not of the optimizer

    def __post_init__(self):
        if self.steps < 1 or not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"{self.SECTION}: steps must be >= 1 and label_smoothing in [0, 1)")


@dataclasses.dataclass(frozen=True)
class ARStudentConfig(TeacherConfig):
    """The fair AR baseline (Kasai et al. 2021, "Deep encoder, shallow decoder"): an AR
    model trained as the teacher is, on the PaDIR student's data (the distilled pairs when
    `distill.enabled`), with a deep encoder and a one-layer decoder, for about the student's
    wall time (`steps`); decoded by the AR kinds with `model: ar_student`.
    `init_from_teacher` starts it from the teacher where paths and shapes match
    (model/warm_start.py: the embedding, the encoder's first layers, the first decoder layer).
    """

    SECTION: ClassVar[str] = "ar_student"

    model: ModelConfig = ModelConfig(num_decoder_layers=1)
    init_from_teacher: bool = False


@dataclasses.dataclass(frozen=True)
class DrafterConfig(TeacherConfig):
    """The block drafter of `draft_verify`: given the source and the accepted prefix, it
    predicts the next `block` tokens in one pass (no length head; its decoder's depth
    trades the tokens a round accepts against what a round's pass costs: the benchmark's
    has the teacher's 4 layers, chosen on dev), trained as the teacher is on the PaDIR
    student's data (the distilled
    pairs when `distill.enabled`). `init_from_teacher` starts it from the teacher where
    paths and shapes match (model/warm_start.py).
    """

    SECTION: ClassVar[str] = "drafter"

    model: ModelConfig = ModelConfig(num_decoder_layers=1)
    block: int = 8  # tokens drafted per pass: the pattern it trains on and decodes with
    init_from_teacher: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.block < self.model.max_target_len:
            raise ConfigError(f"drafter.block: expected 1 <= block < model.max_target_len "
                              f"({self.model.max_target_len}), got {self.block}")


@dataclasses.dataclass(frozen=True)
class StudentConfig:
    """The PaDIR student: phase 1 single-stage loss, then phase 2 the unrolled loss.

    Phase 2 starts from phase 1's final parameters (and continues its data stream) with a
    fresh optimizer, warmup included.
    """

    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    loop: TrainLoopConfig = TrainLoopConfig()
    phase1_steps: int = 20000
    phase2_steps: int = 10000
    num_passes: int = 2  # decoder passes unrolled in phase 2 (phase 1 always uses 1)
    # Phase 2: glancing (GLAT): pass 2 sees round(ratio x pass 1's errors) gold tokens and
    # learns the rest (model/losses.py `glance`); 0 is off.
    glancing_ratio: float = 0.0
    label_smoothing: float = 0.1  # of the token cross-entropies (not of the length loss)
    # Phase 1 starts from the teacher's parameters where paths and shapes match (embedding,
    # encoder, decoder attention and MLPs: model/warm_start.py); the rest from scratch.
    init_from_teacher: bool = False

    def __post_init__(self):
        if self.phase1_steps < 1 or self.phase2_steps < 0 or self.num_passes < 1:
            raise ConfigError("student: phase1_steps >= 1, phase2_steps >= 0, num_passes >= 1")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError("student.label_smoothing: expected a value in [0, 1)")
        if not 0.0 <= self.glancing_ratio <= 1.0:
            raise ConfigError("student.glancing_ratio: expected a value in [0, 1]")


# Logical axis -> mesh axes, in priority order (flax `logical_to_mesh_axes` semantics: an
# array dimension takes the first rule whose mesh axes are still free in that array). The
# batch splits over both axes (FSDP also splits data); weights shard their largest dimension
# over "fsdp". An empty list means replicated.
DEFAULT_LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", ("fsdp",)),
    ("mlp", ("fsdp",)),
    ("heads", ("fsdp",)),
    ("embed", ("fsdp",)),
    ("kv", ()),
    ("length", ()),
    ("position", ()),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh (axes "data", "fsdp") for both training stages.

    `data: -1` takes all devices not used by `fsdp`. `distributed: true` calls
    `jax.distributed.initialize()` first, one process per host: on a TPU slice JAX finds
    the coordinator, process count and index itself; elsewhere (CPU hosts, a local test)
    give them (`--set mesh.process_id=1` on the second host).
    """

    data: int = -1
    fsdp: int = 1
    distributed: bool = False
    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_LOGICAL_AXIS_RULES

    def __post_init__(self):
        if self.fsdp < 1 or (self.data < 1 and self.data != -1):
            raise ConfigError("mesh: fsdp must be >= 1 and data >= 1 or -1 (all devices)")
        for logical, mesh_axes in self.logical_axis_rules:
            unknown = [a for a in mesh_axes if a not in ("data", "fsdp")]
            if unknown:
                raise ConfigError(
                    f"mesh.logical_axis_rules: '{logical}' maps to unknown mesh axes {unknown}"
                )


# --- distillation ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Sequence-level knowledge distillation (Kim & Rush 2016) for the student.

    With `enabled`, the teacher translates every training source by beam search
    (`beam_size`, GNMT `length_penalty`) and the student trains on these targets (stages
    `distill`, then `encode_distilled`); without, it trains on the original pairs, like
    the teacher, and neither stage runs. Sources are decoded `batch_size` at a time, each
    batch of one decoder shape and sorted by length (pipelines/distill.py), by `engine`:
    `jax`, our jitted beam search (`ar_beam`), or `ctranslate2`, the teacher exported to
    CTranslate2 (`ct2_beam`, float32; about 6x our batched CPU throughput), whose beam
    search normalises by length ** length_penalty instead of GNMT's penalty, so that above
    0 a sentence may end on another hypothesis. Either way the written score is the
    teacher's summed log-probability (components/distillation.py `log_prob`).

    Every pair is kept or rejected with its reason (components/distillation.py): always
    `empty`, `unfinished` (no EOS within the output width) and `source_too_long` (cut to
    the teacher's widest bucket); `length_ratio` when target/source tokens, EOS included,
    exceed `max_length_ratio` either way; `low_score` when the teacher's log-probability per
    target token (EOS included) is below `min_token_log_prob`. Null turns a filter off.
    """

    enabled: bool = True
    engine: Literal["jax", "ctranslate2"] = "jax"
    beam_size: int = 4
    length_penalty: float = 0.6
    batch_size: int = 64
    max_length_ratio: Optional[float] = 3.0
    min_token_log_prob: Optional[float] = None

    def __post_init__(self):
        if self.engine not in ("jax", "ctranslate2"):  # also when built in code, not parsed
            raise ConfigError(f"distill.engine: 'jax' or 'ctranslate2', not {self.engine!r}")
        if self.beam_size < 1 or self.batch_size < 1:
            raise ConfigError("distill.beam_size and distill.batch_size must be >= 1")
        if self.length_penalty < 0:
            raise ConfigError("distill.length_penalty: expected a number >= 0")
        if self.max_length_ratio is not None and self.max_length_ratio < 1.0:
            raise ConfigError("distill.max_length_ratio: expected a number >= 1 or null")
        if self.min_token_log_prob is not None and self.min_token_log_prob > 0:
            raise ConfigError("distill.min_token_log_prob: a log-probability, <= 0, or null")


# --- decoding and its measurement -------------------------------------------------------

# The training stages whose artifacts decode: the AR models (the teacher, and the AR
# student, the fair AR baseline), the PaDIR student and the block drafter of draft_verify.
AR_STAGES = ("teacher", "ar_student")
TRAINING_STAGES = (*AR_STAGES, "student", "drafter")


@dataclasses.dataclass(frozen=True)
class DecodingKind:
    """What the pipeline needs to know of a decoding kind without running it (its search
    is `model/decoding/translator.py: SEARCHES[kind]`)."""

    # The training stage whose checkpoint it decodes with: "teacher", "student" or
    # "drafter"; a kind that reads `model` decodes with the AR model that names (this is
    # its default).
    stage: str
    options: tuple[str, ...]  # the DecodeMethod fields it reads; setting another is an error
    rescorer: Optional[str] = None  # the training stage whose model picks among its candidates
    # Its output may reach the cap (AR search, drafts that grow), rather than ending within
    # the student's predicted lengths: it decodes into the cap's width.
    to_the_cap: bool = False


# Decoding kinds: config validation, `padir translate`'s flags and inference all read this.
DECODING_KINDS: dict[str, DecodingKind] = {
    "ar_greedy": DecodingKind("teacher", ("shortlist", "model"), to_the_cap=True),
    "ar_beam": DecodingKind("teacher", ("beam_size", "length_penalty", "shortlist", "model"),
                            to_the_cap=True),
    "refine": DecodingKind("student", ("iterations", "num_length_candidates", "length_offsets",
                                       "shortlist")),
    "refine_rescored": DecodingKind("student", ("iterations", "num_length_candidates",
                                                "length_offsets", "shortlist"),
                                    rescorer="teacher"),
    "mask_predict": DecodingKind("student", ("iterations", "num_length_candidates",
                                             "length_offsets", "shortlist")),
    "adaptive": DecodingKind("student", ("tokens_per_step", "num_length_candidates",
                                         "length_offsets", "shortlist")),
    "draft_verify": DecodingKind("drafter", ("iterations", "tolerance_top_k",
                                             "tolerance_margin", "shortlist"),
                                 rescorer="teacher", to_the_cap=True),
    "ct2_greedy": DecodingKind("teacher", ("compute_type", "shortlist", "model"),
                               to_the_cap=True),
    "ct2_beam": DecodingKind("teacher", ("beam_size", "length_penalty", "compute_type",
                                         "shortlist", "model"), to_the_cap=True),
}


@dataclasses.dataclass(frozen=True)
class DecodeMethod:
    """One decoding method to measure (model/decoding/refinement.py, model/decoding/beam_search.py).

    The AR kinds (ar_*, ct2_*) decode with the AR model `model` names: the `teacher`
    (default) or the `ar_student`; draft_verify with the block drafter (`drafter`); the
    others with the PaDIR student (`student`). Each kind
    reads only its options (`DECODING_KINDS`); giving another one a value other than its default
    is an error, so a config never carries a knob that does nothing.

      ar_greedy     greedy search with a KV cache
      ar_beam       beam search: beam_size, length_penalty (GNMT exponent)
      refine        PaDIR's parallel iterative refinement: iterations (the most passes; a
                    sentence stops earlier at a fixed point), num_length_candidates x
                    length_offsets
      refine_rescored  refine of every length candidate, the candidate kept
                    the one the teacher scores best (one teacher-forced pass; the decode
                    stage gives it the teacher)
      mask_predict  exactly `iterations` passes; num_length_candidates x length_offsets
      adaptive      unmask the tokens_per_step positions per pass most certain by margin;
                    num_length_candidates x length_offsets
      draft_verify  the drafter drafts a block of its `block` tokens after the accepted
                    prefix (iterations: drafter passes per draft), the teacher verifies in
                    one teacher-forced pass and keeps the drafted tokens it agrees with,
                    then its own next token
                    (model/decoding/draft_verify.py): the teacher's greedy output exactly, in fewer
                    sequential calls when the drafts are good; tolerance_top_k > 1 also
                    accepts a drafted token in the teacher's top k within tolerance_margin
                    of its best log-probability (fewer rounds, no longer exact)
      ct2_greedy    the teacher exported to CTranslate2 (the CPU serving baseline),
                    greedy; compute_type float32 or int8 (model/decoding/ctranslate2_search.py)
      ct2_beam      the same, beam search: beam_size, length_penalty (CTranslate2's:
                    log-probability / length ** length_penalty, not GNMT's), compute_type

    Every kind reads `shortlist`: score only the target pieces a batch's sources can need
    (model/decoding/shortlist.py, built from the model's own training pairs) instead of all V; the
    CTranslate2 kinds get it as CTranslate2's vocabulary map (`use_vmap`).

    `name` names the method in file names and reports.
    """

    name: str
    kind: Literal[tuple(DECODING_KINDS)]  # parsed against the table: an unknown kind names the key
    iterations: int = 4
    beam_size: int = 4
    length_penalty: float = 0.6
    num_length_candidates: int = 1  # most likely lengths, each plus every offset; one
    length_offsets: tuple[int, ...] = (0,)  # candidate: 1.9x faster than offsets (-1, 0, 1)
    # at 1.4 BLEU less (benchmarks/README.md, decode_speed.py: "Length candidates")
    tokens_per_step: int = 2
    shortlist: bool = False
    compute_type: Literal["float32", "int8"] = "float32"
    model: Literal[AR_STAGES] = "teacher"  # the AR kinds: which AR model decodes
    tolerance_top_k: int = 1  # draft_verify: 1 is exact verification
    tolerance_margin: float = 0.0  # draft_verify with tolerance_top_k > 1: nats below the best

    def __post_init__(self):
        where = f"decode method {self.name!r}"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ConfigError(f"{where}: a name of letters, digits, '_', '.', '-' only")
        if self.kind not in DECODING_KINDS:  # also when built in code, not parsed
            raise ConfigError(f"{where}: kind must be one of {list(DECODING_KINDS)}")
        if self.model not in AR_STAGES:
            raise ConfigError(f"{where}: model must be one of {list(AR_STAGES)}")
        reads = DECODING_KINDS[self.kind].options
        for field in decode_options():
            if field.name not in reads and getattr(self, field.name) != field.default:
                raise ConfigError(f"{where}: '{field.name}' does not apply to kind {self.kind} "
                                  f"(it reads {list(reads) or 'no options'})")
        if min(self.iterations, self.beam_size, self.num_length_candidates,
               self.tokens_per_step) < 1:
            raise ConfigError(f"{where}: iterations, beam_size, num_length_candidates and "
                              "tokens_per_step must be >= 1")
        if self.tolerance_top_k < 1 or self.tolerance_margin < 0:
            raise ConfigError(f"{where}: tolerance_top_k must be >= 1 and tolerance_margin "
                              ">= 0")
        if self.tolerance_top_k == 1 and self.tolerance_margin:
            raise ConfigError(f"{where}: tolerance_margin needs tolerance_top_k > 1 (with 1 "
                              "the teacher's best token alone is accepted)")
        if self.length_penalty < 0 or not self.length_offsets:
            raise ConfigError(f"{where}: length_penalty must be >= 0 and length_offsets "
                              "non-empty")

    @property
    def stage(self) -> str:
        """The training stage whose checkpoint this method decodes with."""
        return self.model if "model" in DECODING_KINDS[self.kind].options else DECODING_KINDS[self.kind].stage

    @property
    def rescorer(self) -> Optional[str]:
        """The training stage whose model rescores this method's candidates, if any."""
        return DECODING_KINDS[self.kind].rescorer


def decode_options() -> tuple[dataclasses.Field, ...]:
    """The DecodeMethod fields a kind may read (all but `name` and `kind`)."""
    return tuple(field for field in dataclasses.fields(DecodeMethod)
                 if field.name not in ("name", "kind"))


DEFAULT_DECODE_METHODS: tuple[DecodeMethod, ...] = (
    DecodeMethod("ar_greedy", "ar_greedy"),
    DecodeMethod("ar_beam4", "ar_beam", beam_size=4),
    DecodeMethod("padir_1", "refine", iterations=1),
    DecodeMethod("padir_2", "refine", iterations=2),
    DecodeMethod("padir_4", "refine", iterations=4),
    DecodeMethod("padir_10", "refine", iterations=10),
    DecodeMethod("mask_predict_4", "mask_predict", iterations=4),
    DecodeMethod("mask_predict_10", "mask_predict", iterations=10),
    DecodeMethod("adaptive_margin", "adaptive"),
    DecodeMethod("ct2_greedy", "ct2_greedy"),
    DecodeMethod("ct2_beam4", "ct2_beam", beam_size=4),
    DecodeMethod("ct2_greedy_int8", "ct2_greedy", compute_type="int8"),
    DecodeMethod("ct2_beam4_int8", "ct2_beam", beam_size=4, compute_type="int8"),
)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """What the `decode` stage runs on every test set, and how it measures speed.

    Each method decodes every sentence batched at `throughput_batch_size` (the hypotheses
    that are scored; sentences and tokens per second), and the first `latency_sentences`
    (by id; null: all) again at `latency_batch_size` (1: per-sentence latency). A latency
    sample of a few hundred sentences gives its percentiles at a fraction of the cost of
    decoding the whole test set one sentence at a time. `max_sentences` decodes only the
    first N sentences of each test set, by id (the demo's slice).
    """

    methods: tuple[DecodeMethod, ...] = DEFAULT_DECODE_METHODS
    latency_batch_size: int = 1
    throughput_batch_size: int = 64
    latency_sentences: Optional[int] = None
    max_sentences: Optional[int] = None

    def __post_init__(self):
        if not self.methods:
            raise ConfigError("decode.methods: give at least one method")
        names = [method.name for method in self.methods]
        for i, name in enumerate(names):
            if names.index(name) != i:
                raise ConfigError(f"decode.methods[{i}].name: {name!r} is given twice")
        if min(self.latency_batch_size, self.throughput_batch_size) < 1:
            raise ConfigError("decode.latency_batch_size and throughput_batch_size must be >= 1")
        for name in ("latency_sentences", "max_sentences"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"decode.{name}: expected a positive integer or null")

    @property
    def models(self) -> tuple[str, ...]:
        """The training stages whose artifacts the methods decode or rescore with, sorted."""
        return tuple(sorted({stage for method in self.methods
                             for stage in (method.stage, method.rescorer) if stage}))


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """The Apache Beam runner and its pipeline options; flags given to a job override these."""

    name: str = "FnApiRunner"
    options: tuple[str, ...] = ()  # extra flags, e.g. ["--direct_num_workers=2"]


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole experiment."""

    workdir: str = "work"  # local (made absolute, relative to the current directory) or gs://
    seed: int = 0
    runner: RunnerConfig = RunnerConfig()
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # fails: langs required
    prepare: PrepareConfig = PrepareConfig()
    vocab: VocabConfig = VocabConfig()
    encode: EncodeConfig = EncodeConfig()
    teacher: TeacherConfig = TeacherConfig()
    distill: DistillConfig = DistillConfig()
    student: StudentConfig = StudentConfig()
    ar_student: ARStudentConfig = ARStudentConfig()
    drafter: DrafterConfig = DrafterConfig()
    decode: DecodeConfig = DecodeConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        if "://" not in self.workdir:  # local: absolute, so artifacts and checkpoints are too
            object.__setattr__(self, "workdir", os.path.abspath(self.workdir))
        self.data.train.validate("data.train")
        if self.data.dev is not None:
            self.data.dev.validate("data.dev")
        for i, test_set in enumerate(self.data.test):
            test_set.corpus.validate(f"data.test[{i}]")
        widest = self.encode.bucket_boundaries[-1]  # batches are padded to a boundary
        for name in TRAINING_STAGES:
            model = self.section(name).model
            if min(model.max_source_len, model.max_target_len) < widest:
                raise ConfigError(
                    f"{name}.model.max_source_len and max_target_len must be >= the widest "
                    f"bucket, encode.bucket_boundaries[-1] = {widest}")

    def section(self, name: str) -> Any:
        return getattr(self, name)

    def section_hash(self, name: str) -> str:
        """A stable hash of one section's resolved values (for artifact keys and caching)."""
        return stable_hash(to_dict(self.section(name)))

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


# --- parsing ---------------------------------------------------------------------------


def stable_hash(value: Any, length: int = 12) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def to_dict(value: Any) -> Any:
    """A config (or section) as plain JSON-able data."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [to_dict(v) for v in value]
    return value


_ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Sections whose strings keep their `${VAR}` placeholders (see the module docstring).
KEEP_PLACEHOLDERS = (CorpusConfig,)
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4


def _short(value: Any) -> str:
    """A bounded repr: an error never echoes a whole value (a YAML alias bomb expands)."""
    return f"{type(value).__name__} {_SHORT.repr(value)}"


def expand_env(text: str, where: str = "") -> str:
    """`text` with every `${VAR}` replaced from the environment.

    Raises:
      ConfigError: a variable is not set (named, with `where`).
    """
    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise ConfigError(f"{where or text}: environment variable {name} is not set")
        return os.environ[name]

    return _ENV_VAR.sub(substitute, text)


# Floats that PyYAML (YAML 1.1) reads as strings: an exponent without a dot, e.g. 2e-3.
_YAML11_EXPONENT = re.compile(r"[-+]?(\d+|\d*\.\d+)[eE][-+]?\d+")


def _convert(value: Any, annotation: Any, where: str, expand: bool = True) -> Any:
    """Checks `value` against a type annotation and converts it (lists to tuples, ...)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], where, expand)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {_short(value)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_short(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]", expand)
                         for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(v, a, f"{where}[{i}]", expand)
                     for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_short(value)}")
        return from_dict(annotation, value, where)
    if annotation is float:
        if isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value):
            value = float(value)  # YAML 1.1 (PyYAML) reads 2e-3 as a string; YAML 1.2 does not
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_short(value)}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_short(value)}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {_short(value)}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_short(value)}")
        expanded = expand_env(value, where)  # also checks every variable is set
        return expanded if expand else value
    raise TypeError(f"{where}: unsupported annotation {annotation!r}")


def from_dict(cls: type, data: dict, where: str = "", base: Any = None) -> Any:
    """Builds dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError.

    Keys not given keep the values of `base` (default: `cls()`'s); a mapping given for a
    section fills from that section's default, so `ar_student.model: {d_model: 512}` keeps
    the AR student's one decoder layer."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = set(fields)
    for key in data:
        if key not in names:
            path = f"{where}.{key}" if where else str(key)
            raise ConfigError(f"unknown config key '{_SHORT.repr(path)[1:-1]}' "
                              f"(valid here: {sorted(names)})")
    kwargs = {}
    expand = cls not in KEEP_PLACEHOLDERS
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        default = fields[key].default
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            kwargs[key] = from_dict(type(default), value, path, base=default)
        else:
            kwargs[key] = _convert(value, hints[key], path, expand)
    try:
        return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)
    except ConfigError:
        raise
    except TypeError as e:
        raise ConfigError(f"{where or 'config'}: {e}") from e


def _set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{key}' is not a section")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", c), with c parsed as YAML (so numbers, lists, null work)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {_SHORT.repr(text)}")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"--set {key.strip()}: the value is not valid YAML ({problem}); "
                          "quote it to pass a string") from e


def load(path: str, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML config (with `include:` of a base file) and applies `--set` overrides."""
    data = _read_yaml(path, ())
    for text in overrides:
        _set_path(data, *parse_override(text))
    return from_dict(Config, data)


def _parse_yaml(path: str) -> Any:
    """The YAML document at `path`; any reading or parsing problem is one ConfigError."""
    try:
        with open(path, "rb") as f:
            return yaml.safe_load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: no such config file") from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror or e}") from e
    except yaml.MarkedYAMLError as e:  # syntax errors, and tags such as !!python/object
        mark = e.problem_mark or e.context_mark
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{at}: invalid YAML: {e.problem or e.context}") from e
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid YAML: {type(e).__name__}") from e


def _read_yaml(path: str, including: tuple[str, ...]) -> dict:
    """A YAML mapping; `include: base.yaml` (relative to this file) is merged underneath.

    Args:
      including: the real paths of the files that include this one (an include loop).
    """
    real = os.path.realpath(path)
    if real in including:
        chain = " -> ".join(os.path.relpath(p) for p in (*including, real))
        raise ConfigError(f"{path}: include loop: {chain}")
    data = _parse_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {_short(data)}")
    base = data.pop("include", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: include: expected a file name, got {_short(base)}")
    merged = _read_yaml(os.path.join(os.path.dirname(path), base), (*including, real))
    _merge(merged, data)
    return merged


def _merge(base: dict, overlay: dict) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def dump(config: Config) -> str:
    """The resolved config as YAML (written next to every artifact), corpus locations with
    their `${VAR}` placeholders."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def summary(config: Config, sections: Sequence[str]) -> str:
    """One line naming a stage's sections and their hashes (the log line of a stage; the
    whole config belongs at DEBUG), e.g. `prepare 1a2b3c4d5e6f, seed 0`."""
    return ", ".join(
        f"{name} {getattr(config, name)}" if isinstance(getattr(config, name), (int, str))
        else f"{name} {config.section_hash(name)}" for name in sections)
