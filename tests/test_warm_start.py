"""Starting the PaDIR student from the AR teacher's parameters (model/warm_start.py)."""

import jax
import numpy as np

from components.config import ModelConfig
from model import train, warm_start
from model.models import ARModel, PaDIRModel

CONFIG = ModelConfig(d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                     mlp_dim=32, max_source_len=8, max_target_len=8)


def _params(model, seed):
    return model.init(jax.random.PRNGKey(seed), train.example_batch(model))


def test_the_student_takes_every_shared_array_and_keeps_its_own():
    teacher = _params(ARModel(CONFIG, 50, label_smoothing=0.1), seed=0)
    student = _params(PaDIRModel(CONFIG, 50, first_real_id=6), seed=1)
    started, taken = warm_start.from_teacher(student, teacher)

    flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(x)
                         for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    teacher, student, started = flat(teacher), flat(student), flat(started)
    assert set(taken) == {name for name in student
                          if name in teacher and teacher[name].shape == student[name].shape}
    for name in taken:
        np.testing.assert_array_equal(started[name], teacher[name])
    for name in set(student) - set(taken):
        np.testing.assert_array_equal(started[name], student[name])
    assert "['token_embedding']['embedding']" in taken
    assert any("['encoder']['layer_0']" in name for name in taken)
    assert any("['decoder']['layer_0']['cross_attention']" in name for name in taken)
    # PaDIR's own parts, and its encoder positions (one more, for [LENGTH]), start fresh.
    assert not any("positional_attention" in name or "length_classifier" in name
                   for name in taken)
    assert "['encoder']['pos_embedding']" not in taken
