"""A published training artifact restored as a model: what decoding and warm starts read.

    loaded = load("work/multi30k_en_de/student/<key>")   # LoadedModel (params on device)
    loaded.model, loaded.params, loaded.tokenizer, loaded.boundaries

`load` reads everything from the artifact itself: the model config from its manifest's
config section, the vocabulary from the `vocab` artifact its manifest names as an input,
the length buckets from the `encode` section of its config.yaml, and the parameters of the
checkpoint the training stage would decode with (components/training_artifact.py
`decoded_checkpoints`: the best by the run's `best_metric`; for the student, of its last
phase). `load_cached` restores each artifact once per process (the decode stage's workers,
`padir translate`); `restore` reads one checkpoint folder of a model already built (the
teacher's final dev evaluation).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any, Optional, Union

import fsspec
import jax
import yaml

from components import artifacts, training_artifact
from components import config as config_lib
from components.tokenizer import Tokenizer
from model import checkpoints, train
from model.models import ARModel, DrafterModel, PaDIRModel

log = logging.getLogger(__name__)

# Checkpoint restores in this process, by artifact URI (tests assert "once per process").
RESTORES: collections.Counter = collections.Counter()
_CACHE: dict[tuple[str, str], "LoadedModel"] = {}
_CACHE_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A training artifact restored for decoding."""

    uri: str
    stage: str  # "teacher" or "ar_student" (ARModel), "student" (PaDIRModel), "drafter"
    step: int
    model: Union[ARModel, PaDIRModel, DrafterModel]
    params: Any
    tokenizer: Tokenizer
    boundaries: tuple[int, ...]  # the encode stage's length buckets


def restore(model: Any, directory: str, best_metric: Optional[str]) -> tuple[Any, int]:
    """A model's parameters from a checkpoint directory: the best step by `best_metric`
    (else the latest), on the default device. Returns (params, step)."""
    abstract = jax.eval_shape(model.init, jax.random.key(0), train.example_batch(model))
    params, _, step = checkpoints.restore_params(directory, abstract, best_metric=best_metric)
    log.info("restored step %d of %s", step, directory)
    return params, step


def _read_text(uri: str) -> str:
    with fsspec.open(uri, "r") as f:
        return f.read()


def load(uri: str) -> LoadedModel:
    """Restores a published training artifact, `teacher`, `ar_student`, `student` or
    `drafter` (see the module docstring; the drafter's `block` is its manifest's too).

    Raises:
      artifacts.IncompleteArtifactError: `uri` has no manifest.
      config_lib.ConfigError: it is not a training artifact.
    """
    artifact = artifacts.read(uri)
    if artifact.stage not in config_lib.TRAINING_STAGES:
        raise config_lib.ConfigError(f"{uri} is a {artifact.stage!r} artifact; decoding needs "
                                     f"one of {config_lib.TRAINING_STAGES}")
    section = artifact.manifest["config"][artifact.stage]
    model_config = config_lib.from_dict(config_lib.ModelConfig, section["model"],
                                        f"{artifact.stage}.model")
    tokenizer = Tokenizer.for_artifact(artifact)
    if artifact.stage in config_lib.AR_STAGES:
        model = ARModel(model_config, tokenizer.vocab_size)
    elif artifact.stage == "drafter":
        model = DrafterModel(model_config, tokenizer.vocab_size, section["block"])
    else:
        model = PaDIRModel(model_config, tokenizer.vocab_size, tokenizer.first_real_id)
    resolved = yaml.safe_load(_read_text(artifact.path(artifacts.CONFIG)))
    boundaries = config_lib.from_dict(config_lib.EncodeConfig, resolved["encode"],
                                      "encode").bucket_boundaries
    params, step = restore(model, training_artifact.decoded_checkpoints(artifact),
                           section["loop"]["best_metric"])
    RESTORES[uri] += 1
    return LoadedModel(uri=uri, stage=artifact.stage, step=step, model=model, params=params,
                       tokenizer=tokenizer, boundaries=tuple(boundaries))


def load_cached(uri: str) -> LoadedModel:
    """`load`, once per process and published artifact (a rerun stage republishes under
    the same URI with a new manifest, and is restored again)."""
    manifest = artifacts.read(uri).manifest
    with _CACHE_LOCK:
        key = (uri, f"{manifest['created']} {manifest['wall_seconds']}")
        if key not in _CACHE:
            _CACHE[key] = load(uri)
        return _CACHE[key]
