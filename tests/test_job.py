"""pipelines/job.py: counters and the accounting check (every job's `run` goes through
`job.run`; the stage tests run it end to end)."""

import apache_beam as beam
import pytest

from pipelines import job


def test_counter_values_are_sorted_with_a_zero_for_names_never_counted():
    pipeline = beam.Pipeline(runner="FnApiRunner")
    _ = (pipeline
         | beam.Create(["a", "b", "c"])
         | "CountRead" >> beam.Map(job.counted, "test_job", "read")
         | "CountOther" >> beam.Map(job.counted, "elsewhere", "read"))
    result = pipeline.run()
    result.wait_until_finish()
    assert job.counter_values(result, "test_job", ["rejected", "read"]) == {
        "read": 3, "rejected": 0}
    assert list(job.counter_values(result, "test_job", ["z", "b"])) == ["b", "read", "z"]


def test_accounting_names_every_balance_that_does_not_hold():
    job.check_accounting("stage", {"kept + rejected": (5, 5)})
    with pytest.raises(RuntimeError) as error:
        job.check_accounting("stage", {"kept + rejected": (5, 4), "in the stats": (4, 4),
                                       "translated": (5, 6)})
    assert str(error.value) == ("stage: counts do not add up: kept + rejected is 4, "
                                "expected 5; translated is 6, expected 5")
