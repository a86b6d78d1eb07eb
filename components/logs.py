"""One logging set-up for every entry point (`padir`, `python -m pipelines.X`).

INFO for the project, WARNING for libraries that log routine work at INFO: the stage logs
should show the stages, not every orbax save, Prefect API request or Beam type hint.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LOGGERS = (
    "absl",  # orbax: every checkpoint save step
    "httpx",  # Prefect's client: every API request
    "apache_beam.typehints.native_type_compatibility",  # every string type hint of a job
)
# Messages dropped whoever logs them. Beam's RunInference imports its model manager, which
# needs torch, in the same `try` as the `resource` module: without torch it warns at every
# model load that memory usage cannot be fetched, on Linux too (apache-beam 2.77).
# Orbax warns at every read-only restore (decoding, distillation) that it will not save.
DROPPED_MESSAGES = ("Resource module is not available for current platform",
                    "CheckpointManagerOptions.read_only=True",
                    "Given directory is read only")
# Clients whose errors are a retry's or a caller's to report: gcsfs logs the end of its
# retries, and a request it does not retry, at ERROR with a traceback, where the caller
# retries again (a lease renewal) or raises what the user reads as one line. Capped at
# WARNING, in one line, so that a run that recovered does not read as failed.
CLIENT_LOGGERS = ("gcsfs", "aiohttp", "google.auth")


# A URL (scheme://...) up to a space, a quote, a bracket or fsspec's `::` chaining, less
# the punctuation that ends a sentence or a clause after it.
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://(?:(?!::)[^\s'\"<>])*(?<![:,.;)\]])")
REDACTED = "***"


def redact_url(url: str) -> str:
    """`url` without secrets: its userinfo and each query value become `***` (a signed
    URL's signature, a token, a password), so that an error, a log or a manifest that names
    it leaks nothing."""
    scheme, _, rest = url.partition("://")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority, rest = rest[:end], rest[end:]
    if "@" in authority:
        authority = f"{REDACTED}@{authority.rpartition('@')[2]}"
    path, question, query = rest.partition("?")
    if question:
        query, hash_, fragment = query.partition("#")
        query = "&".join(f"{part.partition('=')[0]}={REDACTED}" if "=" in part else REDACTED
                         for part in query.split("&")) + hash_ + fragment
    return f"{scheme}://{authority}{path}{question}{query}"


def redact(text: str) -> str:
    """`text` with every URL in it redacted (`redact_url`)."""
    return _URL.sub(lambda match: redact_url(match.group(0)), text) if "://" in text else text


def format_exception(error: BaseException) -> str:
    """`error`'s traceback as Python prints it, its causes included, every URL in it
    redacted: a client's message names the URL it requested, secrets and all (aiohttp's
    does, with the token a `${VAR}` in it expanded to)."""
    return redact("".join(traceback.format_exception(error)))


def redact_values(value: Any) -> Any:
    """`value` (JSON-like) with every URL in its strings redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_values(v) for v in value)
    return value


class _Redact(logging.Filter):
    """Redacts the URLs of every record and of its traceback, whoever logs it (a library
    that names a URL)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "://" in message:
            record.msg, record.args = redact(message), ()
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = format_exception(record.exc_info[1]).rstrip("\n")
        return True


class _CapClients(logging.Filter):
    """A record of `CLIENT_LOGGERS` above WARNING becomes a WARNING of one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING and any(
                record.name == name or record.name.startswith(f"{name}.")
                for name in CLIENT_LOGGERS):
            lines = record.getMessage().splitlines()
            record.msg, record.args = lines[0] if lines else "", ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = record.stack_info = None
        return True


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(DROPPED_MESSAGES)


def configure(level: int = logging.INFO) -> None:
    """`level` (INFO; DEBUG with `padir --debug`, which adds each stage's whole resolved
    config) to stderr, with the noisy libraries above at WARNING, the messages above
    dropped, the clients' errors capped at WARNING and every URL redacted, tracebacks
    included."""
    logging.basicConfig(level=level, format=FORMAT)
    root = logging.getLogger()
    root.setLevel(level)  # also when something configured it first
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in root.handlers:
        for kind in (_DropMessages, _CapClients, _Redact):
            if not any(isinstance(f, kind) for f in handler.filters):
                handler.addFilter(kind())
