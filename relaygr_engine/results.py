"""What a measured result says about itself: the machine it was measured on (:func:`environment`), and the one
``RESULT key=value ...`` line every benchmark and ``relaygr calibrate`` end with (:func:`emit_result`)."""
from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["environment", "emit_result"]


def environment(device: str = "cpu") -> dict[str, Any]:
    """What a result was measured on: device name, versions, date and git commit (when in a checkout)."""
    dev = torch.device(device)
    cpu = f"{platform.processor() or platform.machine()} CPU"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"device": str(dev), "device_name": name, "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "date": datetime.date.today().isoformat(), "commit": commit}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace(" ", "_")


def emit_result(result: dict[str, Any], json_path: Optional[str] = None, extra: Optional[dict] = None) -> str:
    """Print the one ``RESULT key=value ...`` line (last line of every benchmark) and optionally write JSON."""
    line = "RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in result.items())
    if json_path:
        payload = {"result": result, **(extra or {})}
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(line, flush=True)
    return line
