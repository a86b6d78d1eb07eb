"""Apache Beam jobs, one module per stage; each runs alone with `python -m pipelines.NAME`."""
