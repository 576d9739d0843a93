"""The schedule MILP's window-time rows: each window's duration variable (``tF1 tF tH tB tBL tT``) bounds
every lane's load in that window and every chain of dependent ops, exactly as ``Schedule.windows()`` issues
them (``schedule_windows``) and the simulator times them; ``block_chain`` gives a recompute block's chain as one
constant per block edge, and T's rows are the simulator's own timing of T per optimizer mode. A mixin of
``milp.ScheduleModel`` (its variables, lane costs ``p_s g_s gth rs ar``, ``internals`` and ``partial`` terms);
the rows are kept in ``lane_loads`` for the seed and the LazyTrain objective.
"""

from __future__ import annotations

import dataclasses


class WindowTimes:
    """The window-time rows of ``ScheduleModel`` (``_create_window_times`` and its chains)."""

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
        """Times (from the window's start) of recompute block ``(s, u+1)`` in ``B{u}``, as ``schedule_windows``
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
