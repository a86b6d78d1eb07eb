"""The accelerator check: decode_speed's rows and a training-step probe, from one packed folder.

Two steps, so that the machine with the accelerator needs neither the workdir nor the
pipeline's heavy stack (TensorFlow, Apache Beam, Prefect):

  1. `--pack DIR`, where the trained models are: writes into DIR exactly what must travel:
     the published parameters of the teacher and the student (numpy, float32), their model
     configs, the SentencePiece model, the test set's sources and references, and a few
     hundred training batches of each model's own data (numpy, int16), in well under 60 MiB.

         python benchmarks/device_check.py --pack pack/ --config configs/multi30k_en_de.yaml

  2. `--run DIR` on the accelerator (or on the CPU, to compare): restores the packed models
     on JAX's default device and prints the decode rows (AR greedy, AR beam 4, PaDIR-1,
     PaDIR-4, Mask-Predict-10; batch 1 over the first `--latency-sentences` sentences,
     interleaved as benchmarks/decode_speed.py does; batch `--batch-size` over all of them,
     length-sorted as the decode stage batches; medians, p99, BLEU, chrF; components/report.py
     renders them) and the training probe: steps per second and target tokens per second of
     model/train.py's `train_step` for the teacher and both student phases (phase 1 one stage,
     phase 2 the unrolled `num_stages`), over the packed batches, after a compiling step per
     shape.

         python benchmarks/device_check.py --run pack/ [--json device.json]

The run path imports only JAX, Flax, Optax, Orbax, SentencePiece, sacreBLEU, NumPy and
the project's model/ and components/ modules (tests/test_device_check.py holds it to that).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from components import config as config_lib  # noqa: E402
from components.config import DecodeMethod  # noqa: E402

METHODS = (
    DecodeMethod("ar_greedy", "ar_greedy"),
    DecodeMethod("ar_beam4", "ar_beam", beam_size=4),
    DecodeMethod("padir_1", "padir", iterations=1),
    DecodeMethod("padir_4", "padir", iterations=4),
    DecodeMethod("mask_predict_10", "mask_predict", iterations=10),
)
STAGES = ("teacher", "student")
MODELS, TEST, SPM = "models.json", "test.jsonl", "spm.model"
PACK_LIMIT_BYTES = 60 * 2**20


def _params_file(stage: str) -> str:
    return f"{stage}_params.npz"


def _batches_file(stage: str) -> str:
    return f"{stage}_batches.npz"


# --- step 1: pack -----------------------------------------------------------------------------


def _flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """A nested dict of arrays -> {"a/b/c": float32 array}."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else key
        flat.update(_flatten(value, name) if isinstance(value, dict)
                    else {name: np.asarray(value, np.float32)})
    return flat


def _unflatten(flat: Any) -> dict:
    tree: dict = {}
    for name in flat:
        *path, leaf = name.split("/")
        node = tree
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = flat[name]
    return tree


def _training_batches(uri: str, boundaries: Sequence[int], tokens_per_batch: int,
                      count: int) -> dict[str, np.ndarray]:
    """`count` batches of a training artifact's pairs, as the trainer shapes them: pairs of
    one length bucket, about `tokens_per_batch` tokens a side, padded to the boundary."""
    from model import input_pipeline  # TensorFlow: on the packing side only

    by_bucket: dict[int, list] = {b: [] for b in boundaries}
    for source, target in input_pipeline.read_pairs(input_pipeline.split_files(uri, "train")):
        longest = max(len(source), len(target))
        bucket = next((b for b in boundaries if longest <= b), None)
        if bucket is not None:
            by_bucket[bucket].append((source, target))
    sizes = dict(zip(boundaries, input_pipeline.batch_sizes_for_tokens(boundaries,
                                                                       tokens_per_batch)))
    out: dict[str, np.ndarray] = {}
    while len(out) < 2 * count and any(len(p) >= sizes[b] for b, p in by_bucket.items()):
        for bucket, pairs in by_bucket.items():
            if len(out) >= 2 * count or len(pairs) < sizes[bucket]:
                continue
            rows, by_bucket[bucket] = pairs[:sizes[bucket]], pairs[sizes[bucket]:]
            index = len(out) // 2
            for name, side in (("source", 0), ("target", 1)):
                batch = np.zeros((len(rows), bucket), np.int16)
                for i, row in enumerate(rows):
                    batch[i, :len(row[side])] = row[side]
                out[f"{name}_{index:04d}"] = batch
    return out


def pack(directory: str, config: config_lib.Config, *, train_batches: int,
         max_sentences: int | None = None) -> dict[str, int]:
    """Writes the pack (module docstring) into `directory`; returns its files' sizes.

    Raises:
      RuntimeError: the pack is over `PACK_LIMIT_BYTES`.
    """
    from components import artifacts, corpus, dag
    from model import translator

    os.makedirs(directory, exist_ok=True)
    about: dict[str, Any] = {"seed": config.seed, "boundaries": None,
                             "target_lang": config.data.target_lang,
                             "num_stages": config.student.num_stages,
                             "remask_stutter": config.student.remask_stutter}
    for stage in STAGES:
        uri = dag.output_uri(config, stage)
        loaded = translator.load(uri)
        np.savez(os.path.join(directory, _params_file(stage)), **_flatten(loaded.params))
        section = config.section(stage)
        data_uri = next(u for name, u in artifacts.read(uri).manifest["inputs"].items()
                        if name in translator.TRAINING_DATA)
        np.savez_compressed(os.path.join(directory, _batches_file(stage)), **_training_batches(
            data_uri, loaded.boundaries, section.loop.tokens_per_batch, train_batches))
        about[stage] = {"model": config_lib.to_dict(loaded.model.config), "step": loaded.step,
                        "optimizer": config_lib.to_dict(section.optimizer),
                        "label_smoothing": section.label_smoothing}
        about["boundaries"] = list(loaded.boundaries)
        tokenizer = loaded.tokenizer
    with open(os.path.join(directory, SPM), "wb") as f:
        f.write(tokenizer.model_bytes)
    with open(os.path.join(directory, MODELS), "w") as f:
        json.dump(about, f, indent=2)
    from pipelines.decode import decoded_splits  # the decode stage's test sets

    split = decoded_splits(config.data)[0]
    pairs = sorted(corpus.read_split(dag.output_uri(config, "prepare"), split),
                   key=lambda pair: corpus.id_sort_key(pair["id"]))[:max_sentences]
    with open(os.path.join(directory, TEST), "w") as f:
        for pair in pairs:
            f.write(json.dumps({"id": pair["id"], "source": pair["source"],
                                "target": pair["target"], "split": split},
                               ensure_ascii=False) + "\n")
    sizes = {name: os.path.getsize(os.path.join(directory, name))
             for name in sorted(os.listdir(directory))}
    if sum(sizes.values()) > PACK_LIMIT_BYTES:
        raise RuntimeError(f"the pack is {sum(sizes.values()) / 2**20:.1f} MiB, over "
                           f"{PACK_LIMIT_BYTES / 2**20:.0f} MiB: pack fewer --train-batches")
    return sizes


# --- step 2: run ------------------------------------------------------------------------------


def load_pack(directory: str) -> tuple[dict, dict[str, Any]]:
    """(models.json, stage -> model/translator.py LoadedModel on JAX's default device)."""
    import jax

    from components.tokenizer import Tokenizer
    from model import translator
    from model.models import ARModel, PaDIRModel

    with open(os.path.join(directory, MODELS)) as f:
        about = json.load(f)
    with open(os.path.join(directory, SPM), "rb") as f:
        tokenizer = Tokenizer(f.read())
    loaded = {}
    for stage in STAGES:
        config = config_lib.from_dict(config_lib.ModelConfig, about[stage]["model"], stage)
        model = (ARModel(config, tokenizer.vocab_size) if stage == "teacher" else
                 PaDIRModel(config, tokenizer.vocab_size, tokenizer.first_real_id))
        with np.load(os.path.join(directory, _params_file(stage))) as flat:
            params = jax.device_put(_unflatten({name: flat[name] for name in flat.files}))
        loaded[stage] = translator.LoadedModel(
            uri=f"{os.path.abspath(directory)}#{stage}", stage=stage,
            step=about[stage]["step"], model=model, params=params, tokenizer=tokenizer,
            boundaries=tuple(about["boundaries"]))
    return about, loaded


def decode_rows(loaded: dict[str, Any], pairs: list[dict], *, latency_sentences: int,
                batch_size: int, seed: int = 0, target_lang: str = "") -> dict:
    """decode_speed's measurement without Beam: the report content (components/report.py)."""
    from components import report
    from model import translator

    batch_size = min(batch_size, len(pairs))
    latency, batched = {}, {}
    for method in METHODS:
        model = loaded[method.stage]
        latency[method.name] = translator.Translator(model, method, batch_size=1, seed=seed)
        batched[method.name] = translator.Translator(model, method, batch_size=batch_size,
                                                     seed=seed)
    names = [method.name for method in METHODS]
    sample = pairs[:latency_sentences]
    timed = {name: [] for name in names}
    for i, pair in enumerate(sample):  # interleaved, the order rotating per sentence
        for name in names[i % len(names):] + names[:i % len(names)]:
            timed[name].append(latency[name].translate([pair["source"]])[0])
    tokenizer = loaded["teacher"].tokenizer
    lengths = [len(ids) for ids in tokenizer.encode([pair["source"] for pair in pairs])]
    by_length = sorted(range(len(pairs)), key=lambda i: (lengths[i], i))
    references = [pair["target"] for pair in pairs]
    results = []
    for method in METHODS:
        done = batched[method.name].translate([pairs[i]["source"] for i in by_length])
        in_order = [t for _, t in sorted(zip(by_length, done), key=lambda x: x[0])]
        records = [_record(pair, t) for pair, t in zip(pairs, in_order)]
        results.append(report.score_method(
            method.name, method.kind, records, references, report.throughput(records, batch_size),
            [_record(pair, t) for pair, t in zip(sample, timed[method.name])],
            setting=report.describe_setting(method), target_lang=target_lang))
    return report.build_report({pairs[0].get("split", "test"): results})


def _record(pair: dict, translation: Any) -> dict:
    """One decode-stage line (pipelines/decode.py `to_record`)."""
    return {"id": pair["id"], "hypothesis": translation.hypothesis,
            "latency_s": translation.latency_s, "passes": translation.passes,
            "source_tokens": translation.source_tokens, "score": translation.score,
            "hypothesis_tokens": len(translation.tokens), "truncated": translation.truncated}


@dataclasses.dataclass(frozen=True)
class StepRate:
    """A training-step probe's figures (medians over the timed steps)."""

    name: str
    steps: int
    step_ms: float
    steps_per_s: float
    target_tokens_per_s: float  # non-pad target tokens of the batches


def probe_training(directory: str, about: dict, loaded: dict[str, Any], *, steps: int
                   ) -> list[StepRate]:
    """model/train.py's `train_step`, jitted with the state donated, on the packed batches:
    the teacher, the student's phase 1 (one stage) and phase 2 (`num_stages`)."""
    import functools

    import jax

    from model import train

    runs = [("teacher", "teacher", {}), ("student phase 1", "student", {"num_stages": 1}),
            ("student phase 2", "student",
             {"num_stages": about["num_stages"], "remask_stutter": about["remask_stutter"]})]
    rates = []
    for name, stage, loss_options in runs:
        model = dataclasses.replace(loaded[stage].model,
                                    label_smoothing=about[stage]["label_smoothing"])
        optimizer = config_lib.from_dict(config_lib.OptimizerConfig, about[stage]["optimizer"],
                                         f"{stage}.optimizer")
        tx, _ = train.make_optimizer(optimizer, total_steps=max(steps, 2))
        params = jax.tree.map(lambda x: x.copy(), loaded[stage].params)
        state = train.TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params,
                                 opt_state=tx.init(params), rng=jax.random.PRNGKey(about["seed"]))
        step = jax.jit(functools.partial(train.train_step, model=model, tx=tx, **loss_options),
                       donate_argnums=0)
        with np.load(os.path.join(directory, _batches_file(stage))) as flat:
            batches = [{side: flat[f"{side}_{i:04d}"].astype(np.int32)
                        for side in ("source", "target")}
                       for i in range(len(flat.files) // 2)]
        if not batches:
            raise RuntimeError(f"the pack has no {stage} training batch")
        for shape in sorted({b["source"].shape for b in batches}):  # compile every shape
            state, metrics = step(state, next(b for b in batches if b["source"].shape == shape))
        jax.block_until_ready(metrics)
        times, tokens = [], []
        for i in range(steps):
            batch = batches[i % len(batches)]
            started = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - started)
            tokens.append(int((batch["target"] != 0).sum()))
        median = statistics.median(times)
        rates.append(StepRate(name, steps, 1e3 * median, 1 / median,
                              sum(tokens) / sum(times)))
    return rates


def run(directory: str, *, latency_sentences: int, batch_size: int, train_steps: int) -> dict:
    """Both measurements, printed; returns {"devices", "report", "training", "seconds"}."""
    import jax

    from components import report

    started = time.time()
    about, loaded = load_pack(directory)
    with open(os.path.join(directory, TEST)) as f:
        pairs = [json.loads(line) for line in f]
    print(f"devices {jax.devices()}; {len(pairs)} test sentences, batch 1 over the first "
          f"{min(latency_sentences, len(pairs))}, batch {batch_size} over all", flush=True)
    content = decode_rows(loaded, pairs, latency_sentences=latency_sentences,
                          batch_size=batch_size, seed=about["seed"],
                          target_lang=about["target_lang"])
    print(report.render_markdown(content), flush=True)
    print(f"decoding: {time.time() - started:.0f} s", flush=True)
    rates = probe_training(directory, about, loaded, steps=train_steps)
    print(f"{'training step':18} {'steps':>6} {'ms/step':>9} {'steps/s':>8} {'tgt tok/s':>10}")
    for rate in rates:
        print(f"{rate.name:18} {rate.steps:6d} {rate.step_ms:9.2f} {rate.steps_per_s:8.2f} "
              f"{rate.target_tokens_per_s:10.0f}")
    seconds = time.time() - started
    print(f"total: {seconds:.0f} s", flush=True)
    return {"devices": [str(d) for d in jax.devices()], "report": content,
            "training": [dataclasses.asdict(rate) for rate in rates], "seconds": seconds}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step = parser.add_mutually_exclusive_group(required=True)
    step.add_argument("--pack", metavar="DIR", help="write the pack of a config's models here")
    step.add_argument("--run", metavar="DIR", help="measure on this machine from a pack")
    parser.add_argument("--config", default="configs/multi30k_en_de.yaml", help="with --pack")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--train-batches", type=int, default=150,
                        help="with --pack: training batches per model")
    parser.add_argument("--max-sentences", type=int, help="with --pack: the first N by id")
    parser.add_argument("--latency-sentences", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=50, help="timed steps per probe")
    parser.add_argument("--json", metavar="PATH", help="with --run: also write the figures")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pack:
        config = config_lib.load(args.config, args.set)
        sizes = pack(args.pack, config, train_batches=args.train_batches,
                     max_sentences=args.max_sentences)
        for name, size in sizes.items():
            print(f"{size / 2**20:8.2f} MiB  {name}")
        print(f"{sum(sizes.values()) / 2**20:8.2f} MiB  in {args.pack}")
        return 0
    figures = run(args.run, latency_sentences=args.latency_sentences,
                  batch_size=args.batch_size, train_steps=args.train_steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
