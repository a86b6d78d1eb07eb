"""The score stage's report: quality and speed per test set and decoding method.

    result = score_method("padir_4", "refine", records, references, throughput, timed,
                          setting=describe_setting(method))   # method: config.DecodeMethod
    report = build_report({"test2016": [result, ...]})   # JSON-able dict
    markdown = render_markdown(report)
    write_plots(report, {"test2016": {"padir_4": timed}}, out_dir)   # PNG paths

`records` are the decode stage's lines of one method from its batched pass (`{"id",
"hypothesis", "latency_s", "passes", "source_tokens", ...}`), `references` the raw
reference of each, in the same order; `throughput` the decode manifest's figures for that
pass; `timed` the lines of the batch-1 pass over the latency sample.

Per method: its setting (`describe_setting`: what its kind reads of the decode config, e.g.
"iterations 4, 1 length candidate x offsets (0)" or "beam 4, length penalty 0.6"),
sacreBLEU BLEU and chrF with their signatures, tokenised lowercased BLEU (only to compare
with published figures that use it), stutter (components/metrics.py), latency per sentence
at batch 1 (mean, median, p90, p99 over the latency sample), batched throughput (sentences
and tokens per second of decode time), sequential decoder calls per sentence (the figure
that predicts an accelerator at batch 1, never called a speedup), draft and verify's rounds
and accepted tokens per round (`draft_cost`), and speedups over the AR
baselines: the first method of each kind of `BASELINE_KINDS` (our JAX search, `ar_greedy`
and `ar_beam`, and the teacher served by CTranslate2, `ct2_greedy` and `ct2_beam`) that
decodes with the teacher: the AR student's rows are compared with them, never one of them.
A latency speedup is baseline latency / method latency per statistic (> 1: faster); a
throughput speedup is method sentences/s / baseline sentences/s. Both were measured in one
decode job, one decode at a time, on the same machine. The markdown then says in words, per method of
the student and per regime (batch 1 median and p99, batched throughput), how it compares
with the fastest AR row of that regime, whichever model and engine that is, with both
BLEUs, and in which regimes it is on the BLEU/speed frontier (no row both as fast and as
good). Last, per CTranslate2 method and pass, every thread setting its sweep timed beside
the one it chose (the decode manifest's `ctranslate2_sweep`, given to `build_report`).

Plots (matplotlib, Agg backend, imported on use): BLEU against median latency at batch 1
and against batched throughput, every method a point and the frontier drawn; stutter per
method; latency against source length; one of each per test set. And the
student's dev BLEU against its training steps (components/training_artifact.py
`dev_curve`, given to `training_summary`), so that a reader sees whether more training
would pay.
"""

from __future__ import annotations

import dataclasses
import io
import posixpath
import statistics
from typing import Any, Mapping, Optional, Sequence

from components import artifacts, metrics
from components.config import DECODING_KINDS, DecodeMethod

BASELINE_KINDS = ("ar_greedy", "ar_beam", "ct2_greedy", "ct2_beam")
REGIMES = (("median", "batch 1 median"), ("p99", "batch 1 p99"), ("throughput", "batched"))
PLOTS = ("bleu_vs_latency", "bleu_vs_throughput", "stutter", "latency_vs_length")
DEV_CURVE_PLOT = "student_dev_bleu"  # plots/student_dev_bleu.png, when the curve is known


@dataclasses.dataclass(frozen=True)
class MethodResult:
    """Everything the report says about one method on one test set."""

    method: str
    kind: str
    sentences: int
    bleu: metrics.CorpusScore
    chrf: metrics.CorpusScore
    bleu_tok_lc: metrics.CorpusScore
    stutter: metrics.StutterStats
    latency: metrics.LatencySummary  # seconds per sentence, batch 1
    throughput: Mapping[str, Any]  # the decode manifest's: sentences_per_s, tokens_per_s, ...
    mean_passes: float
    truncated: int  # sources cut to the widest length bucket
    setting: str = ""  # describe_setting of the method ("" where unknown)
    stage: str = ""  # DecodeMethod.stage: the model it decoded with ("" where unknown)
    draft: Optional[Mapping[str, float]] = None  # draft_verify's cost (`draft_cost`)


def describe_setting(method: DecodeMethod) -> str:
    """The settings a method's kind reads (`config.DECODING_KINDS`), in words, in that order:
    "greedy", "beam 4, length penalty 0.6", "iterations 4, 1 length candidate x offsets (0)",
    "2 tokens per pass by margin, 3 length candidates x offsets (-1, 0, 1)"; `init` only
    when it is not the default [MASK] ("init random"); the AR model only when it is not
    the teacher ("greedy, model ar_student"); "shortlist" last when it is on
    ("greedy, shortlist")."""
    reads = DECODING_KINDS[method.kind].options
    words = []
    for option in reads:
        value = getattr(method, option)
        if option == "beam_size":
            words.append(f"beam {value}")
        elif option == "length_penalty":
            words.append(f"length penalty {value:g}")
        elif option == "iterations":
            words.append(f"{value} drafter pass{'' if value == 1 else 'es'} a draft"
                         if method.kind == "draft_verify" else f"iterations {value}")
        elif option == "num_length_candidates":
            offsets = ", ".join(str(offset) for offset in method.length_offsets)
            words.append(f"{value} length candidate{'' if value == 1 else 's'} x offsets "
                         f"({offsets})")
        elif option == "length_offsets":
            if "num_length_candidates" not in reads:
                words.append(f"offsets ({', '.join(str(offset) for offset in value)})")
        elif option == "tokens_per_step":
            words.append(f"{value} token{'' if value == 1 else 's'} per pass by margin")
        elif option == "compute_type":
            words.append(f"CTranslate2 {value}")
        elif option == "tolerance_top_k":
            words.append("exact" if value == 1 else
                         f"tolerant: top {value} within {method.tolerance_margin:g} nats")
        elif option == "tolerance_margin":
            pass  # with tolerance_top_k
        elif option not in ("shortlist", "model"):
            words.append(f"{option.replace('_', ' ')} {value}")
    words = words or [method.kind.replace("ar_", "")]
    if method.stage != DECODING_KINDS[method.kind].stage:
        words.append(f"model {method.stage}")
    return ", ".join(words + (["shortlist"] if method.shortlist else []))


def throughput(records: Sequence[Mapping[str, Any]], batch_size: int) -> dict[str, Any]:
    """Sentences and hypothesis tokens (EOS included) per second of decode-call time, from
    the records of a batched pass (their `latency_s` sum to the batches' decode time)."""
    seconds = sum(record["latency_s"] for record in records)
    tokens = sum(record["hypothesis_tokens"] for record in records)
    return {
        "batch_size": batch_size,
        "sentences": len(records),
        "tokens": tokens,
        "seconds": seconds,
        "sentences_per_s": len(records) / seconds if seconds > 0 else None,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
    }


def score_method(method: str, kind: str, records: Sequence[Mapping[str, Any]],
                 references: Sequence[str], throughput: Mapping[str, Any],
                 latency_records: Sequence[Mapping[str, Any]], *,
                 setting: str = "", target_lang: str = "", stage: str = "") -> MethodResult:
    """Scores one method's decode records against their references (same order); its
    latency comes from the records of the batch-1 pass, `latency_records`; `setting` is
    its `describe_setting`; `target_lang` picks BLEU's tokeniser (`metrics.corpus_bleu`);
    `stage` is the model it decoded with (`DecodeMethod.stage`, which `baselines` reads)."""
    hypotheses = [record["hypothesis"] for record in records]
    return MethodResult(
        method=method,
        kind=kind,
        sentences=len(records),
        bleu=metrics.corpus_bleu(hypotheses, references, target_lang),
        chrf=metrics.corpus_chrf(hypotheses, references),
        bleu_tok_lc=metrics.tokenized_lowercased_bleu(hypotheses, references),
        stutter=metrics.stutter_stats(hypotheses, references),
        latency=metrics.summarize_latency([record["latency_s"] for record in latency_records]),
        throughput=dict(throughput),
        mean_passes=statistics.fmean(record["passes"] for record in records),
        truncated=sum(1 for record in records if record.get("truncated")),
        setting=setting,
        stage=stage,
        draft=draft_cost(records) if records and "rounds" in records[0] else None,
    )


def draft_cost(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """What draft and verify cost per sentence (records with `rounds` and `accepted`): the
    rounds' mean, median and p90, the drafted tokens the teacher accepted per round, and
    the output tokens per round (accepted + the teacher's own, over greedy's one a step)."""
    rounds = [record["rounds"] for record in records]
    total_rounds = sum(rounds)
    return {
        "rounds_mean": statistics.fmean(rounds),
        "rounds_median": metrics.percentile(rounds, 50),
        "rounds_p90": metrics.percentile(rounds, 90),
        "accepted_per_round": sum(r["accepted"] for r in records) / total_rounds,
        "tokens_per_round": sum(r["hypothesis_tokens"] for r in records) / total_rounds,
    }


def baselines(results: Sequence[MethodResult]) -> dict[str, MethodResult]:
    """Kind -> the first method of that kind, for each of `BASELINE_KINDS` present, of those
    that decode with the teacher (or do not say): the AR student is measured, not a baseline."""
    firsts = {kind: next((r for r in results if r.kind == kind and r.stage != "ar_student"),
                         None) for kind in BASELINE_KINDS}
    return {kind: result for kind, result in firsts.items() if result is not None}


def speedups(result: MethodResult, baseline: MethodResult) -> dict[str, Optional[float]]:
    """Latency speedups (median, p99) and the throughput ratio of `result` over `baseline`."""
    latency = metrics.speedups(baseline.latency, result.latency) \
        if result.latency.median > 0 and result.latency.p99 > 0 else {}
    mine = result.throughput.get("sentences_per_s")
    theirs = baseline.throughput.get("sentences_per_s")
    return {
        "median": latency.get("median"),
        "p99": latency.get("p99"),
        "throughput": mine / theirs if mine and theirs else None,
    }


def _score(score: metrics.CorpusScore) -> dict[str, Any]:
    return {"score": score.score, "signature": score.signature, "details": score.details}


def result_dict(result: MethodResult, bases: Mapping[str, MethodResult]) -> dict[str, Any]:
    """One method as JSON-able data (the entries of report.json)."""
    stutter = result.stutter
    return {
        "method": result.method,
        "kind": result.kind,
        "setting": result.setting,
        "sentences": result.sentences,
        "truncated": result.truncated,
        "bleu": _score(result.bleu),
        "chrf": _score(result.chrf),
        "bleu_tok_lc": _score(result.bleu_tok_lc),
        "stutter": {"sentence_rate": stutter.sentence_rate,
                    "per_100_words": stutter.per_100_words,
                    **dataclasses.asdict(stutter)},
        "latency_s": dataclasses.asdict(result.latency),
        "throughput": dict(result.throughput),
        "stage": result.stage,
        "mean_passes": result.mean_passes,
        **({"draft": dict(result.draft)} if result.draft else {}),
        "speedup": {f"vs_{base.method}": speedups(result, base) for base in bases.values()},
    }


def training_summary(manifests: Mapping[str, Mapping[str, Any]],
                     dev_curves: Mapping[str, Sequence[Mapping[str, Any]]] = {}
                     ) -> dict[str, Any]:
    """Training stage -> its manifest -> what the report says of it: the steps it trained
    (the last phase's, for the student), why it stopped early if it did (`stop_reason`:
    "time budget" when `loop.max_minutes` cut it short), its dev figures, and its
    dev curve where given (stage -> components/training_artifact.py `dev_curve`)."""
    summary = {}
    for stage, manifest in manifests.items():
        dev = manifest["metrics"].get("dev") or {}
        summary[stage] = {"steps": manifest["counts"].get("steps"),
                          "stop_reason": manifest["metrics"].get("stop_reason"),
                          "dev_bleu": dev.get("bleu"), "dev_bleu_tok_lc": dev.get("bleu_tok_lc")}
        if dev_curves.get(stage):
            summary[stage]["dev_curve"] = [dict(point) for point in dev_curves[stage]]
    return summary


def build_report(results: Mapping[str, Sequence[MethodResult]],
                 training: Mapping[str, Any] | None = None,
                 ctranslate2_sweep: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Test set -> its methods' results (and `training_summary`, and the decode manifest's
    `ctranslate2_sweep`: the threads each CTranslate2 method was timed with) -> report.json's
    content."""
    test_sets = {}
    for test_set, methods in results.items():
        bases = baselines(methods)
        test_sets[test_set] = {
            "baselines": {kind: base.method for kind, base in bases.items()},
            "methods": [result_dict(result, bases) for result in methods],
        }
    return {"training": dict(training or {}), "test_sets": test_sets,
            "ctranslate2_sweep": [dict(sweep) for sweep in ctranslate2_sweep]}


def headline(report: Mapping[str, Any]) -> dict[str, Any]:
    """A few figures per test set and method, for the stage's manifest."""
    out = {}
    for test_set, entry in report["test_sets"].items():
        out[test_set] = {}
        for method in entry["methods"]:
            figures = {"bleu": round(method["bleu"]["score"], 2),
                       "chrf": round(method["chrf"]["score"], 2),
                       "stutter_rate": round(method["stutter"]["sentence_rate"], 4),
                       "latency_median_s": method["latency_s"]["median"],
                       "throughput_sentences_per_s": method["throughput"].get("sentences_per_s")}
            for name, ratio in method["speedup"].items():
                figures[f"speedup_median_{name}"] = ratio["median"]
            out[test_set][method["method"]] = figures
    return out


# --- markdown ---------------------------------------------------------------------------


def _number(value: Optional[float], digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 1
           ) -> list[str]:
    """A markdown table: the first `text_columns` columns left-aligned, the others right."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < text_columns else "---:" for i in range(len(header)))
             + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render_markdown(report: Mapping[str, Any]) -> str:
    """report.json as tables a person reads: the models, then per test set quality, speed,
    speedups and signatures."""
    lines = ["# Decoding report", ""] + _training_lines(report.get("training") or {})
    for test_set, entry in report["test_sets"].items():
        methods = entry["methods"]
        sentences = methods[0]["sentences"] if methods else 0
        lines += [f"## {test_set} ({sentences} sentences)", "", "### Quality", ""]
        lines += _table(
            ["method", "kind", "setting", "BLEU", "chrF", "BLEU tok+lc", "stutter (% sent.)",
             "stutter /100 words", "sequential calls"],
            [[m["method"], m["kind"], m.get("setting") or "–", _number(m["bleu"]["score"]),
              _number(m["chrf"]["score"]),
              _number(m["bleu_tok_lc"]["score"]),
              _number(100 * m["stutter"]["sentence_rate"], 1),
              _number(m["stutter"]["per_100_words"]), _number(m["mean_passes"], 1)]
             for m in methods], text_columns=3)
        lines += ["", "Sequential calls: decoder calls per sentence that wait on the one "
                      "before (AR steps, refinement passes, the teacher's scoring or "
                      "verifying passes). On an accelerator at batch 1 a call over 16 "
                      "positions costs about what a call over 1 does, so this figure predicts "
                      "that regime's latency; it is not a speedup measured here."]
        lines += _draft_lines(methods)
        lines += ["", "### Speed", "",
                  f"Latency per sentence at batch 1 (ms, the first "
                  f"{methods[0]['latency_s']['count']} sentences); throughput batched "
                  f"(batch {_batch_size(methods)}), decode time only.", ""]
        lines += _table(
            ["method", "median ms", "p90 ms", "p99 ms", "sentences/s", "tokens/s"],
            [[m["method"], _number(1e3 * m["latency_s"]["median"]),
              _number(1e3 * m["latency_s"]["p90"]), _number(1e3 * m["latency_s"]["p99"]),
              _number(m["throughput"].get("sentences_per_s"), 1),
              _number(m["throughput"].get("tokens_per_s"), 0)] for m in methods])
        baseline_names = list(entry["baselines"].values())
        if baseline_names:
            lines += ["", "### Speedups", "",
                      "Baseline latency / method latency (median, p99) and method / baseline "
                      "throughput; > 1 means faster.", ""]
            header = ["method"] + [f"vs {name} {stat}" for name in baseline_names
                                   for stat in ("median", "p99", "throughput")]
            rows = [[m["method"]] + [_number(m["speedup"][f"vs_{name}"][stat], 2, "x")
                                     for name in baseline_names
                                     for stat in ("median", "p99", "throughput")]
                    for m in methods]
            lines += _table(header, rows)
            lines += _verdict_lines(entry)
        if methods and methods[0]["truncated"]:  # a property of the sources: same for all
            lines += ["", f"{methods[0]['truncated']} of {sentences} sources were longer than "
                          "the widest length bucket and were cut to it."]
        lines += ["", "Signatures:"]
        if methods:
            for name in ("bleu", "chrf", "bleu_tok_lc"):
                lines.append(f"- {name}: `{methods[0][name]['signature']}`")
        lines += ["- BLEU tok+lc is sacreBLEU 13a, lowercased: only to compare with published "
                  "figures that use tokenised lowercased BLEU (components/metrics.py says how "
                  "it differs from theirs).", ""]
        lines += [f"![{plot}](plots/{test_set}/{plot}.png)" for plot in PLOTS] + [""]
    lines += _sweep_lines(report.get("ctranslate2_sweep") or [])
    return "\n".join(lines)


def _sweep_lines(sweeps: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per CTranslate2 method and pass, every thread setting its sweep timed, the chosen
    one marked (pipelines/decode.py `sweep_ctranslate2`)."""
    if not sweeps:
        return []
    some = sweeps[0]
    lines = ["## CTranslate2's threads", "",
             f"Each CTranslate2 method decoded each pass with the threads its sweep chose: "
             f"every setting below decoded the first {some['sentences']} sentences of "
             f"{some['test_set']} {some['repeats']} times on {some['cpus']} CPUs (medians), "
             "in a process of its own.", ""]
    rows = []
    for sweep in sweeps:
        for regime in ("latency", "batched"):
            about = sweep[regime]
            for setting in about["settings"]:
                threads = {key: setting[key] for key in about["chosen"]}
                rows.append([sweep["method"], regime, str(about["batch_size"]),
                             f"{setting['intra_threads']} x {setting['inter_threads']}",
                             _number(setting.get("median_ms")),
                             _number(setting.get("sentences_per_s"), 1),
                             "chosen" if threads == about["chosen"] else ""])
    return lines + _table(["method", "pass", "batch", "intra x inter threads", "median ms",
                           "sentences/s", ""], rows, text_columns=2) + [""]


def speed(method: Mapping[str, Any], stat: str) -> float:
    """A method's speed in a regime (`REGIMES`), larger is faster: sentences/s batched,
    else the negated batch-1 latency statistic."""
    if stat == "throughput":
        return method["throughput"].get("sentences_per_s") or 0.0
    return -method["latency_s"][stat]


def on_frontier(methods: Sequence[Mapping[str, Any]], stat: str) -> list[bool]:
    """Per method, whether no other method is at least as fast in regime `stat` and at
    least as good in BLEU, and strictly better in one (the BLEU/speed Pareto frontier)."""
    points = [(speed(m, stat), m["bleu"]["score"]) for m in methods]
    return [not any(s >= x and b >= y and (s > x or b > y) for s, b in points)
            for x, y in points]


def _ratio(method: Mapping[str, Any], other: Mapping[str, Any], stat: str) -> float:
    """How many times faster `method` is than `other` in regime `stat` (> 1: faster)."""
    if stat == "throughput":
        return speed(method, stat) / speed(other, stat) if speed(other, stat) else float("nan")
    mine = method["latency_s"][stat]
    return other["latency_s"][stat] / mine if mine else float("nan")


def _verdict_lines(entry: Mapping[str, Any]) -> list[str]:
    """Per method of the student (every PaDIR decoding) or the drafter (draft and verify)
    and per regime: its speed against the fastest AR row of that regime, whichever model
    and engine that is (the teacher or the AR student, our search or CTranslate2), with the
    BLEU of both; and the regimes where it is on the BLEU/speed frontier."""
    methods = entry["methods"]
    ar = [m for m in methods if m["kind"] in BASELINE_KINDS]
    frontier = {stat: dict(zip((m["method"] for m in methods), on_frontier(methods, stat)))
                for stat, _ in REGIMES}
    lines = []
    for m in methods:
        if DECODING_KINDS[m["kind"]].stage not in ("student", "drafter") or not ar:
            continue
        bleu = m["bleu"]["score"]
        parts = []
        for stat, words in REGIMES:
            fastest = max(ar, key=lambda a: speed(a, stat))
            ratio = _ratio(m, fastest, stat)
            parts.append(f"{words} {'faster' if ratio > 1 else 'slower'}, {ratio:.2f}x "
                         f"{fastest['method']} (BLEU {bleu - fastest['bleu']['score']:+.2f})")
        best = [words for stat, words in REGIMES if frontier[stat][m["method"]]]
        lines.append(f"- {m['method']} (BLEU {bleu:.2f}): {'; '.join(parts)}. On the "
                     f"BLEU/speed frontier: {', '.join(best) if best else 'in no regime'}.")
    if not lines:
        return []
    return ["", "Where PaDIR wins and where it does not: each method of the student (and "
                "draft and verify) against the fastest AR row of each regime (> 1x: "
                "faster), and the regimes where no other row is both as fast and as good:",
            ""] + lines


def _draft_lines(methods: Sequence[Mapping[str, Any]]) -> list[str]:
    """Draft and verify's cost per sentence, against greedy's steps where it is measured."""
    drafted = [m for m in methods if m.get("draft")]
    if not drafted:
        return []
    greedy = next((m for m in methods if m["kind"] == "ar_greedy"
                   and m.get("stage", "teacher") == "teacher"), None)
    steps = f" (greedy: {greedy['mean_passes']:.1f} steps)" if greedy else ""
    lines = ["", f"Draft and verify, per sentence{steps}: rounds (each a drafter pass and a "
                 "teacher pass over the block), drafted tokens the teacher accepted per "
                 "round, and output tokens per round (greedy: 1).", ""]
    return lines + _table(
        ["method", "rounds mean", "median", "p90", "accepted / round", "tokens / round"],
        [[m["method"], _number(m["draft"]["rounds_mean"], 1),
          _number(m["draft"]["rounds_median"], 0), _number(m["draft"]["rounds_p90"], 0),
          _number(m["draft"]["accepted_per_round"]), _number(m["draft"]["tokens_per_round"])]
         for m in drafted])


def _training_lines(training: Mapping[str, Any]) -> list[str]:
    """The models' training, with a loud line for each run cut short."""
    if not training:
        return []
    lines = ["## Models", ""]
    for stage, about in training.items():
        if about["stop_reason"]:
            lines += [f"**Warning: the {stage} stopped early ({about['stop_reason']}) at step "
                      f"{about['steps']:,}**: it did not train the config's fixed number of "
                      f"steps (`{stage}.loop.max_minutes` cut it short on this machine), so "
                      "the figures below are not those of the recipe.", ""]
    lines += _table(
        ["model", "stopped", "steps (last phase)", "dev BLEU", "dev BLEU tok+lc"],
        [[stage, about["stop_reason"] or "completed",
          f"{about['steps']:,}" if about["steps"] is not None else "–",
          _number(about["dev_bleu"]), _number(about["dev_bleu_tok_lc"])]
         for stage, about in training.items()], text_columns=2)
    curve = (training.get("student") or {}).get("dev_curve")
    if curve:
        lines += ["", "The student's dev BLEU (PaDIR-4, the most likely length) at each "
                  "evaluation, both phases:" + _last_gain(curve), "",
                  f"![student dev BLEU](plots/{DEV_CURVE_PLOT}.png)"]
    return lines + [""]


def _last_gain(curve: Sequence[Mapping[str, Any]]) -> str:
    """" the last evaluation gained +0.80 BLEU over the 500 steps before it." (or "")."""
    if len(curve) < 2:
        return ""
    before, last = curve[-2], curve[-1]
    return (f" the last evaluation gained {last['bleu'] - before['bleu']:+.2f} BLEU over the "
            f"{last['step'] - before['step']:,} steps before it.")


def _batch_size(methods: Sequence[Mapping[str, Any]]) -> str:
    sizes = sorted({m["throughput"].get("batch_size") for m in methods} - {None})
    return "/".join(str(size) for size in sizes) or "?"


# --- plots --------------------------------------------------------------------------------


def _save(figure, path: str) -> None:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    fs, local = artifacts.filesystem(path)
    fs.makedirs(posixpath.dirname(local), exist_ok=True)
    with fs.open(local, "wb") as f:
        f.write(buffer.getvalue())


def _plot_dev_curve(plt, curve: Sequence[Mapping[str, Any]], path: str) -> str:
    """The student's dev BLEU against its steps, one line per phase, the phase boundary
    dashed: whether the curve still rises when training stops."""
    figure, axes = plt.subplots(figsize=(6.5, 4.0))
    for phase, label in ((1, "phase 1 (one stage)"), (2, "phase 2 (unrolled)")):
        points = [point for point in curve if point["phase"] == phase]
        if points:
            axes.plot([p["step"] for p in points], [p["bleu"] for p in points], marker="o",
                      label=label)
    ends = [p["step"] for p in curve if p["phase"] == 1]
    if ends and any(p["phase"] == 2 for p in curve):
        axes.axvline(max(ends), color="gray", linestyle="--", linewidth=1)
    axes.set(xlabel="training steps (both phases)", ylabel="dev sacreBLEU",
             title="student: dev BLEU during training")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")
    _save(figure, path)
    plt.close(figure)
    return path


def _plot_frontier(plt, methods: Sequence[Mapping[str, Any]], stat: str, path: str, *,
                   xlabel: str, title: str) -> str:
    """BLEU against speed in one regime, every method a point (squares: AR rows), the
    BLEU/speed frontier drawn through the methods no other beats on both."""
    figure, axes = plt.subplots(figsize=(6.5, 4.5))
    x = [1e3 * m["latency_s"][stat] if stat != "throughput" else speed(m, stat)
         for m in methods]
    for m, value in zip(methods, x):  # a legend, not labels by the points: they crowd
        axes.scatter([value], [m["bleu"]["score"]], label=m["method"],
                     marker="s" if m["kind"] in BASELINE_KINDS else "o")
    best = sorted((value, m["bleu"]["score"]) for value, m, keep
                  in zip(x, methods, on_frontier(methods, stat)) if keep)
    if best:
        axes.step([p[0] for p in best], [p[1] for p in best], color="gray", linewidth=1,
                  where="post" if stat != "throughput" else "pre", label="frontier")
    axes.set(xlabel=xlabel, ylabel="sacreBLEU", title=title)
    axes.legend(fontsize=7, ncol=2, loc="best")
    axes.grid(alpha=0.3)
    _save(figure, path)
    plt.close(figure)
    return path


def write_plots(report: Mapping[str, Any],
                latency_records: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
                out_uri: str) -> list[str]:
    """Writes `plots/{test_set}/{plot}.png` under `out_uri` (local or fsspec), and
    `plots/student_dev_bleu.png` when the report has the student's `dev_curve`; their paths.

    Args:
      latency_records: test set -> method -> its batch-1 decode records (latency against
        source length).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display; safe in workers and CI
    import matplotlib.pyplot as plt

    written = []
    curve = (report.get("training", {}).get("student") or {}).get("dev_curve")
    if curve:
        written.append(_plot_dev_curve(plt, curve, artifacts.join(
            out_uri, "plots", f"{DEV_CURVE_PLOT}.png")))
    for test_set, entry in report["test_sets"].items():
        methods = entry["methods"]
        names = [m["method"] for m in methods]

        def path(plot: str) -> str:
            return artifacts.join(out_uri, "plots", test_set, f"{plot}.png")

        _plot_frontier(plt, methods, "median", path("bleu_vs_latency"),
                       xlabel="median latency per sentence, batch 1 (ms)",
                       title=f"{test_set}: quality against latency at batch 1")
        _plot_frontier(plt, methods, "throughput", path("bleu_vs_throughput"),
                       xlabel=f"sentences per second, batch {_batch_size(methods)}",
                       title=f"{test_set}: quality against batched throughput")

        figure, axes = plt.subplots(figsize=(max(6.0, 0.7 * len(methods)), 4.0))
        rates = [100 * m["stutter"]["sentence_rate"] for m in methods]
        axes.bar(range(len(methods)), rates, color=[
            "tab:gray" if m["kind"] in BASELINE_KINDS else "tab:blue" for m in methods])
        axes.set_xticks(range(len(methods)), names, rotation=30, ha="right")
        axes.set_ylim(0, max(1.0, 1.15 * max(rates, default=0.0)))
        axes.set(ylabel="sentences with a stutter (%)", title=f"{test_set}: stutter per method")
        axes.grid(axis="y", alpha=0.3)
        _save(figure, path("stutter"))
        plt.close(figure)

        figure, axes = plt.subplots(figsize=(6.5, 4.5))
        for name in names:
            method_records = latency_records[test_set][name]
            axes.scatter([r["source_tokens"] for r in method_records],
                         [1e3 * r["latency_s"] for r in method_records], s=8, alpha=0.6,
                         label=name)
        axes.set(xlabel="source tokens (EOS included)", ylabel="latency, batch 1 (ms)",
                 title=f"{test_set}: latency against source length")
        axes.set_yscale("log")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7, ncol=2)
        _save(figure, path("latency_vs_length"))
        plt.close(figure)
        written += [path(plot) for plot in PLOTS]
    return written
