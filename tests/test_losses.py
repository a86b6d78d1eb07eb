"""Tests for model/losses.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.config import ModelConfig, StudentConfig
from components.tokenizer import EOS_ID, MASK_ID, PAD_ID
from model import losses
from model.models import PaDIRModel
from model.noising import noise_targets

VOCAB = 12
TARGETS = jnp.array([[7, 8, 9, EOS_ID, 0], [10, EOS_ID, 0, 0, 0], [0, 0, 0, 0, 0]], jnp.int32)
NON_PAD = np.asarray(TARGETS != PAD_ID)


def test_cross_entropy_matches_log_softmax_and_is_zero_at_the_smoothed_target():
    logits = jax.random.normal(jax.random.key(0), TARGETS.shape + (VOCAB,))
    total, count = losses.cross_entropy(logits, TARGETS, TARGETS != PAD_ID)
    log_probs = jax.nn.log_softmax(logits)
    expected = -jnp.take_along_axis(log_probs, TARGETS[..., None], -1)[..., 0]
    np.testing.assert_allclose(total, np.sum(np.asarray(expected)[NON_PAD]), rtol=1e-5)
    assert count == NON_PAD.sum()
    # With smoothing 0.1, logits equal to the log of the smoothed target give loss 0.
    soft = jax.nn.one_hot(TARGETS, VOCAB) * (0.9 - 0.1 / 11) + 0.1 / 11
    total, _ = losses.cross_entropy(jnp.log(soft), TARGETS, TARGETS != PAD_ID, 0.1)
    np.testing.assert_allclose(total, 0.0, atol=1e-4)


def _reference_cross_entropy(logits, targets, weights, label_smoothing):
    """The textbook form: the smoothed one-hot against the log-softmax, by autodiff."""
    vocab = logits.shape[-1]
    low = label_smoothing / (vocab - 1)
    soft = jax.nn.one_hot(targets, vocab) * (1 - label_smoothing - low) + low
    entropy = -jnp.sum(jnp.where(soft > 0, soft * jnp.log(soft), 0.0), axis=-1)
    loss = -jnp.sum(soft * jax.nn.log_softmax(logits), axis=-1) - entropy
    return jnp.sum(loss * weights)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_and_its_gradient_match_the_textbook_form(label_smoothing):
    logits = 3 * jax.random.normal(jax.random.key(2), TARGETS.shape + (VOCAB,))
    weights = (TARGETS != PAD_ID) * jnp.array([1.0, 0.5, 2.0, 1.0, 0.0])
    ours = jax.value_and_grad(
        lambda x: losses.cross_entropy(x, TARGETS, weights, label_smoothing)[0])
    textbook = jax.value_and_grad(
        lambda x: _reference_cross_entropy(x, TARGETS, weights, label_smoothing))
    (value, grad), (expected_value, expected_grad) = jax.jit(ours)(logits), textbook(logits)
    np.testing.assert_allclose(value, expected_value, rtol=1e-5)
    np.testing.assert_allclose(grad, expected_grad, atol=1e-6)


def test_correct_tokens_is_the_argmax_count_and_counts_ties_as_correct():
    logits = jax.random.normal(jax.random.key(3), TARGETS.shape + (VOCAB,))
    logits = logits.at[0, 0, 7].set(5.0).at[0, 1, 8].set(5.0)  # two right, the rest random
    weights = TARGETS != PAD_ID
    expected = jnp.sum((losses.argmax_ids(logits) == TARGETS) * weights)
    assert losses.correct_tokens(logits, TARGETS, weights) == expected >= 2
    # A control id above the target is not a competitor (it can never be emitted); a tie
    # with a lower target id counts as correct.
    tied = logits.at[0, 2, MASK_ID].set(9.0).at[0, 2, 9].set(6.0).at[0, 2, 6].set(6.0)
    assert losses.correct_tokens(tied, TARGETS, weights) == expected + 1


def test_next_pass_input_zeroes_pads():
    argmax = jnp.array([[7, 7, 9, EOS_ID, 5], [PAD_ID, EOS_ID, 8, 8, 8], [3, 3, 3, 3, 3]])
    logits = jax.nn.one_hot(argmax, VOCAB) * 10.0
    plain = losses.next_pass_input(logits, TARGETS)
    # Pad positions of the target are PAD whatever the argmax; PAD is never emitted
    # inside the target (row 1, position 0: the best id that may be a target).
    np.testing.assert_array_equal(plain * (1 - NON_PAD), 0)
    assert np.all(np.asarray(plain)[NON_PAD] != PAD_ID)
    np.testing.assert_array_equal(plain[0], [7, 7, 9, EOS_ID, PAD_ID])


def _toy_pass_logits(a, b):
    """Pass-1 logits depend on `a` only, pass-2 logits on `b` and the hypothesis."""

    def logits_fn(hypothesis, k):
        if k == 1:
            return jnp.broadcast_to(a, TARGETS.shape + (VOCAB,))
        return b * jax.nn.one_hot(hypothesis, VOCAB) + jnp.arange(VOCAB) * 0.01

    return logits_fn


def _padir_loss(logits_fn, num_passes=2):
    noised, mask = noise_targets(jax.random.key(0), TARGETS, vocab_size=VOCAB, first_real_id=6)
    length_logits = jnp.zeros((3, 5))
    return losses.padir_loss(logits_fn, TARGETS, noised, mask, length_logits,
                             num_passes=num_passes)


def test_no_gradient_through_the_first_pass_argmax():
    def pass2_loss(a, b):
        return _padir_loss(_toy_pass_logits(a, b))[1]["loss_pass2"]

    a = jax.random.normal(jax.random.key(1), (VOCAB,))
    b = jnp.array(2.0)
    grad_a, grad_b = jax.grad(pass2_loss, argnums=(0, 1))(a, b)
    # The pass-2 loss does depend on `a` (through the argmax that builds its input)...
    assert pass2_loss(a, b) != pass2_loss(a.at[7].set(100.0), b)
    # ...but no gradient flows along that path, while it does flow to pass 2's own params.
    np.testing.assert_array_equal(grad_a, np.zeros(VOCAB))
    assert grad_b != 0.0


def test_no_gradient_through_the_first_pass_argmax_of_the_real_model():
    config = ModelConfig(d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                         mlp_dim=32, dropout_rate=0.0, max_source_len=8, max_target_len=5)
    model = PaDIRModel(config, VOCAB, first_real_id=6)
    source = jnp.array([[6, 7, EOS_ID], [8, EOS_ID, 0], [9, EOS_ID, 0]])
    batch = {"source": source, "target": TARGETS}
    init = jax.jit(model.init)
    params_1, params_2 = init(jax.random.key(1), batch), init(jax.random.key(2), batch)

    def pass2_loss(pass1_params):
        """Pass 1 runs with `pass1_params`, pass 2 with the fixed `params_2`."""
        def logits_fn(hypothesis, k):
            params = pass1_params if k == 1 else params_2
            encoded, memory_mask = model.encode(params, batch["source"])
            return model.module.apply({"params": params}, encoded, memory_mask, hypothesis,
                                      method=model.module.decode)
        return _padir_loss(logits_fn)[1]["loss_pass2"]

    value_and_grad = jax.jit(jax.value_and_grad(pass2_loss))
    value_1, grads = value_and_grad(params_1)
    value_2, _ = value_and_grad(params_2)
    assert value_1 != value_2  # pass-1 params shape the pass-2 input...
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))  # ...not its gradient


def test_pass_weights_objective_and_length_loss():
    a = jax.random.normal(jax.random.key(1), (VOCAB,))
    loss, metrics = _padir_loss(_toy_pass_logits(a, jnp.array(2.0)))
    noised, mask = noise_targets(jax.random.key(0), TARGETS, vocab_size=VOCAB, first_real_id=6)
    assert metrics["weights"] == np.sum(np.asarray(mask) | np.asarray(TARGETS == EOS_ID))
    assert metrics["weights_pass2"] == NON_PAD.sum() == metrics["tokens"]
    # The all-pad row is not an example; uniform length logits cost log(5) each.
    assert metrics["examples"] == 2
    np.testing.assert_allclose(metrics["length_loss"], 2 * np.log(5.0), rtol=1e-5)
    expected = (metrics["loss"] / metrics["weights"]
                + metrics["loss_pass2"] / metrics["weights_pass2"]
                + metrics["length_loss"] / metrics["examples"])
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    one_pass_loss, one_pass = _padir_loss(_toy_pass_logits(a, 2.0), num_passes=1)
    assert "loss_pass2" not in one_pass
    np.testing.assert_allclose(
        one_pass_loss, expected - metrics["loss_pass2"] / metrics["weights_pass2"], rtol=1e-5)


def test_length_loss_classes_count_eos():
    # Lengths 4 and 2 are classes 3 and 1.
    logits = jnp.zeros((3, 5)).at[0, 3].set(50.0).at[1, 1].set(50.0)
    loss, metrics = losses.length_loss(logits, TARGETS)
    assert metrics["length_accuracy"] == 2
    np.testing.assert_allclose(loss, 0.0, atol=1e-5)


def test_ar_loss_normalises_per_token():
    logits = jax.random.normal(jax.random.key(3), TARGETS.shape + (VOCAB,))
    loss, metrics = losses.ar_loss(logits, TARGETS)
    assert metrics["weights"] == NON_PAD.sum()
    np.testing.assert_allclose(loss, metrics["loss"] / metrics["weights"], rtol=1e-6)


# --- glancing (GLAT) --------------------------------------------------------------------------


def _answer_logits(argmax):
    return jax.nn.one_hot(argmax, VOCAB) * 10.0


def test_glance_reveals_the_rounded_ratio_of_errors_on_non_pad_positions():
    # Row 0: 2 of 4 wrong; row 1: 2 of 2 wrong; row 2: all pad.
    argmax = jnp.array([[7, 9, 9, 6, 0], [11, 11, 0, 0, 0], [5, 5, 5, 5, 5]])
    logits = _answer_logits(argmax)
    for ratio, counts in ((1.0, [2, 2, 0]), (0.5, [1, 1, 0]), (0.3, [1, 1, 0]), (0.2, [0, 0, 0])):
        for seed in range(5):
            revealed = np.asarray(losses.glance(jax.random.key(seed), logits, TARGETS, ratio))
            np.testing.assert_array_equal(revealed.sum(axis=1), counts)
            assert not np.any(revealed & ~NON_PAD)
    # Which positions: uniform among the non-pad ones, wrong or not.
    seen = np.zeros(TARGETS.shape)
    for seed in range(60):
        seen += np.asarray(losses.glance(jax.random.key(seed), logits, TARGETS, 0.5))
    assert np.all(seen[0, :4] > 0) and np.all(seen[1, :2] > 0)


def _glancing_loss(logits_fn, ratio, rng=jax.random.key(9)):
    noised, mask = noise_targets(jax.random.key(0), TARGETS, vocab_size=VOCAB, first_real_id=6)
    return losses.padir_loss(logits_fn, TARGETS, noised, mask, jnp.zeros((3, 5)),
                             num_passes=2, glancing_ratio=ratio, rng=rng)


def test_glancing_ratio_zero_is_the_two_pass_loss():
    a = jax.random.normal(jax.random.key(1), (VOCAB,))
    logits_fn = _toy_pass_logits(a, jnp.array(2.0))
    loss, metrics = _padir_loss(logits_fn)
    glancing_loss, glancing_metrics = _glancing_loss(logits_fn, 0.0)
    assert float(glancing_loss) == float(loss)
    assert jax.tree.map(float, glancing_metrics) == jax.tree.map(float, metrics)


def test_a_wholly_wrong_first_pass_at_ratio_one_reveals_every_token():
    wrong = jnp.where(TARGETS == 6, 7, 6)  # every non-pad position wrong
    inputs = []

    def logits_fn(hypothesis, k):
        inputs.append(hypothesis)
        return _answer_logits(wrong if k == 1 else hypothesis)

    loss, metrics = _glancing_loss(logits_fn, 1.0)
    pass2_input = np.asarray(inputs[1])
    np.testing.assert_array_equal(pass2_input[NON_PAD], np.asarray(TARGETS)[NON_PAD])
    assert metrics["weights_pass2"] == 0 and metrics["loss_pass2"] == 0


def test_glancing_trains_pass_two_on_the_tokens_not_revealed():
    # Pass 1 gets row 0's first token right and the 3 others wrong, row 1's both wrong.
    first_pass = jnp.array([[7, 6, 6, 6, 0], [6, 6, 0, 0, 0], [0, 0, 0, 0, 0]])
    inputs = []

    def logits_fn(hypothesis, k):
        inputs.append(hypothesis)
        return _answer_logits(first_pass) if k == 1 else jnp.zeros(TARGETS.shape + (VOCAB,))

    loss, metrics = _glancing_loss(logits_fn, 0.5, jax.random.key(4))
    pass2_input = np.asarray(inputs[1])
    # round(0.5 x 3) = 2 revealed in row 0, round(0.5 x 2) = 1 in row 1.
    assert metrics["tokens"] - metrics["weights_pass2"] == 3
    # Elsewhere pass 2 reads pass 1's argmax; uniform pass-2 logits cost log(V) per token.
    kept = NON_PAD & (pass2_input != np.asarray(TARGETS))
    np.testing.assert_array_equal(pass2_input[kept], np.asarray(first_pass)[kept])
    np.testing.assert_allclose(metrics["loss_pass2"], metrics["weights_pass2"] * np.log(VOCAB),
                               rtol=1e-5)
    # Jitted, with the key as an argument: the same draw.
    jitted_loss, jitted = jax.jit(lambda rng: _glancing_loss(logits_fn, 0.5, rng))(
        jax.random.key(4))
    assert float(jitted_loss) == pytest.approx(float(loss))
    assert float(jitted["weights_pass2"]) == float(metrics["weights_pass2"])


def test_glancing_needs_an_rng():
    logits_fn = _toy_pass_logits(jnp.zeros(VOCAB), jnp.array(2.0))
    with pytest.raises(ValueError, match="rng"):
        _glancing_loss(logits_fn, 0.5, rng=None)


def test_the_real_model_glances_under_jit_and_is_unchanged_without_it():
    config = ModelConfig(d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                         mlp_dim=32, dropout_rate=0.0, max_source_len=8, max_target_len=5)
    model = PaDIRModel(config, VOCAB, first_real_id=6)
    batch = {"source": jnp.array([[6, 7, EOS_ID], [8, EOS_ID, 0], [9, EOS_ID, 0]]),
             "target": TARGETS}
    params = jax.jit(model.init)(jax.random.key(1), batch)
    loss_fn = jax.jit(model.loss_fn, static_argnames="settings")
    rng = jax.random.key(2)
    _, plain_metrics = loss_fn(params, batch, rng, settings=losses.LossSettings(num_passes=2))
    _, glanced = loss_fn(params, batch, rng,
                         settings=losses.LossSettings(num_passes=2, glancing_ratio=1.0))
    # An untrained model is mostly wrong: at ratio 1 it is shown most of the tokens.
    assert glanced["weights_pass2"] < plain_metrics["weights_pass2"] == NON_PAD.sum()
    assert float(glanced["loss"]) == float(plain_metrics["loss"])  # pass 1 untouched


def test_the_students_phases_share_the_noise_and_phase_two_unrolls():
    cfg = StudentConfig(num_passes=3, glancing_ratio=0.5)
    assert losses.student_loss_settings(cfg, 1) == losses.LossSettings()
    assert losses.student_loss_settings(cfg, 2) == losses.LossSettings(
        num_passes=3, glancing_ratio=0.5)
    # A static argument of jit: equal settings hash alike, so they share a compiled step.
    assert len({losses.student_loss_settings(cfg, 2), losses.student_loss_settings(cfg, 2)}) == 1
    with pytest.raises(ValueError, match="phase 1 or 2"):
        losses.student_loss_settings(cfg, 3)
