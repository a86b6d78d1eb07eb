"""Shared test set-up. Prefect never touches the user's ~/.prefect or a configured server.

Set here, before any test module imports Prefect (it reads these when it is imported):
PREFECT_HOME is a fresh temporary directory (profiles, SQLite databases, default result
storage), no PREFECT_API_URL is inherited, and no Prefect server sends telemetry. JAX's
compilation cache is a fresh temporary directory too (read when JAX is imported), shared
by this process and the child interpreters of the session, never the user's.
Tests that run flows request the session-scoped `prefect_harness` (one temporary server
for the whole session, started only if some selected test needs it).
"""

import atexit
import logging
import os
import shutil
import tempfile

import pytest

_PREFECT_HOME = tempfile.mkdtemp(prefix="padir-test-prefect-")
atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.pop("PREFECT_API_URL", None)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
_JAX_CACHE = tempfile.mkdtemp(prefix="padir-test-jax-cache-")
atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE


def pytest_collection_modifyitems(items):
    """A test on the tiny DAG's real stages (the `tiny_workdir` fixture) is marked `dag`, so
    that `make test-fast` can leave those out."""
    for item in items:
        if "tiny_workdir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.dag)


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect API on loopback with a throwaway SQLite database."""
    from prefect.testing.utilities import prefect_test_harness

    # Loaded 2-core CI machines take well over Prefect's default 30 s to start it.
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_workdir(tmp_path_factory):
    """One workdir for every test on the tiny Multi30k experiment (tiny_experiment.py): the
    artifacts whose keys agree (prepare and vocab everywhere) are computed once a session."""
    return str(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def cache_dir():
    """The JAX compilation cache of the whole session (this process and its children)."""
    return _JAX_CACHE


@pytest.fixture(autouse=True)
def _restore_logging():
    """`padir` entry points configure the root logger; no test leaks that into the next."""
    from components import logs

    root = logging.getLogger()
    saved = (root.level, list(root.handlers), {h: list(h.filters) for h in root.handlers},
             {name: logging.getLogger(name).level for name in logs.QUIET_LOGGERS})
    yield
    level, handlers, filters, quiet = saved
    root.setLevel(level)
    root.handlers[:] = handlers
    for handler, kept in filters.items():
        handler.filters[:] = kept
    for name, quiet_level in quiet.items():
        logging.getLogger(name).setLevel(quiet_level)
