"""The SLO benchmark's measured points, kept as they finish, so a run cut short resumes where it stopped.

A seed at production shape on a GPU can outlast a time-limited call. ``<out>/points.jsonl`` holds, first, the run's
settings (:func:`relaygr_engine.bench.slo_run._settings`) and its calibrated latency model, then one line per
finished point (a judged QPS or length, a reference run), each written and flushed as it finishes. A rerun with
``--resume``, the same settings and ``--out`` takes the calibration back (so its searches walk the same QPS and
lengths) and serves only the points not yet measured; a file written under other settings is then refused before
anything runs. Without ``--resume`` a run starts the file afresh, as it rewrites the report. A run under
``--budget-s`` also keeps its plan (one line, :meth:`PointLog.put_plan`): a resumed run serves the same settings.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

__all__ = ["PointLog", "FILE"]

FILE = "points.jsonl"


class PointLog:
    """The points of one run directory.

    Parameters
    ----------
    out : str
        The run's output directory (created if missing).
    settings : dict
        The run's settings; with ``resume``, a file holding other ones raises ``ValueError`` naming it and the
        options that differ.
    resume : bool
        Take the file's points back (else :meth:`start` begins it afresh).
    """

    def __init__(self, out: str, settings: dict, resume: bool = True) -> None:
        self.path = os.path.join(out, FILE)
        self.latency: Optional[dict] = None  # the kept calibration, where a run was here before
        self.plan: Optional[dict] = None     # the kept budget plan (--budget-s)
        self._points: dict = {}
        self._fresh = not resume
        if resume and os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                lines = [json.loads(line) for line in f if line.strip()]
            head = lines[0] if lines else {}
            if head.get("settings") != settings:
                old = head.get("settings") or {}
                differ = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
                raise ValueError(f"{self.path} holds the points of a run with other settings ({', '.join(differ)} "
                                 f"differ): give another --out, or run without --resume to start over")
            self.latency = head.get("latency")
            self._points = {line["key"]: line["value"] for line in lines[1:] if "key" in line}
            self.plan = next((line["plan"] for line in lines[1:] if "plan" in line), None)
        self._settings = settings

    def __len__(self) -> int:
        return len(self._points)

    def start(self, latency: dict) -> None:
        """Write the header of a new file: the settings and the calibrated latency model (``LatencyModel.to_dict``)."""
        if self.latency is not None:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if self._fresh and os.path.exists(self.path):
            os.remove(self.path)
        self.latency = latency
        self._append({"settings": self._settings, "latency": latency})

    def put_plan(self, plan: dict) -> None:
        """Keep the run's budget plan (once; a resumed run takes it back as :attr:`plan`)."""
        assert self.latency is not None, "start() writes the header first"
        if self.plan is None:
            self.plan = json.loads(json.dumps(plan, default=_plain))
            self._append({"plan": self.plan})

    def get(self, *key) -> Optional[Any]:
        """The value kept for ``key`` (kind, mode, QPS, base length), or None."""
        return self._points.get(_key(key))

    def put(self, value: Any, *key) -> None:
        """Keep ``value`` (JSON-able; numpy scalars become numbers) for ``key``, on disk at once."""
        assert self.latency is not None, "start() writes the header first"
        value = json.loads(json.dumps(value, default=_plain))
        self._points[_key(key)] = value
        self._append({"key": _key(key), "value": value})

    def _append(self, line: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, default=_plain) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _key(key: tuple) -> str:
    return "|".join(repr(k) for k in key)  # (repr: a float's exact value)


def _plain(x):
    return x.item() if hasattr(x, "item") else str(x)
