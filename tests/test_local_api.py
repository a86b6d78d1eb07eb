"""flows/local_api.py: `padir run` without a Prefect server, as `make demo` runs it.

Every other flow test runs under `prefect_test_harness`; these run the real command in a
fresh interpreter with no PREFECT_API_URL, so it starts its own temporary API.
"""

import os
import subprocess
import sys

import pytest

from components import artifacts, dag
from components import config as config_lib
from tiny_experiment import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _padir_run(cwd, config_path: str, **env: str) -> subprocess.CompletedProcess:
    environ = {name: value for name, value in os.environ.items()
               if not name.startswith("PREFECT_")}  # no server, no harness settings
    environ.update(PYTHONPATH=REPO, PREFECT_SERVER_ANALYTICS_ENABLED="false", **env)
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", config_path, "--only", "prepare"],
        cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)


def _experiment(tmp_path) -> str:
    """A tiny config file in `tmp_path`, named relative to it as a user would."""
    config = tiny_config(str(tmp_path))
    (tmp_path / "experiment.yaml").write_text(config_lib.dump(config))
    return "experiment.yaml"


@pytest.mark.server
def test_run_creates_a_missing_prefect_home_and_starts_a_temporary_api(tmp_path):
    home = tmp_path / "no" / "such" / "parent" / "prefect"
    proc = _padir_run(tmp_path, _experiment(tmp_path), PREFECT_HOME=str(home),
                      PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="240")  # loaded CI
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert (home / "prefect.db").is_file()
    config = config_lib.load(str(tmp_path / "experiment.yaml"))
    assert artifacts.is_complete(dag.output_uri(config, "prepare"))
    assert dag.output_uri(config, "prepare") in proc.stdout


def test_an_unusable_prefect_home_is_one_line_naming_it(tmp_path):
    (tmp_path / "a-file").write_text("")
    home = tmp_path / "a-file" / "prefect"
    proc = _padir_run(tmp_path, _experiment(tmp_path), PREFECT_HOME=str(home))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"padir: error: cannot create PREFECT_HOME {home}: Not a directory"]


def test_a_database_that_cannot_be_opened_is_one_line_naming_it(tmp_path):
    home = tmp_path / "prefect"
    (home / "prefect.db").mkdir(parents=True)  # a directory where the SQLite file belongs
    proc = _padir_run(tmp_path, _experiment(tmp_path), PREFECT_HOME=str(home))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("padir: error: the temporary Prefect API cannot open its database "
                           f"{home}/prefect.db (PREFECT_HOME {home})")


@pytest.mark.server  # a server process that never answers: padir waits its deadline
def test_a_server_that_never_starts_fails_within_its_deadline(tmp_path):
    home = tmp_path / "prefect"
    proc = _padir_run(
        tmp_path, _experiment(tmp_path), PREFECT_HOME=str(home),
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="3",
        # A database server nobody listens on: Prefect would keep waiting for its API.
        PREFECT_API_DATABASE_CONNECTION_URL="postgresql+asyncpg://padir:x@127.0.0.1:9/none")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "padir: error" in line]
    assert errors == [f"padir: error: the temporary Prefect API did not start (PREFECT_HOME "
                      f"{home}): Timed out while attempting to connect to ephemeral Prefect "
                      "API server."]
    # The server process may log its own start-up failure (uvicorn's traceback, on a fast
    # machine) before padir gives up; padir itself prints no traceback.
    assert 'flows/' not in proc.stderr
