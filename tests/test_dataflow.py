"""Dataflow readiness: every Beam stage's job builds for the DataflowRunner, and its graph
and DoFns serialise as a worker receives them. Nothing is submitted: `run()` is never
called and nothing reaches the network.

Each module's `build` composes its job on a `beam.Pipeline` with the options of
configs/overlays/dataflow.yaml (runner, dummy project, region, gs:// temp location, the
worker image), plus `--no_auth` and `--dry_run=True`, which keep the options' validation
off GCS. Then the pipeline is converted to its portable proto (which pickles every DoFn,
CombineFn, source and sink), every ParDo's DoFn is pickled and unpickled on its own, and
the proto is loaded back into a pipeline, here and in a fresh interpreter started outside
the repository: what a worker with the installed project can import, nothing bound to a
test module or `__main__`.

Inputs are small local files (a text source checks at construction that its files exist,
which for gs:// would need GCS); the workdir, outputs and checkpoints are gs:// URIs that
construction never touches.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import tomllib
import zipfile

import apache_beam as beam
import pytest
import sentencepiece as spm
from apache_beam.internal import pickler
from apache_beam.ml.inference.base import _RunInferenceDoFn
from apache_beam.options.pipeline_options import GoogleCloudOptions, WorkerOptions
from apache_beam.runners.dataflow.dataflow_runner import DataflowRunner

from components import artifacts, corpus
from components import config as config_lib
from components.tokenizer import Tokenizer
from pipelines import decode, distill, encode, prepare, vocab
from pipelines import options as options_lib

OFFLINE = ("--no_auth", "--dry_run=True")  # options only: run() is never called
BUCKET = "gs://my-padir-bucket/padir-test"
WORDS = "a dog runs on the green grass ein hund läuft auf dem grünen gras".split()


@pytest.fixture(scope="module")
def config(monkeypatch_module):
    monkeypatch_module.setenv("PADIR_DATA_ROOT", "gs://my-padir-bucket/data")
    return config_lib.load("configs/overlays/dataflow.yaml")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, config) -> str:
    """A local prepare artifact's files: every split the jobs read, one shard each."""
    folder = tmp_path_factory.mktemp("prepared")
    rng = random.Random(0)
    for split in corpus.output_splits(config.data):
        with open(folder / f"{split}-00000-of-00001.jsonl", "w") as f:
            for i in range(5):
                text = " ".join(rng.choice(WORDS) for _ in range(6))
                f.write(json.dumps({"id": f"{split}:{i:06d}", "source": text,
                                    "target": text}) + "\n")
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("spm")
    (folder / "text.txt").write_text(" ".join(WORDS) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "text.txt"), model_prefix=str(folder / "spm"), vocab_size=40,
        hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=3,
        control_symbols=["<mask>", "<length>"], minloglevel=2)
    return Tokenizer((folder / "spm.model").read_bytes())


def _dataflow_pipeline(config) -> beam.Pipeline:
    return beam.Pipeline(options=options_lib.pipeline_options(config, OFFLINE))


def _build_all(config, prepared: str, tokenizer: Tokenizer) -> dict[str, beam.Pipeline]:
    """Stage -> its job, composed by the module's own `build` for the DataflowRunner."""
    out = lambda stage: artifacts.join(BUCKET, stage, "key")  # noqa: E731
    jobs = {stage: _dataflow_pipeline(config)
            for stage in ("prepare", "vocab", "encode", "distill", "decode")}
    prepare.build(jobs["prepare"], config, out("prepare"))
    vocab.build(jobs["vocab"], config, corpus.split_pattern(prepared, corpus.TRAIN),
                artifacts.join(out("vocab"), "word_counts.tsv"))
    encode.build(jobs["encode"], config, tokenizer=tokenizer, output_uri=out("encode"),
                 inputs={split: corpus.split_pattern(prepared, split)
                         for split in (corpus.TRAIN, corpus.DEV)})
    distill.build(jobs["distill"], config, prepared_uri=prepared, teacher_uri=out("teacher"),
                  tokenizer=tokenizer, num_shards=4, output_uri=out("distill"))
    decode.build(jobs["decode"], config, prepared_uri=prepared, output_uri=out("decode"),
                 checkpoints={stage: out(stage) for stage in config.decode.models},
                 tokenizer=tokenizer, ctranslate2_threads={})  # no sweep: the default
    return jobs


def _do_fns(pipeline: beam.Pipeline) -> list[beam.DoFn]:
    found = []

    class Visitor(beam.pipeline.PipelineVisitor):
        def visit_transform(self, applied):
            if isinstance(applied.transform, beam.ParDo):
                found.append(applied.transform.fn)

    pipeline.visit(Visitor())
    return found


def test_the_overlay_targets_dataflow_with_the_project_container(config):
    options = options_lib.pipeline_options(config, OFFLINE)
    assert config.runner.name == "DataflowRunner" and config.workdir.startswith("gs://")
    assert options.view_as(GoogleCloudOptions).temp_location.startswith("gs://")
    assert options.view_as(WorkerOptions).sdk_container_image.endswith("beam-worker:0.1.0")
    assert isinstance(_dataflow_pipeline(config).runner, DataflowRunner)


@pytest.mark.slow  # a worker's fresh interpreter loads every job
def test_every_pipeline_job_builds_and_serialises_for_dataflow(config, prepared, tokenizer,
                                                              tmp_path):
    jobs = _build_all(config, prepared, tokenizer)
    protos = {}
    for stage, pipeline in jobs.items():
        assert isinstance(pipeline.runner, DataflowRunner)
        do_fns = _do_fns(pipeline)
        assert do_fns, stage
        for do_fn in do_fns:  # each alone, as the runner ships it
            assert type(pickler.loads(pickler.dumps(do_fn))) is type(do_fn), (stage, do_fn)
        protos[stage] = pipeline.to_runner_api()
        loaded = beam.Pipeline.from_runner_api(protos[stage], pipeline.runner, pipeline.options)
        assert len(_do_fns(loaded)) == len(do_fns), stage
        (tmp_path / f"{stage}.pb").write_bytes(protos[stage].SerializeToString())
    kinds = {stage: {type(fn).__name__ for fn in _do_fns(jobs[stage])} for stage in jobs}
    assert {"TokenizePairs"} <= kinds["encode"]
    assert {"KeyByDecoderShape", _RunInferenceDoFn.__name__} <= kinds["distill"]
    assert _RunInferenceDoFn.__name__ in kinds["decode"]
    labels = {t.unique_name for t in protos["distill"].components.transforms.values()}
    assert {"BatchByLength/GroupByShape", "Translate", "WriteTrain", "WriteRejects",
            "WriteDev"} <= labels

    # A worker: a fresh interpreter outside the repository, with the installed packages.
    script = (
        "import sys\n"
        "import apache_beam as beam\n"
        "from apache_beam.portability.api import beam_runner_api_pb2\n"
        "for path in sys.argv[1:]:\n"
        "    proto = beam_runner_api_pb2.Pipeline.FromString(open(path, 'rb').read())\n"
        "    beam.Pipeline.from_runner_api(proto, None, beam.pipeline.PipelineOptions([]))\n"
        "print('loaded', len(sys.argv) - 1)\n")
    paths = [str(tmp_path / f"{stage}.pb") for stage in jobs]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script, *paths], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"loaded {len(jobs)}" in done.stdout


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_the_worker_pins_are_the_launchers_environment():
    """constraints.txt (the Dockerfile's pins) matches what is installed here, package for
    package: the launcher pickles against the versions the workers unpickle with."""
    from importlib import metadata

    installed = {_canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    with open("constraints.txt") as f:
        pins = dict(line.strip().split("==") for line in f
                    if line.strip() and not line.startswith("#"))
    assert {"apache-beam", "jax", "tensorflow", "tensorflow-text"} <= set(map(_canonical, pins))
    differ = {name: (version, installed.get(_canonical(name)))
              for name, version in pins.items() if installed.get(_canonical(name)) != version}
    assert not differ, f"regenerate constraints.txt (pinned, installed): {differ}"


def test_the_worker_image_builds_its_wheel_from_the_files_it_copies(tmp_path):
    """The Dockerfile's `pip install .` sees only what its COPY lines bring: its wheel holds
    every package pyproject.toml lists but benchmarks/, which no worker imports (a package
    the image forgot would be missing from it)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "Dockerfile")) as f:
        copies = [line.split()[1:-1] for line in f if line.startswith("COPY ")]
    for sources in copies:
        for source in sources:
            source = source.rstrip("/")
            if os.path.isdir(os.path.join(root, source)):
                shutil.copytree(os.path.join(root, source), tmp_path / source,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(os.path.join(root, source), tmp_path / source)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(tmp_path / "dist"), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = os.listdir(tmp_path / "dist")
    with zipfile.ZipFile(tmp_path / "dist" / wheel) as f:
        packages = {os.path.dirname(name).replace("/", ".") for name in f.namelist()
                    if name.endswith("/__init__.py")}
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"])
    assert packages == listed - {"benchmarks"}
