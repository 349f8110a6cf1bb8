"""``relaygr bench ray``: 1 vs N Ray Serve replicas (see :mod:`relaygr_engine.serving.bench`)."""
from relaygr_engine.serving.bench import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
