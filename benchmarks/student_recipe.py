"""The student's recipe, measured: variants of one config's PaDIR student at equal wall time.

Each arm is a set of `--set` overrides (the student's section, or the data it learns from:
`distill.beam_size`, `vocab.size`) and a split of its steps between phase 1 (one stage) and
phase 2 (unrolled). An arm's step count is what fits `--minutes-per-arm` at its own step
times, probed first at the config's shapes (`step_seconds`: a phase-2 step runs two decoder
passes), so that a cosine schedule really decays to its end; each phase evaluates at its
last step only. The arms train one after the other in this process over one workdir, which
holds the trained teacher and its distilled data: an arm reuses every complete upstream
artifact and computes the rest (a new `vocab.size` trains its own teacher, a new
`distill.beam_size` distils again: their time is reported, not counted in the budget).
A phase whose steps cost the same in two arms is probed once for both (phase 1: one student
shape, vocabulary and batch; phase 2: those and its stages and loss; dropout, LR, noise and
the data change neither), so that measurement noise does not give arms different budgets (a
glancing arm differs from `base` in phase 2 only). A rerun with the same
`--json` reuses those probes and the arms already trained (probes vary from run to run, and
other step counts would be another student), and keeps the rows of arms it does not rerun.

Per arm: the steps reached (both phases), the student stage's wall time, and on the dev set
decoded here: PaDIR-4 BLEU (one length candidate, as the decode stage's `padir_4`),
Mask-Predict-10 BLEU, PaDIR-4's stutter (% of sentences) and exact-length rate (how often
its output has the reference's length, in the arm's pieces). Prints a markdown table and
writes the rows to `--json`.

    PADIR_DATA_ROOT=/path/to/data python -m benchmarks.student_recipe --minutes-per-arm 15 \\
        [--config configs/multi30k_en_de.yaml] [--arms base,glancing,...] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any, Optional, Sequence

from components import artifacts, corpus, dag, metrics, training_artifact
from components import config as config_lib

log = logging.getLogger("student_recipe")

WIDE = ("student.model={d_model: 256, num_heads: 4, num_encoder_layers: 4, "
        "num_decoder_layers: 4, mlp_dim: 512}")


@dataclasses.dataclass(frozen=True)
class Arm:
    """Overrides of the config, and the share of the student's steps in phase 2 (None: the
    config's phase2_steps / (phase1_steps + phase2_steps))."""

    overrides: tuple[str, ...] = ()
    phase2_fraction: Optional[float] = None


# name -> arm; each differs from `base` (the config as it is) in one choice.
ARMS = {
    "base": Arm(),
    "phase2_half": Arm(phase2_fraction=0.5),
    "phase1_only": Arm(phase2_fraction=0.0),
    "lr_2e-3": Arm(("student.optimizer.learning_rate=2.0e-3",)),
    "lr_5e-4": Arm(("student.optimizer.learning_rate=5.0e-4",)),
    "warmup_400": Arm(("student.optimizer.warmup_steps=400",)),
    "dropout_0": Arm(("student.model.dropout_rate=0.0",)),
    "dropout_0.3": Arm(("student.model.dropout_rate=0.3",)),
    "decoder_2": Arm(("student.model.num_decoder_layers=2",)),
    "decoder_6": Arm(("student.model.num_decoder_layers=6",)),
    "wide_256": Arm((WIDE,)),  # its layers no longer fit the teacher's: from scratch
    "glancing_0.3": Arm(("student.glancing_ratio=0.3",)),
    "glancing_0.5": Arm(("student.glancing_ratio=0.5",)),
    "distill_greedy": Arm(("distill.beam_size=1",)),
    "vocab_4000": Arm(("vocab.size=4000",)),
}


def step_seconds(config: config_lib.Config, phase: int, *, length: int,
                 steps: int = 3) -> float:
    """The student's train-step time in `phase` (1 or 2: its loss as the stage trains it),
    on a synthetic batch of `loop.tokens_per_batch` tokens at `length` (best of `steps`
    timed steps, after a compiling one: the least disturbed by other processes)."""
    import jax
    import numpy as np

    from benchmarks import train_throughput
    from model import sharding, train
    from model.losses import student_loss_settings
    from pipelines import training

    model = training.student_model(config, training.load_tokenizer(config))
    tx, _ = train.make_optimizer(config.student.optimizer, total_steps=1000)
    ema_decay = config.student.optimizer.ema_decay  # the stage's step updates the average
    placement = train.place(model, tx, config.mesh, ema=ema_decay is not None)
    compiled = train.compile_steps(
        model, tx, placement.state_shardings, placement.batch_sharding, ema_decay=ema_decay,
        loss_settings=student_loss_settings(config.student, phase))
    state = placement.create_state(seed=0)
    rows = max(jax.device_count(), config.student.loop.tokens_per_batch // length)
    rows -= rows % jax.device_count()
    batch = sharding.shard_batch(train_throughput.synthetic_batch(
        np.random.default_rng(0), model.vocab_size, rows, length, length),
        placement.batch_sharding)
    state, _ = compiled.train(state, batch)
    jax.block_until_ready(state)
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics_ = compiled.train(state, batch)
        jax.block_until_ready((state, metrics_))
        best = min(best, time.perf_counter() - start)
    return best


def step_shapes(config: config_lib.Config) -> dict[str, str]:
    """Phase -> what its step time depends on: the arms with equal shapes share a probe.
    Phase 1 is one pass of the decoder; phase 2 adds the unrolled passes and their loss."""
    section = config.student
    model = dataclasses.replace(section.model, dropout_rate=0.0)
    phase1 = repr((model, config.vocab.size, section.loop.tokens_per_batch))
    return {"phase1": phase1,
            "phase2": repr((phase1, section.num_passes, section.glancing_ratio > 0))}


def plan_steps(seconds: float, phase1_s: float, phase2_s: float, phase2_fraction: float
               ) -> tuple[int, int]:
    """(phase-1 steps, phase-2 steps) that fill `seconds` with `phase2_fraction` of the
    steps in phase 2; at least 2 in phase 1 (and in phase 2 unless its share is 0)."""
    total = seconds / ((1.0 - phase2_fraction) * phase1_s + phase2_fraction * phase2_s)
    phase2 = round(phase2_fraction * total)
    phase2 = max(2, phase2) if phase2_fraction > 0 else 0
    return max(2, round(total) - phase2), phase2


def sized_overrides(arm: Arm, config: config_lib.Config, phase1: int, phase2: int,
                    minutes: float) -> list[str]:
    """The arm's overrides plus its step counts and cadences: log about 20 times a phase,
    evaluate and checkpoint at each phase's last step, warm up at most half of the shorter
    phase, and a safety stop (reported as the stop reason if it cuts) that leaves room for
    what the probe does not time: a compilation per length bucket and phase, evaluations."""
    shortest = min(phase1, phase2) if phase2 else phase1
    warmup = min(config.student.optimizer.warmup_steps, max(1, shortest // 2))
    cadence = max(phase1, phase2)
    return [*arm.overrides, f"student.phase1_steps={phase1}", f"student.phase2_steps={phase2}",
            f"student.loop.eval_every={cadence}", f"student.loop.checkpoint_every={cadence}",
            f"student.loop.log_every={max(1, min(phase1, phase2 or phase1) // 20)}",
            f"student.optimizer.warmup_steps={warmup}",
            f"student.loop.max_minutes={2 * minutes + 10}"]


def ensure_upstream(config: config_lib.Config) -> float:
    """Computes every stage before the student that is not complete yet; its seconds."""
    from flows import stages

    start = time.perf_counter()
    for stage in dag.active_stages(config):
        if stage in ("student", "decode", "score"):
            continue
        if not artifacts.is_complete(dag.output_uri(config, stage)):
            log.info("computing %s for this arm", stage)
            stages.run_stage(stage, config)
    return time.perf_counter() - start


def dev_figures(config: config_lib.Config, student_uri: str,
                max_sentences: Optional[int]) -> dict[str, Any]:
    """PaDIR-4 and Mask-Predict-10 on the dev set (the first `max_sentences`), batched."""
    from model import trained_model
    from model.decoding import translator

    pairs = list(corpus.read_split(dag.require_input(config, "prepare").uri, "dev"))
    pairs = pairs[:max_sentences]
    sources = [pair["source"] for pair in pairs]
    references = [pair["target"] for pair in pairs]
    loaded = trained_model.load(student_uri)
    lang = config.data.target_lang
    figures: dict[str, Any] = {"dev_sentences": len(pairs)}
    for name, method in (
            ("padir_4", config_lib.DecodeMethod("padir_4", "refine", iterations=4)),
            ("mask_predict_10", config_lib.DecodeMethod("mask_predict_10", "mask_predict",
                                                        iterations=10))):
        decoded = translator.Translator(loaded, method, batch_size=64,
                                        boundaries=config.encode.bucket_boundaries
                                        ).translate(sources)
        hypotheses = [t.hypothesis for t in decoded]
        figures[f"dev_bleu_{name}"] = round(
            metrics.corpus_bleu(hypotheses, references, lang).score, 2)
        if name == "padir_4":
            figures["stutter_pct"] = round(
                100 * metrics.stutter_stats(hypotheses, references).sentence_rate, 1)
            lengths = [len(ids) + 1 for ids in loaded.tokenizer.encode(references)]
            figures["exact_length_pct"] = round(100 * sum(
                len(t.tokens) == n for t, n in zip(decoded, lengths)) / max(1, len(pairs)), 1)
    return figures


def earlier_study(path: str, study: dict[str, Any]) -> dict[str, Any]:
    """The JSON at `path` if it holds a study with the same settings (`study`'s keys), else
    {}: what a rerun may reuse."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        kept = json.load(f)
    return kept if all(kept.get(k) == v for k, v in study.items()) else {}


def run_arm(name: str, arm: Arm, config_path: str, base: Sequence[str], minutes: float, *,
            probe_length: int, max_dev_sentences: Optional[int],
            probes: dict[str, float]) -> dict[str, Any]:
    """Trains one arm to the steps that fit `minutes` (or reuses it) and measures it.
    `probes`: a phase's step shape -> its step time, probed once (and filled here)."""
    from flows import stages

    config = config_lib.load(config_path, [*base, *arm.overrides])
    upstream_s = ensure_upstream(config)
    section = config.student
    fraction = (section.phase2_steps / (section.phase1_steps + section.phase2_steps)
                if arm.phase2_fraction is None else arm.phase2_fraction)
    shapes = step_shapes(config)
    for phase, number in (("phase1", 1), ("phase2", 2)):
        if shapes[phase] not in probes:
            probes[shapes[phase]] = step_seconds(config, number, length=probe_length)
    phase1_s, phase2_s = probes[shapes["phase1"]], probes[shapes["phase2"]]
    phase1, phase2 = plan_steps(60 * minutes, phase1_s, phase2_s, fraction)
    sized = [*base, *sized_overrides(arm, config, phase1, phase2, minutes)]
    config = config_lib.load(config_path, sized)
    start = time.perf_counter()
    if not artifacts.is_complete(dag.output_uri(config, "student")):
        stages.run_stage("student", config)
    wall = time.perf_counter() - start
    student = artifacts.read(dag.output_uri(config, "student"))
    curve = training_artifact.dev_curve(student.uri)
    return {
        "arm": name,
        "overrides": list(arm.overrides),
        "phase2_fraction": round(fraction, 3),
        # unrounded: a rerun plans the same steps
        "probe_step_s": {"phase1": phase1_s, "phase2": phase2_s},
        "planned_steps": {"phase1": phase1, "phase2": phase2},
        "steps_reached": curve[-1]["step"] if curve else None,
        "stop_reason": student.manifest["metrics"].get("stop_reason"),
        "student_minutes": round(wall / 60, 2),
        "upstream_minutes": round(upstream_s / 60, 2),
        "student": student.uri,
        **dev_figures(config, student.uri, max_dev_sentences),
    }


def _table_row(row: dict[str, Any]) -> str:
    cut = f" (cut: {row['stop_reason']})" if row["stop_reason"] else ""
    return (f"| {row['arm']} | {'; '.join(row['overrides']) or '(config as is)'} "
            f"| {row['phase2_fraction']} | {row['planned_steps']['phase1']}"
            f"+{row['planned_steps']['phase2']} | {row['steps_reached']}{cut} "
            f"| {row['student_minutes']} | {row['dev_bleu_padir_4']} "
            f"| {row['dev_bleu_mask_predict_10']} | {row['stutter_pct']} "
            f"| {row['exact_length_pct']} |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/multi30k_en_de.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="overrides of every arm (e.g. a smaller dev set)")
    parser.add_argument("--minutes-per-arm", type=float, default=15.0,
                        help="the student stage's wall time per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    parser.add_argument("--json", default="student_recipe.json", help="where to write the rows")
    parser.add_argument("--probe-length", type=int, default=16,
                        help="the synthetic batch's source and target length of the step-time "
                             "probe (Multi30k's pairs are 12-16 pieces long)")
    parser.add_argument("--max-dev-sentences", type=int,
                        help="decode only the first N dev sentences (default: all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.arms.split(",") if name not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    study = {"minutes_per_arm": args.minutes_per_arm, "config": args.config, "set": args.set}
    # arm -> its row, from an earlier run of the same study first
    rows = {row["arm"]: row for row in earlier_study(args.json, study).get("arms", [])}
    probes: dict[str, float] = {}  # the first row's probe of a shape is the one kept
    for row in rows.values():
        shapes = step_shapes(config_lib.load(args.config, [*args.set, *row["overrides"]]))
        for phase, shape in shapes.items():
            probes.setdefault(shape, row["probe_step_s"][phase])
    print("| arm | overrides | phase-2 share | steps planned | steps reached | student min "
          "| dev PaDIR-4 | dev MP-10 | stutter % | exact length % |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.arms.split(","):
        row = run_arm(name, ARMS[name], args.config, args.set, args.minutes_per_arm,
                      probe_length=args.probe_length, max_dev_sentences=args.max_dev_sentences,
                      probes=probes)
        rows[name] = row
        print(_table_row(row), flush=True)
        with open(args.json, "w") as f:  # after every arm: a long study keeps what it has
            json.dump({**study, "arms": list(rows.values())}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
