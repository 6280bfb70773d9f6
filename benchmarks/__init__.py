"""Benchmarks and the chaos harness, each with its figures beside it as a dated page; each runs as a file from
anywhere, e.g. python benchmarks/bench.py --help."""
