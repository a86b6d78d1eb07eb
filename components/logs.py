"""One logging set-up for every entry point (`padir`, `python -m pipelines.X`).

INFO for the project, WARNING for libraries that log routine work at INFO: the stage logs
should show the stages, not every orbax save, Prefect API request or Beam type hint.
"""

from __future__ import annotations

import logging

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


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(DROPPED_MESSAGES)


def configure(level: int = logging.INFO) -> None:
    """`level` (INFO; DEBUG with `padir --debug`, which adds each stage's whole resolved
    config) to stderr, with the noisy libraries above at WARNING and the messages above
    dropped."""
    logging.basicConfig(level=level, format=FORMAT)
    root = logging.getLogger()
    root.setLevel(level)  # also when something configured it first
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in root.handlers:
        if not any(isinstance(f, _DropMessages) for f in handler.filters):
            handler.addFilter(_DropMessages())
