"""The plan checked by measurement: after a plan takes effect, the run times it against the schedules it
was compared with and keeps the fastest.

Note: [the plan checked by measurement]
    The plan is the MILP's best schedule as the simulator prices it, and the simulator is a model: where it
    is wrong, the plan can be slower than a simple policy it beat on paper. On the first H200 run (1B
    model, b8 x 1024) the MILP plan ran 1.32 s a step and MegaTrain's schedule 1.15 s, predicted 1.47 and
    1.71 s. So once a plan takes effect (the first one, and a re-plan that switched), the run measures it:
    ``steps`` optimizer steps on the plan, then as many on each challenger, then it keeps the schedule
    whose median step was the fastest. Challengers are the baselines the plan was compared with
    (planner/plan.py, ``evaluate_baselines``) that fit the budget and whose predicted step is within
    ``margin`` of the plan's (a factor ``1 + margin``); the ``candidates`` fastest of them. A challenger
    must beat the plan by ``min_gain`` to be kept (a tie keeps the plan).

    A step's time is the wall time from the end of one optimizer step's backward to the next, so it
    includes the optimizer update, the data loading and the callbacks: what a user waits for, the same
    for a serial and a pipelined optimizer. The first step after each switch is not counted (its copies,
    allocations and a pipelined update's hand-over belong to the switch), nor is a step with an
    evaluation in it. Switches happen where every schedule switch does, between optimizer steps, so
    training stays exact. A re-profile the run asks for meanwhile (drift is not watched while racing;
    the allocator's peak is) ends the race on the plan, and the re-plan decides.

    Default: on with CUDA, off elsewhere (``ReplanOptions.race=None``): a 2-core CPU's run-to-run noise is
    larger than the differences between schedules, and the CPU tests plan from the first step.
    ``ReplanOptions(race=True)`` turns it on anywhere. Each race is logged and kept in
    ``strategy.races``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PlanRace", "RaceEntry"]


@dataclass
class RaceEntry:
    """A schedule in the race: the plan (``plan`` set, index 0) or a challenger."""

    name: str
    schedule: Any
    predicted_s: float
    plan: Any = None  # the AutoPlan this entry runs when kept (core/planning.py ``Planner.race``)
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("inf")


class PlanRace:
    """The state of one race (see the module doc). ``step_ended(now)`` after every optimizer step's
    backward; it returns the entry to switch to at this step boundary, or None."""

    def __init__(self, entries: list[RaceEntry], *, steps: int, min_gain: float) -> None:
        if len(entries) < 2:
            raise ValueError("a race needs the plan and at least one challenger")
        self.entries = entries
        self.steps = steps
        self.min_gain = min_gain
        self.current = 0  # the entry running now
        self.winner: RaceEntry | None = None  # set when the race is decided
        self._last_end: float | None = None
        self._skip = 1  # steps not to count on the current entry (the first after a switch)
        self._tainted = False

    @staticmethod
    def length(steps: int, challengers: int) -> int:
        """Optimizer steps a race takes at most (each entry: one uncounted step and ``steps`` counted),
        from the step that adopted the plan; the winner runs from the step after."""
        return (1 + challengers) * (1 + steps)

    @property
    def done(self) -> bool:
        return self.winner is not None

    @property
    def winner_index(self) -> int | None:
        return None if self.winner is None else self.entries.index(self.winner)

    def taint(self) -> None:
        """Something that is not training ran since the last step's end (an evaluation): that step's
        time does not count."""
        self._tainted = True

    def step_ended(self, now: float) -> RaceEntry | None:
        """An optimizer step's backward ended at ``now`` (seconds, a monotonic clock). Returns the entry to
        run from this step boundary on (a switch), or None to stay."""
        if self.done:
            return None
        last, self._last_end = self._last_end, now
        tainted, self._tainted = self._tainted, False
        if last is None:  # the step that adopted the plan: the clock starts here
            return None
        if self._skip:
            self._skip -= 1
            return None
        entry = self.entries[self.current]
        if not tainted:
            entry.times.append(now - last)
        if len(entry.times) < self.steps:
            return None
        if self.current + 1 < len(self.entries):  # the next challenger
            self.current += 1
            self._skip = 1
            return self.entries[self.current]
        return self._decide()

    def _decide(self) -> RaceEntry | None:
        plan = self.entries[0]
        best = min(self.entries[1:], key=lambda e: e.median)
        self.winner = best if best.median < plan.median * (1.0 - self.min_gain) else plan
        if self.winner is self.entries[self.current]:
            return None
        self.current = self.entries.index(self.winner)
        return self.winner

    def abandon(self) -> RaceEntry | None:
        """End the race on the plan (a re-profile comes first); the plan's entry if a switch back is due."""
        if self.done:
            return None
        self.winner = self.entries[0]
        if self.current == 0:
            return None
        self.current = 0
        return self.entries[0]

    def record(self) -> dict[str, Any]:
        """What the race measured and kept (``strategy.races``)."""
        return {"entries": [{"name": e.name, "predicted_s": e.predicted_s, "measured_s": e.times,
                             "median_s": e.median if e.times else None} for e in self.entries],
                "kept": self.winner.name if self.winner else None, "steps": self.steps, "min_gain": self.min_gain}

    def summary(self) -> str:
        parts = ", ".join(f"{e.name} {e.median:.3f} s" + (f" (predicted {e.predicted_s:.3f})" if e.predicted_s else "")
                          for e in self.entries if e.times)
        kept = self.winner.name if self.winner else "?"
        return f"median step over {self.steps} steps each: {parts}; keeping {kept}"
