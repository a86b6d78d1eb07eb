"""The teacher's recipe, measured: variants of one config's teacher trained for equal wall time.

Each arm is a set of `--set` overrides of the teacher's section (model shape, token batch,
learning-rate schedule, dropout, label smoothing, parameter averaging). An arm's step count
is what fits `--minutes` at its own step time (probed first with
benchmarks/train_throughput.py at the config's shapes), so that a schedule that decays to
zero at the last step really reaches it; evaluation runs only at the end. Every arm trains
in a fresh `python -m flows.cli stage teacher` process on the same prepared, tokenised and
encoded data (one workdir; each arm is its own teacher key), one after the other, and the
table gives its steps, wall time and dev BLEU (sacreBLEU, greedy and beam 4, and beam 4's
tokenised lowercased BLEU, from the stage's manifest). A rerun reuses the arms already trained.

    PADIR_DATA_ROOT=/path/to/data python benchmarks/recipe.py --minutes 8 \\
        [--config configs/multi30k_en_de.yaml] [--arms base,tiny,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from components import artifacts, dag
from components import config as config_lib

TINY = ("teacher.model={d_model: 128, num_heads: 4, num_encoder_layers: 4, "
        "num_decoder_layers: 4, mlp_dim: 256}")  # fairseq transformer_tiny, the anchor's shape
COSINE = "teacher.optimizer.decay=cosine"

# name -> overrides of the config's teacher; each arm differs from one before it in one choice.
ARMS = {
    "base": [],
    "cosine": [COSINE],
    "tiny": [TINY, COSINE, "teacher.optimizer.learning_rate=2.0e-3"],
    "tiny_batch4k": [TINY, COSINE, "teacher.optimizer.learning_rate=2.0e-3",
                     "teacher.loop.tokens_per_batch=4096"],
    "tiny_dropout0.3": [TINY, COSINE, "teacher.optimizer.learning_rate=2.0e-3",
                        "teacher.model.dropout_rate=0.3"],
    "tiny_smoothing0": [TINY, COSINE, "teacher.optimizer.learning_rate=2.0e-3",
                        "teacher.label_smoothing=0.0"],
    "tiny_ema": [TINY, COSINE, "teacher.optimizer.learning_rate=2.0e-3",
                 "teacher.optimizer.ema_decay=0.999"],
}


def step_seconds(config_path: str, overrides: list[str]) -> float:
    """The teacher's train-step time at the config's shapes (best of the timed steps: the
    least disturbed by other processes, as for the throughput benchmark's ceiling)."""
    command = [sys.executable, "benchmarks/train_throughput.py", "--config", config_path,
               "--models", "teacher", "--steps", "5"]
    for item in overrides:
        command += ["--set", item]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["step_s"]


def train_arm(config_path: str, overrides: list[str], minutes: float) -> dict:
    """Trains one arm to the steps that fit `minutes`; returns its manifest's figures."""
    seconds = step_seconds(config_path, overrides)
    steps = max(10, int(minutes * 60 / seconds))
    sized = [*overrides, f"teacher.steps={steps}", f"teacher.loop.eval_every={steps}",
             f"teacher.loop.checkpoint_every={steps}", f"teacher.loop.log_every={max(1, steps // 20)}",
             f"teacher.optimizer.warmup_steps={min(200, steps // 10)}",
             f"teacher.loop.max_minutes={2 * minutes + 2}"]  # a safety stop, reported if it cuts
    command = [sys.executable, "-m", "flows.cli", "stage", "teacher", config_path]
    for item in sized:
        command += ["--set", item]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    wall = time.perf_counter() - start
    config = config_lib.load(config_path, sized)
    manifest = artifacts.require(config.workdir, "teacher", dag.stage_key(config, "teacher"))
    final = manifest.manifest["metrics"]["dev_final"]
    return {
        "probe_step_s": seconds,
        "steps": manifest.manifest["counts"]["steps"],
        "stage_minutes": round(wall / 60, 1),
        "stop_reason": manifest.manifest["metrics"].get("stop_reason"),
        "dev_bleu_greedy": final["greedy"]["bleu"],
        "dev_bleu_beam4": final["beam4"]["bleu"],
        "dev_bleu_beam4_tok_lc": final["beam4"]["bleu_tok_lc"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/multi30k_en_de.yaml")
    parser.add_argument("--minutes", type=float, default=8.0, help="wall time per arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for stage in ("prepare", "vocab", "encode"):  # reused when already complete
        subprocess.run([sys.executable, "-m", "flows.cli", "stage", stage, args.config], check=True)
    print("| arm | overrides | probe s/step | steps | stage min | dev BLEU greedy | beam 4 "
          "| beam 4 tok. lc |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.arms.split(","):
        row = train_arm(args.config, ARMS[name], args.minutes)
        cut = f" (cut: {row['stop_reason']})" if row["stop_reason"] else ""
        print(f"| {name} | {'; '.join(ARMS[name]) or '(config as is)'} | {row['probe_step_s']} "
              f"| {row['steps']}{cut} | {row['stage_minutes']} | {row['dev_bleu_greedy']} "
              f"| {row['dev_bleu_beam4']} | {row['dev_bleu_beam4_tok_lc']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
