"""Starting the student from the teacher: the parameters the two models share.

The PaDIR student and the AR teacher share their layout where their architectures agree
(model/transformer.py names both alike): the token embedding, the encoder, and in each
decoder layer the self-attention, cross-attention and MLP with their norms. What only
PaDIR has (positional attention, the length head, the position table of its [LENGTH]
token) starts from scratch. A parameter is taken when its path and shape are the same in
both models, so a student of another shape takes only what fits.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)


def from_teacher(student_params: Any, teacher_params: Any) -> tuple[Any, list[str]]:
    """`student_params` with every array that `teacher_params` has at the same path and
    shape replaced by the teacher's (placed like the student's); and the paths taken."""
    teacher = {jax.tree_util.keystr(path): leaf
               for path, leaf in jax.tree_util.tree_leaves_with_path(teacher_params)}
    taken: list[str] = []

    def take(path, leaf):
        name = jax.tree_util.keystr(path)
        source = teacher.get(name)
        if source is None or tuple(source.shape) != tuple(leaf.shape):
            return leaf
        taken.append(name)
        return jax.device_put(np.asarray(source, dtype=leaf.dtype), leaf.sharding)

    params = jax.tree_util.tree_map_with_path(take, student_params)
    total = len(jax.tree_util.tree_leaves(student_params))
    log.info("initialised %d of %d parameter arrays from the teacher; the rest from scratch",
             len(taken), total)
    return params, taken
