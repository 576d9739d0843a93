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
                         re-run two layers back, the prefetch after the last re-run (see
                         ``schedule`` and ``block_chain``: one exact constant per block edge)
    _create_objective    iteration time = T + sum tF1 + (g-1) sum tF + g (tH + sum tB) (+ tie-breaks);
                         ablated: LazyTrain's objective (recompute time + exposed transfer)
``solve.py`` runs it. The simulator re-derives everything from the returned ``Schedule``; the two agree by construction
of the timing rule, which a test checks to 1%.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import InvalidInput
from .hardware import Hardware
from .milp_internals import InternalsOffload
from .milp_memory import MIP_FEASIBILITY_TOLERANCE, ROW_SCALE, MemoryRows
from .milp_partial import PartialKeep
from .milp_solution import SolutionIO
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


class ScheduleModel(MemoryRows, SolutionIO):
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

    def _create_window_times(self) -> None:
        m, A, lay, L, hw, wl = self.m, self.A, self.lay, self.L, self.hw, self.wl
        h2d, d2h = hw.h2d_bytes_per_s, hw.d2h_bytes_per_s
        nvr = hw.nvme_read_bytes_per_s or 1.0
        nvw = hw.nvme_write_bytes_per_s or 1.0
        pipe = self.pipe  # 1 / 0 for a forced mode, the binary m.pipe for auto
        loads = self.lane_loads
        cast = [l.cast_seconds for l in lay] + [0.0]  # host lane; cast[L] = 0 (no layer L to fetch)
        acc = [l.accum_seconds for l in lay] + [0.0]

        def bound(var, name: str, exprs: list) -> None:
            loads[name] = (var, exprs)
            for expr in exprs:
                if not isinstance(expr, (int, float)) or expr > 0:
                    self.add(var >= expr)

        gth, rs, ar = self.gth, self.rs, self.ar
        for j in range(L):
            fetch = self.p_s[j + 1] if j + 1 < L else 0.0
            d2h_load = sum(A[i] * self.off(i, j) for i in self.inner) / d2h + self.internals.d2h_seconds(j, d2h)
            nvw_load = sum(A[i] * self.off(i, j - 1, ("n",)) for i in self.inner) / nvw if j >= 1 else 0.0
            optimizer = lay[j + 1].opt_seconds * (pipe - self.y.get(j + 1, 0) - self.bwd) if j + 1 < L else 0.0
            # chain: optimizer (pipelined only) -> cast -> fetch of layer j + 1
            chain = optimizer + cast[j + 1] + fetch
            if gth[j + 1]:  # shard: the all-gather follows the fetch
                chain = chain + gth[j + 1]
            hull = self.internals.hull_rows(lay[j].fwd_seconds, "F", j, d2h)
            bound(m.tF1[j], f"tF1[{j}]", [lay[j].fwd_seconds, chain, d2h_load, nvw_load] + hull)
            if wl.grad_accum > 1:
                exprs = [lay[j].fwd_seconds, cast[j + 1] + fetch + gth[j + 1] if gth[j + 1] else cast[j + 1] + fetch,
                         d2h_load, nvw_load]
                if j == 0:  # layer 0's grads of the previous micro-batch, accumulated after the cast
                    g0 = self.g_s[0] + rs[0] if rs[0] else self.g_s[0]  # shard: behind its reduce-scatter
                    exprs[2] = d2h_load + g0
                    if acc[0]:
                        exprs += [g0 + acc[0], cast[1] + acc[0]]
                    if rs[0] and gth[1]:  # the all-gather of layer 1 queues behind the reduce-scatter
                        exprs.append(rs[0] + gth[1])
                bound(m.tF[j], f"tF[{j}]", exprs + hull)
        # H fetches layer L-1 again, but not one without a backward (Note: [layers without a backward])
        top = 1.0 if L == 1 or wl.backward_runs(L - 1) else 0.0
        if self.dp == "none":
            h2d_h = (top * lay[L - 1].param_bytes * lay[L - 1].param_widen * (1 - m.r[L - 1])
                     + sum(A[i] * self.rel(i, L) for i in self.inner)) / h2d
        else:
            h2d_h = top * self.p_s[L - 1] * (1 - m.r[L - 1]) + sum(A[i] * self.rel(i, L) for i in self.inner) / h2d
        h2d_h += self.internals.h2d_seconds(L, h2d)  # behind the boundary reloads
        recast = top * wl.recast_seconds(L - 1)  # H's fetch of layer L-1 is its second in the micro-batch
        if recast:
            h2d_h += recast * (1 - m.r[L - 1])  # the fetch, and the reloads behind it, wait for its cast
        nvw_h = sum(A[i] * self.off(i, L - 1, ("n",)) for i in self.inner) / nvw
        nvr_h = sum(A[i] * self.rel(i, L - 1, ("n",)) for i in self.inner) / nvr
        h_rows = [wl.head_seconds, h2d_h, nvw_h, nvr_h]
        if gth[L - 1] and top:  # shard: cast -> fetch -> all-gather of layer L-1
            h_rows.append((recast + self.p_s[L - 1] + gth[L - 1]) * (1 - m.r[L - 1]))
        bound(m.tH, "tH", h_rows + self.internals.hull_rows(wl.head_seconds, "B", L, h2d))
        runs = wl.backward_runs
        for u in range(L):
            # Note: [layers without a backward]: B{u} of such a layer computes and re-runs nothing
            blocks = self.block_into(u + 1) if runs(u) else []
            # after the block's re-runs; a partial keep's elementwise recompute replaces the local one
            tail = (lay[u].bwd_seconds + lay[u].fwd_seconds * (1 - m.k[u]) + self.partial.recompute_seconds(u)
                    if runs(u) else 0.0)
            compute = tail + sum(m.x[s, e] * sum(lay[j].fwd_seconds for j in range(s, u)) for (s, e) in blocks)
            reloads = sum(A[i] * self.rel(i, u) for i in self.inner) / h2d + self.internals.h2d_seconds(u, h2d)
            grads = self.g_s[u + 1] if u + 1 < L else 0.0
            if rs[u + 1]:  # shard: the gradient D2H waits for the reduce-scatter, first on the collective lane
                grads = rs[u + 1] + grads
            # ... of a layer without a backward only where it is resident (Schedule.windows)
            sent = 1 if u + 1 >= L or runs(u + 1) else m.r[u + 1]
            grads, acc_u, ar_u = grads * sent, acc[u + 1] * sent, ar[u + 1] * sent
            nvr_b = sum(A[i] * self.rel(i, u - 1, ("n",)) for i in self.inner) / nvr if u >= 1 else 0.0
            # updates in the backward: layer u+1's update follows its accumulate in the last micro-batch's
            # B{u} (its own window variable tBL with accumulation; tB is then the other micro-batches')
            upd = lay[u + 1].opt_seconds * self.bwd if self.in_backward and u + 1 < L and runs(u + 1) else 0.0
            # and the early non-block parts at the end of the last micro-batch's first B window
            early = self._early_rows if u == L - 1 else (lambda cast_end: [])
            windows = ([(m.tB[u], f"tB[{u}]", 0.0, False), (m.tBL[u], f"tBL[{u}]", upd, True)] if hasattr(m, "tBL")
                       else [(m.tB[u], f"tB[{u}]", upd, True)])
            if u == 0:  # no prefetch, no block
                for var, name, up, last in windows:
                    rows = [compute, reloads, grads + acc_u + up, nvr_b] + (early(0.0) if last else [])
                    if ar[u + 1]:  # replicate_overlap: the host all-reduce after the accumulate
                        rows.append(grads + acc_u + ar_u)
                    bound(var, name, rows)
                continue
            fetched, cast_end, gathered = self._b_chains(u, h2d)
            for var, name, up, last in windows:
                exprs = [compute, fetched + reloads, grads + acc_u + up, nvr_b] + gathered
                if last:
                    exprs += early(cast_end)
                for (s, e) in blocks:  # the re-runs wait for their weights: the compute lane's end, one row
                    # per edge (one summed row, sum x * end, left HiGHS 1.16 stuck before presolve: 28 layers)
                    exprs.append(tail + m.x[s, e] * self.block_chain(s, u, h2d)[2])
                if acc[u + 1] or (last and self.in_backward and u + 1 < L and runs(u + 1)):
                    # the accumulate queues behind the window's casts, and layer u+1's update in the backward
                    # behind it, even an accumulate of 0 s (a measured workload's): the host lane is in order
                    exprs.append(cast_end + acc_u + up)
                if ar[u + 1]:
                    exprs += [grads + acc_u + ar_u, cast_end + acc_u + ar_u]
                bound(var, name, exprs + self.internals.hull_rows(lay[u].bwd_seconds if runs(u) else 0.0, "B", u, h2d))
        bound(m.tT, "tT", self._t_window())

    def _early_rows(self, cast_end) -> list:
        """Note: [early non-block parts] (engine/early_parts.py): with the updates in the backward (``bwd``),
        the last micro-batch's ``B{L-1}`` ends with each early part's gradient D2H (the D2H lane is
        otherwise idle there), its host accumulate (FIFO, after the window's casts, which end at
        ``cast_end``) and its update (CPU lane, after the accumulate; ``Schedule.windows``). The lanes'
        end as rows, exact for a binary ``bwd``: the CPU lane's end is the longest of the paths that
        enter the host lane at part k0 (after its D2H, or after the casts) and the CPU lane at part k."""
        from .schedule import Op
        from .simulator import op_cost

        parts = self.wl.backward_parts(True) if self.in_backward else ()
        if not parts:
            return []
        cost = lambda lane, kind, p: op_cost(Op(lane, kind, -1 - p), self.wl, self.hw)[0]  # noqa: E731
        d2h = [cost("d2h", "grads", p) for p in parts]
        acc = [cost("host", "accumulate", p) for p in parts]
        upd = [cost("cpu", "optimizer", p) for p in parts]
        rows = []
        for k in range(len(parts)):
            tail = sum(upd[k:])
            rows.append(cast_end + (sum(acc[:k + 1]) + tail) * self.bwd)
            for k0 in range(k + 1):
                rows.append((sum(d2h[:k0 + 1]) + sum(acc[k0:k + 1]) + tail) * self.bwd)
        return rows

    def block_chain(self, s: int, u: int, h2d: float) -> tuple[float, float, float, float, float, float]:
        """Times (from the window's start) of recompute block ``(s, u+1)`` in ``B{u}``, as ``schedule``
        orders it: (end of the block's casts, of its fetches, of its re-runs, of the prefetch of
        ``u-1``'s cast, of that prefetch).

        Per layer j = s..u-1: cast j (host, FIFO; after the re-run of j-2, whose buffer it reuses),
        fetch j (H2D, FIFO; after cast j), re-run j (compute, FIFO; after fetch j). Without the
        buffer waits this is the three-stage flow-shop makespan ``max over a <= b of c[s..a] +
        p[a..b] + f[b..u-1]``; with them, the longest path of the same max-plus recurrence. The
        prefetch of ``u-1`` casts after the last re-run (the spare buffer), then fetches.

        Shard: a fourth stage, the all-gather after each fetch (collective lane, FIFO, starting after
        the reduce-scatter of layer ``u+1``); each re-run waits for its gather. The sixth value is the
        end of the prefetch's gather (= the prefetch's end without sharding)."""
        lay, gth = self.lay, self.gth
        cast_end = fetch_end = run_end = 0.0
        coll = self.rs[u + 1] if self.dp == "shard" else 0.0
        runs: dict[int, float] = {}
        for j in range(s, u):
            cast_end = max(cast_end, runs.get(j - 2, 0.0)) + self.wl.recast_seconds(j)
            fetch_end = max(fetch_end, cast_end) + self.p_s[j]
            ready = fetch_end
            if self.dp == "shard":
                coll = max(coll, fetch_end) + gth[j]
                ready = coll
            run_end = max(run_end, ready) + lay[j].fwd_seconds
            runs[j] = run_end
        if u - 1 != 0 and not self.wl.backward_runs(u - 1):  # no prefetch (Note: [layers without a backward])
            return cast_end, fetch_end, run_end, cast_end, fetch_end, coll if self.dp == "shard" else fetch_end
        pre_cast = max(cast_end, run_end) + self.wl.recast_seconds(u - 1)
        pre_fetch = max(fetch_end, pre_cast) + self.p_s[u - 1]
        pre_gather = max(coll, pre_fetch) + gth[u - 1] if self.dp == "shard" else pre_fetch
        return cast_end, fetch_end, run_end, pre_cast, pre_fetch, pre_gather

    def _b_chains(self, u: int, h2d: float):
        """B{u} (u >= 1): (end of the H2D lane's weight fetches, end of the host lane's casts), linear
        in the decisions; the block's re-runs are bounded per edge in ``_create_window_times``.

        Without a block: the prefetch of ``u-1``, ``(c + p)[u-1] (1 - r[u-1])``, its cast ``c[u-1]
        (1 - r[u-1])``. With block ``(s, u+1)`` (``x[s,u+1] = 1``): the constants of ``block_chain``.
        At most one block ends at ``u + 1`` and it forces ``r[u-1] = 0``, so the sums below are
        exact (each coefficient is >= 0, and only nonzero ones are added)."""
        m = self.m
        # Note: [layers without a backward]: no prefetch of such a layer (but layer 0), no block ending in B{u}
        refetch = u - 1 == 0 or self.wl.backward_runs(u - 1)
        c, p = (self.wl.recast_seconds(u - 1), self.p_s[u - 1]) if refetch else (0.0, 0.0)
        fetched = (c + p) * (1 - m.r[u - 1]) if c + p else 0
        cast_end = c * (1 - m.r[u - 1]) if c else 0
        # shard: the prefetch's all-gather ends at max(its fetch, the reduce-scatter) + gather: two rows
        # (no reduce-scatter of layer u+1 if it has no backward: its gradients are sent only where it is
        # resident, and then the gradient row bounds the lane; every schedule checked, test_planner_no_backward)
        g = self.gth[u - 1] if refetch else 0.0
        rs = self.rs[u + 1] if u + 1 >= self.L or self.wl.backward_runs(u + 1) else 0.0
        gathered = [] if self.dp != "shard" else [(c + p + g) * (1 - m.r[u - 1]), (rs + g) * (1 - m.r[u - 1])]
        for (s, e) in (self.block_into(u + 1) if self.wl.backward_runs(u) else []):
            _, _, _, pre_cast, pre_fetch, pre_gather = self.block_chain(s, u, h2d)
            if pre_fetch - c - p:
                fetched += m.x[s, e] * (pre_fetch - c - p)
            if pre_cast - c:
                cast_end += m.x[s, e] * (pre_cast - c)
            if gathered:
                gathered[0] += m.x[s, e] * (pre_gather - c - p - g)
                gathered[1] += m.x[s, e] * (pre_gather - rs - g)
        return fetched, cast_end, gathered

    def _t_window(self) -> list:
        """T's only decision is the optimizer mode: layer 0's and the non-block grads arrive and are
        accumulated (host, FIFO; the non-block group in ``Workload.nonblock_part_count`` parts), the
        non-block update (then layer 0's; serial: every layer's) runs, each updated group is cast and
        fetched. T holds no other decision, so its length in each mode is a constant, taken from the
        simulator's own timing of ``Schedule.windows()``'s T (exact, for one rank or several); with
        both modes open the rows are gated by ``pipe`` (exact for a binary). With the updates in the
        backward (``bwd``) a third constant: T without the early parts' accumulates and updates
        (``Workload.backward_parts``; they run in ``B{L-1}``, ``_early_rows``)."""
        from .policies import recompute_all
        from .simulator import _run_window

        ends, cpu_end = {}, {}
        modes = [*self.modes, *(["in_backward"] if self.in_backward else [])]
        for mode in modes:
            s = dataclasses.replace(recompute_all(self.L), optimizer="pipelined" if mode == "in_backward" else mode,
                                    data_parallel=self.dp)
            t = s.windows(nonblock_parts=self.wl.nonblock_part_count, updates_in_backward=mode == "in_backward",
                          early_parts=self.wl.backward_parts(mode == "in_backward"))[-1]
            segments: list = []
            ends[mode], _ = _run_window(t, 0.0, self.wl, self.hw, segments, {})
            cpu_end[mode] = max((g.end for g in segments if g.lane == "cpu"), default=0.0)
        pipe = self.pipe
        rows = ([ends["pipelined"] * (self.m.pipe - self.bwd), ends["serial"] * (1 - self.m.pipe)]
                if len(self.modes) > 1 else [ends[self.modes[0]] * ((1 - self.bwd) if self.modes == ("pipelined",) else 1)])
        if self.in_backward:  # T without the early parts' updates (Note: [early non-block parts])
            rows.append(ends["in_backward"] * self.bwd)
        if self.y:  # the serial layers' updates follow layer 0's on the CPU lane; nothing waits for them
            # (a serial layer excludes the updates in the backward, whose T has the early parts' updates
            # elsewhere: its own CPU lane's end, gated by bwd)
            on_t = (cpu_end["pipelined"] * (pipe - self.bwd) + cpu_end["in_backward"] * self.bwd if self.in_backward
                    else cpu_end["pipelined"] * pipe)
            rows.append(on_t + sum(self.lay[j].opt_seconds * y for j, y in self.y.items()))
        return rows

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
