"""components/corpus.py: reading, normalisation, validation, carving, the artifact readers."""

import gzip
import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
import zipfile

import fsspec
import pytest

from components import corpus
from components import config as config_lib
from components.config import CorpusConfig, DataConfig, PrepareConfig

PREPARE = PrepareConfig(max_chars=50, max_length_ratio=3.0, min_chars_for_ratio=10)


def _write(path, lines: list[bytes]) -> str:
    blob = b"".join(line + b"\n" for line in lines)
    if str(path).endswith(".gz"):
        blob = gzip.compress(blob)
    path.write_bytes(blob)
    return str(path)


def _raw(source: bytes, target: bytes, split="train", line=0) -> corpus.RawPair:
    return corpus.RawPair(corpus.make_id(split, line), split, source, target)


# --- normalise -------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("Cafe\u0301", "Caf\u00e9"),  # NFC
    ("  a \t b\n", "a b"),  # tab/newline -> space, collapsed, stripped
    ("a\x00b\x7fc", "abc"),  # Cc removed
    ("zero\u200bwidth\u00adsoft\ufeff", "zerowidthsoft"),  # Cf removed (ZWSP, SHY, BOM)
    ("a\u00a0\u2028b\x85c", "a b c"),  # other whitespace (NBSP, LS, NEL) collapses too
    ("e\u200d\u0301", "\u00e9"),  # NFC after removing the format character
    ("\r\n\t ", ""),
    ("Plain ASCII.", "Plain ASCII."),
])
def test_normalise(text, expected):
    assert corpus.normalise(text) == expected


# --- check_pair / clean_pair -----------------------------------------------------------


@pytest.mark.parametrize("source, target, reason", [
    ("A cat.", "Eine Katze.", None),
    ("", "Leer", "empty"),
    ("Voll", "", "empty"),
    ("x" * 51, "y" * 51, "too_long"),
    ("x" * 50, "y" * 50, None),  # max_chars is inclusive
    ("a" * 10, "b" * 31, "length_ratio"),
    ("a" * 10, "b" * 30, None),  # ratio exactly 3 is allowed
    ("a" * 9, "b" * 40, None),  # shorter side below min_chars_for_ratio: no ratio test
])
def test_check_pair(source, target, reason):
    assert corpus.check_pair(source, target, PREPARE, filter_lengths=True) == reason


def test_check_pair_held_out_sets_only_reject_empty():
    assert corpus.check_pair("x" * 500, "y", PREPARE, filter_lengths=False) is None
    assert corpus.check_pair("", "y", PREPARE, filter_lengths=False) == "empty"


def test_clean_pair_normalises_and_keeps():
    pair = corpus.clean_pair(_raw(" Cafe\u0301\tau lait ".encode(), b"Milchkaffee\r"), PREPARE)
    assert pair == corpus.Pair("train:000000", "train", "Caf\u00e9 au lait", "Milchkaffee")
    assert json.loads(pair.to_json()) == {
        "id": "train:000000", "source": "Caf\u00e9 au lait", "target": "Milchkaffee"}


def test_clean_pair_invalid_utf8_shows_the_bytes():
    reject = corpus.clean_pair(_raw(b"Caf\xe9", b"Kaffee", split="test2016", line=7), PREPARE)
    assert reject == corpus.Reject("test2016:000007", "test2016", "invalid_utf8",
                                   "Caf\\xe9", "Kaffee")
    assert json.loads(reject.to_json())["source"] == "Caf\\xe9"


def test_clean_pair_length_filters_apply_to_train_only():
    long_pair = (b"x" * 60, b"y" * 60)
    assert corpus.clean_pair(_raw(*long_pair), PREPARE).reason == "too_long"
    assert isinstance(corpus.clean_pair(_raw(*long_pair, split="dev"), PREPARE), corpus.Pair)
    assert corpus.clean_pair(_raw(b" ", b"y", split="dev"), PREPARE).reason == "empty"


def test_clean_pair_malformed():
    raw = corpus.RawPair("train:000003", "train", b"a\tb\tc", b"", reason="malformed")
    assert corpus.clean_pair(raw, PREPARE) == corpus.Reject(
        "train:000003", "train", "malformed", "a\tb\tc", "")


def test_drop_duplicates_keeps_lowest_id_numerically():
    pairs = [corpus.Pair(corpus.make_id("train", n), "train", "a", "b")
             for n in (1_000_000, 999_999, 5_000_000)]
    kept, rejects = corpus.drop_duplicates(pairs)
    assert kept.id == "train:999999"
    assert [(r.id, r.reason) for r in rejects] == [
        ("train:1000000", "duplicate"), ("train:5000000", "duplicate")]


# --- reading ---------------------------------------------------------------------------


def test_read_pairs_plain_and_gz_with_limit(tmp_path):
    source = _write(tmp_path / "s.en.gz", [b"one", b"two\r", b"three\xe2\x80\xa8x"])
    target = _write(tmp_path / "t.de", [b"eins", b"zwei", b"drei"])
    spec = corpus.CorpusSpec("train", CorpusConfig(source=source, target=target))
    assert corpus.check_corpus(spec) == 3
    raws = list(corpus.read_pairs(spec))
    # CR stripped; U+2028 inside a line does not split it.
    assert [(r.id, r.source, r.target) for r in raws] == [
        ("train:000000", b"one", b"eins"), ("train:000001", b"two", b"zwei"),
        ("train:000002", b"three\xe2\x80\xa8x", b"drei")]
    limited = corpus.CorpusSpec("train", spec.corpus, limit=2)
    assert [r.id for r in corpus.read_pairs(limited)] == ["train:000000", "train:000001"]


def test_read_pairs_tsv_in_zip(tmp_path):
    archive = tmp_path / "deu-eng.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("deu.txt", "Hi.\tHallo!\nHi.\tGr\u00fc\u00df Gott!\nno tab\nx\ty\tz\n")
        z.writestr("_about.txt", "about")
    config = CorpusConfig(tsv=str(archive), member="deu.txt")
    spec = corpus.CorpusSpec("train", config)
    assert corpus.check_corpus(spec) == 4
    raws = list(corpus.read_pairs(spec))
    assert [(r.source, r.target, r.reason) for r in raws] == [
        (b"Hi.", b"Hallo!", None), (b"Hi.", "Grüß Gott!".encode(), None),
        (b"no tab", b"", "malformed"), (b"x\ty\tz", b"", "malformed")]
    # Three columns, target first: the third column is ignored, two-column lines malformed.
    swapped = CorpusConfig(tsv=str(archive), member="deu.txt", tsv_columns=(1, 0),
                           tsv_num_columns=3)
    raws = list(corpus.read_pairs(corpus.CorpusSpec("train", swapped)))
    assert [r.reason for r in raws] == ["malformed", "malformed", "malformed", None]
    assert (raws[3].source, raws[3].target) == (b"y", b"x")


def test_check_corpus_misaligned_names_both_files_and_counts(tmp_path):
    source = _write(tmp_path / "train.en.gz", [b"a", b"b", b"c"])
    target = _write(tmp_path / "train.de.gz", [b"a", b"b"])
    spec = corpus.CorpusSpec("train", CorpusConfig(source=source, target=target))
    with pytest.raises(corpus.CorpusError) as error:
        corpus.check_corpus(spec)
    message = str(error.value)
    assert source in message and target in message
    assert "3 lines" in message and "2 lines" in message


def test_check_corpus_missing_file(tmp_path):
    source = _write(tmp_path / "s", [b"a"])
    spec = corpus.CorpusSpec("dev", CorpusConfig(source=source, target=str(tmp_path / "nope")))
    with pytest.raises(corpus.CorpusError, match="data.dev.target.*nope"):
        corpus.check_corpus(spec)
    missing_member = CorpusConfig(tsv=str(tmp_path / "x.zip"), member="deu.txt")
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as z:
        z.writestr("other.txt", "a\tb\n")
    with pytest.raises(corpus.CorpusError, match="deu.txt"):
        corpus.check_corpus(corpus.CorpusSpec("train", missing_member))


# --- malformed files: one CorpusError naming the file and the cause, or a counted reject ---


def _check(tmp_path, source: bytes, target: bytes = None, split="train"):
    (tmp_path / "s").write_bytes(source)
    (tmp_path / "t").write_bytes(source if target is None else target)
    spec = corpus.CorpusSpec(split, CorpusConfig(source=str(tmp_path / "s"),
                                                 target=str(tmp_path / "t")))
    return corpus.check_corpus(spec)


def test_a_truncated_or_bit_flipped_gzip_is_a_corpus_error(tmp_path):
    blob = gzip.compress(b"".join(b"line %d of a corpus\n" % i for i in range(5000)))
    deflate, crc = bytearray(blob), bytearray(blob)
    deflate[12] ^= 0xFF  # the first block's code lengths
    crc[len(blob) // 2] ^= 0x10  # decodes, to the wrong bytes
    for name, damaged, cause in (
            ("cut.gz", blob[:len(blob) // 2], "EOFError: Compressed file ended"),
            ("deflate.gz", bytes(deflate), "zlib.error: Error -3 while decompressing"),
            ("crc.gz", bytes(crc), "BadGzipFile: CRC check failed"),
            ("header.gz", b"\x1f\x8b\x08" + b"\x00" * 20, "")):
        path = tmp_path / name
        path.write_bytes(damaged)
        spec = corpus.CorpusSpec("train", CorpusConfig(source=str(path), target=str(path)))
        with pytest.raises(corpus.CorpusError,
                           match=f"data.train.source: cannot read .*{name}: {cause}"):
            corpus.check_corpus(spec)


def test_a_damaged_zip_is_a_corpus_error(tmp_path):
    archive = tmp_path / "deu-eng.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("deu.txt", "".join(f"Hi {i}.\tHallo {i}!\n" for i in range(2000)))
    blob = archive.read_bytes()
    for name, damaged in (("cut.zip", blob[:len(blob) // 2]), ("junk.zip", b"PK" + blob[40:])):
        (tmp_path / name).write_bytes(damaged)
        spec = corpus.CorpusSpec("train", CorpusConfig(tsv=str(tmp_path / name), member="deu.txt"))
        with pytest.raises(corpus.CorpusError, match=f"data.train: cannot read .*{name}"):
            corpus.check_corpus(spec)


def test_cr_only_line_endings_are_a_corpus_error_and_crlf_is_not(tmp_path):
    with pytest.raises(corpus.CorpusError, match=r"data.test2016.source: .*s has CR-only "
                                                 r"line endings \(3 CRs, 0 newlines\)"):
        _check(tmp_path, b"A dog.\rA cat.\rA cow.\r", split="test2016")
    assert _check(tmp_path, b"A dog.\r\nA cat.\r\nA stray\rCR.\r\n") == 3


@pytest.mark.parametrize("text, encoding", [
    ("A dog runs.\nEin Hund läuft.\n", "utf-16"),  # with a byte-order mark
    ("A dog runs.\nEin Hund läuft.\n", "utf-16-le"),  # without: NUL bytes
    ("A dog runs.\n", "utf-32"),
])
def test_utf16_and_utf32_files_are_a_corpus_error(tmp_path, text, encoding):
    with pytest.raises(corpus.CorpusError, match=r"data.train.source: .* looks like UTF-"):
        _check(tmp_path, text.encode(encoding))


def test_an_empty_file_is_a_corpus_error(tmp_path):
    with pytest.raises(corpus.CorpusError, match=r"data.dev: .*s is empty"):
        _check(tmp_path, b"", split="dev")


def test_latin1_lines_are_rejected_as_invalid_utf8(tmp_path):
    spec = corpus.CorpusSpec("train", CorpusConfig(
        source=_write(tmp_path / "s", [b"Stra\xdfe", b"Hund"]),
        target=_write(tmp_path / "t", [b"street", b"dog"])))
    assert corpus.check_corpus(spec) == 2
    results = [corpus.clean_pair(raw, PREPARE) for raw in corpus.read_pairs(spec)]
    assert results[0] == corpus.Reject("train:000000", "train", "invalid_utf8",
                                       "Stra\\xdfe", "street")
    assert isinstance(results[1], corpus.Pair)


def test_an_oversized_line_is_rejected_with_its_start_and_the_next_lines_read(tmp_path):
    long = b"x" * 5000
    spec = corpus.CorpusSpec("train", CorpusConfig(
        source=_write(tmp_path / "s.gz", [b"a", long, b"c" * 100 + b"\r", b"d"]),
        target=_write(tmp_path / "t", [b"A", b"B", b"C", long + b"\r"])), max_line_bytes=100)
    assert corpus.check_corpus(spec) == 4
    raws = list(corpus.read_pairs(spec))
    assert [r.reason for r in raws] == [None, "oversized", None, "oversized"]
    assert raws[1].source == long[:corpus.SHOWN_BYTES] and raws[2].source == b"c" * 100
    reject = corpus.clean_pair(raws[3], PREPARE)
    assert (reject.id, reject.reason, reject.source) == ("train:000003", "oversized", "d")


def test_a_50mb_line_is_read_under_a_memory_cap(tmp_path):
    """A line with no newline is never held whole: reading stays far below its size."""
    import tracemalloc

    path = tmp_path / "one-line.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        for _ in range(50):
            f.write(b"x" * (1 << 20))
        f.write(b"\nshort\n")
    tracemalloc.start()
    lines = list(corpus.read_lines(str(path), max_bytes=1 << 16))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [(len(line), oversized) for line, oversized in lines] == [
        (corpus.SHOWN_BYTES, True), (5, False)]
    assert peak < 8 << 20  # a few 1 MiB blocks, not the 50 MiB line


def test_relative_and_env_var_locations_are_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PADIR_TEST_ROOT", str(tmp_path))
    _write(tmp_path / "s.gz", [b"a"])
    _write(tmp_path / "t", [b"b"])
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as z:
        z.writestr("deu.txt", "a\tb\n")
    for config in (CorpusConfig(source="s.gz", target="${PADIR_TEST_ROOT}/t"),
                   CorpusConfig(tsv="x.zip", member="deu.txt")):
        spec = corpus.CorpusSpec("train", config)
        assert corpus.check_corpus(spec) == 1
        assert [(r.source, r.target) for r in corpus.read_pairs(spec)] == [(b"a", b"b")]


# --- splits ----------------------------------------------------------------------------


def _data(**kwargs) -> DataConfig:
    return DataConfig(source_lang="en", target_lang="de", train=CorpusConfig(tsv="x.tsv"),
                      **kwargs)


def test_output_splits_and_specs():
    carved = _data()
    assert corpus.output_splits(carved) == ("train", "dev", "test")
    given = _data(dev=CorpusConfig(tsv="d.tsv"), max_train_pairs=10,
                  test=(config_lib.TestSetConfig("test2016", CorpusConfig(tsv="t.tsv")),))
    assert corpus.output_splits(given) == ("train", "dev", "test2016")
    specs = corpus.corpus_specs(given, PrepareConfig(max_line_bytes=99))
    assert [(s.split, s.limit, s.max_line_bytes) for s in specs] == [
        ("train", 10, 99), ("dev", None, 99), ("test2016", None, 99)]


def test_carve_split_is_deterministic_and_roughly_proportional():
    data = _data(carve_dev_fraction=0.1, carve_test_fraction=0.2)
    sources = [f"Sentence number {i}." for i in range(5000)]
    first = [corpus.carve_split(s, seed=0, data=data) for s in sources]
    assert first == [corpus.carve_split(s, seed=0, data=data) for s in sources]
    shares = {split: first.count(split) / len(first) for split in ("train", "dev", "test")}
    assert shares["test"] == pytest.approx(0.2, abs=0.03)
    assert shares["dev"] == pytest.approx(0.1, abs=0.03)
    other_seed = [corpus.carve_split(s, seed=1, data=data) for s in sources]
    assert other_seed != first


def test_carve_split_only_carves_what_is_not_given():
    sources = [f"s{i}" for i in range(2000)]
    carve_both = _data(carve_dev_fraction=0.2, carve_test_fraction=0.2)
    dev_given = _data(carve_dev_fraction=0.2, carve_test_fraction=0.2,
                      dev=CorpusConfig(tsv="d.tsv"))
    both = [corpus.carve_split(s, seed=3, data=carve_both) for s in sources]
    test_only = [corpus.carve_split(s, seed=3, data=dev_given) for s in sources]
    assert "dev" not in test_only
    # The bands are fixed: the carved test split is the same whether or not dev is carved.
    assert [s == "test" for s in both] == [s == "test" for s in test_only]


def test_output_split_keeps_translations_of_one_source_together():
    data = _data(carve_dev_fraction=0.3, carve_test_fraction=0.3)
    for i in range(200):
        source = f"English sentence {i}."
        splits = {corpus.output_split(corpus.Pair(f"train:{j:06d}", "train", source, f"de {j}"),
                                      seed=0, data=data) for j in range(3)}
        assert len(splits) == 1
    given = corpus.Pair("test2016:000000", "test2016", "x", "y")
    assert corpus.output_split(given, seed=0, data=data) == "test2016"


def test_carving_by_target_keeps_the_sources_of_one_target_together():
    # Tatoeba de->en: several German sources translate one English target.
    data = _data(carve_dev_fraction=0.3, carve_test_fraction=0.3, carve_by="target")
    by_source = _data(carve_dev_fraction=0.3, carve_test_fraction=0.3)
    straddled = 0
    for i in range(200):
        pairs = [corpus.Pair(f"train:{j:06d}", "train", f"Deutscher Satz {i}.{j}",
                             f"English sentence {i}.") for j in range(3)]
        assert len({corpus.output_split(p, seed=0, data=data) for p in pairs}) == 1
        straddled += len({corpus.output_split(p, seed=0, data=by_source) for p in pairs}) > 1
        assert corpus.carve_key(pairs[0], data) == f"English sentence {i}."
    assert straddled > 50  # carving by source would split most of them


def test_carve_by_is_validated_when_built_in_code():
    with pytest.raises(config_lib.ConfigError, match="data.carve_by"):
        _data(carve_by="english")


# --- the artifact readers --------------------------------------------------------------


def _write_shards(fs, root: str) -> None:
    shards = {
        "train-00000-of-00002.jsonl": ["train:000010", "train:000002"],
        "train-00001-of-00002.jsonl": ["train:1000000", "train:000005"],
        "test-00000-of-00001.jsonl": ["train:000001"],
        "test2016-00000-of-00001.jsonl": ["test2016:000000"],
    }
    for name, ids in shards.items():
        with fs.open(f"{root}/{name}", "wb") as f:
            for pair_id in ids:
                # U+2028 in the text must not break the line.
                record = {"id": pair_id, "source": "a\u2028b", "target": "t"}
                f.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")


@pytest.mark.parametrize("scheme", ["local", "memory"])
def test_read_split_is_sorted_by_id_and_matches_only_its_split(tmp_path, scheme):
    root = str(tmp_path) if scheme == "local" else f"memory://{tmp_path.name}/prepare"
    fs, _ = fsspec.core.url_to_fs(root)
    if scheme == "memory":
        fs.makedirs(root, exist_ok=True)
    _write_shards(fs, root)
    assert corpus.split_pattern(root, "train") == f"{root}/train-?????-of-?????.jsonl"
    assert [r["id"] for r in corpus.read_split(root, "train")] == [
        "train:000002", "train:000005", "train:000010", "train:1000000"]
    assert [r["id"] for r in corpus.read_split(root, "test")] == ["train:000001"]
    assert next(corpus.read_split(root, "test2016"))["source"] == "a\u2028b"
    with pytest.raises(FileNotFoundError, match="dev"):
        list(corpus.read_split(root, "dev"))


def test_in_sample_is_a_deterministic_hash_sample_of_the_given_fraction():
    ids = [corpus.make_id("train", n) for n in range(20_000)]
    assert all(corpus.in_sample(i, 1.0) for i in ids)
    sample = [i for i in ids if corpus.in_sample(i, 0.25)]
    assert sample == [i for i in ids if corpus.in_sample(i, 0.25)]  # the same on every run
    assert abs(len(sample) / len(ids) - 0.25) < 0.01
    # A smaller fraction is a subset of a larger one: slices of one corpus are nested.
    assert set(i for i in ids if corpus.in_sample(i, 0.1)) <= set(sample)


# --- an http(s) corpus that the server refuses: one line, no secret ------------------------


class _Refusing(http.server.BaseHTTPRequestHandler):
    """`/<head>/<status>/...`: a HEAD answered 200 (`headok`, as an expired signed URL still
    answers it) or `status`, then every GET answered `status`."""

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        head, status = self.path.split("/")[1:3]
        self.send_response(200 if head == "headok" else int(status))
        self.send_header("Content-Length", "100")
        self.end_headers()

    def do_GET(self):
        self.send_response(int(self.path.split("/")[2]))
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"nope\n")


@pytest.mark.slow  # eight `padir stage prepare` interpreters
def test_a_refused_corpus_url_is_one_line_without_its_secrets(tmp_path):
    """`padir stage prepare` on a corpus URL with a password and a `${TOKEN}` query whose
    GET is refused (401, 403, 404, 500), after a HEAD that succeeded or failed: exit status
    2, one line naming the file and the answer, the URL's secrets redacted, no traceback."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, PADIR_TEST_TOKEN="s3cr3t-t0ken")
    base = f"http://127.0.0.1:{server.server_address[1]}"
    runs = {}
    try:
        for head in ("headok", "headfail"):
            for status in (401, 403, 404, 500):
                url = f"{base}/{head}/{status}/train"
                config = tmp_path / f"{head}-{status}.yaml"
                config.write_text(
                    f"workdir: {tmp_path / 'work'}\n"
                    "data: {source_lang: en, target_lang: de, train: {source: "
                    f"'http://user:hunter2@{url[7:]}.en?token=${{PADIR_TEST_TOKEN}}', "
                    f"target: '{url}.de'}}}}\n")
                runs[head, status] = subprocess.Popen(
                    [sys.executable, "-m", "flows.cli", "stage", "prepare", str(config)],
                    cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True)
        ended = {case: run.communicate(timeout=300) for case, run in runs.items()}
    finally:
        server.shutdown()
    for (head, status), (out, err) in ended.items():
        cause = "no such file" if status == 404 else \
            f"HTTP {status} {http.client.responses[status]}"
        assert (runs[head, status].returncode, out, err) == (2, "", (
            f"padir: error: data.train.source: cannot read http://***@{base[7:]}/{head}/"
            f"{status}/train.en?token=***: {cause}\n")), (head, status)
