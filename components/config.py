"""The experiment config: one typed schema, YAML in, `--set a.b=c` overrides.

Every stage reads a narrow, frozen section of it (`config.prepare`, `config.vocab`, ...).
Defaults live here and nowhere else. Unknown keys and wrong types are errors that name
the offending key. Parsing a config imports nothing heavy (no JAX, TF or Beam).

`${VAR}` in string values is expanded from the environment when the file is loaded
(e.g. `${PADIR_DATA_ROOT}`), so configs stay machine-independent while the resolved
config written next to every artifact records the real paths.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import types
import typing
from typing import Any, Literal, Optional, Sequence

import yaml


class ConfigError(ValueError):
    """A config that cannot be used: the message names the key."""


# --- data ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    """One parallel corpus: two line-aligned files (plain or .gz), or one TSV.

    Paths may be local, `gs://`, or `http(s)://`. A TSV may sit inside a .zip
    (`tsv: deu-eng.zip`, `member: deu.txt`); `tsv_columns` says which columns hold
    source and target (Tatoeba's export is `English<TAB>German`).
    """

    source: Optional[str] = None
    target: Optional[str] = None
    tsv: Optional[str] = None
    member: Optional[str] = None
    tsv_columns: tuple[int, int] = (0, 1)

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


@dataclasses.dataclass(frozen=True)
class TestSetConfig:
    """A named held-out set (e.g. Multi30k test2016)."""

    name: str
    corpus: CorpusConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the raw parallel text comes from.

    If `dev` is not given, a dev split is carved from train deterministically (by the seed,
    hashing the source sentence so that all translations of one source land in one split).
    Likewise a test split when `test` is empty. `max_train_pairs` reads only the first N
    training pairs (the demo's slice).
    """

    source_lang: str = "en"
    target_lang: str = "de"
    train: CorpusConfig = CorpusConfig()
    dev: Optional[CorpusConfig] = None
    test: tuple[TestSetConfig, ...] = ()
    carve_dev_fraction: float = 0.02
    carve_test_fraction: float = 0.02
    max_train_pairs: Optional[int] = None


# --- stages ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """Normalisation and filtering of raw pairs (every rejection is counted and written)."""

    max_chars: int = 1000  # per side, after normalisation
    max_length_ratio: float = 3.0  # longer/shorter side, in characters
    min_chars_for_ratio: int = 10  # the ratio test skips pairs whose shorter side is tiny
    deduplicate: bool = True
    num_shards: int = 4


@dataclasses.dataclass(frozen=True)
class VocabConfig:
    """A joint SentencePiece model trained from Beam word counts of both sides."""

    size: int = 8000
    model_type: Literal["unigram", "bpe"] = "unigram"
    character_coverage: float = 1.0
    byte_fallback: bool = True  # unseen characters become byte pieces, never <unk>
    max_words: int = 2_000_000  # distinct words fed to SentencePiece (most frequent)


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
    max_source_len: int = 64  # tokens, including EOS (and the [LENGTH] token for PaDIR)
    max_target_len: int = 64  # tokens, including EOS; also the number of length classes
    positional_attention: bool = True  # PaDIR decoder only
    dtype: Literal["float32", "bfloat16"] = "float32"


@dataclasses.dataclass(frozen=True)
class BeamConfig:
    """Beam pipeline options; command-line flags given to a job override these."""

    runner: str = "FnApiRunner"
    options: tuple[str, ...] = ()  # extra flags, e.g. ["--direct_num_workers=2"]


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole experiment."""

    workdir: str = "work"
    seed: int = 0
    beam: BeamConfig = BeamConfig()
    data: DataConfig = DataConfig()
    prepare: PrepareConfig = PrepareConfig()
    vocab: VocabConfig = VocabConfig()

    def __post_init__(self):
        self.data.train.validate("data.train")
        if self.data.dev is not None:
            self.data.dev.validate("data.dev")
        for i, test_set in enumerate(self.data.test):
            test_set.corpus.validate(f"data.test[{i}]")

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


def _expand_env(text: str, where: str) -> str:
    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise ConfigError(f"{where}: environment variable {name} is not set")
        return os.environ[name]

    return _ENV_VAR.sub(substitute, text)


def _convert(value: Any, annotation: Any, where: str) -> Any:
    """Checks `value` against a type annotation and converts it (lists to tuples, ...)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        return from_dict(annotation, value, where)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return _expand_env(value, where)
    raise TypeError(f"{where}: unsupported annotation {annotation!r}")


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Builds dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            path = f"{where}.{key}" if where else str(key)
            raise ConfigError(f"unknown config key '{path}' (valid here: {sorted(names)})")
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        kwargs[key] = _convert(value, hints[key], path)
    try:
        return cls(**kwargs)
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
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load(path: str, overrides: Sequence[str] = ()) -> Config:
    """Reads a YAML config (with `include:` of a base file) and applies `--set` overrides."""
    data = _read_yaml(path)
    for text in overrides:
        key, value = parse_override(text)
        _set_path(data, key, value)
    return from_dict(Config, data)


def _read_yaml(path: str) -> dict:
    """A YAML mapping; `include: base.yaml` (relative to this file) is merged underneath."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    base = data.pop("include", None)
    if base is None:
        return data
    merged = _read_yaml(os.path.join(os.path.dirname(path), base))
    _merge(merged, data)
    return merged


def _merge(base: dict, overlay: dict) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def dump(config: Config) -> str:
    """The resolved config as YAML (written next to every artifact)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)
