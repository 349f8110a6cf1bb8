"""What the seeds of one ``relaygr bench slo`` command share, paid once: the model, the latency calibration, each
mode's services (compiled model, captured CUDA graphs, allocated pages), the code-path warm-up, the budget and its
plan (:mod:`relaygr_engine.bench.slo_budget`), and the answers of the seeds already run (where a budgeted run's
later seeds start their searches).

The seeds vary the workload's draw and trace; the model's weights are the same for every seed
(:data:`relaygr_engine.bench.slo_setup.MODEL_SEED`), so one model, one calibration (same model, same device) and
one set of services serve them all. A service is reset before each run (:class:`relaygr_engine.bench.slo_workers.Pool`),
so every run still starts from empty caches and zeroed counters. What a seed pays itself: its interaction log and
workloads, and on CUDA the graphs of shapes no earlier run met (counted per seed in its report).
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Optional

from . import slo_setup, slo_workers
from .slo_budget import FIT, LADDER, Budget, Plan, choose, too_small
from .slo_cost import CACHED_SHARE, CostModel, SeedShape, predict_seed

__all__ = ["Shared", "calibrate_latency", "CALIBRATION_SHARE"]

CALIBRATION_SHARE = 0.2   # of a budget, what the calibration may take (longer lengths are left out)


def calibrate_latency(baseline, num_candidates: int, max_len: int, device: str, repeats: int = 3,
                      timer=time.perf_counter, max_s: Optional[float] = None, on_probe=None):
    """Fit the trigger's latency model on the baseline's full inference of this model (seconds to a few minutes).

    ``baseline`` is a :class:`~relaygr_engine.bench.sim.BaselineService` built as the baseline's workers are
    (implementation, CUDA graphs, compilation): the trigger predicts what a ranking without a cache costs as the
    baseline serves it. ``timer`` is the benchmark's service-time clock.

    The lengths are probed in increasing order (one call each, the calibration's warm-up call: on CUDA it captures
    graphs and compiles). With ``max_s``, probing stops (at least two lengths kept) once half of ``max_s`` is spent
    or the last probe took a quarter of it, and the timed rounds are as many as fit what is left (at least one, a
    round priced as the probes took); ``on_probe(model, spent_s)`` sees a model fitted to the probes before the
    rounds (a budget's first check). The model's ``meta`` records ``wall_s``, ``wall_per_service`` (wall seconds
    per second of the timer over the calls), ``skipped_lengths`` and ``repeats``.
    """
    import torch

    from ..models import Behaviors
    from ..policy import LatencyModel, LatencyPoint, calibrate

    cfg = baseline.model.config
    g = torch.Generator().manual_seed(0)
    spent = {"wall": 0.0, "service": 0.0}

    def fn(L: int, C: int) -> None:
        L = max(L, 1)
        h = Behaviors(torch.randint(0, cfg.num_items, (L,), generator=g).to(device),
                      torch.randint(0, cfg.num_actions, (L,), generator=g).to(device),
                      torch.arange(L, dtype=torch.long).to(device) * 60)
        c = torch.randint(0, cfg.num_items, (C,), generator=g).to(device)
        w0, s0 = time.perf_counter(), timer()
        baseline.score(h, c)
        spent["service"] += timer() - s0
        spent["wall"] += time.perf_counter() - w0

    grid = (32, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
    grid += tuple(4096 << k for k in range(1, max(0, (max_len - 1) // 4096).bit_length() + 1))  # production lengths
    lengths = sorted({min(max_len, x) for x in grid})
    t0 = time.perf_counter()
    probes: list = []                                                     # (length, wall s, service s)
    for L in lengths:
        if max_s is not None and len(probes) >= 2 and (time.perf_counter() - t0 > max_s / 2 or
                                                        probes[-1][1] > max_s / 4):
            break
        w, s = spent["wall"], spent["service"]
        fn(L, num_candidates)
        probes.append((L, spent["wall"] - w, spent["service"] - s))
    kept = [L for L, _, _ in probes]
    if max_s is not None:
        left = max_s - (time.perf_counter() - t0)
        repeats = max(1, min(repeats, int(left // max(sum(w for _, w, _ in probes), 1e-9))))
    if on_probe is not None:
        on_probe(LatencyModel.fit([LatencyPoint(L, num_candidates, s * 1e3) for L, _, s in probes], device=device),
                 time.perf_counter() - t0)
    meta = {"model": "benchmark model", "candidates": num_candidates, "baseline": baseline.impl.value,
            "cuda_graphs": baseline.cuda_graphs, "compiled": baseline.compile_model}
    lat = calibrate(fn, kept, [num_candidates], repeats, warmup=0, quantile=0.75, timer=timer, device=device,
                    meta=meta)
    lat.meta.update(wall_s=time.perf_counter() - t0, skipped_lengths=[L for L in lengths if L not in kept],
                    wall_per_service=max(1.0, spent["wall"] / max(spent["service"], 1e-9)))
    return lat


class Shared:
    """What one command's seeds share (see the module doc).

    Parameters
    ----------
    args : argparse.Namespace
        The command's options (checked); ``args.budget_s`` sets :attr:`budget`.
    started : float, optional
        When the command started (``time.monotonic()``; the budget counts from it). Default: now.
    exit_s : float
        What the process takes to exit after the last report (:class:`~relaygr_engine.bench.slo_budget.Budget`).
    """

    def __init__(self, args, started: Optional[float] = None, exit_s: float = 0.0) -> None:
        self.budget = Budget(args.budget_s, started, exit_s=exit_s) if getattr(args, "budget_s", None) else None
        self.plan: Optional[Plan] = None
        self.cost = None                      # slo_cost.CostModel, once calibrated
        self.latency = None                   # the calibrated LatencyModel
        self.calibration_s = 0.0
        self.warmup_s: Optional[float] = None  # the code-path warm-up (once per command)
        self.priors: dict = {"qps": {}, "len": {}}   # mode -> the answers of the seeds run so far
        self.seeds_left: list = []            # seeds still to run, the current one first (the seeds' loop)
        self.shape: Optional[SeedShape] = None  # the current seed's searches, as the planner sees them
        self.seed_overhead_s = 1.0            # a seed's time outside its searches (workloads, report): measured
        self._models: dict = {}
        self._pools: dict = {}
        self._phases: dict = {}               # the current seed's phases: predicted, deadline, spent
        self._phase: Optional[tuple] = None   # (name, started)
        self._seed_started: Optional[float] = None
        self._once_this_seed = 0.0            # of the current seed's time, what was paid once for all seeds
        self._main = None                     # the first seed's stream, before its plan (the code-path warm-up)
        self._wrote = False                   # a report was written (its time measured)
        self.sharing: dict = {}               # what was paid once, what the last seed paid itself

    # ------------------------------------------------------------------------------------------ paid once
    def model(self, args, num_actions: int):
        """The ranker (:func:`relaygr_engine.bench.slo_setup.build_model`), built once per item and action
        vocabulary."""
        key = (args.num_items, num_actions)
        if key not in self._models:
            self._models[key] = slo_setup.build_model(args, num_items=args.num_items, num_actions=num_actions)
        return self._models[key]

    def pool(self, args, model, timer) -> "slo_workers.Pool":
        """The services of ``model``'s workers, built once and reset before every run."""
        if id(model) not in self._pools:
            self._pools[id(model)] = slo_workers.Pool(args, model, timer)
        return self._pools[id(model)]

    def calibrate(self, args, model, timer, kept: Optional[dict], check=None):
        """The latency model and how it was had: ``kept`` (an earlier run's, from its points file), the one an
        earlier seed of this command measured, or measured now (within :data:`CALIBRATION_SHARE` of the budget;
        ``check(model, spent_s)`` sees the probes' fit first)."""
        from ..policy import LatencyModel

        if kept is not None:
            lat = LatencyModel.from_dict(kept)
            self.latency = self.latency or lat
            return lat, "kept from the run resumed"
        if self.latency is not None:
            return self.latency, "measured once for every seed of this command"
        t0 = time.perf_counter()
        max_s = None if self.budget is None else CALIBRATION_SHARE * self.budget.seconds
        self.latency = calibrate_latency(self.pool(args, model, timer).baseline_service(), args.candidates,
                                         max(args.max_history, args.max_len_hi), args.device, repeats=5,
                                         timer=timer, max_s=max_s, on_probe=check)
        self.calibration_s = time.perf_counter() - t0
        self._once_this_seed += self.calibration_s
        return self.latency, f"on this model in {self.calibration_s:.1f}s"

    # ------------------------------------------------------------------------------------------ a seed
    def stream(self, args, log, model, timer, modes, points) -> None:
        """Before the calibration: the seed's served stream as the planner sees it (:attr:`shape`, under a
        budget only): mean history length, how much longer the length search's requests run than their base."""
        self._seed_started = time.perf_counter()
        self._phases, self._phase, self._once_this_seed = {}, None, 0.0
        if self.budget is None:
            return
        from .slo_bench import _Bench

        if self.plan is None and points.plan is not None:
            self.plan = Plan.from_dict(points.plan)
        prov = _provisional(args, self.plan)
        bench = _Bench(prov, log, model, None, None, timer, None, self.pool(args, model, timer))
        main = bench.at(0.0)
        mean_len = float(main.history_lengths().mean())
        L = max(prov.len_step, min(prov.max_len_hi, 1024) // prov.len_step * prov.len_step)
        growth = 0.0 if args.no_max_len else float(bench.workload(L).history_lengths().mean()) - L
        self.shape = SeedShape(modes=list(modes), candidates=args.candidates, workers=args.workers,
                               mean_len=mean_len, growth=max(0.0, growth), capacity=0.0, max_len_hi=args.max_len_hi,
                               max_evals=(14, 8) if args.quick else (20, 14), no_max_len=args.no_max_len,
                               qps_start=args.qps_start, ref_qps=args.ref_qps)
        self._main = main

    def early_check(self, args):
        """Under a budget with no plan yet, eager serving: a check of the calibration's first points (a model fitted
        to one call per length, half of it), before its timed rounds: a usage error where even a lower bound of the
        last rung cannot fit the time left."""
        if self.budget is None or self.plan is not None or args.cuda_graphs or args.compile:
            return None   # (a graphed or compiled first call captures or compiles: no bound; checked after)

        def check(probe_model, spent_s):
            # one call per length (a first call: slower than later ones, on a GPU by far): half of it, a bound
            cost = CostModel(probe_model, args.candidates, 0.5, priors={m: CACHED_SHARE for m in self.shape.modes
                                                                        if m != "baseline"})
            values = {k: v for k, v in LADDER[-1].values().items()}
            values.update({k: getattr(args, k) for k in values if k not in args.planned})
            shape = self._seed_shape(cost)
            seeds = self.seeds_left or [args.seed]
            least = sum(predict_seed(cost, values, shape, later=i > 0, miss=0.0)["total"] for i in range(len(seeds)))
            if least > self.budget.serve_until() - self.budget.clock():
                typical = sum(predict_seed(CostModel(probe_model, args.candidates), values, shape, later=i > 0)
                              ["total"] for i in range(len(seeds)))
                raise too_small(self.budget.seconds, LADDER[-1].name, values, len(seeds), least,
                                self.budget.elapsed(), self.budget.elapsed() + typical / FIT)
        return check

    def _seed_shape(self, cost) -> SeedShape:
        shape = dataclasses.replace(self.shape, prior=self.prior())
        shape.capacity = shape.workers * 1e3 / max(cost.lat.predict_ms(int(shape.mean_len), shape.candidates), 1e-3)
        return shape

    def prepare_seed(self, args, log, model, lat, out, timer, modes, points) -> Optional[SeedShape]:
        """After the calibration: the code-path warm-up (once per command), and under a budget the plan (kept by
        the points file, this command's, or chosen now and printed) applied to ``args``; the seed's shape for the
        phases' deadlines (None without a budget)."""
        from .sim import simulate
        from .slo_bench import _Bench
        from ..workload.requests import Workload

        pool = self.pool(args, model, timer)
        if self.warmup_s is None:  # every mode's code paths (imports, allocations, compilation, graphs), once
            t0 = time.perf_counter()
            main = self._main if self.budget is not None else \
                _Bench(args, log, model, lat, None, timer, None, pool).at(0.0)
            warm = Workload([dataclasses.replace(r, warmup=False) for r in main.requests[:24]], main.config,
                            main.info)
            for m in modes:  # relay modes admitting every pre-infer, so chunks, extensions and hits all run
                simulate(pool.workers(m, lat, trigger=False, requests=warm.requests), warm, 2.0,
                         batch=slo_workers.batch_policy(args))
            self.warmup_s = time.perf_counter() - t0
            self._once_this_seed += self.warmup_s
        if self.budget is None:
            return None
        if self.cost is None:
            self.cost = CostModel(lat, args.candidates, lat.meta.get("wall_per_service", 1.0))
        shape = self.shape = self._seed_shape(self.cost)
        if self.plan is None:
            seeds = self.seeds_left or [args.seed]
            left = self.budget.serve_until() - self.budget.clock() - self.budget.writing_s * (len(seeds) - 1)
            # a bound on this machine now: every answer where expected, no run slower than its calibration
            least = CostModel(lat, args.candidates, lat.meta.get("wall_per_service", 1.0),
                              priors={m: CACHED_SHARE for m in modes if m != "baseline"})
            self.plan = choose(left, self.budget.elapsed(), self.budget.seconds, seeds,
                               lambda values, i: self._predict(values, shape, later=i > 0), args,
                               ladder=LADDER[-1:] if args.quick else LADDER,
                               usable=getattr(args, "usable_events", None),
                               bound=lambda values, i: predict_seed(least, values, shape, later=i > 0, miss=0.0))
            for line in self.plan.lines():
                out.say(line)
        else:
            out.say(f"budget plan '{self.plan.rung}' (made before this seed): {self.budget.left():.0f} s of "
                    f"{self.budget.seconds:g} s left")
        for k in self.plan.planned:
            setattr(args, k, self.plan.values[k])
        points.put_plan(self.plan.to_dict())
        return shape

    def _predict(self, values, shape, later: bool) -> dict:
        p = predict_seed(self.cost, values, shape, later=later)
        p["total"] += self.seed_overhead_s + self.budget.writing_s
        return p

    def phase(self, bench, name: str, shape: Optional[SeedShape]):
        """Enter phase ``name`` (``"qps"``, ``"ref"``, ``"len"``; ``"done"`` ends the last) of the current seed:
        the time left is shared among the phases still to run (this seed's and the later seeds') in proportion to
        their predictions; returns the searches' stop hook (no evaluation starts once its share is over; None
        without a budget) and sets the runs' abort time: a run of the QPS searches is stopped where this seed's
        reference runs would not fit any more, every other run only at the end of serving (a run begun in time
        is worth finishing)."""
        now = time.perf_counter()
        if self._phase is not None:
            done, t0 = self._phase
            self._phases.setdefault(done, {})["spent_s"] = now - t0
        self._phase = (name, now)
        bench.phase = name
        if self.budget is None or name == "done":
            bench.abort = None
            return None
        values = self.plan.values
        this = self._predict(values, shape, later=bool(self.prior()))
        order = ["qps", "ref"] + ([] if shape.no_max_len else ["len"])
        rest = [(p, this[p]) for p in order[order.index(name):]]
        rest += [(f"seed {s}", self._predict(values, shape, later=True)["total"]) for s in self.seeds_left[1:]]
        clock = self.budget.clock
        soft, abort = self.budget.shares(rest, mandatory_s=this["ref"] if name == "qps" else 0.0)
        t = clock()
        bench.abort = self.abort_check(abort)
        self._phases[name] = {"predicted_s": round(this[name], 2), "deadline_s": round(soft - t, 2),
                              "abort_s": round(abort - t, 2)}
        return lambda: clock() >= soft

    def record(self, bench, results: dict, workload_s: float, pool, builds_before: dict) -> Optional[dict]:
        """What the report says of this seed's budget and of what it paid itself (``report["budget"]``; None
        without a budget, then only ``sharing`` is returned inside ``report["setup"]``)."""
        own = {"workloads_s": round(workload_s, 2),
               "services_built": {m: n - builds_before.get(m, 0) for m, n in pool.builds.items()
                                  if n - builds_before.get(m, 0)},
               **{k: int(v) for k, v in bench.paid.items()}}
        self.sharing = {"paid_once": {"model": "built once (weights: seed %d)" % slo_setup.MODEL_SEED,
                                      "calibration_s": round(self.calibration_s, 2),
                                      "code_path_warmup_s": round(self.warmup_s or 0.0, 2),
                                      "services_built": dict(pool.builds)},
                        "paid_by_this_seed": own}
        if self.budget is None:
            return None
        spent = time.perf_counter() - self._seed_started - self._once_this_seed
        searched = sum(p.get("spent_s", 0.0) for p in self._phases.values())
        self.seed_overhead_s = max(0.5, spent - searched)   # (its log, the next seed's before this one's run)
        meta = self.latency.meta if self.latency is not None else {}
        return {"budget_s": self.budget.seconds, "elapsed_s": round(self.budget.elapsed(), 2),
                "plan": self.plan.to_dict(), "phases": self._phases, "cost_model": self.cost.to_dict(),
                "calibration": {k: meta.get(k) for k in ("wall_s", "wall_per_service", "repeats", "skipped_lengths")},
                "statuses": {m: {k: (r.get(k) or {}).get("status") for k in ("slo_throughput", "max_len")}
                             for m, r in results.items()},
                "sharing": self.sharing}

    def result_fields(self) -> dict:
        """What a budgeted run adds to its RESULT line: the budget, the command's elapsed seconds, the plan's
        resolution."""
        if self.budget is None:
            return {}
        return dict({"budget_s": self.budget.seconds, "elapsed_s": round(self.budget.elapsed(), 1)},
                    **self.plan.resolution())

    def wrote(self, seconds: float) -> None:
        """Writing a report took ``seconds``: what later reports are expected to take."""
        if self.budget is not None:
            self.budget.writing_s = max(self.budget.writing_s if self._wrote else 0.0, seconds)
            self._wrote = True

    def can_start_seed(self) -> bool:
        """Under a budget: whether a seed can still report (its reference runs and one evaluation of each mode's
        searches fit the time left, as predicted); without one, always."""
        if self.budget is None or self.plan is None or self.shape is None:
            return True
        bound = CostModel(self.cost.lat, self.cost.candidates, self.cost.wall_per_service,
                          priors={m: CACHED_SHARE for m in self.shape.modes if m != "baseline"})
        p = predict_seed(bound, self.plan.values, self._seed_shape(self.cost), later=True, miss=0.0)
        need = p["ref"] + self.seed_overhead_s + sum(p[k] / max(1, p[f"runs_{k}"]) for k in ("qps", "len")) * \
            len(self.shape.modes)
        return self.budget.serve_until() - self.budget.clock() >= need

    # ------------------------------------------------------------------------------------------ seeds
    def remember(self, results: dict) -> None:
        """A finished seed's answers (each mode's SLO-compliant QPS and longest history): where the budgeted
        searches of the next seeds start."""
        for m, r in results.items():
            for key, src in (("qps", "slo_throughput"), ("len", "max_len")):
                best = (r.get(src) or {}).get("best")
                if best is not None:
                    self.priors[key].setdefault(m, []).append(best)

    def prior(self) -> Optional[dict]:
        """``{"qps": {mode: median}, "len": {mode: median}}`` of the seeds run so far, or None before the first."""
        if not self.priors["qps"]:
            return None
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        return {k: {m: med(v) for m, v in d.items()} for k, d in self.priors.items()}

    def abort_check(self, at: float):
        """A ``simulate`` abort hook: True once the budget's clock reaches ``at``."""
        clock = self.budget.clock
        return lambda: clock() >= at


def _provisional(args, plan: Optional[Plan]):
    """``args`` with the planned options filled (by ``plan``, else the first rung): to build streams before
    the plan is made."""
    prov = copy.copy(args)
    values = plan.values if plan is not None else LADDER[0].values()
    for k in getattr(args, "planned", []):
        if getattr(prov, k) is None:
            setattr(prov, k, values[k])
    if prov.warmup_requests is None:
        prov.warmup_requests = 2 * prov.requests
    return prov
