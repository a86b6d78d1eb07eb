"""components/logs.py: one logging set-up for every entry point."""

import logging

from components import logs


def test_configure_quiets_noisy_libraries_and_drops_known_false_warnings():
    logs.configure()
    logs.configure()  # idempotent: one filter per handler
    root = logging.getLogger()
    assert root.level == logging.INFO
    assert logging.getLogger("absl").level == logging.WARNING
    for handler in root.handlers:
        assert sum(isinstance(f, logs._DropMessages) for f in handler.filters) == 1
    dropped = logging.makeLogRecord({"msg": logs.DROPPED_MESSAGES[0] + ", memory usage ...",
                                     "levelno": logging.WARNING})
    kept = logging.makeLogRecord({"msg": "decode: wrote ...", "levelno": logging.INFO})
    assert [logs._DropMessages().filter(r) for r in (dropped, kept)] == [False, True]


def test_configure_debug_lowers_the_project_level_only():
    try:
        logs.configure(logging.DEBUG)
        assert logging.getLogger().level == logging.DEBUG
        assert logging.getLogger("httpx").level == logging.WARNING
    finally:
        logs.configure()
    assert logging.getLogger().level == logging.INFO
