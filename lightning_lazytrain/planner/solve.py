"""Solving the schedule MILP: seed from the best baseline, run HiGHS, check, fall back.

``solve()`` records solver name and version, status (``optimal``; ``time_limit`` with the
incumbent; ``fallback`` to the best feasible baseline, with a warning, when there is no
incumbent), the proven gap, and build and solve seconds. The returned schedule is replayed by the
simulator; with the full model a violation there is a bug and raises.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field

from .errors import InfeasibleSchedule
from .hardware import Hardware
from .milp import MIP_FEASIBILITY_TOLERANCE, MilpOptions, ScheduleModel
from .policies import keep_all, megatrain, recompute_all
from .schedule import Schedule
from .shortage import fitting_floor, no_schedule
from .simulator import SimResult, simulate
from .workload import Workload

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SolveResult:
    schedule: Schedule
    status: str  # optimal | time_limit | fallback
    objective: float | None
    bound: float | None
    mip_gap: float | None
    build_seconds: float
    solve_seconds: float
    solver: dict = field(default_factory=dict)
    simulated: SimResult | None = None
    seed_policy: str | None = None
    violation: str | None = None  # what the simulator rejects (only possible with window_memory=False)

    def solver_json(self) -> dict:
        return {**self.solver, "mip_gap": self.mip_gap, "build_seconds": self.build_seconds,
                "solve_seconds": self.solve_seconds, "objective": self.objective, "bound": self.bound,
                "seed": self.seed_policy}


def solver_info(**extra) -> dict:
    """What ``SolveResult.solver`` says of the solver, with ``extra``."""
    return {"name": "highs", "version": solver_version(), "interface": "pyomo appsi_highs", **extra}


def solver_version() -> str:
    import highspy

    h = highspy.Highs()
    return f"{h.versionMajor()}.{h.versionMinor()}.{h.versionPatch()}"


# Note: [HiGHS's thread pool] HiGHS keeps one thread scheduler per process, made by the first solve with
# that solve's ``threads``; a later solve asking for another count ended at once ("scheduler has already
# been initialized"), and solve() fell back to a baseline without a word (review 7). So the pool is reset
# whenever a solve asks for a count other than the one it was made with.
_pool_threads: list[int | None] = []  # the count the process's pool was made with (empty: none made yet)


def _thread_pool(threads: int | None) -> None:
    import highspy

    if _pool_threads and _pool_threads[0] != threads:
        highspy.Highs.resetGlobalScheduler(True)
        _pool_threads.clear()
    if not _pool_threads:
        _pool_threads.append(threads)


def in_space(s: Schedule, opt: MilpOptions, optimizer: str | None = None, data_parallel: str | None = None) -> Schedule:
    """The nearest schedule in the MILP's space (backward prefetch on; the optimizer ``optimizer`` if
    given, else the schedule's own when the options allow it, else the one they allow)."""
    modes = opt.optimizer_modes()
    mode = optimizer or (s.optimizer if s.optimizer in modes else modes[-1])
    return Schedule(num_layers=s.num_layers, homes=s.homes, keep_internals=s.keep_internals,
                    resident_weights=s.resident_weights, offload_window=s.offload_window,
                    reload_window=s.reload_window, internals_offload_window=s.internals_offload_window,
                    internals_reload_window=s.internals_reload_window,
                    partial_keep=s.partial_keep if opt.partial_keep else (), backward_prefetch=True, optimizer=mode,
                    serial_layers=s.serial_layers if mode == "pipelined" and opt.serial_layers
                    and (data_parallel or s.data_parallel) == "none" else (),
                    data_parallel=data_parallel or s.data_parallel, policy=s.policy)


def best_baseline(wl: Workload, hw: Hardware, opt: MilpOptions, K: int = 4) -> tuple[Schedule, SimResult] | None:
    """The fastest feasible baseline, mapped into the MILP's space (None if none fits); with
    ``optimizer_mode="auto"`` each baseline is tried with both optimizer modes."""
    L = wl.num_layers
    candidates = [recompute_all(L), megatrain(L, min(K, opt.max_block, L))]
    if opt.keep_internals:
        candidates.append(keep_all(L))
    best = None
    for base in candidates:
        for mode in opt.optimizer_modes():
            cand = in_space(base, opt, mode, wl.data_parallel)
            try:
                sim = simulate(cand, wl, hw)
            except InfeasibleSchedule:
                break  # the mode changes no memory figure
            if best is None or sim.iteration_seconds < best[1].iteration_seconds:
                best = (cand, sim)
    return best


def solve(wl: Workload, hw: Hardware, options: MilpOptions | None = None, *, start: Schedule | None = None,
          **overrides) -> SolveResult:
    """Solve for the fastest schedule. See the module docstring for the model.

    ``start``: a schedule to warm-start from (a re-plan passes the schedule the run is on): used
    as HiGHS's MIP start (and as the fallback) when it fits the new workload, lies in the model's
    space and is at least as fast as the best baseline; ``SolveResult.seed_policy`` says
    ``"current plan"`` then.

    With ``solver_process`` (the default) HiGHS runs in a process of its own under a wall-clock
    guard (Note: [the solver's process] in solver_process.py); the answer is the same."""
    opt = options or MilpOptions()
    if overrides:
        opt = MilpOptions(**{**{f: getattr(opt, f) for f in opt.__slots__}, **overrides})
    wl.validate()
    hw.validate()
    if opt.solver_process and os.name == "posix":  # the guard waits with poll() on pipes
        from .solver_process import Stopped, solve_guarded

        res = solve_guarded(wl, hw, opt, start)
        if not isinstance(res, Stopped):
            return res
        seed, origin, _ = seeds(wl, hw, opt, start)
        info = solver_info(stopped=list(res.why))
        return fallback(wl, hw, opt, seed, origin, f"{res.why[0]}, and again with presolve off", solve_s=res.seconds,
                        info=info)
    return solve_here(wl, hw, opt, start)


def seeds(wl: Workload, hw: Hardware, opt: MilpOptions, start: Schedule | None):
    """(seed, origin, best baseline): the warm start and fallback (the best baseline, or ``start`` when it
    fits and is at least as fast), the name of its policy, and the best baseline alone."""
    baseline_seed = seed = best_baseline(wl, hw, opt)
    origin = seed[0].policy if seed else None
    if start is not None:
        cand = in_space(start, opt, data_parallel=wl.data_parallel)
        try:
            sim = simulate(cand, wl, hw)
        except InfeasibleSchedule:
            sim = None
        if sim is not None and (seed is None or sim.iteration_seconds <= seed[1].iteration_seconds):
            seed, origin = (cand, sim), "current plan"
    return seed, origin, baseline_seed


def fallback(wl: Workload, hw: Hardware, opt: MilpOptions, seed, origin: str | None, why: str, *, bound=None,
             build: float = 0.0, solve_s: float = 0.0, info: dict | None = None) -> SolveResult:
    """The answer when HiGHS gave none: ``seed`` (see seeds()), else the fitting floor, else no_schedule;
    warns with ``why`` (what the solver did) and what the plan falls back to."""
    info = info or {}
    if seed is not None:
        warnings.warn(f"{why}; falling back to {origin}", stacklevel=3)
        return SolveResult(schedule=seed[0], status="fallback", objective=None, bound=bound, mip_gap=None,
                           build_seconds=build, solve_seconds=solve_s, solver=info, simulated=seed[1],
                           seed_policy=origin)
    floor = fitting_floor(wl, hw)  # Note: [no schedule fits] in shortage.py
    if floor is not None:  # no baseline fits, but a floor does (the MILP ran out of time before finding it)
        schedule = in_space(floor[0], opt, data_parallel=wl.data_parallel)
        warnings.warn(f"{why}; falling back to {floor[0].policy}", stacklevel=3)
        return SolveResult(schedule=schedule, status="fallback", objective=None, bound=bound, mip_gap=None,
                           build_seconds=build, solve_seconds=solve_s, solver=info,
                           simulated=simulate(schedule, wl, hw), seed_policy=floor[0].policy)
    raise no_schedule(wl, hw, f"{why} and no baseline fits")


def solve_here(wl: Workload, hw: Hardware, opt: MilpOptions, start: Schedule | None = None, *,
               presolve: bool = True, on_run=None) -> SolveResult:
    """solve() in this process. ``on_run(time_limit)`` is called as each HiGHS run starts and
    ``on_run(None)`` as it ends (the solver process's guard); ``presolve=False`` turns HiGHS's presolve off."""
    import pyomo.environ as pyo
    from pyomo.contrib.appsi.base import TerminationCondition
    from pyomo.contrib.appsi.solvers import Highs

    t0 = time.perf_counter()
    model = ScheduleModel(wl, hw, opt)
    seed, origin, baseline_seed = seeds(wl, hw, opt, start)
    if seed is not None and opt.seed:
        try:
            model.seed_from(seed[0])
        except KeyError:  # the start lies outside the model's index sets (block length, horizons)
            seed, origin = baseline_seed, baseline_seed[0].policy if baseline_seed else None
            if seed is not None:
                model.seed_from(seed[0])
    build = time.perf_counter() - t0

    def run(warm: bool):
        _thread_pool(opt.threads)
        solver = Highs()
        solver.config.mip_gap = opt.mip_gap
        solver.config.time_limit = opt.time_limit
        solver.config.load_solution = False
        solver.config.stream_solver = False
        solver.config.warmstart = warm
        # Note: [no MIP restarts] HiGHS 1.16 can hang after a MIP restart ("... inactive integer
        # columns, restarting"), past its time limit and holding the GIL (no watchdog thread can
        # stop it); seen on 27B/H800/b72 with a 3 GB/s link, the optimizer forced pipelined and
        # partial keep on. Without restarts that solve ends (optimal) in ~9 s.
        solver.highs_options = {"mip_allow_restart": False,
                                # Note: [memory rows and the solver's tolerance]
                                "mip_feasibility_tolerance": MIP_FEASIBILITY_TOLERANCE,
                                **({"threads": opt.threads} if opt.threads else {}),
                                **({} if presolve else {"presolve": "off"})}
        t = time.perf_counter()
        if on_run is not None:
            on_run(opt.time_limit)
        result = solver.solve(model.m)
        if on_run is not None:
            on_run(None)
        return result, time.perf_counter() - t

    warm = seed is not None and opt.seed
    res, solve_s = run(warm)
    restarted = False
    if warm and res.best_feasible_objective is not None:
        # Note: [warm start and presolve] HiGHS 1.16 values a MIP start in the presolved space
        # without the objective offset of the columns presolve removed, so a start that survives
        # as the answer is misvalued (seen: reported 32 s, true 33 s) and B&B may have pruned on
        # it. Presolve is too valuable to switch off (grad-accumulation models: 1.5 s vs 60 s),
        # so check the answer and, when it is the misvalued start, solve again without it.
        res.solution_loader.load_vars()
        true_value = pyo.value(model.m.obj)
        if abs(true_value - res.best_feasible_objective) > 1e-6 * max(1.0, abs(true_value)):
            log.info("HiGHS misvalued the MIP start (%.6g vs %.6g); solving again without it",
                     res.best_feasible_objective, true_value)
            res, again = run(False)
            solve_s += again
            restarted = True
    info = solver_info(warm_start=warm and not restarted, **({} if presolve else {"presolve": "off"}))
    tc = res.termination_condition
    has_incumbent = res.best_feasible_objective is not None
    bound = res.best_objective_bound
    objective = res.best_feasible_objective
    gap = None
    if has_incumbent and bound is not None and objective:
        gap = abs(objective - bound) / max(abs(objective), 1e-12)
    if has_incumbent and tc in (TerminationCondition.optimal, TerminationCondition.maxTimeLimit,
                                TerminationCondition.maxIterations, TerminationCondition.interrupted):
        res.solution_loader.load_vars()
        objective = pyo.value(model.m.obj)  # recomputed: never trust a reported incumbent value
        if bound is not None:
            gap = max(0.0, objective - bound) / max(abs(objective), 1e-12)
        status = "optimal" if tc == TerminationCondition.optimal else "time_limit"
        schedule = model.extract()
        sim = simulate(schedule, wl, hw, check=False)
        violation = None
        try:
            simulate(schedule, wl, hw)
        except InfeasibleSchedule as err:
            if opt.window_memory:
                raise  # the full model's constraints mirror the simulator's: this is a bug
            violation = str(err)
        return SolveResult(schedule=schedule, status=status, objective=objective, bound=bound, mip_gap=gap,
                           build_seconds=build, solve_seconds=solve_s, solver=info, simulated=sim,
                           seed_policy=origin, violation=violation)
    return fallback(wl, hw, opt, seed, origin, f"MILP ended with {tc.name} and no incumbent", bound=bound,
                    build=build, solve_s=solve_s, info=info)
