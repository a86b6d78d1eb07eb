"""Orchestration: the `padir` CLI and (later) the Prefect flow over the stages."""
