"""The errors a user can fix, which every entry point (`padir`, `python -m pipelines.NAME`)
reports as one line on stderr with exit status 2 instead of a traceback: a bad config or
corpus, a failed download, a missing input, a key another run holds, a file or bucket it
may not read (a PermissionError names the file or object: a 403 on a bucket,
components/artifacts.py). A stage that stopped (`artifacts.StageStopped`: on request, or
its lease lost) is one line with exit status 3."""

from __future__ import annotations

from components import artifacts, corpus, datasets
from components import config as config_lib

USER_ERRORS = (config_lib.ConfigError, corpus.CorpusError, datasets.FetchError,
               artifacts.IncompleteArtifactError, artifacts.LeaseHeldError, PermissionError)
