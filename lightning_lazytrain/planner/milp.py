"""The schedule MILP (Pyomo model, solved by HiGHS through highspy).

Symbols -> variables (``L`` layers, boundaries ``0..L``, window names as in ``schedule``):

    x[s,e]    edge of the recompute path: boundaries s < e materialised, s+1..e-1 recomputed
    g/c/n[i]  boundary i lives on the GPU / in host memory / on NVMe   (m_i = g_i + c_i + n_i)
    k[j]      layer j keeps its internals (no local recompute)          needs g_j
    r[j]      layer j's weights stay resident from F{j} to B{j}
    o[i,w,h]  boundary i (tier h in {c, n}) is offloaded by the D2H lane of F{w}
    q[i,t,h]  boundary i comes back by the H2D lane of B{t} (t = L: H)
    tF1[j], tF[j], tH, tB[t], tT   window durations (tF1: first micro-batch, carries the optimizer)

Constraint groups (each a named method so an ablation is one switch):
    _create_path         flow over boundaries: one path 0 -> L through the materialised ones
    _create_homes        one home per materialised boundary, k_j <= g_j, resident layers never recomputed
    _create_transfers    every offload gets one window, every reload one window before first use
    _create_host         CPU bytes and NVMe bytes within capacity
    _create_gpu_memory   device bytes <= cap in *every* window (or, ablated, one aggregate sum)
    _create_window_times tau_w >= each lane's load in w; chains (optimizer -> fetch) are summed
    _create_objective    iteration time = T + sum tF1 + (g-1) sum tF + g (tH + sum tB) (+ tie-breaks);
                         ablated: LazyTrain's objective (recompute time + exposed transfer)
The simulator re-derives everything from the returned ``Schedule``; the two agree by construction
of the timing rule, which a test checks to 1%.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field

from .errors import InfeasibleBudget, InfeasibleSchedule
from .hardware import Hardware
from .policies import keep_all, megatrain, recompute_all
from .schedule import Schedule
from .simulator import MEM_TOL, SimResult, simulate
from .workload import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class MilpOptions:
    """Switches (each can be turned off for ablation) and solver settings."""

    window_memory: bool = True  # per-window device peak; False: one aggregate sum per tier (the paper)
    time_objective: bool = True  # iteration time; False: LazyTrain's recompute + exposure objective
    pipelined_optimizer: bool = True
    keep_internals: bool = True
    resident_weights: bool = True
    nvme: bool = True
    max_block: int = 8  # longest recompute block (edge length cap)
    reload_slack: int = 2  # reload at most this many windows before the earliest legal one... and later
    offload_horizon: int = 1  # offload within this many forward windows of the boundary's production
    mip_gap: float = 1e-3
    time_limit: float = 60.0
    threads: int | None = None
    seed: bool = True  # warm-start HiGHS from the best feasible baseline (see solve())


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


def solver_version() -> str:
    import highspy

    h = highspy.Highs()
    return f"{h.versionMajor()}.{h.versionMinor()}.{h.versionPatch()}"


class ScheduleModel:
    """Builds the Pyomo model for one (workload, hardware, options)."""

    EPS = 1e-6  # seconds per offloaded boundary: prefer fewer moves among equal-time schedules

    def __init__(self, wl: Workload, hw: Hardware, opt: MilpOptions) -> None:
        import pyomo.environ as pyo

        self.pyo, self.wl, self.hw, self.opt = pyo, wl, hw, opt
        L = self.L = wl.num_layers
        self.A = wl.boundary_bytes
        self.lay = wl.layers
        self.E = max(1, min(opt.max_block, L))
        self.use_nvme = opt.nvme and hw.has_nvme
        m = self.m = pyo.ConcreteModel("lazytrain_schedule")
        self.edges = [(s, e) for s in range(L) for e in range(s + 1, min(L, s + self.E) + 1)]
        self.inner = list(range(1, L))
        self.tiers = ["c", "n"] if self.use_nvme else ["c"]
        self.off_idx = [(i, w, h) for i in self.inner for w in range(i, min(L - 1, i + opt.offload_horizon - 1) + 1)
                        for h in self.tiers]
        last = lambda h: L if h == "c" else L - 1  # noqa: E731 - nvme reads run one window earlier
        self.rel_idx = [(i, t, h) for i in self.inner for h in self.tiers
                        for t in range(i + 1, min(last(h), i + self.E + opt.reload_slack - 1) + 1)]
        m.x = pyo.Var(self.edges, domain=pyo.Binary)
        m.g = pyo.Var(range(L + 1), domain=pyo.Binary)
        m.c = pyo.Var(range(L + 1), domain=pyo.Binary)
        m.n = pyo.Var(range(L + 1), domain=pyo.Binary)
        m.k = pyo.Var(range(L), domain=pyo.Binary)
        m.r = pyo.Var(range(L), domain=pyo.Binary)
        m.o = pyo.Var(self.off_idx, domain=pyo.Binary)
        m.q = pyo.Var(self.rel_idx, domain=pyo.Binary)
        m.any_nvme = pyo.Var(domain=pyo.Binary)
        m.tF1 = pyo.Var(range(L), domain=pyo.NonNegativeReals)
        m.tF = pyo.Var(range(L), domain=pyo.NonNegativeReals)
        m.tH = pyo.Var(domain=pyo.NonNegativeReals)
        m.tB = pyo.Var(range(L), domain=pyo.NonNegativeReals)
        m.tT = pyo.Var(domain=pyo.NonNegativeReals)
        m.cons = pyo.ConstraintList()
        self.lane_loads: dict[str, list] = {}  # window var name -> list of expressions (for seeding)
        self._fix_trivial()
        self._create_path()
        self._create_homes()
        self._create_transfers()
        self._create_host()
        if opt.window_memory:
            self._create_gpu_memory()
        else:
            self._create_aggregate_memory()
        self._create_window_times()
        self._create_objective()

    # ---- helpers --------------------------------------------------------------------------
    def add(self, expr) -> None:
        self.m.cons.add(expr)

    def mat(self, i: int):
        m = self.m
        return m.g[i] + m.c[i] + m.n[i]

    def off(self, i: int, w: int, tiers=("c", "n")):
        return sum(self.m.o[i, w, h] for h in tiers if (i, w, h) in self.m.o)

    def rel(self, i: int, t: int, tiers=("c", "n")):
        return sum(self.m.q[i, t, h] for h in tiers if (i, t, h) in self.m.q)

    def block_into(self, e: int) -> list[tuple[int, int]]:
        """Edges of length >= 2 ending at e (a recompute block whose backward starts in B{e-1})."""
        return [(s, e) for s in range(max(0, e - self.E), e - 1)]

    # ---- constraint groups -----------------------------------------------------------------
    def _fix_trivial(self) -> None:
        m, L = self.m, self.L
        for i in (0, L):
            m.g[i].fix(1)
            m.c[i].fix(0)
            m.n[i].fix(0)
        for i in self.inner:
            if not self.use_nvme:
                m.n[i].fix(0)
        if not self.use_nvme:
            m.any_nvme.fix(0)
        for j in range(L):
            if not self.opt.keep_internals:
                m.k[j].fix(0)
            if not self.opt.resident_weights:
                m.r[j].fix(0)
        if self.wl.grad_accum == 1:
            for j in range(L):
                m.tF[j].fix(0)

    def _create_path(self) -> None:
        m, L = self.m, self.L
        self.add(sum(m.x[0, e] for e in range(1, min(L, self.E) + 1)) == 1)
        self.add(sum(m.x[s, L] for s in range(max(0, L - self.E), L)) == 1)
        for i in self.inner:
            self.add(sum(m.x[s, i] for s in range(max(0, i - self.E), i)) == self.mat(i))
            self.add(sum(m.x[i, e] for e in range(i + 1, min(L, i + self.E) + 1)) == self.mat(i))

    def _create_homes(self) -> None:
        m, L = self.m, self.L
        for i in self.inner:
            self.add(self.mat(i) <= 1)
        for j in range(L):
            self.add(m.k[j] <= m.g[j])
            covering = [m.x[s, e] for (s, e) in self.edges if s <= j <= e - 2]
            self.add(m.r[j] + sum(covering) <= 1)

    def _create_transfers(self) -> None:
        m = self.m
        for i in self.inner:
            tier_var = {"c": m.c[i], "n": m.n[i]}
            for h in self.tiers:
                self.add(sum(m.o[i, w, hh] for (ii, w, hh) in self.off_idx if ii == i and hh == h) == tier_var[h])
                self.add(sum(m.q[i, t, hh] for (ii, t, hh) in self.rel_idx if ii == i and hh == h) == tier_var[h])
            # the reload must end before the first use: B{e-1} for the edge (i, e)
            for e in range(i + 1, min(self.L, i + self.E) + 1):
                early = [m.q[i, t, h] for (ii, t, h) in self.rel_idx if ii == i and t < e]
                if early:
                    self.add(sum(early) <= 1 - m.x[i, e])
            if self.use_nvme:
                self.add(m.any_nvme >= m.n[i])

    def _create_host(self) -> None:
        m, A, hw = self.m, self.A, self.hw
        bounce = 2 * max(A)
        self.add(self.fits(self.wl.host_static_bytes + sum(A[i] * m.c[i] for i in self.inner)
                           + bounce * m.any_nvme, hw.cpu_memory_bytes))
        if self.use_nvme:
            self.add(self.fits(sum(A[i] * m.n[i] for i in self.inner), hw.nvme_capacity_bytes))

    def gpu_bytes_forward(self, w: int):
        m, A, lay = self.m, self.A, self.lay
        expr = self.wl.static_gpu_bytes + A[w] + A[w + 1] + lay[w].fwd_work_bytes
        for i in range(w):
            expr += A[i] * m.g[i]
            expr += A[i] * sum(self.off(i, ww) for ww in range(w, self.L))
        for j in range(w + 1):
            expr += (lay[j].internal_bytes - A[j]) * m.k[j] + (lay[j].param_bytes + lay[j].grad_bytes) * m.r[j]
        return expr

    def gpu_bytes_head(self):
        m, A, lay, L = self.m, self.A, self.lay, self.L
        expr = self.wl.static_gpu_bytes + A[L] + self.wl.head_work_bytes
        for i in range(L):
            expr += A[i] * m.g[i] + A[i] * self.rel(i, L)
        for j in range(L):
            expr += (lay[j].internal_bytes - A[j]) * m.k[j] + (lay[j].param_bytes + lay[j].grad_bytes) * m.r[j]
        return expr

    def gpu_bytes_backward(self, u: int):
        m, A, lay, L = self.m, self.A, self.lay, self.L
        expr = self.wl.static_gpu_bytes + lay[u].bwd_work_bytes + (lay[u].internal_bytes - A[u]) * (1 - m.k[u])
        for i in range(u + 1):
            expr += A[i] * m.g[i]
            expr += A[i] * sum(self.rel(i, t) for t in range(u, L + 1))
        for (s, e) in self.edges:
            if s <= u < e and u > s:
                expr += sum(A[i] for i in range(s + 1, u + 1)) * m.x[s, e]
        for j in range(u + 1):
            expr += (lay[j].internal_bytes - A[j]) * m.k[j] + (lay[j].param_bytes + lay[j].grad_bytes) * m.r[j]
        expr += self.wl.max_param_bytes * sum(m.x[s, e] for (s, e) in self.block_into(u + 1))
        return expr

    def fits(self, nbytes, capacity: float):
        """``nbytes <= capacity`` with rows in GB: byte-sized coefficients (1e10) leave HiGHS's
        feasibility tolerance meaningless and make schedules that exactly hit the cap look
        infeasible. ``MEM_TOL`` matches the simulator's tolerance."""
        return nbytes * 1e-9 <= (capacity + MEM_TOL) * 1e-9

    def _create_gpu_memory(self) -> None:
        cap = self.hw.gpu_memory_cap_bytes
        for w in range(self.L):
            self.add(self.fits(self.gpu_bytes_forward(w), cap))
        self.add(self.fits(self.gpu_bytes_head(), cap))
        for u in range(self.L):
            self.add(self.fits(self.gpu_bytes_backward(u), cap))

    def _create_aggregate_memory(self) -> None:
        """The paper's constraint: one sum per tier (GPU-resident activations fit what is left)."""
        m, A, lay, L = self.m, self.A, self.lay, self.L
        working = max(max(l.internal_bytes + l.bwd_work_bytes for l in lay), self.wl.head_work_bytes)
        budget = self.hw.gpu_memory_cap_bytes - self.wl.static_gpu_bytes - working
        self.add(self.fits(sum(A[i] * m.g[i] for i in range(L + 1))
                           + sum((lay[j].internal_bytes - A[j]) * m.k[j]
                                 + (lay[j].param_bytes + lay[j].grad_bytes) * m.r[j] for j in range(L)), budget))

    def _create_window_times(self) -> None:
        m, A, lay, L, hw, wl = self.m, self.A, self.lay, self.L, self.hw, self.wl
        h2d, d2h = hw.h2d_bytes_per_s, hw.d2h_bytes_per_s
        nvr = hw.nvme_read_bytes_per_s or 1.0
        nvw = hw.nvme_write_bytes_per_s or 1.0
        pipelined = self.opt.pipelined_optimizer
        loads = self.lane_loads

        def bound(var, name: str, exprs: list) -> None:
            loads[name] = (var, exprs)
            for expr in exprs:
                if not isinstance(expr, (int, float)) or expr > 0:
                    self.add(var >= expr)

        for j in range(L):
            fetch = lay[j + 1].param_bytes / h2d if j + 1 < L else 0.0
            d2h_load = sum(A[i] * self.off(i, j) for i in self.inner) / d2h
            nvw_load = sum(A[i] * self.off(i, j - 1, ("n",)) for i in self.inner) / nvw if j >= 1 else 0.0
            optimizer = lay[j + 1].opt_seconds if (pipelined and j + 1 < L) else 0.0
            bound(m.tF1[j], f"tF1[{j}]", [lay[j].fwd_seconds, optimizer + fetch, d2h_load, nvw_load])
            if wl.grad_accum > 1:
                extra = lay[0].grad_bytes / d2h if j == 0 else 0.0
                bound(m.tF[j], f"tF[{j}]", [lay[j].fwd_seconds, fetch, d2h_load + extra, nvw_load])
        h2d_h = (lay[L - 1].param_bytes * (1 - m.r[L - 1]) + sum(A[i] * self.rel(i, L) for i in self.inner)) / h2d
        nvw_h = sum(A[i] * self.off(i, L - 1, ("n",)) for i in self.inner) / nvw
        nvr_h = sum(A[i] * self.rel(i, L - 1, ("n",)) for i in self.inner) / nvr
        bound(m.tH, "tH", [wl.head_seconds, h2d_h, nvw_h, nvr_h])
        for u in range(L):
            blocks = self.block_into(u + 1)
            compute = lay[u].bwd_seconds + lay[u].fwd_seconds * (1 - m.k[u])
            compute += sum(m.x[s, e] * sum(lay[j].fwd_seconds for j in range(s, u)) for (s, e) in blocks)
            h2d_b = sum(m.x[s, e] * sum(lay[j].param_bytes for j in range(s, u)) for (s, e) in blocks)
            if u >= 1:
                h2d_b += lay[u - 1].param_bytes * (1 - m.r[u - 1])
            h2d_b += sum(A[i] * self.rel(i, u) for i in self.inner)
            grads = lay[u + 1].grad_bytes / d2h if u + 1 < L else 0.0
            nvr_b = sum(A[i] * self.rel(i, u - 1, ("n",)) for i in self.inner) / nvr if u >= 1 else 0.0
            bound(m.tB[u], f"tB[{u}]", [compute, h2d_b / h2d, grads, nvr_b])
        # T has no decisions: layer 0's and the non-block grads arrive, the non-block update and its
        # fetch, layer 0's update and its fetch (behind the non-block fetch on the H2D lane)
        grads_t = (lay[0].grad_bytes + wl.nonblock_grad_bytes) / d2h
        after_nb = grads_t + wl.nonblock_opt_seconds
        tail = [after_nb + wl.nonblock_param_bytes / h2d + lay[0].param_bytes / h2d,
                after_nb + lay[0].opt_seconds + lay[0].param_bytes / h2d]
        if not pipelined:
            tail.append(after_nb + sum(l.opt_seconds for l in lay))
        bound(m.tT, "tT", tail)

    def iteration_time(self):
        m, L, g = self.m, self.L, self.wl.grad_accum
        total = m.tT + sum(m.tF1[j] for j in range(L)) + g * (m.tH + sum(m.tB[u] for u in range(L)))
        if g > 1:
            total += (g - 1) * sum(m.tF[j] for j in range(L))
        return total

    def _create_objective(self) -> None:
        pyo, m, L = self.pyo, self.m, self.L
        moves = self.EPS * sum(m.c[i] + 2 * m.n[i] for i in self.inner)
        if self.opt.time_objective:
            m.obj = pyo.Objective(expr=self.iteration_time() + moves, sense=pyo.minimize)
            return
        # LazyTrain: recompute time + activation traffic that does not hide under compute
        m.slack = pyo.Var(range(L), domain=pyo.NonNegativeReals)
        recompute = 0
        for u in range(L):
            var, exprs = self.lane_loads[f"tB[{u}]"]
            compute = exprs[0]
            recompute += compute - self.lay[u].bwd_seconds
            self.add(m.slack[u] >= exprs[1] - compute)
        m.obj = pyo.Objective(expr=recompute + sum(m.slack[u] for u in range(L)) + moves, sense=pyo.minimize)

    # ---- seeding and extraction ----------------------------------------------------------
    def seed_from(self, s: Schedule) -> None:
        """Set every variable from a schedule so HiGHS starts with an incumbent."""
        pyo, m, L = self.pyo, self.m, self.L
        for var in (m.x, m.g, m.c, m.n, m.k, m.r, m.o, m.q):
            for idx in var:
                if not var[idx].fixed:
                    var[idx].set_value(0)
        mat = s.materialised
        for a, b in zip(mat, mat[1:]):
            m.x[a, b].set_value(1)
        for i, home in enumerate(s.homes):
            for name, var in (("gpu", m.g), ("cpu", m.c), ("nvme", m.n)):
                if not var[i].fixed:
                    var[i].set_value(1 if home == name else 0)
            if home in ("cpu", "nvme"):
                h = "c" if home == "cpu" else "n"
                m.o[i, s.offload_window[i], h].set_value(1)
                m.q[i, s.reload_window[i], h].set_value(1)
        for j in range(L):
            if not m.k[j].fixed:
                m.k[j].set_value(int(s.keep_internals[j]))
            if not m.r[j].fixed:
                m.r[j].set_value(int(s.resident_weights[j]))
        if not m.any_nvme.fixed:
            m.any_nvme.set_value(int(any(h == "nvme" for h in s.homes)))
        for var, exprs in self.lane_loads.values():
            if not var.fixed:
                var.set_value(max(pyo.value(e) for e in exprs))
        if not self.opt.time_objective:
            for u in range(L):
                _, exprs = self.lane_loads[f"tB[{u}]"]
                m.slack[u].set_value(max(0.0, pyo.value(exprs[1]) - pyo.value(exprs[0])))

    def extract(self, policy: str = "milp") -> Schedule:
        pyo, m, L = self.pyo, self.m, self.L
        on = lambda v: v.value is not None and v.value > 0.5  # noqa: E731
        homes, off, rel = [], [None] * (L + 1), [None] * (L + 1)
        for i in range(L + 1):
            home = "gpu" if on(m.g[i]) else "cpu" if on(m.c[i]) else "nvme" if on(m.n[i]) else "recompute"
            homes.append(home)
        for (i, w, h) in self.off_idx:
            if on(m.o[i, w, h]):
                off[i] = w
        for (i, t, h) in self.rel_idx:
            if on(m.q[i, t, h]):
                rel[i] = t
        return Schedule(num_layers=L, homes=tuple(homes), keep_internals=tuple(on(m.k[j]) for j in range(L)),
                        resident_weights=tuple(on(m.r[j]) for j in range(L)), offload_window=tuple(off),
                        reload_window=tuple(rel), backward_prefetch=True,
                        optimizer="pipelined" if self.opt.pipelined_optimizer else "serial", policy=policy)


def in_space(s: Schedule, opt: MilpOptions) -> Schedule:
    """The nearest schedule in the MILP's space (backward prefetch on, optimizer per the options)."""
    return Schedule(num_layers=s.num_layers, homes=s.homes, keep_internals=s.keep_internals,
                    resident_weights=s.resident_weights, offload_window=s.offload_window,
                    reload_window=s.reload_window, backward_prefetch=True,
                    optimizer="pipelined" if opt.pipelined_optimizer else "serial", policy=s.policy)


def best_baseline(wl: Workload, hw: Hardware, opt: MilpOptions, K: int = 4) -> tuple[Schedule, SimResult] | None:
    """The fastest feasible baseline, mapped into the MILP's space (None if none fits)."""
    L = wl.num_layers
    candidates = [recompute_all(L), megatrain(L, min(K, opt.max_block, L))]
    if opt.keep_internals:
        candidates.append(keep_all(L))
    best = None
    for cand in candidates:
        cand = in_space(cand, opt)
        try:
            sim = simulate(cand, wl, hw)
        except InfeasibleSchedule:
            continue
        if best is None or sim.iteration_seconds < best[1].iteration_seconds:
            best = (cand, sim)
    return best


def solve(wl: Workload, hw: Hardware, options: MilpOptions | None = None, **overrides) -> SolveResult:
    """Solve for the fastest schedule. See the module docstring for the model."""
    import pyomo.environ as pyo
    from pyomo.contrib.appsi.base import TerminationCondition
    from pyomo.contrib.appsi.solvers import Highs

    opt = options or MilpOptions()
    if overrides:
        opt = MilpOptions(**{**{f: getattr(opt, f) for f in opt.__slots__}, **overrides})
    wl.validate()
    hw.validate()
    t0 = time.perf_counter()
    model = ScheduleModel(wl, hw, opt)
    seed = best_baseline(wl, hw, opt)  # the warm start (if opt.seed) and the fallback
    if seed is not None and opt.seed:
        model.seed_from(seed[0])
    build = time.perf_counter() - t0

    def run(warm: bool):
        solver = Highs()
        solver.config.mip_gap = opt.mip_gap
        solver.config.time_limit = opt.time_limit
        solver.config.load_solution = False
        solver.config.stream_solver = False
        solver.config.warmstart = warm
        if opt.threads:
            solver.highs_options = {"threads": opt.threads}
        t = time.perf_counter()
        result = solver.solve(model.m)
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
    info = {"name": "highs", "version": solver_version(), "interface": "pyomo appsi_highs",
            "warm_start": warm and not restarted}
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
                           seed_policy=seed[0].policy if seed else None, violation=violation)
    if seed is not None:
        warnings.warn(f"MILP ended with {tc.name} and no incumbent; falling back to {seed[0].policy}", stacklevel=2)
        return SolveResult(schedule=seed[0], status="fallback", objective=None, bound=bound, mip_gap=None,
                           build_seconds=build, solve_seconds=solve_s, solver=info, simulated=seed[1],
                           seed_policy=seed[0].policy)
    raise InfeasibleBudget("gpu", 0.0, f"the MILP found no schedule ({tc.name}) and no baseline fits",
                           "run lightning_lazytrain.planner.diagnose() for the shortfall")
