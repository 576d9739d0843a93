"""The schedule MILP's memory rows: host and NVMe bytes within capacity, device bytes within the cap in every
window (or, ablated, one aggregate sum per tier: the paper's constraint). A mixin of ``milp.ScheduleModel``
(its variables ``g c n k r o q x``, ``internals`` and ``partial`` terms); each expression mirrors the
simulator's ``window_memory`` / ``host_bytes`` for the schedule the variables describe.
"""

from __future__ import annotations

from .simulator import MEM_TOL
from .workload import host_page_bytes

# Note: [memory rows and the solver's tolerance]
# HiGHS accepts a MIP solution whose rows are violated by up to its ``mip_feasibility_tolerance`` (1e-6,
# pinned in solve.py), in the row's own units. The memory rows are scaled (``row_scale``): in GB where the
# capacity is 10 MB or more -- byte-sized coefficients (1e10) would leave the tolerance meaningless -- so
# the slack is at most 1e-6 GB = 1000 bytes, inside the simulator's ``MEM_TOL`` (1024 bytes); in units of
# 100 times the capacity below that, so the slack is at most 1e-4 of the capacity. The rows hold the capacity
# itself, ``MEM_TOL`` not added (with both, a solution 2 kB over the cap passed the solver and the
# simulator then refused it: a CPU budget of 142 kB, window B2 at 143 kB; .ci/run on 2026-12-05). At a
# kB-sized budget 1000 bytes is a large share of it: in GB rows a solve at a 9 kB cap took 440 B over it
# (the objective then 1.3% off the simulated time) and another, at 11 kB, stopped "optimal" 5% slower
# than a schedule that fits (review 7, tests/test_review7_milp_fuzz.py); hence the scale per row.
ROW_SCALE = 1e-9
MIP_FEASIBILITY_TOLERANCE = 1e-6
assert MIP_FEASIBILITY_TOLERANCE / ROW_SCALE < MEM_TOL


def row_scale(capacity: float) -> float:
    """Bytes -> the units of a memory row against ``capacity`` (Note: [memory rows and the solver's tolerance])."""
    return max(ROW_SCALE, 1e-2 / capacity) if capacity > 0 else ROW_SCALE


class MemoryRows:
    """The memory rows of ``ScheduleModel`` (Note: [memory rows and the solver's tolerance])."""

    def host_bytes(self):
        """Host bytes (the simulator's ``host_bytes``): static, cpu boundaries, NVMe staging, moved internals."""
        m, A = self.m, [host_page_bytes(a) for a in self.A]  # host buffers are whole pages
        return (self.wl.host_static_bytes + sum(A[i] * m.c[i] for i in self.inner) + 2 * max(A) * m.any_nvme
                + self.internals.host_bytes())

    def _create_host(self) -> None:
        m, A, hw = self.m, self.A, self.hw
        self.add(self.fits(self.host_bytes(), hw.cpu_memory_bytes))
        if self.use_nvme:
            self.add(self.fits(sum(A[i] * m.n[i] for i in self.inner), hw.nvme_capacity_bytes))

    def gpu_bytes_forward(self, w: int):
        m, A, lay = self.m, self.A, self.lay
        expr = self.wl.static_gpu_bytes + A[w] + A[w + 1] + lay[w].fwd_work_bytes
        for i in range(w):
            expr += A[i] * m.g[i]
            expr += A[i] * sum(self.off(i, ww) for ww in range(w, self.L))
        for j in range(w + 1):
            expr += (lay[j].internal_bytes - A[j]) * m.k[j] + self.resident_bytes[j] * m.r[j]
        if w + 1 < self.L:  # a resident layer's buffer exists from its fetch, one window early
            expr += lay[w + 1].param_bytes * m.r[w + 1]
        return expr - self.internals.away_forward(w) + self.partial.held(w)

    def gpu_bytes_head(self):
        m, A, lay, L = self.m, self.A, self.lay, self.L
        expr = self.wl.static_gpu_bytes + A[L] + self.wl.head_work_bytes
        for i in range(L):
            expr += A[i] * m.g[i] + A[i] * self.rel(i, L)
        for j in range(L):
            expr += (lay[j].internal_bytes - A[j]) * m.k[j] + self.resident_bytes[j] * m.r[j]
        return expr - self.internals.away_backward(L) + self.partial.held(L)

    def gpu_bytes_backward(self, u: int):
        m, A, lay, L, runs = self.m, self.A, self.lay, self.L, self.wl.backward_runs
        expr = self.wl.static_gpu_bytes
        if runs(u):  # Note: [layers without a backward]: no backward work, no recompute
            expr += lay[u].bwd_work_bytes + (lay[u].internal_bytes - A[u]) * (1 - m.k[u])
            expr += self.partial.recompute_bytes(u)
        for i in range(u + 1):
            expr += A[i] * m.g[i]
            expr += A[i] * sum(self.rel(i, t) for t in range(u, L + 1))
        for (s, e) in self.edges:  # the re-run boundaries of a block, if it was re-run
            if s <= u < e and u > s and runs(e - 1):
                expr += sum(A[i] for i in range(s + 1, u + 1)) * m.x[s, e]
        for j in range(u + 1):
            expr += (lay[j].internal_bytes - A[j]) * m.k[j] + self.resident_bytes[j] * m.r[j]
        if u + 1 < L:  # a resident layer's gradients until their D2H, one window after its backward
            expr += self.resident_grads[u + 1] * m.r[u + 1]
        if runs(u):
            expr += self.wl.max_param_bytes * sum(m.x[s, e] for (s, e) in self.block_into(u + 1))
        return expr - self.internals.away_backward(u) + self.partial.held(u)

    def fits(self, nbytes, capacity: float):
        """``nbytes <= capacity``, scaled (Note: [memory rows and the solver's tolerance])."""
        scale = row_scale(capacity)
        return nbytes * scale <= capacity * scale

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
                                 + self.resident_bytes[j] * m.r[j] for j in range(L)), budget))
