"""flows/lanes.py: which stages start together and on which cores, and the `padir stage`
process a lane runs (its exit status read back as the flow's errors)."""

import os

import pytest

from components import artifacts, dag
from components import config as config_lib
from flows import lanes
from flows.plan import topological_order
from tiny_experiment import tiny_config

# The benchmark's DAG from the teacher on: three trainings read the same two inputs.
GRAPH = {"teacher": [], "distill": ["teacher"], "encode_distilled": ["distill"],
         "student": ["encode_distilled", "teacher"], "ar_student": ["encode_distilled", "teacher"],
         "drafter": ["encode_distilled", "teacher"],
         "decode": ["student", "ar_student", "drafter"], "score": ["decode"]}


def test_cores_are_split_evenly_the_larger_shares_first():
    assert lanes.split([0, 1], 2) == [(0,), (1,)]
    assert lanes.split([0, 1, 2, 3, 4], 2) == [(0, 1, 2), (3, 4)]
    assert lanes.split([4, 5, 6], 1) == [(4, 5, 6)]


def test_a_stage_alone_gets_every_core_and_the_trainings_share_them():
    scheduler = lanes.Scheduler(topological_order(GRAPH), GRAPH, lanes=2, cores=(0, 1))
    for stage in ("teacher", "distill", "encode_distilled"):
        assert scheduler.start() == [(stage, (0, 1))]
        assert scheduler.start() == []  # its dependents wait for it
        scheduler.finish(stage)
    assert scheduler.start() == [("student", (0,)), ("ar_student", (1,))]
    assert scheduler.start() == []  # no lane free: the drafter waits
    scheduler.finish("ar_student")
    assert scheduler.start() == [("drafter", (1,))]
    scheduler.finish("drafter")
    assert scheduler.start() == []  # decode waits for the student
    scheduler.finish("student")
    assert scheduler.start() == [("decode", (0, 1))]
    scheduler.finish("decode")
    assert scheduler.start() == [("score", (0, 1))]
    scheduler.finish("score")
    assert scheduler.done


def test_one_lane_runs_one_stage_at_a_time_and_stages_not_run_count_as_done():
    stages = ["student", "ar_student", "decode"]  # the rest was reused
    scheduler = lanes.Scheduler(stages, GRAPH, lanes=1, cores=(0, 1, 2))
    assert scheduler.start() == [("student", (0, 1, 2))]
    assert scheduler.start() == []
    scheduler.finish("student")
    assert scheduler.start() == [("ar_student", (0, 1, 2))]
    scheduler.finish("ar_student")
    assert scheduler.start() == [("decode", (0, 1, 2))]  # the drafter is not in this run


def test_more_lanes_than_cores_start_no_more_stages_than_cores():
    scheduler = lanes.Scheduler(["student", "ar_student", "drafter"], GRAPH, lanes=3,
                                cores=(0, 1))
    assert scheduler.start() == [("student", (0,)), ("ar_student", (1,))]
    with pytest.raises(config_lib.ConfigError, match="lanes"):
        lanes.Scheduler(["student"], GRAPH, lanes=0, cores=(0,))


def test_the_command_passes_the_config_its_overrides_and_the_cores():
    command = lanes.command("student", "configs/demo.yaml", ["seed=1", "vocab.size=400"], (2, 3))
    assert command[1:] == ["-m", "flows.cli", "stage", "student", "configs/demo.yaml",
                           "--set", "seed=1", "--set", "vocab.size=400", "--cores", "2,3"]


@pytest.mark.slow  # child interpreters
def test_a_lane_runs_the_stage_in_its_own_process_and_reads_back_its_errors(tmp_path):
    config = tiny_config(str(tmp_path))
    path = tmp_path / "experiment.yaml"
    path.write_text(config_lib.dump(config))
    core = min(os.sched_getaffinity(0))
    with pytest.raises(config_lib.ConfigError, match="padir stage vocab` exited with status 2"):
        lanes.run("vocab", str(path), [], (core,))  # its input, prepare, is not there
    lanes.run("prepare", str(path), [], (core,))
    assert artifacts.is_complete(dag.output_uri(config, "prepare"))
