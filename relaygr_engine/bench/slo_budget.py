"""``relaygr bench slo --budget-s S``: the whole command (every seed, the calibration, compilation and graph
capture included) planned to end within ``S`` seconds of wall time, and held to it.

Plan
----
The options :data:`PLANNED` that the command line does not give are chosen by the run: after the (shared)
calibration and the code-path warm-up, the run knows what full inference costs here, how much wall time a second
of service time takes on this machine now, and what it has spent. It predicts each rung of :data:`LADDER` (the full
settings down to the quick settings' resolution with one run per point; :mod:`relaygr_engine.bench.slo_cost`) for
every seed still to run, and takes the finest whose prediction fits :data:`FIT` of the time left (else the last,
whose deadlines then cut searches short where the prediction is right). It prints that plan before serving and
records it in every report and the summary. Where even a lower bound of the last rung (every answer where the
search expects it, no run slower than the calibration measured, a relay mode's request 0.8 of a full inference,
on this machine as loaded now) passes the time left, the budget cannot reach the quick resolution: the run ends before
serving anything with a usage error (exit status 2) naming the budget the prediction fits. A first such check comes from
the calibration's first measured points (half their cost: first calls), before its timed rounds.

Holding it
----------
Before every phase of every seed (the QPS searches, the reference runs, the length searches) the time left is
shared among the phases still to run in proportion to their predictions, which follow the runs measured so far:
a phase's share is its deadline. A search starts no evaluation past it (status ``"deadline"``, with the bracket
measured so far). A run still going at the *abort* time (past which the phases this seed cannot do without, its
reference runs, would not fit) is stopped and not kept. Nothing is served past ``S`` minus the time the reports
take to write, so the command ends within ``S`` plus that estimate's error; ``S`` plus :data:`OVERRUN` is never
passed in the measured runs (``elapsed_s`` in the RESULT line). A seed whose reference runs could not be served in
time is reported as not finished (its points are kept: ``--resume`` continues it).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

__all__ = ["PLANNED", "Rung", "LADDER", "FIT", "OVERRUN", "Budget", "BudgetTooSmall", "Deadline", "Plan",
           "planned_keys", "choose", "too_small", "process_started"]

PLANNED = ("requests", "warmup_requests", "min_duration_s", "rel_tol", "len_step", "repeats")
FIT = 0.85       # a plan's predicted cost fits this share of the time left
OVERRUN = 0.10   # the run never passes the budget by more than this share


@dataclass(frozen=True)
class Rung:
    """One step of :data:`LADDER`: the planned options' values (``warmup``: warm-up requests per measured one)."""

    name: str
    requests: int
    warmup: int
    min_duration_s: float
    rel_tol: float
    len_step: int
    repeats: int

    def values(self) -> dict:
        return {"requests": self.requests, "warmup_requests": self.warmup * self.requests,
                "min_duration_s": self.min_duration_s, "rel_tol": self.rel_tol, "len_step": self.len_step,
                "repeats": self.repeats}


# From the full settings (bench slo's defaults, three runs of a marginal point) to the quick settings' resolution
# with one run per point: each rung costs less than the one before.
LADDER = (
    Rung("full", 200, 2, 4.0, 0.08, 32, 3),
    Rung("fine", 200, 2, 3.0, 0.08, 64, 2),
    Rung("medium", 160, 2, 2.5, 0.10, 64, 2),
    Rung("medium-1", 128, 1, 2.0, 0.12, 64, 1),
    Rung("coarse", 128, 1, 2.0, 0.12, 128, 1),
    Rung("quick", 100, 1, 1.5, 0.15, 128, 1),
)


class BudgetTooSmall(ValueError):
    """The budget cannot reach the last rung's resolution (a usage error naming ``--budget-s``)."""


class Deadline(Exception):
    """A run was stopped at its abort time (its measurements are discarded)."""


def process_started() -> float:
    """When this process started, on the ``time.monotonic()`` clock (Linux: from ``/proc``; else now)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


def planned_keys(args) -> list[str]:
    """The options of :data:`PLANNED` the command line left unset (None): the ones a budgeted run chooses."""
    return [k for k in PLANNED if getattr(args, k, None) is None]


class Budget:
    """The wall-clock budget of one command: ``seconds`` from ``started`` (``time.monotonic()``).

    Parameters
    ----------
    seconds : float
        The budget ``S`` (> 0).
    started : float, optional
        When the command started (default: now).
    clock : callable
        ``time.monotonic`` (tests pass a fake).
    exit_s : float
        What the process takes to exit after its last line (a command line's: torch's teardown, 1-3 s on a loaded
        CPU), kept free at the end.
    """

    def __init__(self, seconds: float, started: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic, exit_s: float = 0.0) -> None:
        if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds must be a finite number > 0, got {seconds!r}")
        if not exit_s >= 0:
            raise ValueError(f"exit_s must be >= 0, got {exit_s!r}")
        self.seconds, self.clock, self.exit_s = float(seconds), clock, float(exit_s)
        self.started = clock() if started is None else float(started)
        self.writing_s = 2.0       # what writing one seed's report (and the summary) takes: measured once done

    def elapsed(self) -> float:
        return self.clock() - self.started

    def left(self) -> float:
        """Seconds left to ``S``."""
        return self.seconds - self.elapsed()

    def serve_until(self) -> float:
        """The clock time past which nothing is served: ``S`` less what writing the reports takes."""
        return self.started + self.seconds - max(1.0, 1.5 * self.writing_s) - self.exit_s

    def shares(self, phases: list, mandatory_s: float = 0.0) -> tuple[float, float]:
        """Deadlines of the first of ``phases`` (``[(name, predicted seconds), ...]``, every phase still to run):
        ``(soft, abort)`` clock times. ``soft``: its share of the time left, in proportion to the predictions;
        ``abort``: past it, the ``mandatory_s`` predicted for what must still run after it would not fit."""
        now, end = self.clock(), self.serve_until()
        total = sum(max(p, 1e-3) for _, p in phases)
        soft = now + max(0.0, end - now) * max(phases[0][1], 1e-3) / total if phases else end
        return min(soft, end), max(now, end - mandatory_s)


@dataclass
class Plan:
    """The settings a budgeted run chose, and what it predicted.

    ``values``: every option of :data:`PLANNED` as the run uses it; ``planned``: those the run chose (the others
    were given); ``predicted_s``: per seed, per phase; ``left_s``: the time left when it was planned.
    """

    rung: str
    values: dict
    planned: list
    budget_s: float
    seeds: int
    elapsed_s: float
    left_s: float
    predicted_s: dict
    fits: bool

    @property
    def total_s(self) -> float:
        return sum(p["total"] for p in self.predicted_s.values())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_s"] = self.total_s
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(**{k: d[k] for k in ("rung", "values", "planned", "budget_s", "seeds", "elapsed_s", "left_s",
                                       "predicted_s", "fits")})

    def resolution(self) -> dict:
        """What the RESULT line states: the settings that set a result's resolution."""
        v = self.values
        return {"requests": v["requests"], "rel_tol": v["rel_tol"], "len_step": v["len_step"],
                "repeats": v["repeats"]}

    def lines(self) -> list[str]:
        """The plan in a few printed lines."""
        v = self.values
        given = [k for k in PLANNED if k not in self.planned]
        per_seed = " + ".join(f"{p['total']:.0f}" for p in self.predicted_s.values())
        return [f"budget plan: {self.budget_s:g} s for {self.seeds} seed(s); {self.elapsed_s:.1f} s spent before "
                f"serving (calibration, warm-up), {self.left_s:.0f} s left",
                f"  settings '{self.rung}': requests {v['requests']}, warm-up {v['warmup_requests']}, min duration "
                f"{v['min_duration_s']:g} s, rel_tol {v['rel_tol']:g}, len_step {v['len_step']}, repeats "
                f"{v['repeats']}" + (f" (given: {', '.join(given)})" if given else ""),
                f"  predicted serving {self.total_s:.0f} s ({per_seed} per seed) for {FIT:.0%} of the time left"
                + ("" if self.fits else ": over it, so the phases' deadlines will cut searches short")]

    def markdown(self) -> str:
        rows = "\n".join(f"| {s} | {p['qps']:.1f} | {p['ref']:.1f} | {p['len']:.1f} | "
                         f"{p['total'] - p['qps'] - p['ref'] - p['len']:.1f} | {p['total']:.1f} |"
                         for s, p in self.predicted_s.items())
        return "\n".join(self.lines()) + ("\n\n| seed | QPS searches s | reference runs s | length searches s | "
                                          "streams, report s | total s |\n|---|---|---|---|---|---|\n" + rows)


def choose(left_s: float, elapsed_s: float, budget_s: float, seeds: list, predict: Callable[[dict, int], dict],
           args, ladder=LADDER, usable: Optional[int] = None,
           bound: Optional[Callable[[dict, int], dict]] = None) -> Plan:
    """The finest rung of ``ladder`` whose prediction fits :data:`FIT` of ``left_s``; else the last rung, its
    phases' deadlines then cutting searches short where the prediction is right.

    ``predict(values, i)`` -> the phases' predicted seconds (with ``"total"``) of the ``i``-th seed still to run at
    the option values ``values``; the options given on the command line (``args``, not in ``args.planned``) keep
    their values. ``bound(values, i)``: the same, a lower bound (every answer where expected, no run slower than
    the calibration).
    ``usable``: the log's events usable as requests (a rung needing more warm-up and measured requests is passed
    over).

    Raises
    ------
    BudgetTooSmall
        Even the lower bound of the last rung passes ``left_s``: the budget cannot reach its resolution. The message
        names the budget the prediction would fit.
    """
    planned = list(getattr(args, "planned", []))
    last = None
    for rung in ladder:
        values = {k: (v if k in planned else getattr(args, k)) for k, v in rung.values().items()}
        if "warmup_requests" in planned and "requests" not in planned:
            values["warmup_requests"] = rung.warmup * values["requests"]
        if usable is not None and rung is not ladder[-1] and values["requests"] + values["warmup_requests"] > usable:
            continue
        predicted = {str(s): predict(values, i) for i, s in enumerate(seeds)}
        total = sum(p["total"] for p in predicted.values())
        last = Plan(rung.name, values, planned, budget_s, len(seeds), elapsed_s, left_s, predicted,
                    fits=total <= FIT * left_s)
        if last.fits:
            return last
    least = sum(bound(last.values, i)["total"] for i in range(len(seeds))) if bound else last.total_s
    if least <= left_s:
        return last
    raise too_small(budget_s, last.rung, last.values, len(seeds), least, elapsed_s, elapsed_s + last.total_s / FIT)


def too_small(budget_s: float, rung: str, values: dict, seeds: int, least_s: float, elapsed_s: float,
              need_s: float) -> BudgetTooSmall:
    """The usage error of a budget that cannot reach ``rung``'s resolution: serving needs at least ``least_s``
    after ``elapsed_s``; ``need_s``: the budget the prediction fits."""
    return BudgetTooSmall(
        f"argument --budget-s: {budget_s:g} s cannot reach the {rung} settings' resolution (requests "
        f"{values['requests']}, rel_tol {values['rel_tol']:g}, len_step {values['len_step']}, one run per point) "
        f"for {seeds} seed(s) on this machine: serving them needs at least {least_s:.0f} s after {elapsed_s:.0f} s "
        f"of set-up; give --budget-s {_round_up(need_s + 2.0)} or more")


def _round_up(seconds: float) -> int:
    step = 5 if seconds < 100 else 10 if seconds < 1000 else 60
    return int(math.ceil(seconds / step) * step)
