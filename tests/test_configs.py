"""The shipped experiment configs beyond the benchmark: Tatoeba de->en, Multi30k en->fr and
the WMT14 overlay load, validate and say what they claim (no corpus is read but a toy one)."""

import dataclasses
import zipfile

from components import config as config_lib
from components import corpus, dag


def test_tatoeba_reads_german_as_source_from_the_english_first_tsv(tmp_path, monkeypatch):
    (tmp_path / "tatoeba").mkdir()
    with zipfile.ZipFile(tmp_path / "tatoeba" / "deu-eng.zip", "w") as archive:
        archive.writestr("deu.txt", "Hi.\tHallo!\nHi.\tGrüß Gott!\n")
        archive.writestr("_about.txt", "about")
    monkeypatch.setenv("PADIR_DATA_ROOT", str(tmp_path))
    config = config_lib.load("configs/tatoeba_de_en.yaml")
    assert (config.data.source_lang, config.data.target_lang) == ("de", "en")
    spec, = corpus.corpus_specs(config.data, config.prepare)
    assert [(raw.source.decode(), raw.target.decode()) for raw in corpus.read_pairs(spec)] == [
        ("Hallo!", "Hi."), ("Grüß Gott!", "Hi.")]
    # No official split: dev and test are carved by the English sentence (the target), so
    # both German alternatives of "Hi." land in one split.
    assert config.data.dev is None and config.data.test == ()
    assert config.data.carve_by == "target"
    pairs = [corpus.Pair(f"train:{i:06d}", "train", source, "Hi.")
             for i, source in enumerate(("Hallo!", "Grüß Gott!", "Servus!"))]
    assert len({corpus.output_split(p, seed=config.seed, data=config.data) for p in pairs}) == 1


def test_multi30k_en_fr_is_the_benchmark_with_the_french_side(monkeypatch):
    monkeypatch.setenv("PADIR_DATA_ROOT", "/data")
    benchmark = config_lib.load("configs/multi30k_en_de.yaml")
    en_fr = config_lib.load("configs/multi30k_en_fr.yaml")
    corpora = [en_fr.data.train, en_fr.data.dev, *(t.corpus for t in en_fr.data.test)]
    assert all(c.source.endswith(".en.gz") and c.target.endswith(".fr.gz") for c in corpora)
    assert [t.name for t in en_fr.data.test] == ["test2016"]
    assert en_fr.data.target_lang == "fr" and en_fr.workdir != benchmark.workdir
    # Everything but the data is shared, so the two pairs differ in their data alone.
    assert dataclasses.replace(en_fr, data=benchmark.data, workdir=benchmark.workdir) == benchmark


def test_the_wmt14_overlay_is_the_tpu_model_on_dataflow_with_gcs_inputs(monkeypatch):
    monkeypatch.setenv("PADIR_DATA_ROOT", "/data")
    wmt14 = config_lib.load("configs/overlays/wmt14.yaml")
    tpu = config_lib.load("configs/overlays/tpu.yaml")
    dataflow = config_lib.load("configs/overlays/dataflow.yaml")
    corpora = [wmt14.data.train, wmt14.data.dev, *(t.corpus for t in wmt14.data.test)]
    assert all(path.startswith("gs://") for c in corpora for path in (c.source, c.target))
    assert wmt14.workdir.startswith("gs://") and wmt14.workdir not in (tpu.workdir,
                                                                      dataflow.workdir)
    assert [t.name for t in wmt14.data.test] == ["newstest2014"]
    assert wmt14.vocab.size == 32000 and wmt14.encode.bucket_boundaries[-1] == 128
    # The TPU overlay's model and mesh, widened to the longest bucket.
    assert wmt14.mesh == tpu.mesh
    for name in ("teacher", "student", "ar_student", "drafter"):
        model = wmt14.section(name).model
        assert dataclasses.replace(model, max_source_len=64, max_target_len=64) == \
            tpu.section(name).model
        assert (model.max_source_len, model.max_target_len) == (128, 128)
    # Every Dataflow flag of the Dataflow overlay (restated: a list replaces), plus workers.
    assert wmt14.runner.name == dataflow.runner.name == "DataflowRunner"
    assert set(dataflow.runner.options) < set(wmt14.runner.options)
    assert any(flag.startswith("--max_num_workers=") for flag in wmt14.runner.options)
    # The artifact keys are computable (every section validates) and differ from the TPU's.
    assert dag.stage_key(wmt14, "prepare") != dag.stage_key(tpu, "prepare")
