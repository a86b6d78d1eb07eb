"""Scripts that measure and print figures, each run as `python -m benchmarks.NAME`
(benchmarks/README.md)."""
