"""The `score` stage: the decode stage's hypotheses against the raw references -> the report.

Contract:
  reads   the `decode` artifact (`hypotheses/{test_set}/{method}.jsonl`, the batched pass
          that is scored; `latency/{test_set}/{method}.jsonl`, the batch-1 pass over the
          latency sample; the throughput figures in its manifest) and the `prepare`
          artifact's test splits (the references: the prepared target of each id, i.e. the
          raw line normalised as every split is), and the manifests of the training
          artifacts (teacher, student, AR student) the decode artifact names as its inputs.
  writes  `<workdir>/score/<key>/`:
            report.json   the models' training (steps, and `stop_reason` when the time
                          budget cut a run short: loud in report.md too); per test set and
                          method: its setting (`report.describe_setting`
                          of the config's decode.methods, which the decode artifact's key
                          covers), BLEU, chrF, tokenised lowercased BLEU (with sacreBLEU
                          signatures), stutter, latency at batch 1 (mean, median, p90, p99
                          seconds, over the latency sample), batched throughput, mean
                          decoder passes, speedups over the AR greedy and beam baselines;
                          the CTranslate2 methods' thread sweeps (the decode manifest's);
            report.md     the same as tables, with the plots;
            plots/{test_set}/{bleu_vs_latency,stutter,latency_vs_length}.png
            plots/student_dev_bleu.png  the student's dev BLEU at each evaluation (its
                          TensorBoard event files: `training_artifact.dev_curve`), when
                          it has any
            manifest.json headline figures per test set and method.
  What each figure means: components/report.py and components/metrics.py.

Plain Python (no Beam, no JAX): scoring a test set takes seconds.

    padir stage score configs/multi30k_en_de.yaml
"""

from __future__ import annotations

import json
import logging

from components import artifacts, corpus, dag, report, training_artifact
from components import config as config_lib

log = logging.getLogger(__name__)

REPORT_JSON, REPORT_MD = "report.json", "report.md"


class ScoreError(ValueError):
    """The hypotheses do not match the references (a decode artifact from other data)."""


def _write_text(uri: str, text: str) -> None:
    fs, path = artifacts.filesystem(uri)
    with fs.open(path, "w") as f:
        f.write(text)


def aligned_references(records: list[dict], references: dict[str, str], where: str
                       ) -> list[str]:
    """The reference of each record, by id; ScoreError on an unknown or repeated id."""
    ids = [record["id"] for record in records]
    unknown = [pair_id for pair_id in ids if pair_id not in references]
    if unknown or len(set(ids)) != len(ids):
        raise ScoreError(f"{where}: hypotheses do not match the references "
                         f"(unknown ids {unknown[:5]}, {len(ids) - len(set(ids))} repeated)")
    return [references[pair_id] for pair_id in ids]


def run(config: config_lib.Config) -> artifacts.Artifact:
    """Scores the decode artifact of `config` and publishes the report."""
    prepared = dag.require_input(config, "prepare")
    decoded = dag.require_input(config, "decode")
    facts = decoded.manifest["metrics"]
    settings = {method.name: report.describe_setting(method) for method in config.decode.methods}
    results: dict[str, list[report.MethodResult]] = {}
    latency_records: dict[str, dict[str, list[dict]]] = {}
    for test_set in facts["test_sets"]:
        references = {pair["id"]: pair["target"]
                      for pair in corpus.read_split(prepared.uri, test_set)}
        results[test_set], latency_records[test_set] = [], {}
        for about in facts["methods"]:
            method = about["name"]
            lines = list(corpus.read_jsonl(decoded.path("hypotheses", test_set, f"{method}.jsonl")))
            targets = aligned_references(lines, references, f"{test_set}/{method}")
            timed = list(corpus.read_jsonl(decoded.path("latency", test_set, f"{method}.jsonl")))
            latency_records[test_set][method] = timed
            results[test_set].append(report.score_method(
                method, about["kind"], lines, targets, facts["throughput"][test_set][method],
                timed, setting=settings.get(method, ""), target_lang=config.data.target_lang,
                stage=about["stage"]))
            log.info("score %s/%s: BLEU %.2f", test_set, method, results[test_set][-1].bleu.score)
    models = {stage: uri for stage, uri in decoded.manifest["inputs"].items()
              if stage in config_lib.TRAINING_STAGES}
    training = {stage: artifacts.read(uri).manifest for stage, uri in models.items()}
    curves = ({"student": training_artifact.dev_curve(models["student"])}
              if "student" in models else {})
    content = report.build_report(results, report.training_summary(training, curves),
                                  facts["ctranslate2_sweep"])
    with artifacts.write(config.workdir, "score", dag.stage_key(config, "score"),
                         config=dag.section_values(config, "score"),
                         config_yaml=config_lib.dump(config),
                         inputs={"prepare": prepared.uri, "decode": decoded.uri}) as out:
        _write_text(out.path(REPORT_JSON), json.dumps(content, indent=2, ensure_ascii=False))
        _write_text(out.path(REPORT_MD), report.render_markdown(content))
        plots = report.write_plots(content, latency_records, out.tmp_uri)
        out.counts.update({f"scored.{test_set}.{method.method}": method.sentences
                           for test_set, methods in results.items() for method in methods})
        out.counts["plots"] = len(plots)
        out.metrics.update(report.headline(content))
    artifact = artifacts.read(dag.output_uri(config, "score"))
    log.info("score: wrote %s", artifact.path(REPORT_MD))
    return artifact
