"""Translation metrics in plain Python: sacreBLEU BLEU and chrF, stutter, latency.

    bleu = corpus_bleu(hypotheses, references)       # CorpusScore(score, signature, ...)
    chrf = corpus_chrf(hypotheses, references)
    stutter = stutter_stats(hypotheses, references)   # StutterStats
    latency = summarize_latency(seconds)              # LatencySummary (median, p90, p99)
    speedups(ar_latency, padir_latency)               # {"median": 2.3, ...}

Hypotheses are detokenised model output (`Tokenizer.decode`), references the raw
reference lines, one reference per hypothesis.

**BLEU and chrF** are sacreBLEU's with their defaults (BLEU: the tokeniser sacreBLEU picks
for the target language, `data.target_lang`: 13a for languages written with spaces, `zh`
for Chinese, MeCab for Japanese and Korean (`pip install "sacrebleu[ja,ko]"`); mixed
case, exponential smoothing; chrF2: character 6-grams, beta 2), reported with the signature
that makes them reproducible (`nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...`).
They are the figures to quote.

**Tokenised lowercased BLEU** is only for comparing with the Multi30k literature, which
typically runs multi-bleu.perl (whitespace split, no smoothing) on text that was
Moses-tokenised, punctuation-normalised and lowercased before scoring (the dataset's
`*.lc.norm.tok.*` files). We have no Moses tokeniser (sacremoses is not a dependency),
so `tokenized_lowercased_bleu` is sacreBLEU with `tokenize="13a", lowercase=True` on the
raw text: it differs from the BLEU above only by lowercasing, and from the literature's
figures by the tokeniser (13a splits ASCII punctuation except apostrophes and most
hyphens, and no non-ASCII punctuation such as „ “; Moses treats apostrophes, hyphens and
Unicode punctuation its own way and escapes `&"'<>` to entities; nothing here normalises
punctuation) and by smoothing (sacreBLEU's `exp` only matters when an n-gram order has no
match at all). Expect figures close to, not equal to, published ones.

**Stutter** (PaDIR paper §3.3): a word repeated consecutively in the hypothesis where the
reference has no such repetition. Words are whitespace tokens, lowercased, with leading
and trailing punctuation (Unicode category P*) stripped; tokens that are punctuation only
are dropped, so "Hund, Hund" and "Hund , Hund" both repeat "hund" and ". ." is never a
stutter. A *repetition* of w is a position i with words[i] == words[i - 1] == w (so
"a a a" repeats "a" twice). The stutters of a hypothesis are its repetitions of each word
beyond the reference's repetitions of that word (clipped like BLEU's n-gram counts): a
reference "ja ja" licenses one repetition of "ja".

**Latency** percentiles interpolate linearly between order statistics (NumPy's default,
Hyndman & Fan type 7). Speedup = baseline latency / method latency (> 1: the method is
faster), per statistic.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import unicodedata
from typing import Sequence

from sacrebleu.metrics import BLEU, CHRF


@dataclasses.dataclass(frozen=True)
class CorpusScore:
    """A corpus-level score and how it was computed.

    Attributes:
      name: "BLEU", "chrF2", or "BLEU-13a-lc" (tokenised lowercased).
      score: 0..100.
      signature: sacreBLEU's signature string.
      details: sacreBLEU's one-line result (n-gram precisions, brevity penalty, ...).
    """

    name: str
    score: float
    signature: str
    details: str


def _check_pairs(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if isinstance(hypotheses, str) or isinstance(references, str):
        raise TypeError("hypotheses and references are sequences of strings, not strings")
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        raise ValueError("no hypotheses to score")


def _score(metric, name: str, hypotheses, references) -> CorpusScore:
    _check_pairs(hypotheses, references)
    result = metric.corpus_score(list(hypotheses), [list(references)])
    return CorpusScore(
        name=name,
        score=float(result.score),
        signature=str(metric.get_signature()),
        details=str(result),
    )


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str], target_lang: str = ""
                ) -> CorpusScore:
    """sacreBLEU BLEU with its defaults on detokenised output vs raw references, tokenised
    as sacreBLEU does for `target_lang` (a language code; "": 13a)."""
    return _score(BLEU(trg_lang=target_lang), "BLEU", hypotheses, references)


def corpus_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> CorpusScore:
    """sacreBLEU chrF2 (character 6-grams, beta 2, no word n-grams)."""
    return _score(CHRF(), "chrF2", hypotheses, references)


def tokenized_lowercased_bleu(
    hypotheses: Sequence[str], references: Sequence[str]
) -> CorpusScore:
    """BLEU on 13a-tokenised, lowercased text: only to compare with the Multi30k
    literature (see the module docstring for how it differs from it)."""
    return _score(BLEU(tokenize="13a", lowercase=True), "BLEU-13a-lc", hypotheses, references)


# --- stutter --------------------------------------------------------------------------


def _strip_punctuation(token: str) -> str:
    start, end = 0, len(token)
    while start < end and unicodedata.category(token[start]).startswith("P"):
        start += 1
    while end > start and unicodedata.category(token[end - 1]).startswith("P"):
        end -= 1
    return token[start:end]


def stutter_words(text: str) -> list[str]:
    """The words stutter is counted on: lowercased whitespace tokens, edge punctuation
    stripped, punctuation-only tokens dropped. "Ein Hund, ein Hund." -> [ein, hund, ein, hund]."""
    words = (_strip_punctuation(token) for token in text.lower().split())
    return [word for word in words if word]


def _repetitions(words: list[str]) -> collections.Counter:
    """Word -> how many positions repeat it from the position before."""
    return collections.Counter(b for a, b in zip(words, words[1:]) if a == b)


def count_stutter(hypothesis: str, reference: str) -> int:
    """Repetitions in the hypothesis not licensed by the same repetition in the reference."""
    licensed = _repetitions(stutter_words(reference))
    return sum(
        max(0, count - licensed[word])
        for word, count in _repetitions(stutter_words(hypothesis)).items()
    )


@dataclasses.dataclass(frozen=True)
class StutterStats:
    """Corpus stutter counts.

    Attributes:
      sentences: hypotheses scored.
      stuttering_sentences: hypotheses with at least one stutter.
      stutters: total stutters.
      words: total hypothesis words (as `stutter_words` counts them).
    """

    sentences: int
    stuttering_sentences: int
    stutters: int
    words: int

    @property
    def sentence_rate(self) -> float:
        """Fraction of hypotheses with at least one stutter."""
        return self.stuttering_sentences / self.sentences if self.sentences else 0.0

    @property
    def per_100_words(self) -> float:
        """Stutters per 100 hypothesis words."""
        return 100.0 * self.stutters / self.words if self.words else 0.0


def stutter_stats(hypotheses: Sequence[str], references: Sequence[str]) -> StutterStats:
    """Stutter over a corpus (one reference per hypothesis)."""
    _check_pairs(hypotheses, references)
    counts = [count_stutter(h, r) for h, r in zip(hypotheses, references)]
    return StutterStats(
        sentences=len(counts),
        stuttering_sentences=sum(1 for c in counts if c > 0),
        stutters=sum(counts),
        words=sum(len(stutter_words(h)) for h in hypotheses),
    )


# --- latency --------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between order statistics (NumPy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(float(v) for v in values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclasses.dataclass(frozen=True)
class LatencySummary:
    """Per-call latencies in seconds (one call = one sentence at batch 1)."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float


def summarize_latency(seconds: Sequence[float]) -> LatencySummary:
    """Summarises per-sentence latencies (seconds, each >= 0)."""
    values = [float(s) for s in seconds]
    if not values:
        raise ValueError("no latencies to summarise")
    if any(v < 0 or math.isnan(v) for v in values):
        raise ValueError("latencies must be non-negative numbers")
    return LatencySummary(
        count=len(values),
        mean=sum(values) / len(values),
        median=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
    )


def speedup(baseline_seconds: float, method_seconds: float) -> float:
    """baseline latency / method latency: > 1 when the method is faster."""
    if baseline_seconds < 0 or method_seconds <= 0:
        raise ValueError(
            f"need baseline >= 0 and method > 0 seconds, got {baseline_seconds}, {method_seconds}")
    return baseline_seconds / method_seconds


def speedups(baseline: LatencySummary, method: LatencySummary) -> dict[str, float]:
    """`speedup` per statistic: {"mean", "median", "p90", "p99"} -> baseline / method."""
    return {
        stat: speedup(getattr(baseline, stat), getattr(method, stat))
        for stat in ("mean", "median", "p90", "p99")
    }
