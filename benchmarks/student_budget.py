"""How much of the student's gap to its teacher more training closes: the config's student
trained at several multiples of its steps, measured on dev.

Multiple m trains the student stage with m x `phase1_steps` and m x `phase2_steps` (and m x
its `max_minutes` safety stop); everything else is the config's, so m = 1 is the config's own
student (reused when the DAG has trained it) and each other m is a whole run with its own
cosine schedule, not a checkpoint taken halfway through a longer one. Each student is decoded
on the dev set (never test2016) with PaDIR-4 and Mask-Predict-10, beside the teacher's beam 4
there. A line through BLEU against log2(m) says how much each doubling of the student's
compute buys, and how many doublings the issue's goals (PaDIR-4 within 1.5 BLEU of the
teacher's beam 4, Mask-Predict-10 within 1.0) would take if that line held. Prints a table,
writes the rows to `--json` after every multiple (a rerun reuses what it has) and the curve to
`--plot`.

    PADIR_DATA_ROOT=/path/to/data python -m benchmarks.student_budget --multiples 1,2,4 \\
        [--config configs/multi30k_en_de.yaml] [--set k=v ...] [--json F] [--plot F.png]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Any, Optional, Sequence

from benchmarks import student_recipe
from components import artifacts, dag, training_artifact
from components import config as config_lib

log = logging.getLogger("student_budget")

# The goals: the most BLEU each method may trail the teacher's beam 4 by.
GOALS = {"padir_4": 1.5, "mask_predict_10": 1.0}


def scaled_overrides(config: config_lib.Config, multiple: int) -> list[str]:
    """The overrides that train `multiple` times the config's student steps."""
    section = config.student
    overrides = [f"student.phase1_steps={multiple * section.phase1_steps}",
                 f"student.phase2_steps={multiple * section.phase2_steps}"]
    if section.loop.max_minutes is not None:
        overrides.append(f"student.loop.max_minutes={multiple * section.loop.max_minutes}")
    return overrides


def teacher_dev_bleu(config: config_lib.Config) -> float:
    """The teacher's beam-4 BLEU on the whole dev set, as its stage measured it: the line the
    student aims at."""
    teacher = artifacts.read(dag.output_uri(config, "teacher"))
    return teacher.manifest["metrics"]["dev_final"]["beam4"]["bleu"]


def run_multiple(config_path: str, base: Sequence[str], multiple: int) -> dict[str, Any]:
    """Trains (or reuses) the student at `multiple` x the config's steps and measures it on
    the whole dev set."""
    from flows import stages

    overrides = scaled_overrides(config_lib.load(config_path, base), multiple)
    config = config_lib.load(config_path, [*base, *overrides])
    if not artifacts.is_complete(dag.output_uri(config, "student")):
        stages.run_stage("student", config)
    student = artifacts.read(dag.output_uri(config, "student"))
    curve = training_artifact.dev_curve(student.uri)
    return {
        "multiple": multiple,
        "overrides": overrides,
        "steps_reached": curve[-1]["step"] if curve else None,
        "stop_reason": student.manifest["metrics"].get("stop_reason"),
        # The last attempt's wall time: a student resumed after a kill counts only its end.
        "student_minutes": round(student.manifest["wall_seconds"] / 60, 1),
        "student": student.uri,
        "dev_curve": curve,
        **student_recipe.dev_figures(config, student.uri, max_sentences=None),
    }


def doubling_fit(rows: Sequence[dict[str, Any]], method: str) -> Optional[tuple[float, float]]:
    """(BLEU at m = 1, BLEU per doubling): least squares of BLEU against log2(m); None with
    fewer than two multiples."""
    points = [(math.log2(row["multiple"]), row[f"dev_bleu_{method}"]) for row in rows]
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    return mean_y - slope * mean_x, slope


def multiple_for_goal(fit: tuple[float, float], target: float) -> Optional[float]:
    """The multiple of the student's steps at which the fitted line reaches `target`; None
    when the line does not rise."""
    intercept, slope = fit
    if slope <= 0:
        return None
    return 2 ** max(0.0, (target - intercept) / slope)


def summary_lines(rows: Sequence[dict[str, Any]], teacher_bleu: float) -> list[str]:
    lines = ["| student steps | multiple | student min | dev PaDIR-4 (gap) | dev MP-10 (gap) "
             "| stutter % | exact length % |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        cut = f" (cut: {row['stop_reason']})" if row["stop_reason"] else ""
        lines.append(
            f"| {row['steps_reached']}{cut} | {row['multiple']}x | {row['student_minutes']} "
            f"| {row['dev_bleu_padir_4']} ({row['dev_bleu_padir_4'] - teacher_bleu:+.2f}) "
            f"| {row['dev_bleu_mask_predict_10']} "
            f"({row['dev_bleu_mask_predict_10'] - teacher_bleu:+.2f}) "
            f"| {row['stutter_pct']} | {row['exact_length_pct']} |")
    lines.append(f"\nTeacher beam 4 on the same dev sentences: {teacher_bleu}.")
    for method, goal in GOALS.items():
        fit = doubling_fit(rows, method)
        if fit is None:
            continue
        needed = multiple_for_goal(fit, teacher_bleu - goal)
        reach = ("the line does not rise" if needed is None else
                 f"within {goal} of the teacher at about {needed:.3g}x the steps, if the "
                 "line held")
        lines.append(f"{method}: {fit[1]:+.2f} BLEU per doubling of the student's steps; "
                     f"{reach}.")
    return lines


def plot(rows: Sequence[dict[str, Any]], teacher_bleu: float, path: str) -> None:
    """Dev BLEU against the student's steps (log scale), the teacher's beam 4 and the goals;
    thin lines: each run's PaDIR-4 during its training (where its schedule still cut in)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 4.0))
    steps = [row["steps_reached"] for row in rows]
    for i, row in enumerate(rows):
        axes.plot([point["step"] for point in row["dev_curve"]],
                  [point["bleu"] for point in row["dev_curve"]], color="tab:blue", alpha=0.35,
                  linewidth=1, label="PaDIR-4 during each run" if i == 0 else None)
    for method, label, colour in (("padir_4", "PaDIR-4", "tab:blue"),
                                  ("mask_predict_10", "Mask-Predict-10", "tab:orange")):
        axes.plot(steps, [row[f"dev_bleu_{method}"] for row in rows], "o-", color=colour,
                  label=label)
        axes.axhline(teacher_bleu - GOALS[method], color=colour, linestyle=":",
                     label=f"goal for {label} (teacher - {GOALS[method]})")
    axes.axhline(teacher_bleu, color="black", linestyle="--", label="teacher beam 4")
    axes.set_xscale("log", base=2)
    axes.set_xticks(steps, [f"{s}\n({row['multiple']}x)" for s, row in zip(steps, rows)])
    axes.set_xlabel("student steps, both phases (multiple of the config's)")
    axes.set_ylabel("dev BLEU")
    axes.set_title("The student's gap against its training steps")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/multi30k_en_de.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="overrides of every multiple")
    parser.add_argument("--multiples", default="1,2,4",
                        help="multiples of the config's student steps, comma-separated")
    parser.add_argument("--json", default="student_budget.json", help="where to write the rows")
    parser.add_argument("--plot", default="student_budget.png", help="where to draw the curve")
    args = parser.parse_args(argv)
    multiples = [int(m) for m in args.multiples.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    study = {"config": args.config, "set": args.set}
    rows = {row["multiple"]: row
            for row in student_recipe.earlier_study(args.json, study).get("rows", [])}
    config = config_lib.load(args.config, args.set)
    student_recipe.ensure_upstream(config)
    teacher_bleu = teacher_dev_bleu(config)
    for multiple in multiples:
        if multiple not in rows:
            rows[multiple] = run_multiple(args.config, args.set, multiple)
        ordered = [rows[m] for m in sorted(rows)]
        with open(args.json, "w") as f:  # after every multiple: a long study keeps what it has
            json.dump({**study, "teacher_dev_bleu_beam4": teacher_bleu, "rows": ordered},
                      f, indent=2)
        log.info("%dx done", multiple)
    print("\n".join(summary_lines(ordered, teacher_bleu)))
    plot(ordered, teacher_bleu, args.plot)
    print(f"\nwrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
