"""The per-sentence logic of the `distill` stage (plain Python, no Beam), and its figures.

A teacher translation arrives as the record of `model.decoding.translator.Translation`
(`TranslationModelHandler`'s `inference`): `hypothesis` (text), `tokens` (ids, EOS
included when the beam emitted one), `score` (the beam's length-normalised
log-probability, by `distill.engine`'s normalisation), `source_tokens` (EOS included,
after any cut), `truncated`, `latency_s`.
`judge` turns it and its prepared pair into a verdict: kept, or rejected with the first
reason of `REASONS` that applies:

  source_too_long  the source had more tokens than the teacher's widest bucket and was cut,
                   so the translation is of part of it
  unfinished       no EOS within the output width: the translation was cut
  empty            the translation is empty
  length_ratio     target/source tokens (EOS included on both sides), or its inverse, above
                   `distill.max_length_ratio` (if set)
  low_score        the teacher's log-probability per target token (EOS included) below
                   `distill.min_token_log_prob` (if set)

`score` in the written records is the teacher's log-probability of its translation, summed
over its tokens (EOS included), without the length penalty, whichever engine decoded it:
`log_prob` recovers it from the beam's score. Records also carry the token counts the
filters used.

`DistillationStats` sums, over the kept pairs, the whitespace words of sources, distilled
targets and original targets, for the length ratios and type/token ratios that compare
distilled with original targets on the same sentences; and, over all translated
sentences, the decode seconds (`latency_s` sums to the batches' time). Its summary takes
the number of distinct words (types) of each side, which the job counts apart from it
(`target_words`, made distinct by a Beam step): a set of them would grow with the
vocabulary in one worker's memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping, Optional

from components.config import DistillConfig
from components.tokenizer import EOS_ID

REASONS = ("source_too_long", "unfinished", "empty", "length_ratio", "low_score")


# What each `distill.engine`'s beam search divides a hypothesis's summed log-probability by,
# at `length` tokens (EOS counted) and length penalty alpha: GNMT's penalty in ours
# (model/decoding/beam_search.py); length ** alpha in CTranslate2 4.x (measured against the
# teacher-forced log-probability: tests/test_distill.py).
LENGTH_NORMALISERS = {
    "jax": lambda length, alpha: ((5.0 + length) / 6.0) ** alpha,
    "ctranslate2": lambda length, alpha: float(length) ** alpha,
}


def log_prob(translation: Mapping[str, Any], config: DistillConfig) -> float:
    """The teacher's log-probability of `translation`'s tokens: its beam score times the
    length normaliser of the engine that decoded it (`LENGTH_NORMALISERS`)."""
    normaliser = LENGTH_NORMALISERS[config.engine]
    return float(translation["score"]) * normaliser(len(translation["tokens"]),
                                                    config.length_penalty)


def rejection(translation: Mapping[str, Any], config: DistillConfig) -> Optional[str]:
    """The reason to reject a teacher translation (see the module docstring), or None."""
    tokens = translation["tokens"]
    if translation["truncated"]:
        return "source_too_long"
    if not tokens or tokens[-1] != EOS_ID:
        return "unfinished"
    if not translation["hypothesis"].strip():
        return "empty"
    if config.max_length_ratio is not None:
        ratio = len(tokens) / translation["source_tokens"]
        if max(ratio, 1.0 / ratio) > config.max_length_ratio:
            return "length_ratio"
    if config.min_token_log_prob is not None:
        if log_prob(translation, config) / len(tokens) < config.min_token_log_prob:
            return "low_score"
    return None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One training pair after distillation."""

    id: str
    source: str
    target: str  # the original (prepared) target
    hypothesis: str  # the teacher's translation
    score: float  # `log_prob` of the translation
    source_tokens: int  # EOS included, after any cut
    hypothesis_tokens: int  # EOS included when emitted
    reason: Optional[str]  # None: kept
    decode_seconds: float  # this sentence's share of its batch's decode time

    def kept_record(self) -> dict[str, Any]:
        """The distilled pair: the prepared format, plus the teacher's score and the
        number of target tokens it is summed over (so filters can be replayed)."""
        return {"id": self.id, "source": self.source, "target": self.hypothesis,
                "score": self.score, "target_tokens": self.hypothesis_tokens}

    def reject_record(self) -> dict[str, Any]:
        """A rejected pair: `target` is the original, `hypothesis` the teacher's."""
        return {"id": self.id, "reason": self.reason, "source": self.source,
                "target": self.target, "hypothesis": self.hypothesis, "score": self.score,
                "source_tokens": self.source_tokens,
                "hypothesis_tokens": self.hypothesis_tokens}


def judge(pair: Mapping[str, str], translation: Mapping[str, Any],
          config: DistillConfig) -> Verdict:
    """A prepared pair `{"id", "source", "target"}` and the teacher's translation of its
    source -> a verdict (the score rounded to 4 decimals, as written)."""
    return Verdict(
        id=pair["id"], source=pair["source"], target=pair["target"],
        hypothesis=translation["hypothesis"],
        score=round(log_prob(translation, config), 4),
        source_tokens=int(translation["source_tokens"]),
        hypothesis_tokens=len(translation["tokens"]),
        reason=rejection(translation, config),
        decode_seconds=float(translation["latency_s"]))


TARGET_SIDES = ("distilled", "original")


def target_words(verdict: Verdict) -> Iterator[tuple[str, str]]:
    """A kept pair's target words as (side, word), side in `TARGET_SIDES`; none for a
    reject. Their distinct elements, counted per side, are the types of `summary`."""
    if verdict.reason is None:
        for side, text in zip(TARGET_SIDES, (verdict.hypothesis, verdict.target)):
            for word in text.split():
                yield side, word


@dataclasses.dataclass
class DistillationStats:
    """Mergeable word counts of distilled vs original targets (see module docstring)."""

    translated: int = 0
    decode_seconds: float = 0.0
    kept: int = 0
    source_words: int = 0
    distilled_words: int = 0
    original_words: int = 0

    def add(self, verdict: Verdict) -> "DistillationStats":
        self.translated += 1
        self.decode_seconds += verdict.decode_seconds
        if verdict.reason is None:
            self.kept += 1
            self.source_words += len(verdict.source.split())
            self.distilled_words += len(verdict.hypothesis.split())
            self.original_words += len(verdict.target.split())
        return self

    def merge(self, other: "DistillationStats") -> "DistillationStats":
        self.translated += other.translated
        self.decode_seconds += other.decode_seconds
        self.kept += other.kept
        self.source_words += other.source_words
        self.distilled_words += other.distilled_words
        self.original_words += other.original_words
        return self

    def summary(self, types: Mapping[str, int]) -> dict[str, Any]:
        """Plain figures: target/source word ratios and type/token ratios of the kept
        pairs' distilled and original targets, and the decode time of all sentences.

        Args:
          types: side ("distilled", "original") -> distinct words of the kept pairs'
            targets on that side (a side without any may be absent).
        """
        distilled_types, original_types = (types.get(side, 0) for side in TARGET_SIDES)
        return {
            "translated": self.translated,
            "decode_seconds": round(self.decode_seconds, 3),
            "kept": self.kept,
            "length_ratio": {"distilled": _ratio(self.distilled_words, self.source_words),
                             "original": _ratio(self.original_words, self.source_words)},
            "type_token_ratio": {
                "distilled": _ratio(distilled_types, self.distilled_words),
                "original": _ratio(original_types, self.original_words)},
            "types": {"distilled": distilled_types, "original": original_types},
        }


def _ratio(numerator: float, denominator: float) -> Optional[float]:
    return round(numerator / denominator, 4) if denominator else None
