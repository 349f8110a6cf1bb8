"""Package data: the shipped latency profiles (``latency_<device>.json``, written by ``relaygr calibrate``)."""
