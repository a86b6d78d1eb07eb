"""benchmarks/scaling.py: the overlay of one size and the table of the cost curve."""

import os

import yaml

from benchmarks import scaling
from components import artifacts, dag
from components import config as config_lib


def test_a_size_is_a_hashed_sample_of_the_base_config(tmp_path):
    path = scaling.size_overlay(str(tmp_path / "s.yaml"), "configs/tatoeba_de_en.yaml",
                                str(tmp_path / "work"), 0.25)
    overlay = yaml.safe_load(open(path))
    assert overlay["data"] == {"train_sample_fraction": 0.25}
    assert overlay["include"].endswith("configs/tatoeba_de_en.yaml")
    assert overlay["teacher"] == scaling.TINY_TEACHER


def test_the_table_gives_per_pair_and_marginal_costs():
    def runs(pairs, seconds, cpu, rss):
        return [scaling.StageRun(stage, pairs, seconds + 5, cpu, seconds, rss)
                for stage in scaling.STAGES]

    results = {"10,000": (runs(10_000, 20.0, 30.0, 100), 12.5),
               "40,000": (runs(40_000, 50.0, 90.0, 110), 12.9)}
    lines = scaling.table(results).splitlines()
    assert lines[0].startswith("| stage | size | pairs | words/pair |")
    # prepare at 40k: 50 s / 40k pairs = 1.25 s per 1k; marginal (50 - 20) / 30k = 1.0;
    # CPU 90 s / 40k = 2.25 s per 1k, marginal (90 - 30) / 30k = 2.0.
    assert ("| prepare | 40,000 | 40,000 | 12.9 | 55.0 | 50.0 | 1.250 | 1.000 | 2.250 | 2.000 "
            "| 110 |") in lines
    assert "| prepare | 10,000 | 10,000 | 12.5 | 25.0 | 20.0 | 2.000 | - | 3.000 | - | 100 |" \
        in lines
    assert not any(line.startswith("| teacher |") for line in lines)  # set-up, not measured


def test_a_later_size_distills_with_the_first_sizes_teacher(tmp_path, monkeypatch):
    monkeypatch.setenv("PADIR_DATA_ROOT", str(tmp_path))  # paths are resolved, not read

    def size_config(fraction):
        path = scaling.size_overlay(str(tmp_path / f"{fraction}.yaml"),
                                    "configs/tatoeba_de_en.yaml", str(tmp_path / "work"), fraction)
        return config_lib.load(path)

    first, later = size_config(0.1), size_config(0.5)
    key = dag.stage_key(first, "teacher")
    with artifacts.write(first.workdir, "teacher", key, config={"teacher": {"steps": 600}},
                         inputs={"vocab": "/work/vocab/abc"}) as out:
        os.makedirs(out.path("checkpoints", "600"))
        open(out.path("checkpoints", "600", "params"), "w").write("weights")
        out.metrics["dev"] = {"bleu": 1.5}
    teacher = artifacts.read(artifacts.location(first.workdir, "teacher", key))

    scaling.publish_teacher(later, teacher)
    scaling.publish_teacher(later, teacher)  # a rerun reuses it
    published = artifacts.read(dag.output_uri(later, "teacher"))
    assert published.key == dag.stage_key(later, "teacher") != key
    assert published.manifest["inputs"] == {"vocab": "/work/vocab/abc"}  # its own tokenizer
    assert published.manifest["metrics"]["dev"] == {"bleu": 1.5}
    assert published.manifest["metrics"]["published_from"] == teacher.uri
    assert open(published.path("checkpoints", "600", "params")).read() == "weights"
