"""``relaygr bench slo`` keeps each measured point as it finishes (``<out>/points.jsonl``), so a run cut short (a
time-limited GPU call) resumes where it stopped: same calibration, same search path, only the missing points served."""
from __future__ import annotations

import json

import pytest

from relaygr_engine import cli
from relaygr_engine.bench import slo_run
from relaygr_engine.bench.slo_points import FILE, PointLog

TINY = ["bench", "slo", "--model", "nvidia-hstu", "--layers", "1", "--hidden", "32", "--heads", "1", "--head-dim",
        "32", "--dtype", "float32", "--quick", "--requests", "10", "--warmup-requests", "5", "--max-history", "128",
        "--max-len-hi", "256", "--len-step", "128", "--candidates", "4", "--repeats", "1", "--no-plots",
        "--no-progress", "--seed", "0"]


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _counting(monkeypatch, fail_after=None):
    """Count the points ``_Bench.judge`` and ``_Bench.run`` measure; ``fail_after``: raise on the judgement after
    that many (a run cut short)."""
    seen = {"judge": 0}
    judge = slo_run._Bench.judge

    def counted(self, *a, **k):
        if fail_after is not None and seen["judge"] >= fail_after:
            raise RuntimeError("cut short")
        seen["judge"] += 1
        return judge(self, *a, **k)

    monkeypatch.setattr(slo_run._Bench, "judge", counted)
    return seen


def test_a_run_cut_short_resumes_and_a_finished_one_measures_nothing_again(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    argv = TINY + ["--out", str(out), "--resume"]  # (the first run too: nothing to resume yet)
    seen = _counting(monkeypatch, fail_after=3)
    with pytest.raises(RuntimeError, match="cut short"):
        cli.main(argv)
    first = _lines(out / FILE)
    assert "settings" in first[0] and "latency" in first[0] and len(first) == 1 + 3  # the 3 judged points kept
    monkeypatch.undo()

    seen = _counting(monkeypatch)
    assert cli.main(argv) == 0
    done = _lines(out / FILE)
    assert done[:4] == first  # kept as they were, the calibration too
    judged = sum(x["key"].startswith("'judge'") for x in done[1:])
    assert seen["judge"] == judged - 3 > 0  # only the points not kept were measured
    assert sum(x["key"].startswith("'run'") for x in done[1:]) == 2  # each mode's reference run
    report = json.loads((out / "report.json").read_text())
    curve = report["modes"]["baseline"]["curve"]
    kept = {json.loads(x["key"].split("|")[2]): x["value"][1] for x in first[1:] if "'baseline'" in x["key"]}
    assert kept and all(any(p["qps"] == q and p["p99_ms"] == s["p99_ms"] for p in curve) for q, s in kept.items())
    result = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    monkeypatch.undo()

    seen = _counting(monkeypatch, fail_after=0)  # all kept: no point is measured again
    runs = []
    monkeypatch.setattr(slo_run._Bench, "run", lambda *a, **k: runs.append(a) or pytest.fail("measured again"))
    assert cli.main(argv) == 0
    assert [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")] == result
    assert _lines(out / FILE) == done and not runs
    monkeypatch.undo()
    seen = _counting(monkeypatch, fail_after=1)  # without --resume: begun afresh (as the report is rewritten)
    with pytest.raises(RuntimeError, match="cut short"):
        cli.main(argv[:-1])
    assert len(_lines(out / FILE)) == 1 + 1


def test_points_of_other_settings_are_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    PointLog(str(out), {"requests": 20}).start({"a": 1.0})
    with pytest.raises(SystemExit) as e:
        cli.main(TINY + ["--out", str(out), "--resume"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert FILE in err and "other settings" in err and "requests" in err and "--out" in err
    assert len(_lines(out / FILE)) == 1  # untouched
