"""Where a training stage's files live inside its artifact: the one module that names them.

    <artifact>/                  teacher, ar_student or student (`<workdir>/<stage>/<key>/`)
      checkpoints/               the AR models' orbax run (model/checkpoints.py)
      checkpoints/phase{1,2}/    the student's: one run per phase (1: single-stage loss,
                                 2: unrolled), phase 2 started from phase 1's last step
      tensorboard/               the run's event files (process 0), scalars tagged
      tensorboard/phase{1,2}/    `train/<name>` and `dev/<name>`; the student's per phase

The training stages hand these folders to model/train.py, which writes into them; the
decode stage and `padir translate` restore `decoded_checkpoints` (model/trained_model.py);
the score stage reads the student's `dev_curve` for the report.

The event files are TFRecords of `Event` protos (tensorboardX's schema), read as every
TFRecord here is, through fsspec with checksums checked (`records.read_records`): TensorFlow's
reader would reach gs:// through its own GCS client (docs/gcs.md), and would import TensorFlow
into the score stage.
"""

from __future__ import annotations

import posixpath
from typing import Any, Iterator

from components import artifacts, records

CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"
STUDENT_PHASES = (1, 2)
TRAIN, DEV = "train", "dev"  # the groups of the TensorBoard tags (`dev/bleu`)


def checkpoints(artifact_uri: str) -> str:
    """The folder of a training artifact's checkpoints (the student's: of its phases)."""
    return artifacts.join(artifact_uri, CHECKPOINTS)


def tensorboard(artifact_uri: str) -> str:
    """The folder of a training artifact's TensorBoard event files."""
    return artifacts.join(artifact_uri, TENSORBOARD)


def phase(folder: str, number: int) -> str:
    """The student's phase `number` inside its `checkpoints` or `tensorboard` folder."""
    return artifacts.join(folder, f"phase{number}")


def tag(group: str, name: str) -> str:
    """A TensorBoard tag: `tag(DEV, "bleu")` is `dev/bleu`."""
    return f"{group}/{name}"


def decoded_checkpoints(artifact: artifacts.Artifact) -> str:
    """The checkpoints a published training artifact decodes with: the student's last phase
    that trained (a time budget may end training within phase 1)."""
    run = checkpoints(artifact.uri)
    if artifact.stage != "student":
        return run
    last = phase(run, STUDENT_PHASES[-1])
    fs, path = artifacts.filesystem(last)
    return last if fs.exists(path) else phase(run, STUDENT_PHASES[0])


def dev_curve(artifact_uri: str, metric: str = "bleu") -> list[dict[str, Any]]:
    """A student artifact's dev `metric` at every evaluation of both phases, from its
    TensorBoard event files (tag `dev/{metric}`): `[{"phase": 1, "step": 500, "bleu": 12.3},
    ...]` in step order. `step` counts both phases (phase 2's step s is phase 1's last step
    + s). A step logged twice (a run resumed from an earlier checkpoint) keeps its latest
    value; a record cut short (a killed writer) ends its file. [] without event files."""
    curve, offset = [], 0
    for number in STUDENT_PHASES:
        fs, root = artifacts.filesystem(phase(tensorboard(artifact_uri), number))
        values: dict[int, tuple[float, float]] = {}  # step -> (wall time, value)
        last_step = 0
        for path in sorted(fs.glob(posixpath.join(root, "events.out.tfevents*"))):
            for name, step, wall_time, value in _scalars(fs.unstrip_protocol(path)):
                last_step = max(last_step, step)
                if name == tag(DEV, metric) and wall_time >= values.get(step, (-1.0,))[0]:
                    values[step] = (wall_time, value)
        curve += [{"phase": number, "step": offset + step, metric: values[step][1]}
                  for step in sorted(values)]
        offset += last_step
    return curve


def _scalars(uri: str) -> Iterator[tuple[str, int, float, float]]:
    """(tag, step, wall time, value) of every scalar in an event file, up to a record cut
    short or corrupt (the last one a killed writer left)."""
    from tensorboardX.proto import event_pb2  # the writer's own schema

    try:
        for record in records.read_records(uri):
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    yield value.tag, event.step, event.wall_time, value.simple_value
    except ValueError:  # read_records: a truncated or corrupt record
        return
