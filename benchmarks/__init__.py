"""Reproducible measurements of swarmtrain; see BENCHMARKS.md. Run `python -m benchmarks.<name> --quick`."""
