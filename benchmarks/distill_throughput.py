"""Throughput of the distill job: Beam with 1 and 2 workers against a plain loop, same work.

Takes the first N training pairs (by id) of an experiment's prepare artifact and translates
their sources with its teacher artifact, as the `distill` stage does (the config's
`distill` section: beam size, length penalty, batch size), three ways, each in a fresh
process of its own (each restores the teacher and compiles its decoder once):

  plain    a Python loop: `model.translator.Translator` over the batches the job forms
           (`pipelines.batching.KeyByDecoderShape` and `length_batches`: one decoder shape
           per batch, sources sorted by length), shape after shape;
  beam_1   `pipelines.distill.build` on the FnApiRunner, in process (one worker);
  beam_2   the same with `--direct_num_workers=2 --direct_running_mode=multi_processing`:
           two SDK worker processes, each restoring its own teacher.

JAX and fork: the worker processes of `multi_processing` are new interpreters (the runner
starts `python -m apache_beam.runners.worker.sdk_worker_main` with subprocess, fork+exec),
and the process that launches them never imports JAX (building the job does not; the
model is loaded by the handler in the workers), so no JAX runtime is ever forked.

Printed per way: sentences/s over the wall time (restore, compilation, decoding; for Beam
also reading, shuffling and writing the files and starting workers) and over the decode
calls alone, and Beam's overhead as the ratio of its wall time to the plain loop's. On a
shared machine, compare the ratios of one run, not rates across runs.

    PADIR_DATA_ROOT=/path/to/data python benchmarks/distill_throughput.py \\
        [--config configs/multi30k_en_de.yaml] [--set k=v ...] [--teacher DIR] \\
        [--max-sentences 200] [--ways plain,beam_1,beam_2] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from components import artifacts, corpus, dag  # noqa: E402
from components import config as config_lib  # noqa: E402
from components.tokenizer import Tokenizer  # noqa: E402

WAYS = ("plain", "beam_1", "beam_2")
BEAM_FLAGS = {
    "beam_1": ["--runner=FnApiRunner"],
    "beam_2": ["--runner=FnApiRunner", "--direct_num_workers=2",
               "--direct_running_mode=multi_processing"],
}
DEV_PAIRS = 8  # the job also copies a dev split; a few pairs keep that negligible


def write_inputs(config: config_lib.Config, folder: str, max_sentences: int) -> int:
    """The first `max_sentences` train pairs (by id) and a few dev pairs, as a prepared
    artifact's files under `folder`; returns the number of train pairs."""
    prepared = dag.require_input(config, "prepare")
    for split, limit in ((corpus.TRAIN, max_sentences), (corpus.DEV, DEV_PAIRS)):
        pairs = list(corpus.read_split(prepared.uri, split))[:limit]
        with open(os.path.join(folder, f"{split}-00000-of-00001.jsonl"), "w") as f:
            f.writelines(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs)
        if split == corpus.TRAIN:
            count = len(pairs)
    return count


def run_plain(config: config_lib.Config, teacher_uri: str, folder: str) -> dict:
    """The plain loop over the job's batches; JAX starts inside the timed span."""
    started = time.perf_counter()
    from model import translator
    from pipelines import batching, distill

    teacher = artifacts.read(teacher_uri)
    tokenizer = Tokenizer.for_artifact(teacher)
    pairs = list(corpus.read_split(folder, corpus.TRAIN))
    boundaries = config.encode.bucket_boundaries
    key = batching.KeyByDecoderShape(tokenizer, boundaries)
    groups = collections.defaultdict(list)
    for pair in pairs:
        for shape, member in key.process(pair):
            groups[shape].append(member)
    translator = translator.Translator(
        translator.load(teacher_uri), distill.method(config.distill),
        batch_size=config.distill.batch_size, boundaries=boundaries)
    decode_seconds, batches = 0.0, 0
    for shape in sorted(groups):
        batch_size = config.distill.batch_size
        for batch in batching.length_batches((shape, groups[shape]), batch_size):
            translations = translator.translate([source for _, source in batch])
            decode_seconds += translations[0].batch_seconds
            batches += 1
    return {"sentences": len(pairs), "seconds": time.perf_counter() - started,
            "decode_seconds": decode_seconds, "batches": batches,
            "shapes": len(translator._warm)}


def run_beam(config: config_lib.Config, teacher_uri: str, folder: str, way: str) -> dict:
    """The distill job on the FnApiRunner with `BEAM_FLAGS[way]`."""
    import apache_beam as beam

    from pipelines import distill, job
    from pipelines import options as options_lib

    teacher = artifacts.read(teacher_uri)
    output = tempfile.mkdtemp(prefix=f"distill-{way}-", dir=folder)
    pipeline = beam.Pipeline(options=options_lib.pipeline_options(config, BEAM_FLAGS[way]))
    distill.build(pipeline, config, prepared_uri=folder, teacher_uri=teacher_uri,
                  tokenizer=Tokenizer.for_artifact(teacher), num_shards=1,
                  output_uri=output)
    started = time.perf_counter()
    result = pipeline.run()
    result.wait_until_finish()
    seconds = time.perf_counter() - started
    counts = job.counter_values(result, distill.NAMESPACE, distill.COUNTER_NAMES)
    with open(os.path.join(output, distill.STATS_FILE)) as f:
        stats = json.load(f)
    return {"sentences": counts["read"], "seconds": seconds,
            "decode_seconds": stats["decode_seconds"], "kept": counts["kept"]}


def measure(way: str, args: argparse.Namespace, folder: str) -> dict:
    """One way in a fresh process (this script with `--child`): its JSON result."""
    command = [sys.executable, os.path.abspath(__file__), "--child", way, "--inputs", folder,
               "--config", args.config, "--teacher", args.teacher,
               *(f"--set={override}" for override in args.set)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/multi30k_en_de.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--teacher", help="teacher artifact (default: the config's)")
    parser.add_argument("--max-sentences", type=int, default=200)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = config_lib.load(args.config, args.set)
    args.teacher = args.teacher or dag.output_uri(config, "teacher")

    if args.child:  # one measurement, printed as the last line of stdout
        if args.child == "plain":
            figures = run_plain(config, args.teacher, args.inputs)
        else:
            figures = run_beam(config, args.teacher, args.inputs, args.child)
        print(json.dumps(figures))
        return 0

    artifacts.read(args.teacher)  # a clear error now rather than in a child
    settings = config.distill
    with tempfile.TemporaryDirectory(prefix="distill-throughput-") as folder:
        sentences = write_inputs(config, folder, args.max_sentences)
        print(f"teacher {args.teacher}\n{sentences} sentences, beam {settings.beam_size}, "
              f"length penalty {settings.length_penalty}, batch {settings.batch_size}, "
              f"{os.cpu_count()} CPUs")
        results = {}
        for way in args.ways.split(","):
            results[way] = measure(way, args, folder)
            result = results[way]
            result["sentences_per_s"] = result["sentences"] / result["seconds"]
            result["decode_sentences_per_s"] = result["sentences"] / result["decode_seconds"]
            print(f"  {way:7} {result['sentences_per_s']:7.2f} sentences/s over "
                  f"{result['seconds']:6.1f} s wall; decode calls alone "
                  f"{result['decode_sentences_per_s']:7.2f} sentences/s "
                  f"({result['decode_seconds']:.1f} s)", flush=True)
    if "plain" in results:
        for way in ("beam_1", "beam_2"):
            if way in results:
                ratio = results[way]["seconds"] / results["plain"]["seconds"]
                results[way]["wall_ratio_to_plain"] = ratio
                print(f"  {way} wall time / plain loop wall time: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sentences": sentences, "teacher": args.teacher,
                       "distill": config_lib.to_dict(settings), "ways": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
