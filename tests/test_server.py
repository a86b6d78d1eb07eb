"""`padir serve`: a scheduled deployment of the flow on a real Prefect server (loopback only).

Starts `prefect server start` (SQLite in a temporary PREFECT_HOME) and `padir serve` as
subprocesses, triggers a run of the deployment through the client and waits for the
served process to complete it. Runs `--only prepare` on 200 pairs, so the run is short.
Every wait is bounded; both processes are stopped by their process-group id.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from components import artifacts, dag
from components import config as config_lib
from flows import flow
from tiny_experiment import tiny_config

pytestmark = pytest.mark.server

BIN = os.path.dirname(sys.executable)
SERVER_START_TIMEOUT, DEPLOYMENT_TIMEOUT, RUN_TIMEOUT = 120, 90, 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, timeout: float, what: str, process: subprocess.Popen, log_path):
    """Polls `predicate` until it returns a truthy value; fails naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if process.poll() is not None:
            break
        time.sleep(0.5)
    with open(log_path) as f:
        log_tail = f.read()[-4000:]
    pytest.fail(f"no {what} within {timeout}s (process exit code {process.poll()}):\n{log_tail}")


def _start(command, env, log_path) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group, stopped below


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def prefect_server(tmp_path):
    """(API URL, environment for its clients): a fresh server on a free loopback port."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    log_path = tmp_path / "server.log"
    server = _start([os.path.join(BIN, "prefect"), "server", "start", "--host", "127.0.0.1",
                     "--port", str(port)], env, log_path)
    try:
        _wait_for(lambda: _healthy(url), SERVER_START_TIMEOUT, "healthy Prefect server",
                  server, log_path)
        yield url, {**env, "PREFECT_API_URL": url}
    finally:
        _stop(server)


def test_a_served_scheduled_deployment_runs_on_a_real_server(prefect_server, tmp_path):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.exceptions import ObjectNotFound

    url, env = prefect_server
    config = tiny_config(str(tmp_path), "data.dev=null", "data.test=[]")
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(config_lib.dump(config))
    log_path = tmp_path / "serve.log"
    serve = _start([os.path.join(BIN, "padir"), "serve", str(config_path), "--only", "prepare",
                    "--cron", "0 3 * * *", "--name", "nightly"],
                   {**env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}, log_path)
    try:
        with SyncPrefectClient(url) as client:
            def deployment():
                try:
                    return client.read_deployment_by_name(f"{flow.FLOW_NAME}/nightly")
                except ObjectNotFound:
                    return None

            found = _wait_for(deployment, DEPLOYMENT_TIMEOUT, "deployment", serve, log_path)
            assert [s.schedule.cron for s in found.schedules] == ["0 3 * * *"]
            assert found.parameters["only"] == "prepare"
            assert found.parameters["config_path"] == str(config_path)

            flow_run = client.create_flow_run_from_deployment(found.id)

            def finished():
                state = client.read_flow_run(flow_run.id).state
                return state if state is not None and state.is_final() else None

            state = _wait_for(finished, RUN_TIMEOUT, "finished flow run", serve, log_path)
            assert state.is_completed(), f"{state.name}: {state.message}"
        assert artifacts.is_complete(dag.output_uri(config, "prepare"))
        assert not artifacts.is_complete(dag.output_uri(config, "vocab"))
    finally:
        _stop(serve)
