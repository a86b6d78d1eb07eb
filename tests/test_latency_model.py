"""benchmarks/latency_model.py: the counts come from the compiled programs and the model's
arithmetic is the module's (no timing asserted)."""

import jax.numpy as jnp
import pytest

from benchmarks import crossover, latency_model


def test_shape_names_parse_back():
    shape = crossover.Shape(1024, 6, 32000)
    assert crossover.Shape.parse(shape.name) == shape


def test_work_counts_a_matmuls_flops_and_the_ops_outside_fusions():
    x = jnp.ones((4, 64))
    w = jnp.ones((64, 32))
    one = latency_model.work(lambda x, w: jnp.tanh(x @ w), x, w)
    assert one.flops >= 2 * 4 * 64 * 32 and one.bytes >= 4 * (4 * 64 + 64 * 32)
    two = latency_model.work(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w.T), x, w)
    assert two.flops > one.flops and two.ops > one.ops >= 1  # a matmul is its own operation


def test_a_call_is_the_larger_of_compute_and_memory_plus_its_operations():
    rates = latency_model.Rates("test", flops_per_s=lambda d_model, working_set: 1e9,
                                bytes_per_s=lambda working_set: 1e9, seconds_per_op=1e-6,
                                measured=False)
    compute_bound = latency_model.Work(flops=2e6, bytes=1e6, ops=10)
    memory_bound = latency_model.Work(flops=1e6, bytes=3e6, ops=0)
    assert compute_bound.seconds(rates, 64, 0) == pytest.approx(2e-3 + 1e-5)
    assert memory_bound.seconds(rates, 64, 0) == pytest.approx(3e-3)
    assert memory_bound.seconds(rates, 64, 0, scale_bytes=0.5) == pytest.approx(1.5e-3)
    counts = {"encode_ar": compute_bound, "step": memory_bound, "encode_padir": compute_bound,
              "pass": compute_bound, "encode_drafter": compute_bound, "draft": compute_bound,
              "verify": memory_bound, "parameter_bytes": 1e6}
    predicted = latency_model.predict(counts, 20, 64, rates, tokens_per_round=(2, 5))
    assert predicted["AR greedy"] == pytest.approx(2.01e-3 + 20 * 3e-3)
    assert predicted["PaDIR-4"] == pytest.approx(5 * 2.01e-3)
    # Both encoders, then 20 / t rounds of a drafter pass and a teacher block.
    assert predicted["draft and verify, 5 tok/round"] == pytest.approx(
        2 * 2.01e-3 + 4 * (2.01e-3 + 3e-3))
    assert predicted["draft and verify, 2 tok/round"] == pytest.approx(
        2 * 2.01e-3 + 10 * (2.01e-3 + 3e-3))


def test_shape_work_counts_a_pass_over_every_position_and_a_step_over_one():
    counts = latency_model.shape_work(crossover.Shape(32, 1, 300), length=6)
    assert counts["pass"].flops > 3 * counts["step"].flops  # six positions against one
    assert counts["parameter_bytes"] > 0 and counts["step"].ops > 0
    # The teacher over a block of DRAFT_BLOCK + 1 positions does more than a step.
    assert counts["verify"].flops > 2 * counts["step"].flops
    assert counts["draft"].flops > 0 and counts["encode_drafter"].flops > 0
