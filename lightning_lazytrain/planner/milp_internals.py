"""The MILP's internals-offload decision: a layer that keeps its internals may
send them (its saved tensors but its input boundary: ``internal_bytes - boundary_bytes[j]`` bytes)
to host memory over the D2H lane of a later forward window and bring them back over the H2D lane
of a backward window (or ``H``) before its own backward. ``Schedule.internals_offload_window`` /
``internals_reload_window`` carry the choice; the simulator times and counts it from the ops.

Variables (``L`` layers; ``I_j = internal_bytes[j] - A[j]``):

    f[j]      layer j's kept internals go to the host and back         f_j <= k_j
    oi[j,w]   ... by the D2H lane of F{w}, w in j+1 .. min(L-1, j + internals_offload_horizon)
    qi[j,t]   ... come back by the H2D lane of B{t}, t in j+1 .. min(L, j + internals_reload_slack),
              and H (t = L) always                                  sum_w oi = sum_t qi = f_j

Rows they enter (all linear, exact for binaries):
    host memory     + sum_j I_j f_j
    device memory   F{v}: - I_j oi[j,w] for w < v (gone after its offload window);
                    H and B{u} (u = L for H): - I_j qi[j,t] for t < u (not back yet). A kept
                    layer's term ``I_j k_j`` stays in every window ``j .. 2L-j`` as before, so
                    these are exactly the windows the simulator's lifetimes leave out.
    lane time       F{w}'s D2H load + I_j oi[j,w] / d2h; B{t}'s (H's) H2D load + I_j qi[j,t] / h2d:
                    the ops sit on their lanes behind everything else with no ``after`` and
                    nothing waits for them, so they add to the lane's total and to no chain.
    objective       + EPS f_j (a tie-break: no move that buys nothing)

With the switch off (``MilpOptions.offload_internals=False``), without kept internals, or with the
aggregate memory sum (which cannot see a window), no variable or term is created: the model is
row for row the one without this decision.
"""

from __future__ import annotations

from .errors import InvalidInput
from .schedule import Schedule


class InternalsOffload:
    """The variables and row terms of the decision, for one ``ScheduleModel``."""

    def __init__(self, model) -> None:
        pyo, m, opt, L = model.pyo, model.m, model.opt, model.L
        self.model, self.m, self.L = model, m, L
        self.nbytes = [layer.internal_bytes - a for layer, a in zip(model.lay, model.A)]
        self.enabled = opt.offload_internals and opt.keep_internals and opt.window_memory
        if opt.internals_offload_horizon < 1 or opt.internals_reload_slack < 1:
            raise InvalidInput("internals_offload_horizon/internals_reload_slack",
                               (opt.internals_offload_horizon, opt.internals_reload_slack), "must be >= 1")
        off_idx, rel_idx, layers = [], [], []
        if self.enabled:
            for j in range(L):
                offs = range(j + 1, min(L - 1, j + opt.internals_offload_horizon) + 1)
                rels = sorted(set(range(j + 1, min(L, j + opt.internals_reload_slack) + 1)) | {L})
                if not offs or self.nbytes[j] <= 0 or not model.wl.backward_runs(j):  # it keeps none
                    continue
                layers.append(j)
                off_idx += [(j, w) for w in offs]
                rel_idx += [(j, t) for t in rels]
        self.layers, self.off_idx, self.rel_idx = layers, off_idx, rel_idx
        m.f = pyo.Var(layers, domain=pyo.Binary)
        m.oi = pyo.Var(off_idx, domain=pyo.Binary)
        m.qi = pyo.Var(rel_idx, domain=pyo.Binary)
        for j in layers:
            model.add(m.f[j] <= m.k[j])
            model.add(sum(m.oi[jj, w] for (jj, w) in off_idx if jj == j) == m.f[j])
            model.add(sum(m.qi[jj, t] for (jj, t) in rel_idx if jj == j) == m.f[j])

    # ---- row terms (0 when disabled) -------------------------------------------------------------
    def host_bytes(self):
        return sum(self.nbytes[j] * self.m.f[j] for j in self.layers)

    def away_forward(self, v: int):
        """Bytes of kept internals already on the host during ``F{v}`` (offloaded before it)."""
        return sum(self.nbytes[j] * self.m.oi[j, w] for (j, w) in self.off_idx if w < v)

    def away_backward(self, u: int):
        """Bytes of kept internals still on the host during ``B{u}`` (``u = L``: ``H``): those that
        come back in a later window (``B{t}``, ``t < u``)."""
        return sum(self.nbytes[j] * self.m.qi[j, t] for (j, t) in self.rel_idx if t < u)

    def d2h_seconds(self, w: int, d2h: float):
        return sum(self.nbytes[j] * self.m.oi[j, ww] for (j, ww) in self.off_idx if ww == w) / d2h

    def h2d_seconds(self, t: int, h2d: float):
        return sum(self.nbytes[j] * self.m.qi[j, tt] for (j, tt) in self.rel_idx if tt == t) / h2d

    def hull_rows(self, a: float, window: str, index: int, bandwidth: float) -> list:
        """Rows ``tau >= a + sum (c_j - a) x_j`` over this decision's transfers ``x_j`` in one window
        whose transfer of ``c_j`` seconds exceeds ``a``, a lower bound of the window's compute
        (``window``: ``"F"`` for F{index}'s D2H, ``"B"`` for B{index}'s H2D, ``index = L``: H).

        Valid: with no such transfer it is ``tau >= a``; otherwise the lane alone takes at least
        ``sum c_j >= a + sum (c_j - a)``. At integer points it never exceeds the window's time
        (so the MILP still equals the simulator), but a fractional transfer now costs time in
        proportion: without it the LP relaxation hides ``x_j = a / c_j`` of every layer's internals
        under the compute for nothing, and its bound is weak (27B with a 64 GB/s link: 0.7% at
        60 s)."""
        idx = self.off_idx if window == "F" else self.rel_idx
        var = self.m.oi if window == "F" else self.m.qi
        terms = [(self.nbytes[j] / bandwidth - a, var[j, w]) for (j, w) in idx if w == index
                 and self.nbytes[j] / bandwidth > a]
        return [a + sum(c * x for c, x in terms)] if terms else []

    def moves(self):
        return sum(self.m.f[j] for j in self.layers)

    # ---- seeding and extraction ----------------------------------------------------------------
    def seed_from(self, s: Schedule) -> None:
        m = self.m
        for var in (m.f, m.oi, m.qi):
            for idx in var:
                var[idx].set_value(0)
        for j in s.offloaded_internals:
            w, t = s.internals_offload_window[j], s.internals_reload_window[j]
            if (j, w) not in m.oi or (j, t) not in m.qi:
                raise InvalidInput(f"schedule.internals_offload_window[{j}]", (w, t),
                                   "outside the model's space (offload_internals, internals_offload_horizon, "
                                   "internals_reload_slack)")
            m.f[j].set_value(1)
            m.oi[j, w].set_value(1)
            m.qi[j, t].set_value(1)

    def extract(self) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
        on = lambda v: v.value is not None and v.value > 0.5  # noqa: E731
        off, rel = [None] * self.L, [None] * self.L
        for (j, w) in self.off_idx:
            if on(self.m.oi[j, w]):
                off[j] = w
        for (j, t) in self.rel_idx:
            if on(self.m.qi[j, t]):
                rel[j] = t
        return tuple(off), tuple(rel)
