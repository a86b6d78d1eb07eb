"""components/logs.py: one logging set-up for every entry point."""

import asyncio
import io
import logging

import gcsfs.retry
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


@pytest.fixture
def logged():
    """What the handlers `logs.configure` sets up print, as a string."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(logs.FORMAT))
    logging.getLogger().addHandler(handler)
    logs.configure()
    try:
        yield stream
    finally:
        logging.getLogger().removeHandler(handler)


def test_a_logged_traceback_is_redacted(logged):
    try:
        raise OSError("GET https://u:hunter2@h/x?token=s3cr3t: reset")
    except OSError:
        logging.getLogger("components.corpus").exception("reading failed")
    text = logged.getvalue()
    assert "Traceback (most recent call last)" in text
    assert "OSError: GET https://***@h/x?token=***: reset" in text
    assert "s3cr3t" not in text and "hunter2" not in text


def test_gcsfs_out_of_retries_is_one_warning_line_and_a_real_error_stays_an_error(logged):
    """gcsfs logs the end of its retries at ERROR with a traceback; its caller retries (a
    lease renewal) or reports the failure: one WARNING line, redacted. Errors of the
    project's own loggers are left as they are."""
    @gcsfs.retry.retry_request(retries=1)
    async def unavailable():
        raise gcsfs.retry.HttpError({"code": 503, "message": "https://h/o?token=s3cr3t\nbody"})

    with pytest.raises(gcsfs.retry.HttpError):
        asyncio.run(unavailable())
    logging.getLogger("components.artifacts").error("a stage failed")
    lines = logged.getvalue().splitlines()
    assert [line.split(" ", 3)[2:] for line in lines] == [
        ["WARNING", "gcsfs: unavailable out of retries on exception: https://h/o?token=***"],
        ["ERROR", "components.artifacts: a stage failed"]]
