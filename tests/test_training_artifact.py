"""The layout of a training artifact (components/training_artifact.py): the folders the
training stages write, the checkpoints decoding restores, the student's dev curve."""

from components import artifacts, training_artifact


def _artifact(stage, uri):
    return artifacts.Artifact(stage=stage, key="k", uri=str(uri), manifest={})


def test_the_folders_keep_the_published_layout(tmp_path):
    """Artifacts already on disk name these folders: they must not move."""
    root = str(tmp_path)
    assert training_artifact.checkpoints(root) == f"{root}/checkpoints"
    assert training_artifact.tensorboard(root + "/") == f"{root}/tensorboard"
    assert (training_artifact.phase(training_artifact.checkpoints(root), 2)
            == f"{root}/checkpoints/phase2")
    assert training_artifact.tag(training_artifact.DEV, "bleu") == "dev/bleu"


def test_decoding_restores_the_students_last_phase_that_trained(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    assert (training_artifact.decoded_checkpoints(_artifact("teacher", tmp_path))
            == str(checkpoints))
    student = _artifact("student", tmp_path)
    (checkpoints / "phase1").mkdir(parents=True)  # a time budget ended it in phase 1
    assert training_artifact.decoded_checkpoints(student) == str(checkpoints / "phase1")
    (checkpoints / "phase2").mkdir()
    assert training_artifact.decoded_checkpoints(student) == str(checkpoints / "phase2")


def test_the_students_dev_curve_is_read_from_its_event_files(tmp_path):
    from tensorboardX import SummaryWriter

    def log(phase, points, suffix):
        writer = SummaryWriter(training_artifact.phase(training_artifact.tensorboard(
            str(tmp_path)), phase), filename_suffix=suffix)
        for step, bleu in points:
            writer.add_scalar("train/loss", 1.0, step)
            writer.add_scalar("dev/bleu", bleu, step)
        writer.close()

    log(1, [(500, 5.0), (1000, 9.0)], ".a")
    log(2, [(200, 10.0), (400, 12.0)], ".a")
    log(2, [(400, 12.5)], ".b")  # resumed after a crash past its last checkpoint: later wins
    with open(tmp_path / "tensorboard" / "phase2" / "events.out.tfevents.9.cut", "wb") as f:
        f.write(b"\x40\x00\x00")  # a record cut short by a killed writer
    assert training_artifact.dev_curve(str(tmp_path)) == [
        {"phase": 1, "step": 500, "bleu": 5.0}, {"phase": 1, "step": 1000, "bleu": 9.0},
        {"phase": 2, "step": 1200, "bleu": 10.0}, {"phase": 2, "step": 1400, "bleu": 12.5}]
    assert training_artifact.dev_curve(str(tmp_path / "nothing")) == []


def test_a_record_cut_short_ends_its_file_and_keeps_the_records_before_it(tmp_path):
    from tensorboardX import SummaryWriter

    folder = training_artifact.phase(training_artifact.tensorboard(str(tmp_path)), 1)
    writer = SummaryWriter(folder)
    for step in (1, 2):
        writer.add_scalar("dev/bleu", float(step), step)
    writer.close()
    [path] = (tmp_path / "tensorboard" / "phase1").iterdir()
    path.write_bytes(path.read_bytes()[:-7])  # the last record's end lost
    assert training_artifact.dev_curve(str(tmp_path)) == [{"phase": 1, "step": 1, "bleu": 1.0}]
