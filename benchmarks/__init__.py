"""The benchmark harness: `python -m benchmarks.run --help` (see README.md beside this file)."""
