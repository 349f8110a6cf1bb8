"""Workload profiles shipped with the package (read with importlib.resources; see README.md here)."""
