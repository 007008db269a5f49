"""The benchmark harness: `python benchmarks/run.py --help` (see README.md beside this file)."""
