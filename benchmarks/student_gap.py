"""What the student's distance to its teacher is made of: the lengths, or the words in them.

Decodes a test set with an experiment's PaDIR student (`--iterations`, 4 by default, as the
decode stage's PaDIR-4) several ways that differ only in the lengths the refinement fills:
  predicted      the length head's most likely length (the decode stage's PaDIR-k);
  predicted, 3   its three most likely, the best by score (`num_length_candidates: 3`);
  teacher's      the length of the teacher's translation of the sentence (the decode
                 artifact's `--teacher-method`, beam 4 by default): what the student was
                 trained to reproduce, since it learns from the teacher's beam-4 output;
  reference's    the length of the reference, in the same pieces.
and the first again with repeated words collapsed ("ein Hund Hund." -> "ein Hund."), the
usual clean-up of a non-autoregressive output. Prints sacreBLEU, tokenised lowercased BLEU,
stutter, and how often the length head's most likely length is an oracle's, beside the
teacher's own figures.
If an oracle length does not close the gap, a better length head would not either: the
gap is in the words the student puts into the slots.

    PADIR_DATA_ROOT=/path/to/data python benchmarks/student_gap.py \\
        [--config configs/multi30k_en_de.yaml] [--set k=v ...] [--max-sentences N]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from components import config as config_lib  # noqa: E402
from components import corpus, dag, metrics, records  # noqa: E402
from components.tokenizer import EOS_ID, PAD_ID  # noqa: E402
from model import refinement, translator  # noqa: E402
from pipelines import decode  # noqa: E402

BATCH_SIZE = 64


def refine_at(loaded: translator.LoadedModel, sources: Sequence[str], *, iterations: int,
              boundaries: Sequence[int], lengths: Optional[Sequence[int]] = None,
              num_length_candidates: int = 1) -> tuple[list[list[int]], list[int]]:
    """PaDIR refinement of `sources` in batches of `BATCH_SIZE` (sorted by length, in the
    decode stage's shapes), at the given lengths (counting EOS; clipped to each batch's
    output cap) or the length head's candidates. Returns each sentence's tokens (EOS
    included) and the length head's most likely length, in the order of `sources`."""
    model, params = loaded.model, loaded.params
    rows = [ids[:boundaries[-1] - 1] + [EOS_ID] for ids in loaded.tokenizer.encode(sources)]
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]), i))
    tokens: list[list[int]] = [[] for _ in rows]
    predicted = [0] * len(rows)
    for start in range(0, len(order), BATCH_SIZE):
        batch = order[start:start + BATCH_SIZE]
        batch += batch[:1] * (BATCH_SIZE - len(batch))  # filler rows copy the first
        source_width, max_len = records.decoder_shape(max(len(rows[i]) for i in batch),
                                                      boundaries)
        source = np.full((BATCH_SIZE, source_width), PAD_ID, np.int32)
        for row, i in enumerate(batch):
            source[row, :len(rows[i])] = rows[i]
        candidates = refinement.predict_candidates(
            model, params, source, num_length_candidates=num_length_candidates,
            length_offsets=(0,), max_len=max_len)
        head = np.asarray(candidates.lengths)[:, 0]
        if lengths is not None:
            chosen = [[min(max_len, max(refinement.MIN_LENGTH, lengths[i]))] for i in batch]
            candidates = candidates.replace(lengths=jnp.asarray(chosen, jnp.int32))
        width = refinement.output_width(candidates.lengths, max_len)
        out = np.asarray(refinement.refine(model, params, candidates, width=width,
                                         max_iterations=iterations).tokens)
        for row, i in enumerate(batch):
            ids = out[row].tolist()
            tokens[i] = ids[:ids.index(EOS_ID) + 1]  # refinement puts EOS at the length
            predicted[i] = int(head[row])
    return tokens, predicted


def collapse_repeats(text: str) -> str:
    """Each run of tokens that are one word as stutter counts words (case and edge
    punctuation aside) collapsed to its last token: "ein Hund hund." -> "ein hund."."""
    tokens = text.split()
    words = [metrics.stutter_words(token) for token in tokens]
    return " ".join(token for i, token in enumerate(tokens)
                    if not (words[i] and i + 1 < len(tokens) and words[i] == words[i + 1]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/multi30k_en_de.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--test-set", help="a decoded test split (default: the first)")
    parser.add_argument("--max-sentences", type=int, help="the first N sentences by id")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--teacher-method", default="ar_beam4",
                        help="the decode artifact's method whose lengths are the oracle")
    args = parser.parse_args(argv)
    config = config_lib.load(args.config, args.set)
    test_set = args.test_set or decode.decoded_splits(config.data)[0]
    pairs = list(corpus.read_split(dag.require_input(config, "prepare").uri,
                                   test_set))[:args.max_sentences]
    decoded = decode.output_path(dag.require_input(config, "decode").uri, decode.HYPOTHESES,
                                 test_set, args.teacher_method)
    teacher = {line["id"]: line for line in corpus.read_jsonl(decoded)}
    loaded = translator.load(dag.require_input(config, "student").uri)
    sources = [pair["source"] for pair in pairs]
    references = [pair["target"] for pair in pairs]
    oracles = {
        f"{args.teacher_method}'s": [teacher[pair["id"]]["hypothesis_tokens"] for pair in pairs],
        "the reference's": [len(ids) + 1 for ids in loaded.tokenizer.encode(references)],
    }
    common = dict(iterations=args.iterations, boundaries=config.encode.bucket_boundaries)
    tokens, predicted = refine_at(loaded, sources, **common)
    rows = {"the length head's most likely": tokens,
            "the best of its 3 most likely": refine_at(loaded, sources, num_length_candidates=3,
                                                       **common)[0]}
    rows.update({name: refine_at(loaded, sources, lengths=lengths, **common)[0]
                 for name, lengths in oracles.items()})
    hypotheses = {name: [loaded.tokenizer.decode(ids) for ids in out]
                  for name, out in rows.items()}
    first = next(iter(hypotheses))
    hypotheses[f"{first}, repeats collapsed"] = [collapse_repeats(h) for h in hypotheses[first]]
    hypotheses[f"(teacher: {args.teacher_method})"] = [
        teacher[pair["id"]]["hypothesis"] for pair in pairs]

    lang = config.data.target_lang
    print(f"{test_set}: {len(pairs)} sentences; PaDIR-{args.iterations} of "
          f"{loaded.uri} (step {loaded.step})")
    for name, lengths in oracles.items():
        exact = np.mean(np.asarray(predicted) == np.asarray(lengths))
        print(f"the length head's most likely length is {name} length for "
              f"{100 * exact:.1f}% of sentences")
    print("\n| lengths | BLEU | tok. lc | stutter (% sent.) |\n|---|---:|---:|---:|")
    for name, hyps in hypotheses.items():
        stutter = metrics.stutter_stats(hyps, references)
        print(f"| {name} | {metrics.corpus_bleu(hyps, references, lang).score:.2f} | "
              f"{metrics.tokenized_lowercased_bleu(hyps, references).score:.2f} | "
              f"{100 * stutter.sentence_rate:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
