"""Tests for components/metrics.py: agreement with sacreBLEU, stutter, latency."""

import numpy as np
import pytest
import sacrebleu

from components import metrics

HYPOTHESES = [
    "Ein Mann fährt Fahrrad auf der Straße.",
    "Zwei Hunde spielen im Schnee Schnee.",
    "Eine Frau liest ein Buch.",
]
REFERENCES = [
    "Ein Mann fährt auf der Straße Fahrrad.",
    "Zwei Hunde spielen im Schnee.",
    "Eine Frau liest ein Buch.",
]


def test_bleu_and_chrf_agree_with_sacrebleu_and_carry_signatures():
    bleu = metrics.corpus_bleu(HYPOTHESES, REFERENCES)
    assert bleu.score == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score)
    assert bleu.name == "BLEU" and bleu.details.startswith("BLEU = ")
    assert "tok:13a" in bleu.signature and "case:mixed" in bleu.signature
    assert f"version:{sacrebleu.__version__}" in bleu.signature
    chrf = metrics.corpus_chrf(HYPOTHESES, REFERENCES)
    assert chrf.score == pytest.approx(sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score)
    assert "nc:6" in chrf.signature and chrf.name == "chrF2"
    assert metrics.corpus_bleu(REFERENCES, REFERENCES).score == pytest.approx(100.0)


def test_tokenized_lowercased_bleu_ignores_case_only():
    casefolded = [h.lower() for h in HYPOTHESES]  # (upper() would turn ß into SS)
    score = metrics.tokenized_lowercased_bleu(casefolded, REFERENCES)
    assert score.score == pytest.approx(
        sacrebleu.corpus_bleu(casefolded, [REFERENCES], tokenize="13a", lowercase=True).score)
    assert score.score == pytest.approx(metrics.corpus_bleu(HYPOTHESES, REFERENCES).score)
    assert metrics.corpus_bleu(casefolded, REFERENCES).score < score.score
    assert "case:lc" in score.signature and "tok:13a" in score.signature


def test_scores_reject_mismatched_inputs():
    with pytest.raises(ValueError, match="2 hypotheses but 3 references"):
        metrics.corpus_bleu(HYPOTHESES[:2], REFERENCES)
    with pytest.raises(TypeError):
        metrics.corpus_chrf("a sentence", "a sentence")


@pytest.mark.parametrize("hypothesis, reference, expected", [
    ("ein Hund Hund läuft", "ein Hund läuft", 1),
    ("ein Hund hund, Hund läuft", "ein Hund läuft", 2),  # case and punctuation ignored
    ("ein Hund , Hund", "ein Hund", 1),  # a punctuation-only token does not separate
    ("ja ja , ja ja", "ja ja", 2),  # three repetitions, one licensed by the reference
    ("ja ja", "Ja, ja!", 0),
    ("Hund . . Hund", "Hund", 1),  # ". ." is not a stutter
    ("der Hund der Hund", "der Hund", 0),  # not consecutive
    ("", "ein Hund", 0),
])
def test_count_stutter(hypothesis, reference, expected):
    assert metrics.count_stutter(hypothesis, reference) == expected


def test_stutter_stats_rates():
    stats = metrics.stutter_stats(
        ["a b b c", "a a a", "a b", "x , y"], ["a b c", "a", "a b", "x y"])
    assert stats == metrics.StutterStats(
        sentences=4, stuttering_sentences=2, stutters=3, words=11)
    assert stats.sentence_rate == pytest.approx(0.5)
    assert stats.per_100_words == pytest.approx(300 / 11)
    assert metrics.stutter_words("„Ein Hund“ -- läuft!") == ["ein", "hund", "läuft"]


@pytest.mark.parametrize("values", [
    [0.3],
    [0.1, 0.2],
    [5.0, 1.0, 2.0, 4.0, 3.0, 10.0, 0.5],
    list(np.linspace(0.01, 1.0, 101) ** 2),
])
def test_percentiles_match_numpy(values):
    summary = metrics.summarize_latency(values)
    assert summary.count == len(values)
    assert summary.mean == pytest.approx(np.mean(values))
    for stat, q in (("median", 50), ("p90", 90), ("p99", 99)):
        assert getattr(summary, stat) == pytest.approx(np.percentile(values, q))


def test_latency_on_a_fixed_list_and_speedups():
    ar = metrics.summarize_latency([float(i) for i in range(1, 11)])  # 1..10 s
    assert (ar.median, ar.p90, ar.p99) == pytest.approx((5.5, 9.1, 9.91))
    padir = metrics.summarize_latency([1.0] * 9 + [2.0])
    assert metrics.speedup(3.0, 1.5) == 2.0
    ratios = metrics.speedups(ar, padir)
    assert ratios["median"] == pytest.approx(5.5)
    assert ratios["p99"] == pytest.approx(9.91 / 1.91)
    with pytest.raises(ValueError):
        metrics.summarize_latency([])
    with pytest.raises(ValueError):
        metrics.speedup(1.0, 0.0)


def test_bleu_tokenises_as_sacrebleu_does_for_the_target_language():
    hypotheses, references = ["我们去公园散步。"], ["我们去公园散步了。"]
    chinese = metrics.corpus_bleu(hypotheses, references, "zh")
    assert "tok:zh" in chinese.signature
    assert chinese.score == pytest.approx(
        sacrebleu.corpus_bleu(hypotheses, [references], tokenize="zh").score)
    # Without spaces, 13a sees one word per sentence, and no match at all.
    assert metrics.corpus_bleu(hypotheses, references).score < chinese.score
    assert "tok:13a" in metrics.corpus_bleu(hypotheses, references, "de").signature
