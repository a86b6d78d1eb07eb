"""benchmarks/device_check.py on the tiny experiment: the pack holds what must travel, and the
run measures every row and probe from it alone, importing no TensorFlow, Beam or Prefect."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import device_check
from tiny_experiment import ensure, publish_untrained, tiny_config

HEAVY = ("tensorflow", "apache_beam", "prefect")
# Run in a fresh interpreter with the heavy packages made unimportable (a lazy import on
# the run path fails loudly), then list any of them that got in anyway.
RUN = """
import json, sys
for name in {heavy!r}:
    sys.modules[name] = None
sys.path.insert(0, ".")
from benchmarks import device_check
device_check.main(["--run", {pack!r}, "--latency-sentences", "3", "--batch-size", "4",
                   "--train-steps", "2", "--json", {out!r}])
loaded = sorted(n for n in sys.modules if n.split(".")[0] in {heavy!r} and sys.modules[n])
print("HEAVY", json.dumps(loaded))
"""


@pytest.fixture(scope="module")
def pack(tiny_workdir, tmp_path_factory):
    # The student on the original pairs: no distillation run just to pack its batches.
    config = tiny_config(tiny_workdir, "distill.enabled=false")
    ensure(config, "prepare", "vocab", "encode")
    for stage in ("teacher", "student"):
        publish_untrained(config, stage)
    directory = str(tmp_path_factory.mktemp("pack"))
    sizes = device_check.pack(directory, config, train_batches=2, max_sentences=6)
    return directory, sizes


def test_pack_holds_params_vocabulary_test_set_and_batches_under_the_limit(pack):
    directory, sizes = pack
    assert set(sizes) == {"models.json", "spm.model", "test.jsonl", "teacher_params.npz",
                          "student_params.npz", "teacher_batches.npz", "student_batches.npz"}
    assert sum(sizes.values()) < device_check.PACK_LIMIT_BYTES
    with open(os.path.join(directory, "test.jsonl")) as f:
        pairs = [json.loads(line) for line in f]
    assert len(pairs) == 6 and {"id", "source", "target", "split"} <= set(pairs[0])
    about, loaded = device_check.load_pack(directory)
    assert loaded["teacher"].model.config.d_model == 32 and about["num_stages"] == 2
    import numpy as np

    with np.load(os.path.join(directory, "student_batches.npz")) as batches:
        assert len(batches.files) == 4 and batches["target_0000"].dtype == np.int16


@pytest.mark.slow  # about 2-4 minutes on 2 cores: every method and probe compiles
def test_run_measures_every_row_and_probe_without_tensorflow_beam_or_prefect(pack, tmp_path):
    directory, _ = pack
    out = str(tmp_path / "device.json")
    script = RUN.format(heavy=HEAVY, pack=directory, out=out)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "HEAVY []"
    with open(out) as f:
        figures = json.load(f)
    [entry] = figures["report"]["test_sets"].values()
    assert [m["method"] for m in entry["methods"]] == [m.name for m in device_check.METHODS]
    for method in entry["methods"]:
        assert method["sentences"] == 6 and method["latency_s"]["count"] == 3
        assert method["latency_s"]["p99"] > 0 and method["throughput"]["batch_size"] == 4
    assert [rate["name"] for rate in figures["training"]] == [
        "teacher", "student phase 1", "student phase 2"]
    assert all(rate["steps_per_s"] > 0 and rate["target_tokens_per_s"] > 0
               for rate in figures["training"])
    assert "| padir_4 |" in done.stdout and "student phase 2" in done.stdout
