"""The accelerator check: decode_speed's rows, a training-step probe and the student's
budget line, from one packed folder.

Two steps, so that the machine with the accelerator needs neither the workdir nor the
pipeline's heavy stack (TensorFlow, Apache Beam, Prefect):

  1. `--pack DIR`, where the trained models are: writes into DIR exactly what must travel:
     the published parameters of the teacher, the student and, when the config trains them
     and they are published, the AR student and the drafter (numpy, float32), their model
     configs and config sections, the SentencePiece model, the test set's sources and
     references, a few hundred training batches of the teacher's and the student's own
     data (numpy, int16),
     and the student's whole training set (the distilled pairs when `distill.enabled`:
     int16 ids end to end, a few MiB), in well under 60 MiB.

         python -m benchmarks.device_check --pack pack/ --config configs/multi30k_en_de.yaml

  2. `--run DIR` on the accelerator (or on the CPU, to compare): restores the packed models
     on JAX's default device and prints
       * the decode rows (AR greedy, AR beam 4, PaDIR-1, PaDIR-4, Mask-Predict-10; the AR
         student's greedy and beam 4 when it is packed; draft and verify, exact and
         tolerant, when the drafter is packed; CTranslate2's greedy and beam 4 of each
         AR model, on CUDA where JAX runs on a GPU, when `import ctranslate2` works
         there): batch 1 over the first `--latency-sentences` sentences,
         interleaved as benchmarks/decode_speed.py does; batch `--batch-size` over all of
         them, length-sorted as the decode stage batches; medians, p99, BLEU, chrF
         (components/report.py renders them);
       * the training probe: steps per second and target tokens per second of
         model/train.py's `train_step` for the teacher and both student phases (phase 1 one
         stage, phase 2 the unrolled loss with the config's settings), over the packed
         batches, after a compiling step per shape;
       * with `--crossover SHAPES`, benchmarks/crossover.py's sweep of those shapes (random
         models, fixed lengths; CTranslate2's rows when it imports), whose figures replace
         benchmarks/latency_model.py's projection for this device;
       * the budget line (`--budget 1,4,16`; `none` skips it): the student trained from the
         packed training set as its stage trains it (model/train.py `train_student`) for
         each multiple of its config's phase1_steps and phase2_steps, then decoded with
         PaDIR-4 on the test set: steps, training wall time and BLEU per multiple. Training
         stops once the run has lasted `--minutes`, so that the command ends within its
         limit: the training it stops is decoded as it is and reported as stopped, the
         multiples after it are not trained.

         python -m benchmarks.device_check --run pack/ [--json device.json]

The run path imports only JAX, Flax, Optax, Orbax, SentencePiece, sacreBLEU, NumPy (and
CTranslate2 if it is there) and the project's model/ and components/ modules
(tests/test_device_check.py holds it to that); from the repository's root it needs no
install, only these packages. It assumes one device (the packed batch
sizes are not rounded to a device count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from components import config as config_lib
from components.config import DecodeMethod

PADIR_4 = DecodeMethod("padir_4", "refine", iterations=4)  # also the budget line's decoding
METHODS = (
    DecodeMethod("ar_greedy", "ar_greedy"),
    DecodeMethod("ar_beam4", "ar_beam", beam_size=4),
    DecodeMethod("padir_1", "refine", iterations=1),
    PADIR_4,
    DecodeMethod("mask_predict_10", "mask_predict", iterations=10),
    DecodeMethod("ar_student_greedy", "ar_greedy", model="ar_student"),
    DecodeMethod("ar_student_beam4", "ar_beam", beam_size=4, model="ar_student"),
    # The drafter drafts a block, the teacher verifies it over its cache: the teacher's
    # greedy output in fewer sequential calls, which set the latency on an accelerator at
    # batch 1; and the tolerant variant (top 3 within 1 nat).
    DecodeMethod("draft_verify", "draft_verify", iterations=1),
    DecodeMethod("draft_verify_tolerant", "draft_verify", iterations=1, tolerance_top_k=3,
                 tolerance_margin=1.0),
)
CTRANSLATE2_METHODS = (
    DecodeMethod("ct2_greedy", "ct2_greedy"),
    DecodeMethod("ct2_beam4", "ct2_beam", beam_size=4),
    DecodeMethod("ct2_ar_student_greedy", "ct2_greedy", model="ar_student"),
    DecodeMethod("ct2_ar_student_beam4", "ct2_beam", beam_size=4, model="ar_student"),
)
STAGES = ("teacher", "student")  # always packed
OPTIONAL_STAGES = ("ar_student", "drafter")  # packed when the config trains them, published
PROBED = ("teacher", "student")  # the stages whose training batches travel for the probe
SECTIONS = {"teacher": config_lib.TeacherConfig, "student": config_lib.StudentConfig,
            "ar_student": config_lib.ARStudentConfig, "drafter": config_lib.DrafterConfig}
MODELS, TEST, SPM = "models.json", "test.jsonl", "spm.model"
STUDENT_DATA = "student_data.npz"
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


def pack_pairs(pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Pairs of id arrays -> each side's ids end to end and each pair's lengths (int16):
    a training set without padding."""
    sides: dict[str, list] = {"source": [], "target": []}
    for source, target in pairs:
        sides["source"].append(source)
        sides["target"].append(target)
    out = {}
    for name, rows in sides.items():
        out[name] = np.concatenate(rows).astype(np.int16)
        out[f"{name}_lengths"] = np.array([len(row) for row in rows], np.int16)
    return out


def unpack_pairs(flat: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """`pack_pairs`' arrays -> the pairs, int32."""
    sides = []
    for name in ("source", "target"):
        ends = np.cumsum(flat[f"{name}_lengths"], dtype=np.int64)
        sides.append(np.split(flat[name].astype(np.int32), ends[:-1]))
    return list(zip(*sides))


def _published(config: config_lib.Config, stage: str) -> bool:
    """An optional stage travels when the config trains it and its artifact is published."""
    from components import artifacts, dag

    return (stage in dag.active_stages(config)
            and artifacts.is_complete(dag.output_uri(config, stage)))


def pack(directory: str, config: config_lib.Config, *, train_batches: int,
         max_sentences: int | None = None) -> dict[str, int]:
    """Writes the pack (module docstring) into `directory`; returns its files' sizes.

    Raises:
      RuntimeError: the pack is over `PACK_LIMIT_BYTES`.
    """
    from components import artifacts, corpus, dag
    from model import input_pipeline, trained_model
    from model.decoding import translator

    os.makedirs(directory, exist_ok=True)
    stages = STAGES + tuple(stage for stage in OPTIONAL_STAGES if _published(config, stage))
    about: dict[str, Any] = {"seed": config.seed, "boundaries": None, "stages": list(stages),
                             "target_lang": config.data.target_lang,
                             "mesh": config_lib.to_dict(config.mesh)}
    for stage in stages:
        uri = dag.output_uri(config, stage)
        loaded = trained_model.load(uri)
        if loaded.tokenizer.vocab_size > np.iinfo(np.int16).max + 1:
            raise RuntimeError(f"{loaded.tokenizer.vocab_size} pieces: ids overflow int16")
        np.savez(os.path.join(directory, _params_file(stage)), **_flatten(loaded.params))
        section = config.section(stage)
        about[stage] = {"model": config_lib.to_dict(loaded.model.config), "step": loaded.step,
                        "section": config_lib.to_dict(section)}
        about["boundaries"] = list(loaded.boundaries)
        tokenizer = loaded.tokenizer
        if stage not in PROBED:
            continue
        data_uri = next(u for name, u in artifacts.read(uri).manifest["inputs"].items()
                        if name in translator.TRAINING_DATA)
        np.savez_compressed(os.path.join(directory, _batches_file(stage)), **_training_batches(
            data_uri, loaded.boundaries, section.loop.tokens_per_batch, train_batches))
        if stage == "student":  # the budget line's training set, batched as training does
            train_pairs = input_pipeline.read_pairs(input_pipeline.split_files(data_uri, "train"))
            np.savez_compressed(os.path.join(directory, STUDENT_DATA), **pack_pairs(train_pairs))
            about[stage]["batch_sizes"] = list(input_pipeline.batch_sizes_for_tokens(
                loaded.boundaries, section.loop.tokens_per_batch))
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
    """(models.json, stage -> model/trained_model.py LoadedModel on JAX's default device)."""
    import jax

    from components.tokenizer import Tokenizer
    from model import trained_model
    from model.models import ARModel, DrafterModel, PaDIRModel

    with open(os.path.join(directory, MODELS)) as f:
        about = json.load(f)
    with open(os.path.join(directory, SPM), "rb") as f:
        tokenizer = Tokenizer(f.read())
    loaded = {}
    for stage in about["stages"]:
        config = config_lib.from_dict(config_lib.ModelConfig, about[stage]["model"], stage)
        if stage == "student":
            model = PaDIRModel(config, tokenizer.vocab_size, tokenizer.first_real_id)
        elif stage == "drafter":
            model = DrafterModel(config, tokenizer.vocab_size, about[stage]["section"]["block"])
        else:
            model = ARModel(config, tokenizer.vocab_size)
        with np.load(os.path.join(directory, _params_file(stage))) as flat:
            params = jax.device_put(_unflatten({name: flat[name] for name in flat.files}))
        loaded[stage] = trained_model.LoadedModel(
            uri=f"{os.path.abspath(directory)}#{stage}", stage=stage,
            step=about[stage]["step"], model=model, params=params, tokenizer=tokenizer,
            boundaries=tuple(about["boundaries"]))
    return about, loaded


def packed_section(about: dict, stage: str) -> Any:
    """A packed stage's config section (`TeacherConfig`, `StudentConfig`, ...)."""
    return config_lib.from_dict(SECTIONS[stage], about[stage]["section"], stage)


def methods(loaded: dict[str, Any], *, ctranslate2: bool) -> list[DecodeMethod]:
    """The rows whose models are packed; CTranslate2's with `ctranslate2`."""
    table = METHODS + (CTRANSLATE2_METHODS if ctranslate2 else ())
    return [method for method in table if method.stage in loaded]


def ctranslate2_importable() -> bool:
    """Whether CTranslate2's rows can run here (its wheel is not on every machine)."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError as error:
        print(f"CTranslate2 rows skipped: {error}", flush=True)
        return False
    return True


def _length_order(loaded: Any, pairs: list[dict]) -> list[int]:
    """Indices of `pairs` by source length, as the decode stage batches them."""
    lengths = [len(ids) for ids in loaded.tokenizer.encode([pair["source"] for pair in pairs])]
    return sorted(range(len(pairs)), key=lambda i: (lengths[i], i))


def _translate_all(translator: Any, pairs: list[dict], order: list[int]) -> list[Any]:
    """Every pair's translation, decoded in `order`, returned in the pairs' order."""
    done = translator.translate([pairs[i]["source"] for i in order])
    return [t for _, t in sorted(zip(order, done), key=lambda x: x[0])]


def decode_rows(loaded: dict[str, Any], pairs: list[dict], rows: Sequence[DecodeMethod], *,
                latency_sentences: int, batch_size: int, target_lang: str = "") -> dict:
    """decode_speed's measurement without Beam: the report content (components/report.py).
    A CTranslate2 row whose worker cannot start here (no CUDA build, say) is left out."""
    from components import report
    from model.decoding import ctranslate2_search, translator

    batch_size = min(batch_size, len(pairs))
    latency, batched = {}, {}
    for method in rows:
        model = loaded[method.stage]
        rescorer = loaded[method.rescorer] if method.rescorer else None
        try:
            latency[method.name] = translator.Translator(model, method, batch_size=1,
                                                         rescorer=rescorer)
        except ctranslate2_search.WorkerError as error:
            print(f"{method.name} skipped: {str(error).splitlines()[0]}", flush=True)
            continue
        batched[method.name] = translator.Translator(model, method, batch_size=batch_size,
                                                     rescorer=rescorer)
    rows = [method for method in rows if method.name in latency]
    names = [method.name for method in rows]
    sample = pairs[:latency_sentences]
    timed = {name: [] for name in names}
    for i, pair in enumerate(sample):  # interleaved, the order rotating per sentence
        for name in names[i % len(names):] + names[:i % len(names)]:
            timed[name].append(latency[name].translate([pair["source"]])[0])
    order = _length_order(loaded["teacher"], pairs)
    references = [pair["target"] for pair in pairs]
    results = []
    for method in rows:
        in_order = _translate_all(batched[method.name], pairs, order)
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
            "hypothesis_tokens": len(translation.tokens), "truncated": translation.truncated,
            **({"rounds": translation.rounds, "accepted": translation.accepted}
               if translation.rounds is not None else {})}


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
    the teacher, the student's phase 1 and phase 2 (their losses as `train_student` sets
    them from the packed student section)."""
    import functools

    import jax

    from model import train
    from model.losses import student_loss_settings

    teacher, student = packed_section(about, "teacher"), packed_section(about, "student")
    runs = [("teacher", "teacher", teacher, None),
            ("student phase 1", "student", student, student_loss_settings(student, 1)),
            ("student phase 2", "student", student, student_loss_settings(student, 2))]
    rates = []
    for name, stage, section, loss_settings in runs:
        model = dataclasses.replace(loaded[stage].model, label_smoothing=section.label_smoothing)
        tx, _ = train.make_optimizer(section.optimizer, total_steps=max(steps, 2))
        params = jax.tree.map(lambda x: x.copy(), loaded[stage].params)
        state = train.TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params,
                                 opt_state=tx.init(params), rng=jax.random.PRNGKey(about["seed"]))
        step = jax.jit(functools.partial(train.train_step, model=model, tx=tx,
                                         loss_settings=loss_settings), donate_argnums=0)
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


class PairStream:
    """model/train.py's data contract (`TrainData.batches`) over pairs in memory, batched
    as model/input_pipeline.py's `TrainingStream` batches, without TensorFlow: epoch e takes
    the pairs in an order shuffled by (seed, e), each to the smallest bucket that holds it;
    a bucket's batch comes when it fills, and at the epoch's end each bucket's remainder,
    filled up with all-pad rows. Position p is batch p % n of epoch p // n (n batches an
    epoch), so phase 2 continues phase 1's stream. (The same shapes and epochs as the
    stage's stream; not its order.)"""

    def __init__(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]], *,
                 boundaries: Sequence[int], batch_sizes: Sequence[int], seed: int):
        self.boundaries, self.batch_sizes, self.seed = tuple(boundaries), tuple(batch_sizes), seed
        longest = np.array([max(len(source), len(target)) for source, target in pairs])
        if not len(pairs) or longest.max() > self.boundaries[-1]:
            raise ValueError(f"{len(pairs)} pairs, none may be longer than the widest bucket "
                             f"{self.boundaries[-1]}")
        self.bucket = np.searchsorted(self.boundaries, longest, side="left")  # int[N]
        self.ids = {side: np.zeros((len(pairs), self.boundaries[-1]), np.int32)  # int32[N, L]
                    for side in ("source", "target")}
        for i, pair in enumerate(pairs):
            for side, row in zip(("source", "target"), pair):
                self.ids[side][i, :len(row)] = row
        counts = np.bincount(self.bucket, minlength=len(self.boundaries))
        self.batches_per_epoch = int(sum(-(-n // size)
                                         for n, size in zip(counts, self.batch_sizes)))

    def epoch(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """(bucket, pair indices) of each batch of `epoch`, in order."""
        order = np.random.default_rng((self.seed, epoch)).permutation(len(self.bucket))
        buckets = self.bucket[order]
        batches = []
        for bucket, size in enumerate(self.batch_sizes):
            at = np.flatnonzero(buckets == bucket)  # where in the epoch its pairs come
            for start in range(0, len(at), size):
                rows = at[start:start + size]
                filled = int(rows[-1]) if len(rows) == size else len(order)  # remainders last
                batches.append((filled, bucket, order[rows]))
        batches.sort(key=lambda batch: batch[:2])
        return [(bucket, rows) for _, bucket, rows in batches]

    def batches(self, start_position: int = 0) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(position after the batch, {"source", "target": int32[B, L]}) from
        `start_position` on, forever."""
        epoch, skip = divmod(start_position, self.batches_per_epoch)
        position = start_position
        while True:
            for bucket, rows in self.epoch(epoch)[skip:]:
                width, size = self.boundaries[bucket], self.batch_sizes[bucket]
                batch = {side: np.zeros((size, width), np.int32) for side in self.ids}
                for side, ids in self.ids.items():
                    batch[side][:len(rows)] = ids[rows, :width]
                position += 1
                yield position, batch
            epoch, skip = epoch + 1, 0


@dataclasses.dataclass(frozen=True)
class BudgetPoint:
    """One multiple of the budget line."""

    multiple: int
    steps: int  # (phase1_steps + phase2_steps) x multiple
    trained: int  # optimizer steps taken over both phases (fewer: the time limit stopped it)
    completed: bool
    train_s: float  # wall time of the training: compilation and checkpoints included
    decode_s: float
    bleu: float  # PaDIR-4 on the packed test set


def budget_line(directory: str, about: dict, loaded: dict[str, Any], pairs: list[dict], *,
                multiples: Sequence[int], deadline: float, batch_size: int
                ) -> list[BudgetPoint]:
    """The student trained as pipelines/student.py trains it (`train.train_student` with the
    packed student section, mesh and seed, from the teacher when `init_from_teacher`), on
    the packed training set, for each multiple of its phase steps; then decoded with PaDIR-4
    on `pairs`. The parameters decoded are the last step's (their average when the optimizer
    keeps one): no dev set travels to pick a best checkpoint by. Training stops past
    `deadline` (`time.monotonic()`): that run is decoded and marked, the rest are skipped."""
    import tempfile

    from components.metrics import corpus_bleu
    from model import train, trained_model, warm_start
    from model.decoding import refinement, translator
    from model.models import PaDIRModel

    cfg = packed_section(about, "student")
    mesh = config_lib.from_dict(config_lib.MeshConfig, about["mesh"], "mesh")
    tokenizer, teacher = loaded["student"].tokenizer, loaded["teacher"].params
    model = PaDIRModel(cfg.model, tokenizer.vocab_size, tokenizer.first_real_id,
                       label_smoothing=cfg.label_smoothing)
    batch_sizes = tuple(about["student"]["batch_sizes"])
    with np.load(os.path.join(directory, STUDENT_DATA)) as flat:
        stream = PairStream(unpack_pairs(flat), boundaries=about["boundaries"],
                            batch_sizes=batch_sizes, seed=about["seed"])
    data = train.TrainData(stream.batches, batch_sizes)
    start = ((lambda params: warm_start.from_teacher(params, teacher)[0])
             if cfg.init_from_teacher else None)
    order = _length_order(loaded["student"], pairs)
    references = [pair["target"] for pair in pairs]
    print(f"budget line: {len(stream.bucket)} training pairs, "
          f"{stream.batches_per_epoch} batches an epoch; phase steps "
          f"{cfg.phase1_steps} + {cfg.phase2_steps} at 1x", flush=True)
    points: list[BudgetPoint] = []
    for i, multiple in enumerate(multiples):
        minutes_left = (deadline - time.monotonic()) / 60
        if minutes_left <= 0 or (points and not points[-1].completed):
            print("budget line: the time limit ran out; not trained: "
                  f"{', '.join(f'{m}x' for m in multiples[i:])}", flush=True)
            break
        run_cfg = dataclasses.replace(
            cfg, phase1_steps=cfg.phase1_steps * multiple,
            phase2_steps=cfg.phase2_steps * multiple,
            # Each phase's last step is saved (phase 2 starts from phase 1's) and no other:
            # the cadence changes no result.
            loop=dataclasses.replace(cfg.loop, max_minutes=minutes_left,
                                     checkpoint_every=(cfg.phase1_steps + cfg.phase2_steps)
                                     * multiple))
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="budget-line-") as checkpoint_dir:
            result = train.train_student(model, data, run_cfg, mesh,
                                         checkpoint_dir=checkpoint_dir, seed=about["seed"],
                                         predict=refinement.dev_predict(model),
                                         warm_start=start)
        train_s = time.monotonic() - started
        trained = trained_model.LoadedModel(
            uri=f"{os.path.abspath(directory)}#student-{multiple}x", stage="student",
            step=result.position, model=model, params=result.state.eval_params,
            tokenizer=tokenizer, boundaries=tuple(about["boundaries"]))
        started = time.monotonic()
        decoder = translator.Translator(trained, PADIR_4, batch_size=min(batch_size, len(pairs)))
        hypotheses = [t.hypothesis for t in _translate_all(decoder, pairs, order)]
        point = BudgetPoint(
            multiple=multiple, steps=run_cfg.phase1_steps + run_cfg.phase2_steps,
            trained=result.position, completed=result.completed, train_s=train_s,
            decode_s=time.monotonic() - started,
            bleu=corpus_bleu(hypotheses, references, about["target_lang"]).score)
        points.append(point)
        print(f"budget line {multiple:3d}x: {point.trained}/{point.steps} steps in "
              f"{point.train_s:.0f} s, decoded in {point.decode_s:.0f} s, PaDIR-4 BLEU "
              f"{point.bleu:.2f}"
              + ("" if point.completed else " (stopped: the time limit ran out)"), flush=True)
    return points


def run(directory: str, *, latency_sentences: int, batch_size: int, train_steps: int,
        budget: Sequence[int], minutes: float, crossover_shapes: str = "",
        crossover_vocabs: str = "") -> dict:
    """The measurements, printed; returns {"devices", "report", "training", "budget",
    "crossover", "seconds"}."""
    import jax

    from benchmarks import crossover
    from components import report

    started = time.time()
    deadline = time.monotonic() + 60 * minutes
    about, loaded = load_pack(directory)
    with open(os.path.join(directory, TEST)) as f:
        pairs = [json.loads(line) for line in f]
    print(f"devices {jax.devices()}; models {', '.join(loaded)}; {len(pairs)} test sentences, "
          f"batch 1 over the first {min(latency_sentences, len(pairs))}, batch {batch_size} "
          "over all", flush=True)
    rows = methods(loaded, ctranslate2=ctranslate2_importable())
    content = decode_rows(loaded, pairs, rows, latency_sentences=latency_sentences,
                          batch_size=batch_size, target_lang=about["target_lang"])
    print(report.render_markdown(content), flush=True)
    print(f"decoding: {time.time() - started:.0f} s", flush=True)
    rates = probe_training(directory, about, loaded, steps=train_steps)
    print(f"{'training step':18} {'steps':>6} {'ms/step':>9} {'steps/s':>8} {'tgt tok/s':>10}")
    for rate in rates:
        print(f"{rate.name:18} {rate.steps:6d} {rate.step_ms:9.2f} {rate.steps_per_s:8.2f} "
              f"{rate.target_tokens_per_s:10.0f}")
    print(f"training probe: {time.time() - started:.0f} s", flush=True)
    points = budget_line(directory, about, loaded, pairs, multiples=budget, deadline=deadline,
                         batch_size=batch_size) if budget else []
    swept = crossover.sweep(crossover.shapes(crossover_shapes,
                                             crossover_vocabs or crossover.VOCABS),
                            length=crossover.LENGTH, sentences=crossover.SENTENCES,
                            batch_size=batch_size, ctranslate2=ctranslate2_importable()
                            ) if crossover_shapes else None
    seconds = time.time() - started
    print(f"total: {seconds:.0f} s", flush=True)
    return {"devices": [str(d) for d in jax.devices()], "report": content,
            "training": [dataclasses.asdict(rate) for rate in rates],
            "budget": [dataclasses.asdict(point) for point in points], "crossover": swept,
            "seconds": seconds}


def _multiples(text: str) -> tuple[int, ...]:
    """`--budget`: "1,4,16" -> (1, 4, 16); "none" -> ()."""
    if text == "none":
        return ()
    try:
        multiples = tuple(int(part) for part in text.split(","))
    except ValueError:
        multiples = ()
    if not multiples or min(multiples) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16 or none, "
                                         f"got {text!r}")
    return multiples


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
    parser.add_argument("--budget", type=_multiples, default=(1, 4, 16), metavar="MULTIPLES",
                        help="with --run: the budget line's multiples of the student's steps "
                             "(none: skip it)")
    parser.add_argument("--minutes", type=float, default=8.0,
                        help="with --run: the budget line trains only while the run has lasted "
                             "less than this")
    parser.add_argument("--crossover", default="", metavar="SHAPES",
                        help="with --run: also benchmarks/crossover.py's sweep of these shapes "
                             "(e.g. 128x4,512x6,1024x6)")
    parser.add_argument("--crossover-vocabs", default="", metavar="SIZES",
                        help="with --crossover: its vocabularies (default: the sweep's)")
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
                  batch_size=args.batch_size, train_steps=args.train_steps,
                  budget=args.budget, minutes=args.minutes, crossover_shapes=args.crossover,
                  crossover_vocabs=args.crossover_vocabs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
