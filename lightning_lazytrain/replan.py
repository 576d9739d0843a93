"""Re-planning when a run drifts from its plan.

The plan is solved from the first step's profile. If the link, the host or the data change later,
the schedule goes stale (the LazyTrain paper names this as its own limitation). ``DriftMonitor``
watches each step's measured time against the plan's prediction. Their ratio is not expected to be
1 (the measured step leaves out the optimizer, a prediction leaves out launch gaps): what counts
is that it *moves*. The median ratio of the ``patience`` steps after a (re)plan is the baseline;
when the median of the last ``patience`` steps leaves it by more than ``threshold`` the strategy
re-profiles the next step (no extra call of user code: that step runs as usual with timing on),
measures the links from that step's copies, re-solves, and switches the schedule at the step
boundary when the new plan is predicted at least ``min_gain`` faster than the current schedule on
the new profile. Exactness is unchanged: a switch happens between optimizer steps, as the first
plan's does.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["DriftMonitor", "ReplanOptions", "measured_link_rates"]


@dataclass(frozen=True)
class ReplanOptions:
    """``enabled``: watch for drift at all. ``threshold``: relative move of measured/predicted that
    counts as drift. ``patience``: steps in each median (and steps of a new baseline). ``min_gain``:
    switch only to a plan predicted at least this much faster than keeping the current schedule.
    ``max_replans``: at most this many re-profiles in a run (no thrashing on a noisy machine)."""

    enabled: bool = True
    threshold: float = 0.25
    patience: int = 3
    min_gain: float = 0.05
    max_replans: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.threshold:
            raise ValueError(f"replan threshold={self.threshold!r}: must be > 0 (e.g. 0.25 for 25%)")
        if not (isinstance(self.patience, int) and self.patience >= 1):
            raise ValueError(f"replan patience={self.patience!r}: must be an integer >= 1 (steps)")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"replan min_gain={self.min_gain!r}: must be in [0, 1)")
        if not (isinstance(self.max_replans, int) and self.max_replans >= 0):
            raise ValueError(f"replan max_replans={self.max_replans!r}: must be an integer >= 0")

    @classmethod
    def parse(cls, value: Any) -> ReplanOptions:
        """``True``/``False``, a mapping of the fields, or a ``ReplanOptions``."""
        if isinstance(value, ReplanOptions):
            return value
        if isinstance(value, bool):
            return cls(enabled=value)
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"replan: unknown option(s) {unknown}; known: {sorted(known)}")
            return cls(**value)
        raise ValueError(f"replan={value!r}: use True, False or a dict of {[f.name for f in fields(cls)]}")


class DriftMonitor:
    """Decides, step by step, whether the run has drifted from its plan (see the module doc)."""

    def __init__(self, options: ReplanOptions) -> None:
        self.options = options
        self.baseline: float | None = None
        self._ratios: deque[float] = deque(maxlen=options.patience)
        self.replans = 0

    def reset(self) -> None:
        """A (re)plan took effect: the next ``patience`` steps set a new baseline."""
        self.baseline = None
        self._ratios.clear()

    def observe(self, measured_s: float, predicted_s: float) -> str | None:
        """Record a step; the reason to re-plan, or None."""
        o = self.options
        if not o.enabled or not predicted_s > 0 or not measured_s > 0:
            return None
        self._ratios.append(measured_s / predicted_s)
        if len(self._ratios) < o.patience:
            return None
        med = statistics.median(self._ratios)
        if self.baseline is None:
            self.baseline = med
            self._ratios.clear()
            return None
        drift = med / self.baseline - 1.0
        if abs(drift) <= o.threshold or self.replans >= o.max_replans:
            return None
        self.replans += 1
        reason = (f"measured/predicted step time moved from {self.baseline:.2f} to {med:.2f} ({drift:+.0%}, "
                  f"threshold {o.threshold:.0%}) over the last {o.patience} steps")
        self.reset()
        return reason


def measured_link_rates(segments: Iterable[Any], lanes: Iterable[str] = ("h2d", "d2h")) -> dict[str, float]:
    """Achieved bytes/s per copy lane in a step's measured timeline (bytes over busy seconds; lanes
    that moved less than 64 KiB or took no time are left out)."""
    moved: dict[str, float] = {}
    busy: dict[str, float] = {}
    want = set(lanes)
    for s in segments:
        if s.lane in want and s.bytes > 0:
            moved[s.lane] = moved.get(s.lane, 0.0) + float(s.bytes)
            busy[s.lane] = busy.get(s.lane, 0.0) + max(0.0, s.end - s.start)
    return {lane: moved[lane] / busy[lane] for lane in moved if moved[lane] >= 65536 and busy[lane] > 0}
