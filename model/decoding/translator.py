"""Translating text with a published training artifact: restore once, decode jitted.

    loaded = trained_model.load("work/multi30k_en_de/student/<key>")   # LoadedModel
    translator = Translator(loaded, DecodeMethod("padir_4", "refine", iterations=4),
                            batch_size=1, boundaries=loaded.boundaries)
    [t] = translator.translate(["A dog runs."])              # Translation
    t.hypothesis, t.score, t.passes, t.latency_s

The artifact is restored by model/trained_model.py (`load`, or `load_cached`: once per
process).

Static shapes. A batch of sentences is tokenised (pieces + EOS; a source longer than the
widest bucket is cut to it, EOS kept, and flagged `truncated`) and padded to the smallest
bucket boundary S that holds its longest source. Its output cap is the smallest boundary
that holds twice that source, so that targets up to twice as long as the source are never
cut (Multi30k en-de targets average 1.04x their source): S and the cap are
`components.records.decoder_shape`, which the batching of the Beam jobs groups by too. The AR kinds
decode into the cap (the width only sizes their KV cache; the loop stops when every row
has emitted EOS). The PaDIR kinds run two calls: the encoder and the length head, which
pick candidate lengths up to the cap, then the decoder at the width T those lengths need
(`refinement.output_width`: a multiple of 8), because every pass costs rows x T.
Rows are filled up to `batch_size` with copies of the first sentence, whose outputs are
discarded: a copy finishes when its original does, so filler rows never lengthen a
`while_loop`. A translator therefore compiles once per source bucket S (`TRACES` counts
those traces) and, for the PaDIR kinds, once per width T (`WIDTH_TRACES`).

Shortlist (`DecodeMethod.shortlist`, every kind): each batch decodes over the target pieces
its sources can need (`model/decoding/shortlist.py`: frequent pieces, the source's own pieces, the
pieces most associated with them), selected on the host per batch from a table built from
the model's own training pairs (the `encode` or `encode_distilled` artifact its manifest
names), once per process (`shortlist_table`). The search then compiles once per width and
shortlist size (a multiple of `shortlist.SIZE_STEP`). The CTranslate2 kinds get the same
table as CTranslate2's vocabulary map (model/decoding/ctranslate2_search.py).

Timing. A batch whose shapes (S, cap, T) were not met before is decoded twice and timed the
second time (the first compiles; `compile_seconds` adds up those first calls):
`batch_seconds` is the wall time from the first jitted call until the last one's
`block_until_ready`, host to device transfer included, tokenisation and detokenisation
excluded. It splits into `encode_seconds` (PaDIR: encoder + length head, until its lengths
are on the host; AR: the encoder), the choice of width on the host, and `search_seconds`
(the passes or steps). `latency_s` is `batch_seconds` at batch size 1; in a larger batch it
is `batch_seconds` divided by the number of real sentences in the batch (an amortised cost,
not a latency a user would see).

Decoder passes per sentence (the sequential decoder calls, which set the latency on an
accelerator at batch 1): for the NAR kinds what `model.decoding.refinement` reports (the teacher's
scoring pass counted for `refine_rescored`); for `draft_verify` rounds x (drafter passes per
draft + the teacher's pass); for the AR kinds the hypothesis length counting EOS (the steps
that produced it; beam search may run a few more steps before it knows no live beam can
win, each over `beam_size` rows). Scores: the beam's length-penalised log-probability
(`ar_beam`), the mean token log-probability of the chosen candidate (NAR kinds; under the
teacher for `refine_rescored`), None for `ar_greedy` and `draft_verify`.

Kinds with a second model (`DecodeMethod.rescorer`: `refine_rescored`, `draft_verify`)
decode with two: the student refines its candidates and the teacher picks one
(`refinement.refine_rescored`), or the block drafter drafts and the teacher verifies
(`draft_verify.draft_verify`, into the whole cap: the teacher says where a sentence ends).
The first call runs both encoders, the second the passes and the teacher's scoring pass;
both are timed like every other kind. The teacher is the `rescorer` given to the
`Translator` (the decode stage gives its own), else the one the model's artifact was
computed from (`upstream`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from components import artifacts, records
from components import config as config_lib
from components.config import DecodeMethod
from components.tokenizer import EOS_ID, PAD_ID
from model import trained_model
from model.decoding import (beam_search, ctranslate2_search, draft_verify, refinement,
                            shortlist)
from model.trained_model import LoadedModel

log = logging.getLogger(__name__)

# Traces of the encoding call, by (artifact URI, method name, batch size), one per source
# bucket; traces of the search, by (artifact URI, method name, batch size, width, columns
# scored: the shortlist's size or V).
TRACES: collections.Counter = collections.Counter()
WIDTH_TRACES: collections.Counter = collections.Counter()
_SHORTLISTS: dict[str, shortlist.Shortlist] = {}
_SHORTLISTS_LOCK = threading.Lock()
TRAINING_DATA = ("encode", "encode_distilled")  # the manifest inputs a model trained on


def shortlist_table(loaded: LoadedModel) -> shortlist.Shortlist:
    """The shortlist table of a model's own training pairs, built once per process."""
    with _SHORTLISTS_LOCK:
        if loaded.uri not in _SHORTLISTS:
            inputs = artifacts.read(loaded.uri).manifest["inputs"]
            [data] = [uri for name, uri in inputs.items() if name in TRAINING_DATA]
            from model import input_pipeline  # TensorFlow: only where a shortlist is built

            pairs = input_pipeline.read_pairs(input_pipeline.split_files(data, "train"))
            _SHORTLISTS[loaded.uri] = shortlist.build(pairs, loaded.tokenizer.vocab_size)
            log.info("shortlist table of %s built from %s", loaded.uri, data)
        return _SHORTLISTS[loaded.uri]


def upstream(uri: str, stage: str) -> str:
    """The `stage` artifact that artifact `uri` was computed from, found through the
    manifests' inputs, nearest first (a student's teacher: the one it started from, else
    the one that distilled its data). ConfigError if there is none."""
    pending, seen = [uri], set()
    while pending:
        current = pending.pop(0)
        if current in seen:
            continue
        seen.add(current)
        inputs = artifacts.read(current).manifest["inputs"]
        if stage in inputs:
            return inputs[stage]
        pending += list(inputs.values())
    raise config_lib.ConfigError(
        f"{uri} was not computed from a {stage!r} artifact (e.g. a student trained on the "
        f"original pairs): give the {stage} to rescore with")


def _check_rescorer(loaded: LoadedModel, method: DecodeMethod, rescorer: LoadedModel) -> None:
    """The rescorer is of the method's stage and reads the same vocabulary."""
    if rescorer.stage != method.rescorer:
        raise config_lib.ConfigError(
            f"method {method.name!r} ({method.kind}) rescores with a {method.rescorer!r} "
            f"artifact, not {rescorer.uri} ({rescorer.stage!r})")
    if loaded.tokenizer.model_bytes != rescorer.tokenizer.model_bytes:  # the same pieces
        raise config_lib.ConfigError(
            f"{loaded.uri} and its rescorer {rescorer.uri} use different vocabularies")


@dataclasses.dataclass(frozen=True)
class Translation:
    """The decoding of one sentence (see the module docstring for the definitions)."""

    hypothesis: str
    tokens: list[int]  # hypothesis ids, EOS included when emitted
    score: Optional[float]
    passes: int
    source_tokens: int  # source ids decoded, EOS included (after any cut)
    truncated: bool  # the source was cut to the widest bucket
    latency_s: float
    batch_seconds: float
    encode_seconds: float  # of batch_seconds (see the module docstring)
    search_seconds: float
    width: int  # output positions decoded (PaDIR: from the lengths; AR: the cap)
    batch_size: int  # real sentences in the decoded batch
    rounds: Optional[int] = None  # draft_verify: draft-and-verify rounds
    accepted: Optional[int] = None  # draft_verify: drafted tokens the teacher accepted

    def as_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _hypothesis_ids(row: np.ndarray) -> list[int]:
    """A decoded row up to and including its first EOS (the whole row if it has none)."""
    ids = [int(i) for i in row]
    return ids[:ids.index(EOS_ID) + 1] if EOS_ID in ids else ids


def _encode_batch(model: Any, method: DecodeMethod, params: Any, source: jax.Array, *,
                  max_len: int) -> Any:
    """The first call: the encoder (AR), or the encoder and the length head (PaDIR:
    `refinement.Candidates` with lengths up to `max_len`); for a rescored kind, whose model
    and params are (student's, rescorer's), also the rescorer's encoder
    (`refinement.Rescoring`); for draft_verify, (drafter's, teacher's), both encoders."""
    if method.stage in config_lib.AR_STAGES:
        return model.encode(params, source)
    if method.kind == "draft_verify":  # no lengths: the teacher says where a sentence ends
        (model, verifier), (params, verifier_params) = model, params
        return model.encode(params, source), verifier.encode(verifier_params, source)
    if method.rescorer:
        (model, rescorer), (params, rescorer_params) = model, params
        return refinement.Rescoring(
            candidates=_candidates(model, method, params, source, max_len=max_len),
            encoded=rescorer.encode(rescorer_params, source))
    return _candidates(model, method, params, source, max_len=max_len)


def _candidates(model: Any, method: DecodeMethod, params: Any, source: jax.Array, *,
                max_len: int) -> refinement.Candidates:
    return refinement.predict_candidates(
        model, params, source, num_length_candidates=method.num_length_candidates,
        length_offsets=tuple(method.length_offsets), max_len=max_len)


def _search_batch(model: Any, method: DecodeMethod, params: Any, encoded: Any,
                  vocab_ids: Optional[jax.Array], *, width: int
                  ) -> dict[str, Optional[jax.Array]]:
    """The second call, into `width` positions, over the shortlist `vocab_ids` (None: all
    ids): `SEARCHES[method.kind]`."""
    return SEARCHES[method.kind](model, method, params, encoded, vocab_ids, width=width)


# Each search: (model, method, params, encoded, vocab_ids, *, width) ->
# {"tokens": int32[B, T], "scores": float32[B] or None (no score), "passes": int32[B] or None
# (AR: one pass per hypothesis token, counted on the host)}; draft_verify adds "rounds" and
# "accepted" (drafted tokens accepted), int32[B]. `encoded` is what
# `_encode_batch` returned; `vocab_ids` the batch's shortlist or None.


def _ar_greedy(model, method, params, encoded, vocab_ids, *, width):
    return {"tokens": beam_search.greedy(model, params, *encoded, width, vocab_ids),
            "scores": None, "passes": None}


def _ar_beam(model, method, params, encoded, vocab_ids, *, width):
    tokens, scores = beam_search.beam(model, params, *encoded, width, method.beam_size,
                                      method.length_penalty, vocab_ids)
    return {"tokens": tokens, "scores": scores, "passes": None}


def _refine(model, method, params, encoded, vocab_ids, *, width):
    return _result(refinement.refine(model, params, encoded, width=width,
                                   max_iterations=method.iterations, vocab_ids=vocab_ids))


def _refine_rescored(model, method, params, encoded, vocab_ids, *, width):
    (model, rescorer), (params, rescorer_params) = model, params
    return _result(refinement.refine_rescored(
        model, params, rescorer, rescorer_params, encoded, width=width,
        max_iterations=method.iterations, vocab_ids=vocab_ids))


def _draft_verify(model, method, params, encoded, vocab_ids, *, width):
    (model, verifier), (params, verifier_params) = model, params
    result = draft_verify.draft_verify(
        model, params, verifier, verifier_params, encoded, width=width,
        draft_passes=method.iterations, top_k=method.tolerance_top_k,
        margin=method.tolerance_margin, vocab_ids=vocab_ids)
    return {"tokens": result.tokens, "scores": None, "passes": result.passes,
            "rounds": result.rounds, "accepted": result.accepted}


def _mask_predict(model, method, params, encoded, vocab_ids, *, width):
    return _result(refinement.mask_predict(model, params, encoded, width=width,
                                         iterations=method.iterations, vocab_ids=vocab_ids))


def _adaptive(model, method, params, encoded, vocab_ids, *, width):
    return _result(refinement.adaptive(model, params, encoded, width=width,
                                     tokens_per_step=method.tokens_per_step,
                                     vocab_ids=vocab_ids))


def _result(result: Any) -> dict[str, jax.Array]:
    return {"tokens": result.tokens, "scores": result.scores, "passes": result.passes}


# Decoding kind -> its search; `components.config.DECODING_KINDS` holds the rest of its entry.
SEARCHES: dict[str, Callable[..., dict[str, Optional[jax.Array]]]] = {
    "ar_greedy": _ar_greedy,
    "ar_beam": _ar_beam,
    "refine": _refine,
    "refine_rescored": _refine_rescored,
    "mask_predict": _mask_predict,
    "adaptive": _adaptive,
    "draft_verify": _draft_verify,
}


class Translator:
    """One decoding method over a loaded model, in batches of a fixed size.

    Args:
      loaded: the restored artifact; its stage must be the method's (`DecodeMethod.stage`).
      method: what to run.
      batch_size: rows of every decoder call (sentences are decoded this many at a time).
      boundaries: the length buckets (default: the artifact's).
      rescorer: the model that picks among the candidates of a rescored kind
        (`DecodeMethod.rescorer`: the teacher); default the one `loaded` was trained from
        (`upstream`: the teacher that distilled its data). None for the other kinds.
      ctranslate2_threads: the CTranslate2 kinds' threads (model/decoding/ctranslate2_search.py
        `Search`); None for the other kinds.
    """

    def __init__(self, loaded: LoadedModel, method: DecodeMethod, *, batch_size: int,
                 boundaries: Optional[Sequence[int]] = None,
                 rescorer: Optional[LoadedModel] = None,
                 ctranslate2_threads: Optional[ctranslate2_search.Threads] = None):
        if method.stage != loaded.stage:
            raise config_lib.ConfigError(
                f"method {method.name!r} ({method.kind}) decodes with a {method.stage!r} "
                f"artifact, not {loaded.uri} ({loaded.stage!r})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._model, self._params = loaded.model, loaded.params
        if method.rescorer:
            rescorer = rescorer or trained_model.load_cached(upstream(loaded.uri, method.rescorer))
            _check_rescorer(loaded, method, rescorer)
            self._model = (loaded.model, rescorer.model)
            self._params = (loaded.params, rescorer.params)
        elif rescorer is not None:
            raise ValueError(f"method {method.name!r} ({method.kind}) takes no rescorer")
        self.loaded = loaded
        self.rescorer = rescorer
        self.method = method
        self.batch_size = batch_size
        self.boundaries = tuple(boundaries or loaded.boundaries)
        config = loaded.model.config
        if self.boundaries[-1] > min(config.max_source_len, config.max_target_len):
            raise ValueError(f"bucket {self.boundaries[-1]} is wider than the model's "
                             f"max_source_len/max_target_len")
        self._shortlist = shortlist_table(loaded) if method.shortlist else None
        self._ctranslate2 = (
            ctranslate2_search.Search(loaded, method, threads=ctranslate2_threads,
                                      vocabulary_map=self._shortlist)
            if method.kind in ctranslate2_search.KINDS else None)
        self._warm: set[tuple[int, int, int, int]] = set()  # (S, cap, width, columns) compiled
        # The first calls of each shape, untimed by `batch_seconds`: compiling, and a decode.
        self.compile_seconds = 0.0
        trace_key = (loaded.uri, method.name, batch_size)

        def encode(params, source, *, max_len):
            TRACES[trace_key] += 1  # a Python side effect: runs once per trace
            return _encode_batch(self._model, method, params, source, max_len=max_len)

        def search(params, encoded, vocab_ids, *, width):
            columns = loaded.model.vocab_size if vocab_ids is None else vocab_ids.shape[0]
            WIDTH_TRACES[trace_key + (width, columns)] += 1
            return _search_batch(self._model, method, params, encoded, vocab_ids, width=width)

        self._jit_encode = jax.jit(encode, static_argnames=("max_len",))
        self._jit_search = jax.jit(search, static_argnames=("width",))

    def translate(self, sources: Sequence[str]) -> list[Translation]:
        """Translations of `sources`, in order, decoded `batch_size` at a time."""
        if isinstance(sources, str):
            raise TypeError("translate takes a sequence of strings; wrap one in a list")
        out: list[Translation] = []
        for start in range(0, len(sources), self.batch_size):
            out.extend(self._translate_batch(sources[start:start + self.batch_size]))
        return out

    def source_batch(self, sources: Sequence[str]) -> tuple[np.ndarray, int, list[bool]]:
        """What a batch of at most `batch_size` sentences decodes from: (int32[rows, S],
        its source ids padded to their bucket, filler rows copying the first sentence up to
        `batch_size` but for the CTranslate2 kinds; the output cap; whether each source was
        cut to the widest bucket)."""
        widest = self.boundaries[-1]
        pieces = self.loaded.tokenizer.encode(list(sources))
        rows = [ids[:widest - 1] + [EOS_ID] for ids in pieces]
        longest = max(len(row) for row in rows)
        source_width, max_len = records.decoder_shape(longest, self.boundaries)
        filled = len(rows) if self._ctranslate2 is not None else self.batch_size
        source = np.full((filled, source_width), PAD_ID, np.int32)
        for i in range(filled):
            row = rows[i] if i < len(rows) else rows[0]
            source[i, :len(row)] = row
        return source, max_len, [len(ids) + 1 > widest for ids in pieces]

    def _translate_batch(self, sources: Sequence[str]) -> list[Translation]:
        source, max_len, truncated = self.source_batch(sources)
        started = time.perf_counter()
        timed = self._call(source, max_len)
        shape = (source.shape[1], max_len) + timed[-2:]
        if shape not in self._warm:  # it compiled: run again
            self._warm.add(shape)
            self.compile_seconds += time.perf_counter() - started
            timed = self._call(source, max_len)
        output, seconds, encode_seconds, search_seconds, decoded_width, _ = timed
        output = jax.device_get(output)
        translations = []
        for i, cut in enumerate(truncated):
            tokens = _hypothesis_ids(output["tokens"][i])
            scores, passes = output["scores"], output["passes"]
            rounds, accepted = output.get("rounds"), output.get("accepted")
            translations.append(Translation(
                hypothesis=self.loaded.tokenizer.decode(tokens),
                tokens=tokens,
                score=None if scores is None else float(scores[i]),
                passes=len(tokens) if passes is None else int(passes[i]),
                source_tokens=int(np.count_nonzero(source[i] != PAD_ID)),
                truncated=cut,
                latency_s=seconds / len(truncated),
                batch_seconds=seconds,
                encode_seconds=encode_seconds,
                search_seconds=search_seconds,
                width=decoded_width,
                batch_size=len(truncated),
                rounds=None if rounds is None else int(rounds[i]),
                accepted=None if accepted is None else int(accepted[i]),
            ))
        return translations

    def _call(self, source: np.ndarray, max_len: int
              ) -> tuple[dict[str, jax.Array], float, float, float, int, int]:
        """Both calls, timed: (output, seconds, encode seconds, search seconds, width,
        columns scored). The shortlist is selected on the host, timed with the width.
        The CTranslate2 kinds time their own call (model/decoding/ctranslate2_search.py)."""
        if self._ctranslate2 is not None:
            return self._ctranslate2(source, max_len)
        started = time.perf_counter()
        encoded = jax.block_until_ready(
            self._jit_encode(self._params, source, max_len=max_len))
        encoded_at = time.perf_counter()
        if config_lib.DECODING_KINDS[self.method.kind].to_the_cap:
            width = max_len
        else:
            width = refinement.output_width(encoded.lengths, max_len)
        vocab_ids = None if self._shortlist is None else shortlist.select(self._shortlist, source)
        chosen_at = time.perf_counter()
        output = jax.block_until_ready(
            self._jit_search(self._params, encoded, vocab_ids, width=width))
        done = time.perf_counter()
        columns = self.loaded.model.vocab_size if vocab_ids is None else len(vocab_ids)
        return (output, done - started, encoded_at - started, done - chosen_at, width,
                columns)
