"""The schedule MILP's variables to and from a ``Schedule``: ``seed_from`` (HiGHS's MIP start) and ``extract``
(the answer). A mixin of ``milp.ScheduleModel``."""

from __future__ import annotations

import dataclasses

from .errors import InvalidInput
from .schedule import Schedule


class SolutionIO:
    """``ScheduleModel``'s schedule mapping."""

    def seed_from(self, s: Schedule) -> None:
        """Set every variable from a schedule so HiGHS starts with an incumbent (a layer without a backward
        keeps nothing in the model: the engine ignores such a decision, so the seed drops it)."""
        pyo, m, L = self.pyo, self.m, self.L
        s = _without_internals(s, self.wl.no_backward)
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
        self.internals.seed_from(s)
        self.partial.seed_from(s)
        if len(self.modes) > 1:
            m.pipe.set_value(int(s.optimizer == "pipelined"))
        for j, y in self.y.items():  # a serial layer where the model offers none (it cannot pay
            y.set_value(int(j in s.serial_layers))  # there) is seeded as pipelined: as good or better
        if self.in_backward:
            m.bwd.set_value(int(s.updates_in_backward))
        if s.optimizer not in self.modes:
            raise InvalidInput("schedule.optimizer", s.optimizer, f"the model's optimizer mode is {self.modes[0]!r}")
        for var, exprs in self.lane_loads.values():
            if not var.fixed:
                var.set_value(max(pyo.value(e) for e in exprs))
        if not self.opt.time_objective:
            for u in range(L):
                _, exprs = self.lane_loads[f"tB[{u}]"]
                m.slack[u].set_value(max(0.0, pyo.value(exprs[1]) - pyo.value(exprs[0])))

    def extract(self, policy: str = "milp") -> Schedule:
        m, L = self.m, self.L
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
        internals_off, internals_rel = self.internals.extract()
        return Schedule(num_layers=L, homes=tuple(homes), keep_internals=tuple(on(m.k[j]) for j in range(L)),
                        resident_weights=tuple(on(m.r[j]) for j in range(L)), offload_window=tuple(off),
                        reload_window=tuple(rel), internals_offload_window=internals_off,
                        internals_reload_window=internals_rel, partial_keep=self.partial.extract(),
                        backward_prefetch=True, optimizer=self.optimizer(),
                        serial_layers=tuple(j for j, y in self.y.items() if on(y))
                        if self.optimizer() == "pipelined" else (),
                        updates_in_backward=self.in_backward and self.optimizer() == "pipelined" and on(m.bwd),
                        data_parallel=self.dp, policy=policy)

    def optimizer(self) -> str:
        """The optimizer mode of the current solution (the forced one, or the value of ``pipe``)."""
        if len(self.modes) == 1:
            return self.modes[0]
        return "pipelined" if self.m.pipe.value is not None and self.m.pipe.value > 0.5 else "serial"


def _without_internals(s: Schedule, layers: tuple[int, ...]) -> Schedule:
    """``s`` with ``layers`` keeping no internals (fully, partially or moved): Note: [layers without a
    backward] -- what the engine runs for them whatever the schedule says."""
    if not layers:
        return s
    drop = lambda values, off: tuple(off if j in layers else v for j, v in enumerate(values))  # noqa: E731
    return dataclasses.replace(s, keep_internals=drop(s.keep_internals, False),
                               partial_keep=drop(s.partial_keep, False),
                               internals_offload_window=drop(s.internals_offload_window, None),
                               internals_reload_window=drop(s.internals_reload_window, None))
