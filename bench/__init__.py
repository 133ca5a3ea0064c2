"""Benchmarks of blasx against cuBLAS-XT, in-core CuPy and NumPy (see bench/README.md)."""
