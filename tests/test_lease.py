"""components/artifacts.py's lease between real processes: a live holder is named, a killed
one is detected (the kernel drops its lock) and its lease taken over."""

import logging
import os
import signal
import subprocess
import sys

import pytest

from components import artifacts

HOLD = """
import sys, time
from components import artifacts
with artifacts.lease(sys.argv[1], "teacher", "k"):
    print("HELD", flush=True)
    time.sleep(120)
"""


def test_a_live_holder_is_named_and_a_killed_one_taken_over(tmp_path, caplog):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=repo,
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=repo))
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(artifacts.LeaseHeldError,
                           match=f"teacher/k is being written by another run "
                                 rf"\(pid {holder.pid} on "):
            with artifacts.lease(str(tmp_path), "teacher", "k"):
                pytest.fail("took a held lease")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="components.artifacts"):
        with artifacts.lease(str(tmp_path), "teacher", "k"):
            pass
    assert f"taking over the lease of a run that died (pid {holder.pid} on" in caplog.text
    assert not os.path.exists(artifacts.lease_uri(str(tmp_path), "teacher", "k"))


def test_served_deployments_run_one_at_a_time(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import flow

    served = {}
    monkeypatch.setattr(flow.padir_pipeline, "serve", lambda **kwargs: served.update(kwargs))
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        flow.serve("configs/demo.yaml", name="nightly", cron="0 3 * * *")
    assert served["global_limit"] == 1 and served["cron"] == "0 3 * * *"
