"""What WMT14 en-de (4.5M training pairs) would cost, extrapolated from measured figures.

Prints three markdown tables for benchmarks/README.md, each followed by its assumptions, one a line:

* the Beam data stages (prepare, vocab, encode), from `benchmarks/scaling.py --json` at its
  largest size (most pairs read by prepare): the CPU time per pair, scaled by the words of
  a pair, since these stages tokenise, count and normalise words,
      CPU s per pair = cpu_seconds / pairs x (assumed words per pair / measured words per pair)
      CPU-hours = CPU s per pair x pairs / 3600
      wall hours = CPU-hours / (max_num_workers x cores a worker uses)
  with the workers of the config's `runner.options` (`--max_num_workers`, `--machine_type`;
  one core per worker when `--experiments=no_use_multiple_sdk_containers` keeps one
  Python process per VM), and the peak RSS of the stage's process at each measured size
  (flat across sizes: memory does not grow with the corpus);
* training, from the FLOPs of benchmarks/train_throughput.py's `step_flops` (the module
  docstring there has the formula) on rows of S = T = `--pair-tokens` padded tokens,
  `loop.tokens_per_batch // pair_tokens` rows a step,
      FLOPs = step(teacher, K=1) x teacher.steps + step(student, K=1) x phase1_steps
              + step(student, K=num_passes) x phase2_steps
      chip-hours = FLOPs / (peak FLOP/s per chip x MFU) / 3600; wall = chip-hours / chips;
* distillation, the teacher's beam search over every training source (forward only;
  attention, the cache and the search's top-k ignored),
      FLOPs per sentence = 2 x N_enc x S + beam x T x 2 x (N_dec + V x D)
  (N_enc, N_dec: encoder and decoder parameters without position tables, as step_flops
  counts them; V x D the tied output projection), on TPU chips at `--decode-mfu`, and on
  CPU cores at the effective FLOP/s per core that the benchmark teacher reached
  (`--measured-distill SENTENCES_PER_S,CORES,CONFIG`: that formula for the config's teacher
  at S = T = `--measured-tokens`, times its sentences/s, over its cores).

Model shapes come from `jax.eval_shape` of the models' init: no parameter is allocated.

    python -m benchmarks.wmt_plan --scaling-json scaling.json
    python -m benchmarks.wmt_plan --scaling-json scaling.json \\
        --config configs/overlays/wmt14.yaml --tpu-chips 32 \\
        --measured-distill 58.9,2,configs/multi30k_en_de.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Optional, Sequence

import jax

from benchmarks import train_throughput
from components import config as config_lib
from model import train
from model.models import ARModel, PaDIRModel

DATA_STAGES = ("prepare", "vocab", "encode")
WMT_PAIRS = 4_500_000
WMT_WORDS_PER_PAIR = 46.0  # about 23 whitespace words a side: replace with the real count


# --- the Beam data stages --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workers:
    """The Dataflow workers of the pure-Python stages."""

    count: int  # --max_num_workers
    machine_type: str
    cores: int  # per worker, that a pure-Python stage uses


@dataclasses.dataclass(frozen=True)
class DataStageRow:
    stage: str
    measured_pairs: int
    cpu_s_per_1k: float  # measured, at the measured words per pair
    words_measured: float
    words_assumed: float
    cpu_hours: float  # at the target size and words per pair
    wall_hours: float  # on all the workers, perfectly parallel
    peak_rss_mib: tuple[float, ...]  # per process, at each measured size, fewest pairs first


def _flag(options: Sequence[str], name: str) -> Optional[str]:
    """The value of the last `--name=value` in `options` (later flags override)."""
    values = [option.split("=", 1)[1] for option in options if option.startswith(f"--{name}=")]
    return values[-1] if values else None


def machine_vcpus(machine_type: str) -> int:
    """vCPUs of a Compute Engine machine type: the suffix (n2-standard-8: 8, n1-standard-1:
    1), or the count after `custom` (n2-custom-4-16384: 4)."""
    parts = machine_type.split("-")
    count = parts[parts.index("custom") + 1] if "custom" in parts else parts[-1]
    if not count.isdigit():
        raise ValueError(f"machine type {machine_type!r}: cannot read its vCPUs")
    return int(count)


def workers(options: Sequence[str]) -> Workers:
    """The workers `runner.options` asks for. With `no_use_multiple_sdk_containers` a VM runs one
    Python process, so a pure-Python stage keeps one of its cores busy (the GIL)."""
    count, machine_type = _flag(options, "max_num_workers"), _flag(options, "machine_type")
    if count is None or machine_type is None:
        raise ValueError("runner.options must give --max_num_workers=N and --machine_type=TYPE")
    one_process = any("no_use_multiple_sdk_containers" in option for option in options
                      if option.startswith("--experiments="))
    return Workers(int(count), machine_type, 1 if one_process else machine_vcpus(machine_type))


def _rows_of(entry: dict) -> dict[str, dict]:
    return {run["stage"]: run for run in entry["stages"]}


def sizes_by_pairs(scaling: dict) -> list[str]:
    """The size labels, fewest pairs read by prepare first."""
    return sorted(scaling, key=lambda label: _rows_of(scaling[label])["prepare"]["pairs"])


def largest_size(scaling: dict) -> str:
    """The size label whose prepare stage read the most pairs."""
    return sizes_by_pairs(scaling)[-1]


def data_stage_rows(scaling: dict, words_per_pair: float, pairs: int,
                    on: Workers) -> list[DataStageRow]:
    """Per data stage: the largest size's CPU time per pair, scaled to `pairs` pairs of
    `words_per_pair` words, on the workers `on`."""
    label = largest_size(scaling)
    largest = _rows_of(scaling[label])
    measured_words = scaling[label]["words_per_pair"]
    rows = []
    for stage in DATA_STAGES:
        run = largest[stage]
        per_pair = run["cpu_seconds"] / run["pairs"]
        cpu_hours = per_pair * words_per_pair / measured_words * pairs / 3600
        rows.append(DataStageRow(
            stage, run["pairs"], 1e3 * per_pair, measured_words, words_per_pair, cpu_hours,
            cpu_hours / (on.count * on.cores),
            tuple(_rows_of(scaling[size])[stage]["peak_rss_mib"]
                  for size in sizes_by_pairs(scaling))))
    return rows


# --- training ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainRow:
    name: str
    steps: int
    batch: int  # rows of pair_tokens tokens a side
    step_flops: float
    flops: float
    chip_hours: float
    wall_hours: float


def model_params(model):
    """The parameter tree as `jax.ShapeDtypeStruct`s: shapes only, nothing allocated."""
    return jax.eval_shape(model.init, jax.random.PRNGKey(0), train.example_batch(model))


def teacher_of(config: config_lib.Config) -> ARModel:
    return ARModel(config.teacher.model, config.vocab.size)


def training_steps(config: config_lib.Config, pair_tokens: int
                   ) -> list[tuple[str, int, int, float]]:
    """(name, steps, rows a step, FLOPs a step) of the teacher and the student's two phases,
    on rows of `pair_tokens` tokens a side."""
    vocab = config.vocab.size
    teacher_cfg, student_cfg = config.teacher.model, config.student.model
    teacher = model_params(teacher_of(config))
    student = model_params(PaDIRModel(student_cfg, vocab, train_throughput.FIRST_REAL_ID))
    teacher_batch = config.teacher.loop.tokens_per_batch // pair_tokens
    student_batch = config.student.loop.tokens_per_batch // pair_tokens

    def flops(params, cfg, batch, padir, passes):
        return train_throughput.step_flops(params, cfg, vocab, batch, pair_tokens, pair_tokens,
                                           padir, passes)[0]

    passes = config.student.num_passes
    return [
        ("teacher (AR)", config.teacher.steps, teacher_batch,
         flops(teacher, teacher_cfg, teacher_batch, False, 1)),
        ("student phase 1 (K=1)", config.student.phase1_steps, student_batch,
         flops(student, student_cfg, student_batch, True, 1)),
        (f"student phase 2 (K={passes})", config.student.phase2_steps, student_batch,
         flops(student, student_cfg, student_batch, True, passes)),
    ]


def train_rows(steps: Sequence[tuple[str, int, int, float]], peak_flops_per_chip: float,
               mfu: float, chips: int) -> list[TrainRow]:
    """Rows of `training_steps`' figures: FLOPs, chip-hours and wall hours."""
    rows = []
    for name, count, batch, per_step in steps:
        chip_hours = per_step * count / (peak_flops_per_chip * mfu) / 3600
        rows.append(TrainRow(name, count, batch, per_step, per_step * count, chip_hours,
                             chip_hours / chips))
    return rows


# --- distillation -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DistillRow:
    device: str  # "TPU chip" or "CPU core"
    flops_per_sentence: float
    sentences: int
    flops: float
    flops_per_s: float  # effective, per chip or core
    hours: float  # chip- or core-hours
    units: int  # chips or cores of the wall figure
    wall_hours: float


def sentence_flops(n_enc: int, n_dec: int, vocab: int, d_model: int, beam: int, src: int,
                   tgt: int) -> float:
    """Forward FLOPs of one beam search: the encoder once over `src` tokens, the decoder and
    the output projection for each of `tgt` steps of each of `beam` beams."""
    return float(2 * n_enc * src + beam * tgt * 2 * (n_dec + vocab * d_model))


def teacher_sentence_flops(config: config_lib.Config, tokens: int) -> float:
    """`sentence_flops` of `config`'s teacher at its `distill.beam_size`, S = T = `tokens`."""
    params = model_params(teacher_of(config))
    n_enc = train_throughput._count(params["encoder"], skip=("pos_embedding",))
    n_dec = train_throughput._count(params["decoder"], skip=("pos_embedding",))
    return sentence_flops(n_enc, n_dec, config.vocab.size, config.teacher.model.d_model,
                          config.distill.beam_size, tokens, tokens)


def distill_rows(flops_per_sentence: float, sentences: int, chip_flops_per_s: float, chips: int,
                 core_flops_per_s: Optional[float], cores: int) -> list[DistillRow]:
    """The TPU row, and the CPU row when an effective FLOP/s per core is known."""
    flops = flops_per_sentence * sentences
    devices = [("TPU chip", chip_flops_per_s, chips)]
    if core_flops_per_s is not None:
        devices.append(("CPU core", core_flops_per_s, cores))
    rows = []
    for device, rate, units in devices:
        hours = flops / rate / 3600
        rows.append(DistillRow(device, flops_per_sentence, sentences, flops, rate, hours, units,
                               hours / units))
    return rows


@dataclasses.dataclass(frozen=True)
class MeasuredDistill:
    """The benchmark teacher's measured distill throughput."""

    sentences_per_s: float
    cores: int
    config: str


def measured_distill(text: str) -> MeasuredDistill:
    """`SENTENCES_PER_S,CORES,CONFIG` (argparse type)."""
    parts = text.split(",", 2)
    try:
        rate, cores, path = float(parts[0]), int(parts[1]), parts[2]
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(f"expected SENTENCES_PER_S,CORES,CONFIG, got {text!r}")
    if rate <= 0 or cores < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sentences/s and cores must be positive")
    return MeasuredDistill(rate, cores, path)


# --- printing ---------------------------------------------------------------------------


def _sci(value: float) -> str:
    """3 significant figures, e.g. 2.38e13."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _hours(hours: float) -> str:
    return f"{hours:,.0f}" if hours >= 100 else f"{hours:.1f}" if hours >= 10 else f"{hours:.2f}"


def data_table(rows: Sequence[DataStageRow], pairs: int, on: Workers,
               sizes: Sequence[str]) -> str:
    lines = [f"| stage | measured pairs | CPU s / 1k pairs (measured) | words/pair measured -> "
             f"assumed | CPU-hours at {pairs:,} pairs | wall h on {on.count} x {on.machine_type} "
             f"({on.cores} core{'s' if on.cores > 1 else ''} each) | peak RSS MiB per process at "
             f"{' / '.join(sizes)} |", "|---" * 7 + "|"]
    for row in rows:
        rss = " / ".join(f"{mib:.0f}" for mib in row.peak_rss_mib)
        lines.append(f"| {row.stage} | {row.measured_pairs:,} | {row.cpu_s_per_1k:.2f} s | "
                     f"{row.words_measured:.1f} -> {row.words_assumed:.1f} | "
                     f"{_hours(row.cpu_hours)} h | {_hours(row.wall_hours)} h | {rss} |")
    lines.append(f"| total | | | | {_hours(sum(r.cpu_hours for r in rows))} h | "
                 f"{_hours(sum(r.wall_hours for r in rows))} h | |")
    return "\n".join(lines)


def train_table(rows: Sequence[TrainRow], chips: int) -> str:
    lines = ["| model | steps | rows / step | FLOP / step | FLOP | chip-hours | "
             f"wall h on {chips} chips |", "|---" * 7 + "|"]
    for row in rows:
        lines.append(f"| {row.name} | {row.steps:,} | {row.batch:,} | {_sci(row.step_flops)} | "
                     f"{_sci(row.flops)} | {_hours(row.chip_hours)} h | "
                     f"{_hours(row.wall_hours)} h |")
    lines.append(f"| total | | | | {_sci(sum(r.flops for r in rows))} | "
                 f"{_hours(sum(r.chip_hours for r in rows))} h | "
                 f"{_hours(sum(r.wall_hours for r in rows))} h |")
    return "\n".join(lines)


def distill_table(rows: Sequence[DistillRow]) -> str:
    lines = ["| device | FLOP / sentence | sentences | FLOP | effective FLOP/s per device | "
             "device-hours | wall h |", "|---" * 7 + "|"]
    for row in rows:
        lines.append(f"| {row.device} | {_sci(row.flops_per_sentence)} | {row.sentences:,} | "
                     f"{_sci(row.flops)} | {_sci(row.flops_per_s)} | {_hours(row.hours)} "
                     f"{row.device.split()[1]}-hours | {_hours(row.wall_hours)} h on "
                     f"{row.units:,} {row.device.split()[1]}s |")
    return "\n".join(lines)


def _assumptions(lines: Sequence[str]) -> str:
    return "\n".join(f"- {line}" for line in lines)


# --- main -------------------------------------------------------------------------------


def load_config(path: str, overrides: Sequence[str]) -> config_lib.Config:
    """`config_lib.load`, with a placeholder PADIR_DATA_ROOT while it reads, if none is set:
    only shapes and step counts are read here, never a corpus."""
    if "PADIR_DATA_ROOT" in os.environ:
        return config_lib.load(path, overrides)
    os.environ["PADIR_DATA_ROOT"] = "unused-by-wmt_plan"
    try:
        return config_lib.load(path, overrides)
    finally:
        del os.environ["PADIR_DATA_ROOT"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scaling-json", required=True, metavar="PATH",
                        help="what `benchmarks/scaling.py --json` wrote")
    parser.add_argument("--config", default="configs/overlays/wmt14.yaml",
                        help="the target: its models, steps, vocabulary and runner.options")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value of --config")
    parser.add_argument("--pairs", type=int, default=WMT_PAIRS, help="training pairs")
    parser.add_argument("--words-per-pair", type=float, default=WMT_WORDS_PER_PAIR,
                        help="whitespace words of a training pair, both sides (an assumption: "
                        "about 23 a side for WMT14 en-de; replace it with the vocab stage's "
                        "words / train_pairs counted on the real data)")
    parser.add_argument("--pair-tokens", type=int, default=32,
                        help="source and target length of a padded row (WMT news sentences: "
                        "about 27 pieces)")
    parser.add_argument("--tpu-peak-tflops", type=float, default=275.0,
                        help="peak TFLOP/s per chip (TPU v4, bf16)")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="model FLOPs utilisation of training (typical of T5X/MaxText)")
    parser.add_argument("--tpu-chips", type=int, default=8)
    parser.add_argument("--decode-mfu", type=float, default=0.1,
                        help="FLOPs utilisation of beam search (small batches use "
                        "accelerators poorly)")
    parser.add_argument("--measured-distill", type=measured_distill,
                        metavar="SENTENCES_PER_S,CORES,CONFIG",
                        help="the benchmark teacher's measured distill throughput, e.g. "
                        "58.9,2,configs/multi30k_en_de.yaml; without it no CPU figure")
    parser.add_argument("--measured-tokens", type=int, default=16,
                        help="S = T of the measured distill (Multi30k: average target "
                        "pieces + EOS)")
    parser.add_argument("--distill-cores", type=int, default=1600,
                        help="CPU cores of the distill job's wall figure (wmt14.yaml's "
                        "example: 200 n2-standard-8 workers)")
    args = parser.parse_args(argv)

    config = load_config(args.config, args.set)
    with open(args.scaling_json) as f:
        scaling = json.load(f)
    try:
        on = workers(config.runner.options)
    except ValueError as e:
        print(f"wmt_plan: {args.config}: {e}", file=sys.stderr)
        return 1
    label = largest_size(scaling)

    data = data_stage_rows(scaling, args.words_per_pair, args.pairs, on)
    print(f"### Beam data stages at {args.pairs:,} pairs\n")
    print(data_table(data, args.pairs, on, sizes_by_pairs(scaling)))
    print("\n" + _assumptions([
        f"CPU time per pair measured at the largest size ({label}, {args.scaling_json}): "
        "user + system time of the stage's process, start-up and imports included, on the "
        "local FnApiRunner standing in for a Dataflow worker.",
        f"cost proportional to words: {args.words_per_pair:g} words a pair assumed for the "
        "target (replace with the vocab stage's words / train_pairs on the real data).",
        f"wall = CPU-hours over {on.count} workers x {on.cores} core(s), perfectly parallel; "
        "worker start-up and shuffles not counted.",
        "vocab trains SentencePiece on the launcher (at most vocab.max_words distinct "
        "words), which neither scales with pairs nor spreads over the workers.",
    ]))

    training = train_rows(training_steps(config, args.pair_tokens),
                          args.tpu_peak_tflops * 1e12, args.mfu, args.tpu_chips)
    print(f"\n### Training ({args.config})\n")
    print(train_table(training, args.tpu_chips))
    print("\n" + _assumptions([
        f"FLOPs of benchmarks/train_throughput.py's step_flops on rows of S = T = "
        f"{args.pair_tokens} padded tokens, loop.tokens_per_batch // {args.pair_tokens} rows "
        "a step (real batches mix the encode buckets at the same padded tokens).",
        f"{args.mfu:g} MFU of {args.tpu_peak_tflops:g} TFLOP/s per chip; evaluation, "
        "checkpoints and compilation not counted.",
    ]))

    teacher_flops = teacher_sentence_flops(config, args.pair_tokens)
    core_rate = None
    if args.measured_distill:
        measured = args.measured_distill
        bench = load_config(measured.config, ())
        core_rate = (teacher_sentence_flops(bench, args.measured_tokens)
                     * measured.sentences_per_s / measured.cores)
    distill = distill_rows(teacher_flops, args.pairs,
                           args.tpu_peak_tflops * 1e12 * args.decode_mfu, args.tpu_chips,
                           core_rate, args.distill_cores)
    print(f"\n### Distillation: beam {config.distill.beam_size} over {args.pairs:,} sources\n")
    print(distill_table(distill))
    lines = [
        "FLOPs per sentence = 2 x N_enc x S + beam x T x 2 x (N_dec + V x D): attention, the "
        "cache and the search's top-k ignored; N_dec includes the cross-attention key/value "
        "projections that the cache computes once.",
        f"S = T = {args.pair_tokens} for every sentence; a batch's search runs until its last "
        "row is done, on sources padded to their bucket, so the real T is above the mean.",
        f"TPU at {args.decode_mfu:g} of {args.tpu_peak_tflops:g} TFLOP/s per chip.",
    ]
    if args.measured_distill:
        lines.append(
            f"CPU: {measured.sentences_per_s:g} sentences/s on {measured.cores} core(s) with "
            f"{measured.config}'s teacher, at S = T = {args.measured_tokens}: "
            f"{core_rate / 1e9:.2f} effective GFLOP/s per core by the same formula, assumed "
            "to hold at the target teacher's shapes.")
    print("\n" + _assumptions(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
