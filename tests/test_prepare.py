"""pipelines/prepare.py: the transforms under TestPipeline, and `run` on tiny crafted corpora."""

import gzip
import pathlib
import re
import zipfile

import apache_beam as beam
import pytest
import yaml
from apache_beam.testing import test_pipeline
from apache_beam.testing.util import assert_that, equal_to

from components import artifacts, corpus, dag
from components import config as config_lib
from pipelines import prepare


def _write(path, lines: list[bytes]) -> str:
    blob = b"".join(line + b"\n" for line in lines)
    path.write_bytes(gzip.compress(blob) if path.suffix == ".gz" else blob)
    return str(path)


def _config(tmp_path, data: dict, **sections) -> config_lib.Config:
    return config_lib.from_dict(
        config_lib.Config, {"workdir": str(tmp_path / "work"),
                            "data": {"source_lang": "en", "target_lang": "de", **data},
                            **sections})


def _pipeline() -> test_pipeline.TestPipeline:
    # Never the default runner (Prism): it downloads a binary, and this machine is offline.
    return test_pipeline.TestPipeline(runner="FnApiRunner")


# --- transforms ------------------------------------------------------------------------


def test_clean_pairs_routes_rejects_to_the_tagged_output():
    raws = [
        corpus.RawPair("train:000000", "train", b" a \t b ", b"c"),
        corpus.RawPair("train:000001", "train", b"\xff", b"c"),
        corpus.RawPair("dev:000000", "dev", b"x", b"\x00"),
    ]
    with _pipeline() as p:
        outputs = (p | beam.Create(raws)
                   | beam.ParDo(prepare.CleanPairs(config_lib.PrepareConfig()))
                   .with_outputs(corpus.REJECTS, main="pairs"))
        assert_that(outputs.pairs, equal_to([corpus.Pair("train:000000", "train", "a b", "c")]),
                    label="CheckPairs")
        assert_that(outputs[corpus.REJECTS] | beam.Map(lambda r: (r.id, r.reason)),
                    equal_to([("train:000001", "invalid_utf8"), ("dev:000000", "empty")]),
                    label="CheckRejects")


def test_drop_duplicates_keeps_the_lowest_id():
    pairs = [corpus.Pair(corpus.make_id("train", n), "train", text, "t")
             for n, text in [(12, "a"), (3, "a"), (7, "b"), (1_000_000, "a")]]
    with _pipeline() as p:
        outputs = p | beam.Create(pairs) | prepare.DropDuplicates()
        assert_that(outputs.pairs | beam.Map(lambda pair: pair.id),
                    equal_to(["train:000003", "train:000007"]), label="CheckKept")
        assert_that(outputs[corpus.REJECTS] | beam.Map(lambda r: (r.id, r.reason)),
                    equal_to([("train:000012", "duplicate"), ("train:1000000", "duplicate")]),
                    label="CheckDuplicates")


# --- run: every reason, exact counts ---------------------------------------------------


@pytest.fixture
def crafted(tmp_path):
    """Train (.gz) with one pair per reason, a plain dev set and a test set."""
    train = [  # (source, target), line by line
        (b"Hello world.", b"Hallo Welt."),  # 0 kept
        (b"Caf\xe9 au lait", b"Milchkaffee"),  # 1 invalid_utf8 (Latin-1 byte)
        (b" \t ", b"Leer"),  # 2 empty
        (b"x" * 2000, b"lang"),  # 3 too_long
        (b"A short one here.", b"Ein sehr " * 10),  # 4 length_ratio (17 vs 89 chars)
        (b"Hello  world.", b"Hallo Welt.\t"),  # 5 duplicate of 0 after normalisation
        ("Hi\u2028".encode(), b"Hallo, wie geht es dir heute Abend?"),  # 6 kept: "Hi" < 10
        ("Cafe\u0301".encode(), "Kaffee\u200b\x85".encode()),  # 7 kept, normalised
        ("Caf\u00e9".encode(), b"Kaffee"),  # 8 duplicate of 7 (NFC)
        (b"y" * 100_000, b"z"),  # 9 oversized: over prepare.max_line_bytes
    ]
    dev = [
        (b"Good morning.", b"Guten Morgen."),
        (b"", b"Nichts"),  # empty
        (b"x" * 2000, b"y"),  # kept: no length filters on dev
        (b"Hello world.", b"Hallo Welt."),  # kept: not de-duplicated against train
    ]
    test = [(b"One.", b"Eins."), (b"One.", b"Eins.")]
    files = {}
    for name, pairs, ext in [("train", train, ".gz"), ("dev", dev, ""), ("test", test, ".gz")]:
        files[name] = {
            "source": _write(tmp_path / f"{name}.en{ext}", [s for s, _ in pairs]),
            "target": _write(tmp_path / f"{name}.de{ext}", [t for _, t in pairs]),
        }
    data = {"train": files["train"], "dev": files["dev"],
            "test": [{"name": "test2016", "corpus": files["test"]}]}
    # 5 of the 10 train pairs are rejected for bad input: exactly the limit passes.
    return _config(tmp_path, data, prepare={"num_shards": 2, "max_chars": 1000,
                                            "max_line_bytes": 50_000})


def test_run_counts_every_reason_exactly(crafted):
    artifact = prepare.run(crafted)
    counts = artifact.manifest["counts"]
    assert counts == {
        "read.train": 10, "read.dev": 4, "read.test2016": 2,
        "kept.train": 3, "kept.dev": 3, "kept.test2016": 2,
        "rejected.malformed": 0, "rejected.oversized": 1, "rejected.invalid_utf8": 1,
        "rejected.empty": 2, "rejected.too_long": 1, "rejected.length_ratio": 1,
        "rejected.duplicate": 2, "rejected_by_split.train.oversized": 1,
        "rejected_by_split.train.invalid_utf8": 1,
        "rejected_by_split.train.empty": 1, "rejected_by_split.dev.empty": 1,
        "rejected_by_split.train.too_long": 1, "rejected_by_split.train.length_ratio": 1,
        "rejected_by_split.train.duplicate": 2,
    }
    assert artifact.manifest["metrics"]["split_sizes"] == {"train": 3, "dev": 3, "test2016": 2}
    assert artifact.manifest["stage"] == "prepare"
    assert artifacts.require(crafted.workdir, "prepare", artifact.key).uri == artifact.uri

    assert list(corpus.read_split(artifact.uri, "train")) == [
        {"id": "train:000000", "source": "Hello world.", "target": "Hallo Welt."},
        {"id": "train:000006", "source": "Hi", "target": "Hallo, wie geht es dir heute Abend?"},
        {"id": "train:000007", "source": "Caf\u00e9", "target": "Kaffee"},
    ]
    assert [r["id"] for r in corpus.read_split(artifact.uri, "dev")] == [
        "dev:000000", "dev:000002", "dev:000003"]
    assert [r["id"] for r in corpus.read_split(artifact.uri, "test2016")] == [
        "test2016:000000", "test2016:000001"]

    rejects = {r["id"]: r for r in corpus.read_split(artifact.uri, "rejects")}
    assert {i: r["reason"] for i, r in rejects.items()} == {
        "train:000001": "invalid_utf8", "train:000002": "empty", "train:000003": "too_long",
        "train:000004": "length_ratio", "train:000005": "duplicate",
        "train:000008": "duplicate", "train:000009": "oversized", "dev:000001": "empty"}
    assert rejects["train:000001"]["source"] == "Caf\\xe9 au lait"
    assert len(rejects["train:000003"]["source"]) == 2000
    assert rejects["train:000009"]["source"] == "y" * corpus.SHOWN_BYTES

    names = sorted(path.name for path in pathlib.Path(artifact.uri).iterdir())
    assert names == ["config.yaml", "dev-00000-of-00001.jsonl", "manifest.json",
                     "rejects-00000-of-00001.jsonl", "test2016-00000-of-00001.jsonl",
                     "train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl"]


def test_mismatched_files_fail_before_anything_is_written(tmp_path):
    source = _write(tmp_path / "train.en.gz", [b"a", b"b", b"c"])
    target = _write(tmp_path / "train.de.gz", [b"a", b"b"])
    config = _config(tmp_path, {"train": {"source": source, "target": target}})
    with pytest.raises(corpus.CorpusError) as error:
        prepare.run(config)
    assert source in str(error.value) and target in str(error.value)
    assert "3 lines" in str(error.value) and "2 lines" in str(error.value)
    assert not (tmp_path / "work").exists()


def _published(config) -> list[str]:
    """What a run left under <workdir>/prepare: never an artifact or a temporary directory."""
    return sorted(p.name for p in pathlib.Path(config.workdir, "prepare").iterdir())


def test_a_latin1_train_set_fails_with_its_rejects_kept_and_nothing_published(tmp_path):
    german = [b"Stra\xdfe", b"M\xfcnchen", b"Gr\xfc\xdfe", b"Hund"]  # Latin-1
    config = _config(tmp_path, {"train": {"source": _write(tmp_path / "de", german),
                                          "target": _write(tmp_path / "en", german)}})
    with pytest.raises(corpus.CorpusError) as error:
        prepare.run(config)
    rejects_uri = prepare.failed_rejects_uri(config)
    assert str(error.value) == (
        "data.train: 3 of 4 pairs rejected (75%, prepare.max_reject_fraction is 0.5): "
        f"invalid_utf8 3; is the file UTF-8?; nothing published, the rejects are in "
        f"{rejects_uri}")
    assert _published(config) == [pathlib.Path(rejects_uri).name]
    rejects = pathlib.Path(rejects_uri).read_text().splitlines()
    assert len(rejects) == 3 and '"reason": "invalid_utf8"' in rejects[0]


@pytest.mark.parametrize("test_lines, message", [
    ([b"One.", b"\xff\xfe"], "data.test2016: 1 of 2 lines unusable (invalid_utf8 1)"),
    ([b"One.", b"x" * 200], "data.test2016: 1 of 2 lines unusable (oversized 1)"),
    ([b"", b" "], "data.test2016: none of its 2 lines is usable (empty 2)"),
])
def test_a_broken_test_set_fails_and_nothing_is_published(tmp_path, test_lines, message):
    train = _write(tmp_path / "train", [b"Hello.", b"Hi."])
    test = _write(tmp_path / "test", test_lines)
    config = _config(tmp_path, {"train": {"source": train, "target": train},
                                "test": [{"name": "test2016",
                                          "corpus": {"source": test, "target": test}}]},
                     prepare={"max_line_bytes": 100})
    with pytest.raises(corpus.CorpusError, match=re.escape(message)):
        prepare.run(config)
    assert _published(config) == [pathlib.Path(prepare.failed_rejects_uri(config)).name]


@pytest.mark.parametrize("source, message", [
    (b"", "data.train: {source} is empty"),
    (b"a\rb\rc\r", "data.train.source: {source} has CR-only line endings"),
    (gzip.compress(b"a\nb\n", mtime=0)[:-12], "data.train.source: cannot read {source}: EOFError"),
])
def test_a_structural_problem_fails_before_anything_is_written(tmp_path, source, message):
    path = tmp_path / ("train.gz" if source.startswith(b"\x1f") else "train")
    path.write_bytes(source)
    config = _config(tmp_path, {"train": {"source": str(path), "target": str(path)}})
    with pytest.raises(corpus.CorpusError, match=re.escape(message.format(source=path))):
        prepare.run(config)
    assert not (tmp_path / "work").exists()


def test_main_reports_bad_input_in_one_line(tmp_path, capsys):
    config_path = tmp_path / "c.yaml"
    config_path.write_text(f"workdir: {tmp_path / 'work'}\n"
                           "data: {source_lang: en, target_lang: de, train: {tsv: nope.tsv}}\n")
    assert prepare.main(["--config", str(config_path)]) == 2
    assert capsys.readouterr().err == "prepare: error: data.train: cannot read nope.tsv: " \
                                      "no such file\n"
    config_path.write_text("data: [\n")
    assert prepare.main(["--config", str(config_path)]) == 2
    assert capsys.readouterr().err.startswith(f"prepare: error: {config_path}:2:1: invalid YAML")


def test_interrupted_run_publishes_nothing(crafted, monkeypatch):
    clean_pair = corpus.clean_pair

    def fail_mid_way(raw, config):
        if raw.id == "train:000004":
            raise RuntimeError("worker died")
        return clean_pair(raw, config)

    monkeypatch.setattr(corpus, "clean_pair", fail_mid_way)
    with pytest.raises(Exception, match="worker died"):
        prepare.run(crafted)
    # Neither a final nor a temporary directory is left, so nothing can be read.
    assert list(pathlib.Path(crafted.workdir, "prepare").iterdir()) == []
    with pytest.raises(artifacts.IncompleteArtifactError, match="prepare"):
        artifacts.require(crafted.workdir, "prepare", dag.stage_key(crafted, "prepare"))


# --- run: TSV inside a zip, carved dev/test, the command line --------------------------


def _zipped_tsv_config(tmp_path, lines: list[str], seed: int = 0, **data) -> pathlib.Path:
    """A config whose train corpus is `lines` (English<TAB>German) in a zip, with `data`
    settings (no dev or test set: both are carved)."""
    archive = tmp_path / "deu-eng.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("deu.txt", "\n".join(lines) + "\n")
    config_path = tmp_path / "tatoeba.yaml"
    config_path.write_text(yaml.safe_dump({
        "workdir": str(tmp_path / "work"), "seed": seed,
        "data": {"source_lang": "en", "target_lang": "de",
                 "train": {"tsv": str(archive), "member": "deu.txt"}, **data},
    }))
    return config_path


def test_main_on_tsv_in_zip_carves_by_source(tmp_path, capsys):
    lines = []
    for i in range(60):  # 1 to 3 German translations per English sentence
        lines += [f"Sentence {i}.\tSatz {i}, Variante {j}." for j in range(1 + i % 3)]
    lines.insert(5, "a\tstray\ttab")  # malformed
    lines.append("Not read.\tNicht gelesen.")  # beyond max_train_pairs
    config_path = _zipped_tsv_config(tmp_path, lines, seed=7, carve_dev_fraction=0.25,
                                     carve_test_fraction=0.25, max_train_pairs=len(lines) - 1)

    assert prepare.main(["--config", str(config_path), "--set", "prepare.num_shards=3"]) == 0
    stage, uri = capsys.readouterr().out.strip().splitlines()[-1].split(": ")  # "prepare: URI"
    assert stage == "prepare"
    counts = artifacts.read(uri).manifest["counts"]
    assert counts["read.train"] == len(lines) - 1
    assert counts["rejected.malformed"] == 1
    assert sum(counts[f"kept.{s}"] for s in ("train", "dev", "test")) == len(lines) - 2

    config = config_lib.load(str(config_path))
    where = {}
    for split in ("train", "dev", "test"):
        records = list(corpus.read_split(uri, split))
        assert records, split  # the fractions leave every split non-empty
        for record in records:
            assert record["id"].startswith("train:")
            # Deterministic: the split is the one the seed and the source sentence give.
            assert corpus.carve_split(record["source"], seed=7, data=config.data) == split
            where.setdefault(record["source"], set()).add(split)
    assert len(where) == 60
    assert all(len(splits) == 1 for splits in where.values())
    assert "Not read." not in where
    rejects = list(corpus.read_split(uri, "rejects"))
    assert rejects == [{"id": "train:000005", "split": "train", "reason": "malformed",
                        "source": "a\tstray\ttab", "target": ""}]


def test_train_sample_fraction_keeps_a_hashed_sample_spread_over_the_file(tmp_path, capsys):
    # Sorted short to long, as Tatoeba is: the first N lines would be the shortest only.
    lines = [" ".join(["word"] * (1 + i // 20)) + f" {i}.\tWort {i}." for i in range(200)]
    config_path = _zipped_tsv_config(tmp_path, lines, carve_dev_fraction=0.1,
                                     carve_test_fraction=0.1, train_sample_fraction=0.3)

    assert prepare.main(["--config", str(config_path), "--set", "prepare.num_shards=1"]) == 0
    uri = capsys.readouterr().out.strip().splitlines()[-1].split(": ")[1]
    counts = artifacts.read(uri).manifest["counts"]
    expected = {corpus.make_id("train", n) for n in range(200)
                if corpus.in_sample(corpus.make_id("train", n), 0.3)}
    assert counts["read.train"] == len(expected)
    assert counts["read.train"] + counts["not_sampled.train"] == 200  # every line accounted
    kept = {record["id"] for split in ("train", "dev", "test")
            for record in corpus.read_split(uri, split)}
    assert kept == expected
    lines_kept = sorted(int(pair_id.split(":")[1]) for pair_id in kept)
    assert lines_kept[0] < 50 and lines_kept[-1] >= 150  # from the whole file, not its head
