"""Parallel corpus IO and the per-pair logic of the `prepare` stage (plain Python, no Beam).

Reading: a corpus is two line-aligned files (plain or .gz) or one TSV, optionally a member
of a .zip, at a local path (relative or absolute), an http(s) URL or `gs://` (all through
fsspec; `${VAR}` in a location is expanded only here, see components/config.py). Lines are
read as bytes, in blocks, so that invalid UTF-8 is rejected per line, only `\\n` ends a
line (U+2028 or U+0085 inside a sentence never shifts the alignment of the two sides), and
a line longer than `prepare.max_line_bytes` is never held in memory whole.

Before any work starts, `check_corpus` reads every file once and fails with a
`CorpusError` naming the file and the cause when it is missing, unreadable (a damaged
gzip or zip), empty, has CR-only line endings (it would read as one line), or is UTF-16 or
UTF-32 (a byte-order mark, or NUL bytes); or when the two sides differ in length.

Cleaning a pair (`clean_pair`): decode as UTF-8, then `normalise` each side: control and
format characters (Unicode Cc/Cf) are removed, except that the whitespace ones (tab,
newline, CR, ...) become spaces; then NFC; then runs of whitespace collapse to one space
and both ends are stripped.

Rejection reasons (`REASONS`): every rejected pair is kept with its reason, never dropped.
  malformed     a TSV line without the expected number of tab-separated columns
  oversized     a line over `prepare.max_line_bytes` bytes (shown cut to its start)
  invalid_utf8  a side is not valid UTF-8
  empty         a side is empty after normalisation
  too_long      a side has more than `prepare.max_chars` characters
  length_ratio  longer/shorter side in characters above `prepare.max_length_ratio`, tested
                only when the shorter side has at least `prepare.min_chars_for_ratio` chars
  duplicate     the same (source, target) after normalisation as a pair with a lower id

Given dev and test sets are official: they are normalised and rejected only when they are
unusable (malformed, oversized, invalid_utf8, empty); the stage then fails unless it is
`empty` (STRUCTURAL reasons), since a test set with a hole is not the official one. The length filters and de-duplication apply to
pairs read from train alone (including those carved into dev/test from it), so that a
filter setting never silently changes an official evaluation set, and dev/test are not
de-duplicated against train. Rejected dev/test pairs are counted under their split name.

Splits: a pair's id is `"{split_of_origin}:{line:06d}"` (0-based line in the raw input,
e.g. `train:000123`) and never changes. When dev or test sets are not given, they are
carved from train by `carve_split`, hashing the seed and the normalised side that
`data.carve_by` names (the source by default), so that all translations of one sentence on
that side land in the same split.

Output contract of the stage (read it with `read_split`): `{split}-SSSSS-of-NNNNN.jsonl`
files of `{"id", "source", "target"}` lines for `train`, `dev` and each test set name
(`test` when carved), and `rejects-SSSSS-of-NNNNN.jsonl` of
`{"id", "split", "reason", "source", "target"}` (undecodable bytes shown as `\\xNN`).
Which shard holds a pair is up to the runner; `read_split` returns a split in id order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import lzma
import unicodedata
import zipfile
import zlib
from typing import Iterable, Iterator, Optional, Union

import aiohttp
import fsspec

from components import artifacts, logs
from components.config import CorpusConfig, DataConfig, PrepareConfig, expand_env

REASONS = ("malformed", "oversized", "invalid_utf8", "empty", "too_long", "length_ratio",
           "duplicate")
# Reasons that mean the input itself is broken (rather than filtered): any of them fails a
# given dev or test set (`pipelines.prepare.check_rejects`).
STRUCTURAL = ("malformed", "oversized", "invalid_utf8")
TRAIN, DEV, CARVED_TEST, REJECTS = "train", "dev", "test", "rejects"
SHOWN_BYTES = 200  # of an oversized line, in its reject
_BLOCK = 1 << 20  # bytes read at a time
# What a damaged file raises while it is read: gzip's CRC and header errors are OSErrors,
# a corrupt deflate stream is a zlib.error, a damaged zip a BadZipFile, a cut one EOFError;
# an http(s) corpus whose server refuses a read (an expired signed URL: 401 or 403), after
# answering the HEAD that sized it, an aiohttp ClientError.
READ_ERRORS = (OSError, EOFError, KeyError, zlib.error, zipfile.BadZipFile, lzma.LZMAError,
               aiohttp.ClientError)


class CorpusError(ValueError):
    """A structural problem with the input (missing file, misaligned sides): nothing was run.
    Its message names the file with the secrets of its URL redacted (`logs.redact`)."""

    def __init__(self, message: str):
        super().__init__(logs.redact(message))


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """One corpus to read: the split it belongs to, where it is, and how many lines to read."""

    split: str
    corpus: CorpusConfig
    limit: Optional[int] = None
    max_line_bytes: int = PrepareConfig.max_line_bytes
    sample_fraction: float = 1.0  # of the lines read (`in_sample`)


@dataclasses.dataclass(frozen=True)
class RawPair:
    """One input line (or pair of lines) as bytes, before decoding."""

    id: str
    split: str  # of origin
    source: bytes
    target: bytes
    reason: Optional[str] = None  # "malformed" (`source` holds the whole TSV line) or
    # "oversized" (the sides hold the start of the line only)


@dataclasses.dataclass(frozen=True)
class Pair:
    """A normalised pair; `split` is the split of origin (before carving)."""

    id: str
    split: str
    source: str
    target: str

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "source": self.source, "target": self.target},
                          ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class Reject:
    id: str
    split: str
    reason: str
    source: str
    target: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)


# --- ids and splits --------------------------------------------------------------------


def make_id(split: str, line: int) -> str:
    return f"{split}:{line:06d}"


def unit_hash(text: str) -> float:
    """A stable, uniform value in [0, 1) for `text` (the first 8 bytes of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def in_sample(pair_id: str, fraction: float) -> bool:
    """Whether a line belongs to a `fraction` sample of its corpus: a hash of its id, so the
    sample is spread over the file, needs no global order, and the same on every run."""
    return fraction >= 1.0 or unit_hash(f"sample\t{pair_id}") < fraction


def id_sort_key(pair_id: str) -> tuple[str, int]:
    """Orders ids by split of origin, then by line number (numerically, past 999,999)."""
    split, line = pair_id.rsplit(":", 1)
    return split, int(line)


def output_splits(data: DataConfig) -> tuple[str, ...]:
    """The splits the stage writes: train, dev, then the test sets (or the carved `test`)."""
    tests = tuple(t.name for t in data.test) or (CARVED_TEST,)
    return (TRAIN, DEV, *tests)


def carve_split(text: str, *, seed: int, data: DataConfig) -> str:
    """The split a pair read from train goes to: `train`, or a carved `dev` or `test`.

    `text` is the pair's `data.carve_by` side (`carve_key`). The unit interval is cut into
    fixed bands, [0, test_fraction) for test and the next dev_fraction for dev, so carving
    one split never moves the pairs of the other. Only the splits that are not given in the
    config are carved.
    """
    u = unit_hash(f"{seed}\t{text}")
    if u < data.carve_test_fraction:
        return CARVED_TEST if not data.test else TRAIN
    if u < data.carve_test_fraction + data.carve_dev_fraction:
        return DEV if data.dev is None else TRAIN
    return TRAIN


def carve_key(pair: Pair, data: DataConfig) -> str:
    """The side of a pair that decides its carved split (`data.carve_by`)."""
    return pair.target if data.carve_by == "target" else pair.source


def output_split(pair: Pair, *, seed: int, data: DataConfig) -> str:
    """Given dev/test pairs stay in their split; train pairs may be carved out."""
    if pair.split != TRAIN:
        return pair.split
    return carve_split(carve_key(pair, data), seed=seed, data=data)


# --- reading ---------------------------------------------------------------------------


def corpus_specs(data: DataConfig, prepare: PrepareConfig) -> tuple[CorpusSpec, ...]:
    """Every corpus the stage reads, with its split of origin."""
    cap = prepare.max_line_bytes
    specs = [CorpusSpec(TRAIN, data.train, data.max_train_pairs, cap,
                        data.train_sample_fraction)]
    if data.dev is not None:
        specs.append(CorpusSpec(DEV, data.dev, max_line_bytes=cap))
    specs.extend(CorpusSpec(t.name, t.corpus, max_line_bytes=cap) for t in data.test)
    return tuple(specs)


def _tsv_uri(corpus: CorpusConfig) -> str:
    return f"zip://{corpus.member}::{corpus.tsv}" if corpus.member else corpus.tsv


def _blocks(uri: str) -> Iterator[bytes]:
    """The (decompressed) bytes of a file, a block at a time; `uri` may hold `${VAR}`."""
    with fsspec.open(expand_env(uri), "rb", compression="infer") as f:
        while block := f.read(_BLOCK):
            yield block


def _line(head: bytes, oversized: bool) -> tuple[bytes, bool]:
    if oversized:
        return head[:SHOWN_BYTES], True
    return (head[:-1] if head.endswith(b"\r") else head), False


def read_lines(uri: str, max_bytes: int) -> Iterator[tuple[bytes, bool]]:
    """The lines of a (possibly compressed) file as bytes, without the line ending.

    Yields:
      (line, oversized): a line over `max_bytes` bytes is `oversized`, and only its first
      SHOWN_BYTES are kept; the rest is skipped as it is read, never held whole.
    """
    head, oversized = b"", False  # the line being read (its start only, when oversized)
    for block in _blocks(uri):
        *ends, tail = block.split(b"\n")
        for piece in ends:
            if not oversized:
                head += piece
                oversized = len(head) > max_bytes + head.endswith(b"\r")
            yield _line(head, oversized)
            head, oversized = b"", False
        if not oversized:
            head += tail
            if len(head) > max_bytes + 1:  # + 1: a CR that ends the line in the next block
                head, oversized = head[:SHOWN_BYTES], True
    if head or oversized:
        yield _line(head, oversized or len(head) > max_bytes)


def count_lines(uri: str, where: str) -> int:
    """Line count of one file, read whole once.

    Raises:
      CorpusError: the file is missing, unreadable (damaged), UTF-16/32, or has CR-only
        line endings; the message names `where`, the file and the cause.
    """
    newlines = lone_crs = 0
    last = b""  # the last byte of the file so far
    try:
        for i, block in enumerate(_blocks(uri)):
            if i == 0:
                _check_encoding(block, uri, where)
            newlines += block.count(b"\n")
            # CR not followed by LF; a CRLF split across two blocks is not lone.
            lone_crs += block.count(b"\r") - block.count(b"\r\n") - (
                last == b"\r" and block.startswith(b"\n"))
            last = block[-1:]
    except READ_ERRORS as e:  # KeyError: no such member in a zip
        raise CorpusError(f"{where}: cannot read {uri}: {_cause(e)}") from e
    if lone_crs > newlines:
        raise CorpusError(
            f"{where}: {uri} has CR-only line endings ({lone_crs} CRs, {newlines} newlines) "
            "and would read as one line: convert them to \\n (tr '\\r' '\\n')")
    return newlines + (last not in (b"", b"\n"))


def _cause(error: BaseException) -> str:
    """What went wrong, in a few words that name no URL (the caller names the file)."""
    refused = error  # an HTTP answer, maybe under the FileNotFoundError(s) fsspec raises
    while refused is not None and not isinstance(refused, aiohttp.ClientResponseError):
        refused = refused.__cause__ or refused.__context__
    if refused is not None and refused.status != 404:
        return f"HTTP {refused.status} {refused.message}"
    if isinstance(error, (FileNotFoundError, aiohttp.ClientResponseError)):
        return "no such file"
    if isinstance(error, KeyError):
        return f"no member {error} in the zip"
    name = "zlib.error" if isinstance(error, zlib.error) else type(error).__name__
    return f"{name}: {error}" if str(error) else name


_WIDE_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32",
              b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16"}


def _check_encoding(first_block: bytes, uri: str, where: str) -> None:
    """UTF-16/32 text splits into lines of NUL-riddled bytes that decode as UTF-8 and lose
    their NULs in `normalise`: caught here, by its byte-order mark or its NUL bytes."""
    bom = next((name for bom, name in _WIDE_BOMS.items() if first_block.startswith(bom)), None)
    if bom is None and first_block.count(b"\x00") * 10 > len(first_block):
        bom = "UTF-16 or UTF-32 (NUL bytes)"
    if bom is not None:
        raise CorpusError(f"{where}: {uri} looks like {bom}, not UTF-8: convert it "
                          "(iconv -t UTF-8)")


def check_corpus(spec: CorpusSpec) -> int:
    """Checks one corpus before any work starts; returns its number of lines (pairs).

    Raises:
      CorpusError: a file is missing, unreadable, empty, in a wrong encoding or with CR-only
        line endings, or the two sides differ in length.
    """
    where = f"data.{spec.split}"
    corpus = spec.corpus
    if corpus.tsv is not None:
        lines = count_lines(_tsv_uri(corpus), where)
    else:
        lines = count_lines(corpus.source, f"{where}.source")
        targets = count_lines(corpus.target, f"{where}.target")
        if lines != targets:
            raise CorpusError(
                f"{where}: source and target files are not line-aligned: "
                f"{corpus.source} has {lines} lines, {corpus.target} has {targets} lines")
    if lines == 0:
        raise CorpusError(f"{where}: {corpus.tsv or corpus.source} is empty")
    return lines


def read_pairs(spec: CorpusSpec) -> Iterator[RawPair]:
    """The raw pairs of one corpus in file order (the first `spec.limit` only, if set)."""
    try:
        yield from _read_pairs(spec)
    except READ_ERRORS as e:  # checked before the job: the file changed since
        raise CorpusError(f"data.{spec.split}: cannot read it any more: {_cause(e)}") from e


def _read_pairs(spec: CorpusSpec) -> Iterator[RawPair]:
    corpus, cap = spec.corpus, spec.max_line_bytes
    if corpus.tsv is not None:
        columns = corpus.expected_columns
        i, j = corpus.tsv_columns
        lines = enumerate(read_lines(_tsv_uri(corpus), cap))
        for n, (line, oversized) in itertools.islice(lines, spec.limit):
            pair_id = make_id(spec.split, n)
            fields = line.split(b"\t")  # a tab byte never occurs inside a UTF-8 sequence
            if oversized or len(fields) != columns:
                reason = "oversized" if oversized else "malformed"
                yield RawPair(pair_id, spec.split, line, b"", reason=reason)
            else:
                yield RawPair(pair_id, spec.split, fields[i], fields[j])
        return
    try:
        # strict: the lengths were checked up front, so a difference means a file changed.
        lines = enumerate(zip(read_lines(corpus.source, cap), read_lines(corpus.target, cap),
                              strict=True))
        for n, ((source, long_source), (target, long_target)) in itertools.islice(
                lines, spec.limit):
            reason = "oversized" if long_source or long_target else None
            yield RawPair(make_id(spec.split, n), spec.split, source, target, reason=reason)
    except ValueError as e:
        raise CorpusError(f"data.{spec.split}: {corpus.source} and {corpus.target} are no "
                          f"longer line-aligned (changed since the check?): {e}") from e


# --- cleaning --------------------------------------------------------------------------


def normalise(text: str) -> str:
    """Cc/Cf removed (whitespace controls become spaces), NFC, whitespace collapsed."""
    if not text.isprintable():  # fast path: printable text has no Cc/Cf characters
        text = "".join(
            (" " if ch.isspace() else "") if unicodedata.category(ch) in ("Cc", "Cf") else ch
            for ch in text)
    # NFC after removing controls: a removed format character can leave a sequence that
    # composes (e + ZWJ + combining acute -> é).
    text = unicodedata.normalize("NFC", text)
    return " ".join(text.split())


def check_pair(source: str, target: str, config: PrepareConfig, *, filter_lengths: bool
               ) -> Optional[str]:
    """The rejection reason of a normalised pair, or None if it is kept.

    Args:
      filter_lengths: apply `too_long` and `length_ratio` (train only; see module docstring).
    """
    if not source or not target:
        return "empty"
    if not filter_lengths:
        return None
    shorter, longer = sorted((len(source), len(target)))
    if longer > config.max_chars:
        return "too_long"
    if shorter >= config.min_chars_for_ratio and longer / shorter > config.max_length_ratio:
        return "length_ratio"
    return None


def _show(raw: bytes) -> str:
    return raw.decode("utf-8", errors="backslashreplace")


def clean_pair(raw: RawPair, config: PrepareConfig) -> Union[Pair, Reject]:
    """Decodes, normalises and checks one raw pair (everything but de-duplication)."""
    if raw.reason is not None:
        return Reject(raw.id, raw.split, raw.reason, _show(raw.source), _show(raw.target))
    try:
        source, target = raw.source.decode("utf-8"), raw.target.decode("utf-8")
    except UnicodeDecodeError:
        return Reject(raw.id, raw.split, "invalid_utf8", _show(raw.source), _show(raw.target))
    source, target = normalise(source), normalise(target)
    reason = check_pair(source, target, config, filter_lengths=raw.split == TRAIN)
    if reason is not None:
        return Reject(raw.id, raw.split, reason, source, target)
    return Pair(raw.id, raw.split, source, target)


def drop_duplicates(pairs: Iterable[Pair]) -> tuple[Pair, list[Reject]]:
    """Of pairs with the same text, keeps the one with the lowest id; rejects the others."""
    first, *others = sorted(pairs, key=lambda p: id_sort_key(p.id))
    return first, [Reject(p.id, p.split, "duplicate", p.source, p.target) for p in others]


# --- the prepared artifact -------------------------------------------------------------


def split_pattern(artifact_uri: str, split: str) -> str:
    """The glob matching every shard of `split` (or `rejects`) in a prepare artifact."""
    return artifacts.join(artifact_uri, f"{split}-?????-of-?????.jsonl")


def split_files(artifact_uri: str, split: str) -> list[str]:
    """The URIs of the shards of `split` (or `rejects`) in a prepare-format artifact, sorted.

    Raises:
      FileNotFoundError: the artifact has no files for `split`.
    """
    pattern = split_pattern(artifact_uri, split)
    fs, path = artifacts.filesystem(pattern)
    files = [fs.unstrip_protocol(file) for file in sorted(fs.glob(path))]
    if not files:
        raise FileNotFoundError(f"{artifact_uri} has no {split} split (no files match {pattern})")
    return files


def read_jsonl(uri: str) -> Iterator[dict]:
    """The objects of a JSON-lines file (local or fsspec), one per non-blank line, streamed.

    Lines end at b"\\n" only: text may hold U+2028 or U+0085, which str.splitlines breaks on.
    """
    fs, path = artifacts.filesystem(uri)
    with fs.open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def read_split(artifact_uri: str, split: str) -> Iterator[dict]:
    """The records of one split of a prepare-format artifact, in id order.

    Raises:
      FileNotFoundError: the artifact has no files for `split`.
    """
    records = [record for file in split_files(artifact_uri, split) for record in read_jsonl(file)]
    records.sort(key=lambda r: id_sort_key(r["id"]))
    yield from records
