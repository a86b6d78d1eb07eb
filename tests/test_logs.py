"""components/logs.py: one logging set-up for every entry point."""

import logging

import pytest

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


@pytest.mark.parametrize("text, redacted", [
    ("cannot read https://user:pw@host:8080/a/b.gz?token=abc&x=1: HTTP 403",
     "cannot read https://***@host:8080/a/b.gz?token=***&x=***: HTTP 403"),
    ("url='http://127.0.0.1:3/x?X-Goog-Signature=f00d'",
     "url='http://127.0.0.1:3/x?X-Goog-Signature=***'"),
    ("zip://m.tsv::https://u:p@h/x.zip?sig=1", "zip://m.tsv::https://***@h/x.zip?sig=***"),
    ("https://h?t#frag, then gs://bucket/work/prepare/k.",
     "https://h?***#frag, then gs://bucket/work/prepare/k."),
    ("${PADIR_DATA_ROOT}/multi30k/train.en.gz", "${PADIR_DATA_ROOT}/multi30k/train.en.gz"),
])
def test_redact_hides_userinfo_and_query_values_of_every_url(text, redacted):
    assert logs.redact(text) == redacted


def test_every_log_record_and_manifest_value_is_redacted():
    record = logging.makeLogRecord({"msg": "fetching %s", "args": ("https://h/f?token=abc",),
                                    "levelno": logging.INFO})
    assert logs._Redact().filter(record)
    assert record.getMessage() == "fetching https://h/f?token=***"
    assert logs.redact_values({"corpus": ["https://u:p@h/f"], "n": 3}) == \
        {"corpus": ["https://***@h/f"], "n": 3}
