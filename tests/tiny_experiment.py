"""A tiny end-to-end experiment config on a slice of Multi30k, shared by stage tests;
`publish_untrained`: a training artifact with initial parameters, in seconds; and
`publish_prepared`: a prepare artifact of given pairs.

The stage tests share one workdir per session (conftest's `tiny_workdir`): artifacts with
the same key (prepare and vocab for all of them) are computed once, by `ensure`.
"""

import dataclasses
import json
import os
import signal

import pytest

from components import artifacts, dag, training_artifact
from components import config as config_lib

DATA_ROOT = os.environ.get("PADIR_DATA_ROOT", "")
TINY_MODEL = {"d_model": 32, "num_heads": 2, "num_encoder_layers": 1, "num_decoder_layers": 1,
              "mlp_dim": 64, "dropout_rate": 0.0}
TINY_LOOP = {"tokens_per_batch": 512, "log_every": 2, "eval_every": 3, "checkpoint_every": 3}


def tiny_config(workdir, *overrides: str) -> config_lib.Config:
    """configs/multi30k_en_de.yaml shrunk to 200 pairs, a 400-piece vocab and tiny models
    trained for 2-3 steps (the student on the teacher's translations): every stage runs
    in seconds."""
    if not os.path.isdir(os.path.join(DATA_ROOT, "multi30k")):
        message = f"PADIR_DATA_ROOT ({DATA_ROOT or 'unset'}) does not hold multi30k"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}: CI runs every test", pytrace=False)
        pytest.skip(message)
    path = os.path.join(workdir, "tiny.yaml")
    with open(path, "w") as f:
        f.write(f"include: {os.path.abspath('configs/multi30k_en_de.yaml')}\n")
    return config_lib.load(path, [
        f"workdir={workdir}/work",
        "data.max_train_pairs=200",
        # dev carved from those pairs (about 20): evaluations cost seconds, not minutes
        "data.dev=null", "data.carve_dev_fraction=0.1",
        "prepare.num_shards=1",
        "vocab.size=400",
        "encode.num_shards=1",
        f"teacher.model={TINY_MODEL}", f"teacher.loop={TINY_LOOP}", "teacher.steps=3",
        "teacher.optimizer.warmup_steps=1",
        f"student.model={TINY_MODEL}", f"student.loop={TINY_LOOP}", "student.phase1_steps=2",
        "student.phase2_steps=2", "student.optimizer.warmup_steps=1",
        f"ar_student.model={TINY_MODEL}", f"ar_student.loop={TINY_LOOP}", "ar_student.steps=3",
        "ar_student.optimizer.warmup_steps=1",
        f"drafter.model={TINY_MODEL}", f"drafter.loop={TINY_LOOP}", "drafter.steps=3",
        "drafter.optimizer.warmup_steps=1",
        # Few sources share a length here: small batches waste fewer filler rows.
        "distill.batch_size=8",
        *overrides,
    ])


def ensure(config: config_lib.Config, *stages: str) -> None:
    """Runs each stage whose artifact is not complete yet (a test that checks a stage's own
    run calls `training.run_stage` instead)."""
    from flows import stages as stages_lib

    for stage in stages:
        if not artifacts.is_complete(dag.output_uri(config, stage)):
            stages_lib.run_stage(stage, config)


def publish_untrained(config: config_lib.Config, stage: str) -> artifacts.Artifact:
    """A `teacher`, `ar_student`, `student` or `drafter` artifact as its stage lays it out,
    with initial parameters (once per key: an existing one is returned as it is)."""
    if artifacts.is_complete(dag.output_uri(config, stage)):
        return artifacts.read(dag.output_uri(config, stage))
    import jax  # imported here: the config helper above must not start JAX
    import jax.numpy as jnp

    from model import checkpoints, train

    from pipelines import training

    tokenizer = training.load_tokenizer(config)
    make = {"teacher": training.teacher_model, "ar_student": training.ar_student_model,
            "student": training.student_model, "drafter": training.drafter_model}[stage]
    model = make(config, tokenizer)
    params = model.init(jax.random.key(1), train.example_batch(model))
    inputs = {name: dag.output_uri(config, name) for name in dag.inputs(config, stage)}
    with artifacts.write(config.workdir, stage, dag.stage_key(config, stage),
                         config=dag.section_values(config, stage),
                         config_yaml=config_lib.dump(config), inputs=inputs) as out:
        run = training_artifact.checkpoints(out.tmp_uri)
        manager = checkpoints.open_manager(
            training_artifact.phase(run, 2) if stage == "student" else run,
            best_metric=config.section(stage).loop.best_metric)
        state = train.TrainState(step=jnp.array(1, jnp.int32), params=params,
                                 opt_state={"count": jnp.zeros((), jnp.int32)},
                                 rng=jax.random.PRNGKey(0))
        checkpoints.save(manager, state, position=1, metrics={"bleu": 0.0, "loss": 1.0})
        manager.wait_until_finished()
        manager.close()
    return artifacts.read(dag.output_uri(config, stage))


def publish_prepared(config: config_lib.Config, splits: dict[str, list[dict]]) -> None:
    """A prepare artifact of `splits` (split -> pairs), in two shards per split as the
    prepare stage writes them."""
    with artifacts.write(config.workdir, "prepare", dag.stage_key(config, "prepare"),
                         config={}, inputs={}) as out:
        for split, pairs in splits.items():
            for shard in range(2):
                with open(out.path(f"{split}-{shard:05d}-of-00002.jsonl"), "w") as f:
                    for pair in pairs[shard::2]:
                        f.write(json.dumps(pair, ensure_ascii=False) + "\n")


def stop_after_step(step: int, monkeypatch) -> None:
    """SIGTERM while a training stage's loop fetches batch `step` (the loop defers it to
    that step's end): the stage stops there as a preempted one does."""
    from pipelines import training  # JAX: imported here, as in `publish_untrained`

    real = training.training_data

    def interrupted(config, stage, tokenizer):
        data = real(config, stage, tokenizer)

        def batches(position):
            for i, item in enumerate(data.batches(position), 1):
                if i == step:
                    os.kill(os.getpid(), signal.SIGTERM)
                yield item

        return dataclasses.replace(data, batches=batches)

    monkeypatch.setattr(training, "training_data", interrupted)
