"""The MILP's partial-keep decision: a layer's forward keeps only the outputs of
its matmul-class ops (``LayerWork.partial_bytes``, from ``F{j}`` to ``B{j}``) and ``B{j}`` re-runs
only its elementwise ops (``partial_seconds``) instead of the whole layer (``fwd_seconds``).
``Schedule.partial_keep`` carries the choice; the simulator times and counts it from the ops.

Variables (``L`` layers; ``P_j = partial_bytes[j]``, ``e_j = partial_seconds[j]``):

    p[j]      layer j keeps its matmul outputs                  p_j + k_j <= g_j
              (exclusive with a full keep; its input boundary lives on the GPU)

Rows they enter (all linear, exact for binaries):
    device memory   F{w} (j <= w), H (every j), B{u} (j <= u): + P_j p_j -- the windows
                    ``j .. 2L-j`` of the simulator's lifetime. In B{u} the recompute re-materialises
                    the saved tensors that are not kept outputs, ``R_u = partial_recompute_bytes[u]``,
                    in place of the local recompute's: + (R_u - (internal_bytes - A_u)) p_u (the local
                    term ``(internal_bytes - A_u)(1 - k_u)`` stays).
    window time     B{u}'s compute lane: ``fwd_u (1 - k_u)`` becomes ``fwd_u (1 - k_u - p_u) + e_u p_u``
                    (the partial recompute sits where the local recompute would, same ``after``).

A layer whose ``partial_bytes`` is 0 (unknown: a measured workload without the figure) gets no
variable. With the switch off (``MilpOptions.partial_keep=False``), with ``keep_internals`` off or
with the aggregate memory sum (which cannot see a window), no variable or term is created: the
model is row for row the one without this decision.
"""

from __future__ import annotations

from .schedule import Schedule


class PartialKeep:
    """The variables and row terms of the decision, for one ``ScheduleModel``."""

    def __init__(self, model) -> None:
        pyo, m, opt, L = model.pyo, model.m, model.opt, model.L
        self.model, self.m, self.L = model, m, L
        self.nbytes = [layer.partial_bytes for layer in model.lay]
        self.enabled = opt.partial_keep and opt.keep_internals and opt.window_memory
        self.layers = [j for j in range(L) if self.enabled and self.nbytes[j] > 0 and model.wl.backward_runs(j)]
        m.p = pyo.Var(self.layers, domain=pyo.Binary)
        for j in self.layers:
            model.add(m.p[j] + m.k[j] <= m.g[j])

    # ---- row terms (0 when disabled) -------------------------------------------------------------
    def held(self, upto: int):
        """Partial bytes of layers ``0 .. upto`` (F{upto} and B{upto} hold them)."""
        return sum(self.nbytes[j] * self.m.p[j] for j in self.layers if j <= upto)

    def recompute_bytes(self, u: int):
        """B{u}'s memory change against a local recompute: ``(R_u - (internal_bytes - A_u)) p_u``."""
        if u not in self.layers:
            return 0
        lay = self.model.lay[u]
        return (lay.partial_recompute_bytes - (lay.internal_bytes - self.model.A[u])) * self.m.p[u]

    def recompute_seconds(self, u: int):
        """B{u}'s compute-lane change against a local recompute: ``(e_u - fwd_u) p_u``."""
        if u not in self.layers:
            return 0
        return (self.model.lay[u].partial_seconds - self.model.lay[u].fwd_seconds) * self.m.p[u]

    # ---- seeding and extraction ----------------------------------------------------------------
    def seed_from(self, s: Schedule) -> None:
        from .errors import InvalidInput

        for j in self.layers:
            self.m.p[j].set_value(0)
        for j in s.partial_layers:
            if j not in self.layers:
                raise InvalidInput(f"schedule.partial_keep[{j}]", True,
                                   "outside the model's space (partial_keep off, or no partial_bytes for the layer)")
            self.m.p[j].set_value(1)

    def extract(self) -> tuple[bool, ...]:
        return tuple(j in self.layers and self.m.p[j].value is not None and self.m.p[j].value > 0.5
                     for j in range(self.L))
