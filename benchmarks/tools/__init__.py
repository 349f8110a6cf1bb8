"""Kernel-developer tools: offline sm_90 compiles (``python -m benchmarks.tools.ptxas``), SASS instruction mixes,
profiling and audit scripts. Run from the root of a checkout; they import the installed ``relaygr_engine``."""
