"""What the training stages share: `teacher` (pipelines/teacher.py, the AR model),
`student` (pipelines/student.py, the PaDIR student), `ar_student`
(pipelines/ar_student.py, the AR baseline with a one-layer decoder) and `drafter`
(pipelines/drafter.py, the block drafter of draft_verify) read their data, build their
model, start from the teacher and publish their checkpoints the same way, over
model/train.py's loop.

Training works in `<stage>/.partial-<key>/` (see `components.artifacts.write`) under the
key's lease, so a run that is killed, preempted (SIGTERM) or crashes resumes exactly from its
last checkpoint when the stage is run again, and a second run of the key fails naming the
first; the artifact is published only when training finished or its time budget
(`loop.max_minutes`) ran out.

With `mesh.distributed: true` every host runs the same command: `jax.distributed.initialize`
comes first, before anything touches the JAX backend; all processes train and write the
checkpoints together; process 0 alone takes the lease, writes the manifest and publishes.
The processes agree (`sharding.agreement`) once set up, once trained and once published, so
that a failure on one (a held lease, a missing input) ends all of them at once.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import jax

from components import artifacts, corpus, dag
from components import config as config_lib
from components.tokenizer import Tokenizer
from model import input_pipeline, sharding, train, trained_model, warm_start
from model.models import ARModel, DrafterModel, PaDIRModel

log = logging.getLogger(__name__)

TRAIN, DEV = "train", "dev"


def load_tokenizer(config: config_lib.Config) -> Tokenizer:
    return Tokenizer.for_artifact(dag.require_input(config, "vocab"))


def training_data(config: config_lib.Config, stage: str,
                  tokenizer: Tokenizer) -> train.TrainData:
    """The data of training stage `stage` (the teacher or a student, `dag.STUDENTS`): bucketed
    batches of about `loop.tokens_per_batch` tokens of its encode artifact (the students':
    `dag.student_data`), split across processes.
    Reads the JAX backend: `jax.distributed.initialize` must have run."""
    loop = config.section(stage).loop
    encoded = dag.require_input(config, "encode" if stage == "teacher"
                                else dag.student_data(config))
    boundaries = config.encode.bucket_boundaries
    batch_sizes = input_pipeline.batch_sizes_for_tokens(
        boundaries, loop.tokens_per_batch, multiple_of=jax.device_count())
    process = dict(process_index=jax.process_index(), process_count=jax.process_count())
    stream = input_pipeline.TrainingStream(
        input_pipeline.split_files(encoded.uri, TRAIN), boundaries=boundaries,
        batch_sizes=batch_sizes, seed=config.seed, **process)
    dev_ids, dev_batches = [], []
    for ids, batch in input_pipeline.eval_batches(
            input_pipeline.split_files(encoded.uri, DEV), boundaries=boundaries,
            batch_sizes=batch_sizes, **process):
        dev_ids.extend(ids)
        dev_batches.append(batch)
    prepared = dag.require_input(config, "prepare")
    targets = {pair["id"]: pair["target"] for pair in corpus.read_split(prepared.uri, DEV)}
    references = [targets[pair_id] for pair_id in dev_ids if pair_id]
    log.info("%s: %d train batches per epoch (rows per bucket %s), %d dev sentences",
             config.workdir, stream.batches_per_epoch, batch_sizes, len(references))
    return train.TrainData(stream.batches, tuple(batch_sizes), dev_batches=dev_batches,
                           references=references, detokenize=tokenizer.decode,
                           target_lang=config.data.target_lang)


def teacher_model(config: config_lib.Config, tokenizer: Tokenizer) -> ARModel:
    return ARModel(config.teacher.model, tokenizer.vocab_size,
                   label_smoothing=config.teacher.label_smoothing)


def student_model(config: config_lib.Config, tokenizer: Tokenizer) -> PaDIRModel:
    return PaDIRModel(config.student.model, tokenizer.vocab_size, tokenizer.first_real_id,
                      label_smoothing=config.student.label_smoothing)


def ar_student_model(config: config_lib.Config, tokenizer: Tokenizer) -> ARModel:
    return ARModel(config.ar_student.model, tokenizer.vocab_size,
                   label_smoothing=config.ar_student.label_smoothing)


def drafter_model(config: config_lib.Config, tokenizer: Tokenizer) -> DrafterModel:
    return DrafterModel(config.drafter.model, tokenizer.vocab_size, config.drafter.block,
                        label_smoothing=config.drafter.label_smoothing)


def teacher_warm_start(config: config_lib.Config, stage: str):
    """With `<stage>.init_from_teacher` (a student): fresh parameters -> the teacher's where
    they fit (model/warm_start.py); else None."""
    if not config.section(stage).init_from_teacher:
        return None
    teacher_uri = dag.require_input(config, "teacher").uri

    def start(params):
        return warm_start.from_teacher(params, trained_model.load(teacher_uri).params)[0]

    return start


# Errors that one process meets and all report as theirs (a user error is one everywhere).
SHARED_ERRORS = (artifacts.LeaseHeldError, artifacts.IncompleteArtifactError,
                 artifacts.StageStopped)


def publish(config: config_lib.Config, stage: str, train_fn) -> artifacts.Artifact:
    """Runs `train_fn(pending, data, tokenizer) -> TrainResult` inside a resumable artifact,
    published by process 0 once every process is done (see the module docstring).

    The processes agree three times: set up (process 0 holds the lease, every input is
    there), trained (every checkpoint write finished: process 0 may move them), published
    (nobody returns before the manifest is written). A failure on any process ends them all
    at the next agreement."""
    sharding.initialize_distributed(config.mesh)  # before anything initialises the backend
    log.info("%s: %s", stage, config_lib.summary(config, dag.STAGES[stage].sections))
    log.debug("%s: resolved config\n%s", stage, config_lib.dump(config))
    with sharding.agreement(f"{stage}: published", SHARED_ERRORS), \
            contextlib.ExitStack() as stack:
        with sharding.agreement(f"{stage}: set up", SHARED_ERRORS):
            tokenizer = load_tokenizer(config)
            # Checked before the partial directory exists: a missing input leaves nothing.
            inputs = {name: dag.require_input(config, name).uri
                      for name in dag.inputs(config, stage)}
            pending = stack.enter_context(artifacts.write(
                config.workdir, stage, dag.stage_key(config, stage),
                config=dag.section_values(config, stage), config_yaml=config_lib.dump(config),
                inputs=inputs, resumable=True, publisher=jax.process_index() == 0))
            data = training_data(config, stage, tokenizer)
        with sharding.agreement(f"{stage}: trained", SHARED_ERRORS):
            result = train_fn(pending, data, tokenizer)
            _record(stage, result, pending, tokenizer)
    artifact = artifacts.read(dag.output_uri(config, stage))
    log.info("%s: wrote %s %s", stage, artifact.uri, artifact.manifest["metrics"])
    return artifact


def _record(stage: str, result: train.TrainResult, pending: artifacts.PendingArtifact,
            tokenizer: Tokenizer) -> None:
    """The run's figures in the manifest; a run stopped by SIGTERM publishes nothing."""
    if not result.completed and result.stop_reason != "time budget":
        raise artifacts.StageStopped(
            f"{stage} stopped at step {int(result.state.step)} ({result.stop_reason}); "
            f"run `padir stage {stage}` again to resume from its last checkpoint")
    pending.counts.update(steps=int(result.state.step), data_position=result.position,
                          vocab_size=tokenizer.vocab_size)
    pending.metrics.update(dev=result.dev_metrics or {}, stop_reason=result.stop_reason,
                           parameters=_count_parameters(result.state.params))


def _count_parameters(params: Any) -> int:
    return int(sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)))
