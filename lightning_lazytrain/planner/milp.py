"""The schedule MILP (Pyomo model, solved by HiGHS through highspy).

Symbols -> variables (``L`` layers, boundaries ``0..L``, window names as in ``schedule``):

    x[s,e]    edge of the recompute path: boundaries s < e materialised, s+1..e-1 recomputed
    g/c/n[i]  boundary i lives on the GPU / in host memory / on NVMe   (m_i = g_i + c_i + n_i)
    k[j]      layer j keeps its internals (no local recompute)          needs g_j
    r[j]      layer j's weights stay resident from F{j} to B{j}
    pipe      the optimizer is pipelined (1) or serial (0): one global binary, only when
              ``MilpOptions.optimizer_mode`` is ``auto`` (a forced mode is a constant)
    y[j]      pipelined: layer j >= 1 is updated in T instead of in F{j-1} (``Schedule.serial_layers``;
              y_j <= pipe; one rank, ``MilpOptions.serial_layers``)
    o[i,w,h]  boundary i (tier h in {c, n}) is offloaded by the D2H lane of F{w}
    q[i,t,h]  boundary i comes back by the H2D lane of B{t} (t = L: H)
    f[j], oi[j,w], qi[j,t]   layer j's kept internals go to the host by F{w}'s D2H and come back by
              B{t}'s H2D (``milp_internals``: its variables and the terms it adds to the rows below)
    tF1[j], tF[j], tH, tB[t], tT   window durations (tF1: first micro-batch, carries the optimizer)
    bwd       the pipelined optimizer updates in the backward (``Schedule.updates_in_backward``), only
              where ``Workload.updates_in_backward`` allows it; bwd <= pipe, y_j + bwd <= 1
    tBL[t]    the last micro-batch's B windows (they carry those updates) with accumulation

Constraint groups (each a named method so an ablation is one switch):
    _create_path         flow over boundaries: one path 0 -> L through the materialised ones
    _create_homes        one home per materialised boundary, k_j <= g_j, resident layers never recomputed
    _create_transfers    every offload gets one window, every reload one window before first use
    _create_host         CPU bytes (boundaries and offloaded internals) and NVMe bytes within capacity
    _create_gpu_memory   device bytes <= cap in *every* window (or, ablated, one aggregate sum)
    _create_window_times tau_w >= each lane's load in w; chains are summed: optimizer -> cast -> fetch,
                         grads D2H -> accumulate, the host lane's FIFO casts -> their fetches (and
                         the fetches' lane behind them), casts -> accumulate; in a recompute block
                         cast -> fetch -> re-run per layer, the re-runs FIFO, each cast after the
                         re-run two layers back, the prefetch after the last re-run (``milp_times``; see
                         ``schedule_windows`` and ``block_chain``: one exact constant per block edge)
    _create_objective    iteration time = T + sum tF1 + (g-1) sum tF + g (tH + sum tB) (+ tie-breaks);
                         ablated: LazyTrain's objective (recompute time + exposed transfer)
``solve.py`` runs it. The simulator re-derives everything from the returned ``Schedule``; the two agree by construction
of the timing rule, which a test checks to 1%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InvalidInput
from .hardware import Hardware
from .milp_internals import InternalsOffload
from .milp_memory import MIP_FEASIBILITY_TOLERANCE, ROW_SCALE, MemoryRows
from .milp_partial import PartialKeep
from .milp_solution import SolutionIO
from .milp_times import WindowTimes
from .workload import Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class MilpOptions:
    """Switches (each can be turned off for ablation) and solver settings."""

    window_memory: bool = True  # per-window device peak; False: one aggregate sum per tier (the paper)
    time_objective: bool = True  # iteration time; False: LazyTrain's recompute + exposure objective
    pipelined_optimizer: bool = True  # False: serial optimizer only (the ablation); True: the mode is optimizer_mode's
    optimizer_mode: str = "auto"  # auto: the MILP chooses serial or pipelined; serial | pipelined: forced
    serial_layers: bool = False  # pipelined: the MILP may update chosen layers in T (the per-layer mode); off by
    # default: with it a 7B batch-8 solve on a 24 GB card ran into the 60 s limit (2 s without; bench/RESULTS.md)
    keep_internals: bool = True
    resident_weights: bool = True
    nvme: bool = True
    offload_internals: bool = True  # a kept layer's internals may go to host memory and back (milp_internals)
    partial_keep: bool = False  # a layer may keep only its matmul outputs (milp_partial; engine/partial_keep.py);
    # off by default: small gains at the shipped profiles for a 2-3x longer solve (bench/RESULTS.md, "Partial keep")
    max_block: int = 8  # longest recompute block (edge length cap)
    reload_slack: int = 2  # reload at most this many windows before the earliest legal one... and later
    offload_horizon: int = 1  # offload within this many forward windows of the boundary's production
    internals_offload_horizon: int = 2  # layer j's internals leave in F{j+1} .. F{j+this}
    internals_reload_slack: int = 2  # ... and come back in B{j+1} .. B{j+this}, or in H
    mip_gap: float = 1e-3
    time_limit: float = 60.0
    threads: int | None = None
    seed: bool = True  # warm-start HiGHS from the best feasible baseline (see solve())
    # where the dtype conversions run (placement.py, Note: [conversion placement]): "plan" (the plan
    # chooses per parameter group class), "host" (all on the host) or "device" (all on the device)
    conversions: str = "plan"
    # HiGHS runs in a process of its own under a wall-clock guard (solver_process.py, Note: [the solver's
    # process]); False: in this process, with nothing to stop a solve that hangs
    solver_process: bool = True

    def optimizer_modes(self) -> tuple[str, ...]:
        """The optimizer modes the MILP may choose from: ``("serial", "pipelined")`` for ``auto``, else
        one. ``pipelined_optimizer=False`` (the older switch) forbids ``pipelined``. With the paper's
        objective (``time_objective=False``), which cannot see the optimizer, ``auto`` is ``pipelined``."""
        mode = self.optimizer_mode
        if mode not in ("auto", "serial", "pipelined"):
            raise InvalidInput("optimizer_mode", mode, "must be 'auto', 'serial' or 'pipelined'")
        if not self.pipelined_optimizer:
            if mode == "pipelined":
                raise InvalidInput("optimizer_mode", mode, "contradicts pipelined_optimizer=False (serial only)")
            return ("serial",)
        if mode == "auto":
            return ("serial", "pipelined") if self.time_objective else ("pipelined",)
        return (mode,)


class ScheduleModel(MemoryRows, WindowTimes, SolutionIO):
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
        self.dp = wl.data_parallel  # several ranks: the collectives Schedule.windows() adds (see multi.py)
        if self.dp == "replicate_overlap" and wl.grad_accum > 1:
            raise InvalidInput("workload.grad_accum", wl.grad_accum, "replicate_overlap all-reduces in the last "
                               "micro-batch's B windows only; the MILP models it for grad_accum = 1 (simulate it)")
        # per layer: seconds over this rank's host link (link_fraction of the bytes; 1 on one GPU), and the
        # collective lane's all-gather / reduce-scatter / host all-reduce (0 on one GPU); index L: none
        self.p_s = [l.param_bytes * l.link_fraction * l.param_widen / hw.h2d_bytes_per_s for l in wl.layers] + [0.0]
        self.g_s = [l.grad_bytes * l.link_fraction * l.grad_widen / hw.d2h_bytes_per_s for l in wl.layers] + [0.0]
        shard, overlap = self.dp == "shard", self.dp == "replicate_overlap"
        self.gth = [l.gather_seconds if shard else 0.0 for l in wl.layers] + [0.0]
        self.rs = [l.reduce_seconds if shard else 0.0 for l in wl.layers] + [0.0]
        self.ar = [l.allreduce_seconds if overlap else 0.0 for l in wl.layers] + [0.0]  # in B; replicate: in T
        # a resident layer's device buffers: its weights and, if it runs a backward, its gradient buffer (the
        # whole group's; Note: [layers without a backward] in workload.py)
        self.resident_grads = [l.grad_buffer_bytes if wl.backward_runs(j) else 0.0 for j, l in enumerate(wl.layers)]
        self.resident_bytes = [l.param_bytes + g for l, g in zip(wl.layers, self.resident_grads)]
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
        self.modes = opt.optimizer_modes()
        if len(self.modes) > 1:
            m.pipe = pyo.Var(domain=pyo.Binary)
            self.pipe = m.pipe  # pipelined: 1
        else:
            self.pipe = 1 if self.modes == ("pipelined",) else 0
        self.y: dict[int, Any] = {}  # per-layer mode (Schedule.serial_layers): layer -> y_j
        # Note: [updates in the backward pass]: where the run allows it, one binary chooses whether a pipelined
        # optimizer updates layer t+1 in B{t} (bwd = 1) or in F{t} / T as above (bwd <= pipe)
        self.in_backward = wl.updates_in_backward and wl.data_parallel == "none" and "pipelined" in self.modes
        self.bwd: Any = 0
        if self.in_backward:
            m.bwd = pyo.Var(domain=pyo.Binary)
            self.bwd = m.bwd
            if len(self.modes) > 1:
                m.bwd_pipe = pyo.Constraint(expr=m.bwd <= m.pipe)
        if "pipelined" in self.modes and opt.serial_layers and wl.data_parallel == "none" and L > 1:
            # Only where it can pay: moving layer j's update into T shortens nothing unless F{j-1}'s
            # chain update -> cast -> fetch is longer than that window's forward (else its window is
            # the forward either way, and T can only grow); the other binaries would only weaken the
            # relaxation (a batch search solved 9x slower with one per layer).
            lw = wl.layers
            cand = [j for j in range(1, L)
                    if lw[j].opt_seconds + lw[j].cast_seconds + self.p_s[j] > lw[j - 1].fwd_seconds * (1 + 1e-9)]
            if cand:
                m.y = pyo.Var(cand, domain=pyo.Binary)
                self.y = {j: m.y[j] for j in cand}
                if len(self.modes) > 1:
                    m.y_pipe = pyo.Constraint(cand, rule=lambda _, j: m.y[j] <= m.pipe)
                if self.in_backward:  # serial layers and updates in the backward exclude each other
                    m.y_bwd = pyo.Constraint(cand, rule=lambda _, j: m.y[j] + m.bwd <= 1)
        m.tF1 = pyo.Var(range(L), domain=pyo.NonNegativeReals)
        m.tF = pyo.Var(range(L), domain=pyo.NonNegativeReals)
        m.tH = pyo.Var(domain=pyo.NonNegativeReals)
        m.tB = pyo.Var(range(L), domain=pyo.NonNegativeReals)
        if self.in_backward and wl.grad_accum > 1:  # the last micro-batch's B windows carry the updates
            m.tBL = pyo.Var(range(L), domain=pyo.NonNegativeReals)
        m.tT = pyo.Var(domain=pyo.NonNegativeReals)
        m.cons = pyo.ConstraintList()
        self.lane_loads: dict[str, list] = {}  # window var name -> list of expressions (for seeding)
        self._fix_trivial()
        self.internals = InternalsOffload(self)  # its variables and the k -> f rows
        self.partial = PartialKeep(self)  # its variables and the p + k <= g rows
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
            if not self.opt.keep_internals or not self.wl.backward_runs(j):  # Note: [layers without a backward]
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

    def iteration_time(self):
        m, L, g = self.m, self.L, self.wl.grad_accum
        total = m.tT + sum(m.tF1[j] for j in range(L)) + g * m.tH
        if hasattr(m, "tBL"):  # Note: [updates in the backward pass]: the last micro-batch's B windows
            total += (g - 1) * sum(m.tB[u] for u in range(L)) + sum(m.tBL[u] for u in range(L))
        else:
            total += g * sum(m.tB[u] for u in range(L))
        if g > 1:
            total += (g - 1) * sum(m.tF[j] for j in range(L))
        return total

    def _create_objective(self) -> None:
        pyo, m, L = self.pyo, self.m, self.L
        moves = self.EPS * (sum(m.c[i] + 2 * m.n[i] for i in self.inner) + self.internals.moves()
                            + sum(self.y.values()))  # a layer goes to T only when that gains time
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


__all__ = ["MIP_FEASIBILITY_TOLERANCE", "ROW_SCALE", "MilpOptions", "ScheduleModel"]
