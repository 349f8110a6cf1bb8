"""Benchmarks and kernel-developer tools run from a checkout (not part of the installed package)."""
