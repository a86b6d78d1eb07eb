"""An AR model (the teacher, or the AR student with its own depths) as a CTranslate2 model:
the CPU serving baseline (`padir export`).

CTranslate2 is what a user would serve an AR Transformer with on CPU, so the decode stage
measures PaDIR against it as well as against our own JAX search. `transformer_spec` maps
the teacher's parameters onto CTranslate2's `TransformerSpec`, which describes the same
network (model/transformer.py):

  ours                                          CTranslate2
  pre-norm layers, RMSNorm (eps 1e-6)           pre_norm=True, rms_norm=True, layer_norm_epsilon
  learned positions from 0, embeddings          position_encodings.encodings, scale_embeddings
    added unscaled                                =False
  no biases                                     LinearSpec.bias left unset
  tanh-approximated GELU (flax nn.gelu)         Activation.GELUTanh
  q/k/v kernels [D, heads, kv], out [heads,     Linear weights [out, in]: fused qkv (self),
    kv, D]; queries scaled by kv**-0.5            q and fused kv (cross); the same scaling
  tied output projection on y * D**-0.5         decoder.projection = the embedding,
                                                  scale_outputs = D**-0.5
  logits of pad, BOS, [MASK], [LENGTH] masked   `suppress_sequences` (ctranslate2_search.py)

The vocabulary is the SentencePiece model's pieces in id order (ids are equal), the same
for source and target. Sources are given with their EOS piece, as our encoder reads them.

A shortlist table (model/decoding/shortlist.py) can go with the export as CTranslate2's vocabulary
map (`vmap.txt`, read when `translate_batch(use_vmap=True)`): a line with no source piece
lists the pieces always scored, and a line per real source piece its own piece and the
pieces most associated with it, so that a batch scores the same union as our `select`
(without its padding to a size step).
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional, Sequence

import numpy as np

from components.config import ModelConfig
from components.tokenizer import BOS_ID, EOS_ID, NUM_RESERVED, UNK_ID
from components.tokenizer import RESERVED_PIECES
from model.decoding import shortlist

RMS_NORM_EPSILON = 1e-6  # flax.linen.RMSNorm's default, which model/transformer.py keeps
SPM_FILE = "spm.model"  # the SentencePiece model, copied beside the export for users
VMAP_FILE = "vmap.txt"  # the vocabulary map, read from the model directory by CTranslate2


def _array(x: Any) -> np.ndarray:
    return np.asarray(x, np.float32)


def _kernel(kernel: Any) -> np.ndarray:
    """A flax q/k/v kernel [D, heads, kv] as a CTranslate2 weight [heads * kv, D]."""
    kernel = _array(kernel)
    return kernel.reshape(kernel.shape[0], -1).T


def _out_kernel(kernel: Any) -> np.ndarray:
    """A flax attention output kernel [heads, kv, D] as a weight [D, heads * kv]."""
    kernel = _array(kernel)
    return kernel.reshape(-1, kernel.shape[-1]).T


def _attention(spec: Any, params: dict, norm: dict, *, self_attention: bool) -> None:
    spec.layer_norm.gamma = _array(norm["scale"])
    query, key, value = (_kernel(params[name]["kernel"]) for name in ("query", "key", "value"))
    if self_attention:
        spec.linear[0].weight = np.concatenate([query, key, value])  # [3D, D]
        spec.linear[1].weight = _out_kernel(params["out"]["kernel"])
    else:
        spec.linear[0].weight = query
        spec.linear[1].weight = np.concatenate([key, value])  # [2D, D]
        spec.linear[2].weight = _out_kernel(params["out"]["kernel"])


def _mlp(spec: Any, params: dict, norm: dict) -> None:
    spec.layer_norm.gamma = _array(norm["scale"])
    spec.linear_0.weight = _array(params["wi"]["kernel"]).T
    spec.linear_1.weight = _array(params["wo"]["kernel"]).T


def transformer_spec(config: ModelConfig, params: Any) -> Any:
    """The teacher's parameters (ARModel.init's tree) as a CTranslate2 TransformerSpec."""
    from ctranslate2.specs import common_spec, transformer_spec as specs

    spec = specs.TransformerSpec.from_config(
        (config.num_encoder_layers, config.num_decoder_layers), config.num_heads,
        pre_norm=True, activation=common_spec.Activation.GELUTanh, rms_norm=True)
    embedding = _array(params["token_embedding"]["embedding"])  # [V, D]
    for stack, ours in ((spec.encoder, params["encoder"]), (spec.decoder, params["decoder"])):
        stack.scale_embeddings = False
        stack.position_encodings.encodings = _array(ours["pos_embedding"])
        stack.layer_norm.gamma = _array(ours["final_norm"]["scale"])
    spec.encoder.embeddings[0].weight = embedding
    spec.decoder.embeddings.weight = embedding
    spec.decoder.projection.weight = embedding
    spec.decoder.scale_outputs = np.float32(config.d_model ** -0.5)
    for i, layer in enumerate(spec.encoder.layer):
        ours = params["encoder"][f"layer_{i}"]
        _attention(layer.self_attention, ours["self_attention"],
                   ours["pre_self_attention_norm"], self_attention=True)
        _mlp(layer.ffn, ours["mlp"], ours["pre_mlp_norm"])
    for i, layer in enumerate(spec.decoder.layer):
        ours = params["decoder"][f"layer_{i}"]
        _attention(layer.self_attention, ours["self_attention"],
                   ours["pre_self_attention_norm"], self_attention=True)
        _attention(layer.attention, ours["cross_attention"], ours["pre_cross_attention_norm"],
                   self_attention=False)
        _mlp(layer.ffn, ours["mlp"], ours["pre_mlp_norm"])
    spec.config.layer_norm_epsilon = RMS_NORM_EPSILON
    return spec


def check_pieces(pieces: Sequence[str]) -> None:
    """The vocabulary must hold our reserved pieces at their ids, each piece once."""
    if tuple(pieces[:NUM_RESERVED]) != RESERVED_PIECES:
        raise ValueError(f"the first pieces are {list(pieces[:NUM_RESERVED])}, expected the "
                         f"reserved {list(RESERVED_PIECES)}")
    if len(set(pieces)) != len(pieces):
        raise ValueError("a CTranslate2 vocabulary needs distinct pieces")


def vocabulary_map_lines(table: shortlist.Shortlist, pieces: Sequence[str]) -> list[str]:
    """A shortlist table as the lines of CTranslate2's vocabulary map: `source piece \t
    target pieces`, the first line's source empty (the pieces every batch may score)."""
    lines = ["\t" + " ".join(pieces[i] for i in np.flatnonzero(table.always))]
    for source in range(NUM_RESERVED, table.vocab_size):
        associated = table.by_source[source]
        targets = [source] + [int(i) for i in associated[associated >= 0] if i != source]
        lines.append(pieces[source] + "\t" + " ".join(pieces[i] for i in targets))
    return lines


def export(config: ModelConfig, params: Any, pieces: Sequence[str], output_dir: str, *,
           quantization: Optional[str] = None, spm_model: Optional[bytes] = None,
           vocabulary_map: Optional[shortlist.Shortlist] = None) -> str:
    """Writes the teacher as a CTranslate2 model directory (model.bin, config.json,
    shared_vocabulary.json; `spm.model` too when `spm_model` is given, `vmap.txt` when
    `vocabulary_map` is), replacing one that is there.

    Args:
      config, params: the teacher's model config and parameters.
      pieces: the vocabulary, id order (`Tokenizer.id_to_piece` over every id).
      quantization: CTranslate2's weight type on disk (None: float32); a translator may
        still pick another `compute_type` when it loads the model.
      vocabulary_map: a shortlist table of the model's training pairs, for `use_vmap`.
    Returns:
      `output_dir`.
    """
    check_pieces(pieces)
    spec = transformer_spec(config, params)
    spec.config.unk_token = RESERVED_PIECES[UNK_ID]
    spec.config.bos_token = spec.config.decoder_start_token = RESERVED_PIECES[BOS_ID]
    spec.config.eos_token = RESERVED_PIECES[EOS_ID]
    spec.register_source_vocabulary(list(pieces))
    spec.register_target_vocabulary(list(pieces))
    spec.validate()
    spec.optimize(quantization=quantization)
    if os.path.exists(output_dir):
        shutil.rmtree(output_dir)
    os.makedirs(output_dir)
    spec.save(output_dir)
    if spm_model is not None:
        with open(os.path.join(output_dir, SPM_FILE), "wb") as f:
            f.write(spm_model)
    if vocabulary_map is not None:
        with open(os.path.join(output_dir, VMAP_FILE), "w", encoding="utf-8") as f:
            f.write("\n".join(vocabulary_map_lines(vocabulary_map, pieces)) + "\n")
    return output_dir
