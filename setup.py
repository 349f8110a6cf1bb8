"""Build script for relaygr-engine (C++ extension added by the core build)."""
from setuptools import setup

setup(
    packages=[
        "relaygr_engine",
        "relaygr_engine.models",
        "relaygr_engine.policy",
        "relaygr_engine.serving",
        "relaygr_engine.bench",
        "relaygr_engine.kernels",
    ],
    package_dir={"relaygr_engine.kernels": "kernels"},
)
