"""The temporary local Prefect API that `padir run` uses when no server is configured.

Prefect would start it on first use, but with a PREFECT_HOME it cannot create (a parent
missing) or a database it cannot open, its server fails at start-up and Prefect restarts it
forever, printing tracebacks. So `padir run` makes the home first (parents included), checks
that the SQLite database opens, and starts the server itself under a deadline: a failure is
one line that names the cause and the PREFECT_HOME used.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading


class PrefectUnavailable(Exception):
    """The temporary Prefect API cannot start; the message says why, in one line."""


def _make_home() -> str:
    """PREFECT_HOME (default ~/.prefect), created with its parents and exported absolute
    before Prefect is imported (Prefect creates it without parents, and warns if it cannot)."""
    home = os.path.abspath(os.path.expanduser(os.environ.get("PREFECT_HOME", "~/.prefect")))
    try:
        os.makedirs(home, exist_ok=True)
    except OSError as e:
        raise PrefectUnavailable(f"cannot create PREFECT_HOME {home}: {e.strerror}") from None
    if not os.access(home, os.W_OK):
        raise PrefectUnavailable(f"PREFECT_HOME {home} is not writable")
    os.environ["PREFECT_HOME"] = home
    return home


def _check_database(url: str, home: str) -> None:
    """A SQLite database that cannot be opened is the common start-up failure: say so now."""
    if not url.startswith("sqlite"):
        return  # a PostgreSQL database is the server's to report
    path = url.split(":///", 1)[-1]
    try:
        sqlite3.connect(path).close()
    except sqlite3.Error as e:
        raise PrefectUnavailable(f"the temporary Prefect API cannot open its database {path} "
                                 f"(PREFECT_HOME {home}): {e}") from None


def _give_up(server, home: str, seconds: float) -> None:
    """Runs when start-up outlives its deadline (Prefect may be restarting it forever)."""
    if server.server_process is not None:
        server.server_process.kill()
    print(f"padir: error: the temporary Prefect API did not start within {seconds:.0f} s "
          f"(PREFECT_HOME {home}); set PREFECT_API_URL to use a running server",
          file=sys.stderr, flush=True)
    os._exit(2)


def ensure_api() -> None:
    """Starts the temporary local API unless PREFECT_API_URL (or the profile) names a server."""
    home = _make_home()
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_ENABLED", "true")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's own deadline (default 20 s); loaded 2-core machines take 20-40 s.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "60")
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return
    _check_database(settings.server.database.connection_url.get_secret_value(), home)
    from prefect.server.api.server import SubprocessASGIServer

    seconds = settings.server.ephemeral.startup_timeout_seconds
    server = SubprocessASGIServer()  # one per process: Prefect's clients reuse this one
    watchdog = threading.Timer(seconds + 5, _give_up, (server, home, seconds))
    watchdog.daemon = True
    watchdog.start()
    try:
        server.start(timeout=seconds)
    except Exception as e:  # noqa: BLE001 - Prefect raises RuntimeError or httpx errors
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PrefectUnavailable(f"the temporary Prefect API did not start (PREFECT_HOME "
                                 f"{home}): {first_line}") from None
    finally:
        watchdog.cancel()
