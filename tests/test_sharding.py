"""Sharding: mesh from config, rule resolution, and the sharded step (toy and real PaDIR
models, 8 forced host devices in a fresh interpreter) against one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import toy_training as toy
from components.config import ConfigError, MeshConfig
from model import sharding


def test_mesh_shape_from_config():
    assert sharding.mesh_shape(MeshConfig(), 8) == (8, 1)
    assert sharding.mesh_shape(MeshConfig(fsdp=2), 8) == (4, 2)
    assert sharding.mesh_shape(MeshConfig(data=2, fsdp=2), 8) == (2, 2)
    with pytest.raises(ValueError, match="does not divide"):
        sharding.mesh_shape(MeshConfig(fsdp=3), 8)
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.mesh_shape(MeshConfig(data=8, fsdp=2), 8)
    with pytest.raises(ConfigError, match="unknown mesh axes"):
        MeshConfig(logical_axis_rules=(("batch", ("model",)),))


def test_rules_in_flax_form():
    rules = sharding.flax_rules(MeshConfig())
    assert ("batch", ("data", "fsdp")) in rules
    assert ("vocab", "fsdp") in rules and ("kv", None) in rules


def test_mesh_axes_for_skips_rules_that_do_not_divide():
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "fsdp"))
    rules = sharding.flax_rules(MeshConfig())
    # vocab takes fsdp first (rule order); embed then finds it used.
    assert sharding.mesh_axes_for(("vocab", "embed"), (32, 16), mesh, rules) == P("fsdp", None)
    # 33 is odd: vocab cannot take fsdp, so embed does.
    assert sharding.mesh_axes_for(("vocab", "embed"), (33, 16), mesh, rules) == P(None, "fsdp")
    assert sharding.mesh_axes_for(("embed",), (15,), mesh, rules) == P(None)
    assert sharding.mesh_axes_for(("heads", "kv"), (4, 8), mesh, rules) == P("fsdp", None)


def test_box_and_unbox_round_trip():
    tree = {"a": jnp.ones((2, 3)), "b": jnp.ones(())}
    boxed = sharding.box(tree, {"a": P("embed"), "b": None})
    assert isinstance(boxed["a"], nn.Partitioned) and boxed["a"].names == ("embed", None)
    assert not isinstance(boxed["b"], nn.Partitioned)
    assert jax.tree.structure(sharding.unbox(boxed)) == jax.tree.structure(tree)


SHARDED_VS_SINGLE = """
import jax, numpy as np
from jax.sharding import PartitionSpec as P
import toy_training as toy
from components.config import MeshConfig, ModelConfig
from model import sharding, train
from model.losses import LossSettings
from model.models import PaDIRModel

assert jax.device_count() == 8
tiny = ModelConfig(d_model=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                   mlp_dim=64, max_source_len=toy.LENGTH + 1, max_target_len=toy.LENGTH)
batches = [toy.make_batch(0, i, 8) for i in range(3)]
for model, num_passes in [(toy.ToyModel(), 1), (PaDIRModel(tiny, toy.VOCAB, 6), 2)]:
    tx, _ = train.make_optimizer(toy.OPTIMIZER, 10)
    results = {}
    for name, mesh, devices in [("single", MeshConfig(data=1, fsdp=1), jax.devices()[:1]),
                                ("sharded", MeshConfig(data=4, fsdp=2), None)]:
        placement = train.place(model, tx, mesh, devices)
        state = placement.create_state(seed=0)
        steps = train.compile_steps(model, tx, placement.state_shardings,
                                    placement.batch_sharding,
                                    loss_settings=LossSettings(num_passes=num_passes))
        metrics = []
        for batch in batches:
            device_batch = sharding.shard_batch(batch, placement.batch_sharding)
            state, m = steps.train(state, device_batch)
            metrics.append(jax.device_get(m))
        if name == "sharded" and isinstance(model, toy.ToyModel):
            spec = device_batch["source"].sharding.spec
            assert spec == P(("data", "fsdp"), None), spec
            assert len(device_batch["source"].addressable_shards) == 8
            params = state.params
            assert params["embed"].sharding.spec == P("fsdp", None)  # vocab x embed
            assert params["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")  # embed x mlp
            assert params["Dense_1"]["kernel"].sharding.spec == P(None, "fsdp")  # mlp x vocab
            mu = state.opt_state[1][0].mu  # adam's first moment mirrors the params' layout
            assert mu["embed"].sharding.spec == P("fsdp", None), mu["embed"].sharding
        results[name] = (jax.tree.map(np.asarray, state), metrics)

    (single, single_metrics), (sharded, sharded_metrics) = results["single"], results["sharded"]
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(single_metrics, sharded_metrics):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5, err_msg=k)
    print("OK", type(model).__name__, float(sharded_metrics[-1]["objective"]))
"""


@pytest.mark.slow  # about 2 minutes on 2 cores: 8 host devices in a child interpreter
def test_sharded_train_step_matches_one_device(cache_dir):
    proc = toy.run_python(SHARDED_VS_SINGLE, cache_dir, devices=8)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK ToyModel" in proc.stdout and "OK PaDIRModel" in proc.stdout
