"""benchmarks/scaling.py: the overlay of one size and the table of the cost curve."""

import yaml

from benchmarks import scaling


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
    # CPU 90 s / 40k = 2.25 s per 1k.
    assert "| prepare | 40,000 | 40,000 | 12.9 | 55.0 | 50.0 | 1.250 | 1.000 | 2.250 | 110 |" \
        in lines
    assert "| prepare | 10,000 | 10,000 | 12.5 | 25.0 | 20.0 | 2.000 | - | 3.000 | 100 |" in lines
    assert not any(line.startswith("| teacher |") for line in lines)  # set-up, not measured
