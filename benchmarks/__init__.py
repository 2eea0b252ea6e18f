"""Benchmarks: what nandoctor costs next to the loop a user would write, measured side by
side in one process with the candidates interleaved. `python -m benchmarks --help`."""
