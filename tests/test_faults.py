"""What killed stages leave: `padir status` lists it, `padir gc` removes it and nothing else
(a fake workdir, no training; benchmarks/faults.py kills real stages)."""

import os

import pytest

from components import artifacts, dag
from components import config as config_lib
from flows import cli


@pytest.fixture
def config_path(tmp_path):
    config = config_lib.from_dict(config_lib.Config, {
        "workdir": str(tmp_path / "work"),
        "data": {"source_lang": "en", "target_lang": "de",
                 "train": {"source": "a.en", "target": "a.de"}}})
    path = tmp_path / "c.yaml"
    path.write_text(config_lib.dump(config))
    return config, str(path)


def _touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("x")


def test_status_lists_leftovers_and_gc_removes_them_and_nothing_else(config_path, capsys):
    config, path = config_path
    key = {stage: dag.stage_key(config, stage) for stage in dag.STAGES}
    work = config.workdir
    with artifacts.write(work, "prepare", key["prepare"], config={}, inputs={}) as out:
        _touch(out.path("train-00000-of-00001.jsonl"))
    kept = [artifacts.join(work, "prepare", key["prepare"], "train-00000-of-00001.jsonl"),
            artifacts.join(work, "prepare", f"failed-{key['prepare']}-rejects.jsonl")]
    _touch(kept[1])
    left = {  # what kills leave at each point of a run
        f"prepare/.tmp-{key['prepare']}-1234abcd": "temporary output",
        f"teacher/.partial-{key['teacher']}": "training work a rerun resumes from",
        f"vocab/{key['vocab']}": "without a readable manifest",
        f"vocab/.lease-{key['vocab']}": "lease file",
        f"encode/{key['encode']}.old-deadbeef": "replaced by a publication",
    }
    for name in left:
        _touch(os.path.join(work, name, "file") if "lease" not in name
               else os.path.join(work, name))
    running = f"student/.partial-{key['student']}"
    _touch(os.path.join(work, running, "checkpoints", "3"))

    assert cli.main(["status", path]) == 0
    out = capsys.readouterr().out
    assert f"leftovers of runs that died ({len(left) + 1}; `padir gc {path}`" in out
    for name, kind in {**left, running: "resumes from"}.items():
        assert any(name in line and kind in line for line in out.splitlines()), name

    with artifacts.lease(work, "student", key["student"]):  # a training run in progress
        assert cli.main(["gc", path]) == 0
        out = capsys.readouterr().out
        assert f"{len(left)} leftovers removed, 1 keys in use kept" in out
        assert f"kept: student/{key['student']} is being written by another run" in out
        remaining = artifacts.leftovers(work, list(dag.STAGES))
        assert sorted(item.uri for item in remaining) == sorted(
            [artifacts.join(work, running), artifacts.lease_uri(work, "student", key["student"])])
    assert all(os.path.exists(p) for p in kept)
    assert artifacts.is_complete(dag.output_uri(config, "prepare"))
    assert cli.main(["gc", path]) == 0
    assert "1 leftovers removed, 0 keys in use kept" in capsys.readouterr().out
    assert artifacts.leftovers(work, list(dag.STAGES)) == []
    assert cli.main(["status", path]) == 0
    assert "leftovers of runs" not in capsys.readouterr().out
    assert all(os.path.exists(p) for p in kept)

