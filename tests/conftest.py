"""Shared test set-up. Prefect never touches the user's ~/.prefect or a configured server.

Set here, before any test module imports Prefect (it reads these when it is imported):
PREFECT_HOME is a fresh temporary directory (profiles, SQLite databases, default result
storage), no PREFECT_API_URL is inherited, and no Prefect server sends telemetry. JAX's
compilation cache and $XDG_CACHE_HOME (CTranslate2's exports and sweeps) are fresh temporary
directories too (read when JAX is imported), shared
by this process and the child interpreters of the session, never the user's; every
program goes in it, however quickly it compiled. XLA compiles for the CPU at LLVM's lowest
optimisation level (in the children too): compilation is most of the suite's time, and
the tests' tiny programs compile in about a third less time, their runs still seconds.
Tests that run flows request the session-scoped `prefect_harness` (one temporary server
for the whole session, started only if some selected test needs it). Under pytest-xdist
(`make test`) each worker is a session of its own: its own temporary directories, server
and tiny workdir.
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
# A stage run again by another test, or by a child interpreter, loads its programs.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# What the code keeps per machine (CTranslate2's exports and sweeps) goes to a temporary
# cache too, never the user's.
_CACHE_HOME = tempfile.mkdtemp(prefix="padir-test-cache-")
atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", "").split():
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()


def pytest_collection_modifyitems(items):
    """A test on the tiny DAG's real stages (the `tiny_workdir` fixture) is marked `dag`, and
    one that needs the session's Prefect server (`prefect_harness`) `server`, so that
    `make test-fast` can leave those out."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "tiny_workdir" in fixtures:
            item.add_marker(pytest.mark.dag)
        if "prefect_harness" in fixtures:
            item.add_marker(pytest.mark.server)


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
