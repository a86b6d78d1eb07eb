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


def configure() -> None:
    """INFO to stderr, with the noisy libraries above at WARNING."""
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    logging.getLogger().setLevel(logging.INFO)  # also when something configured it first
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
