"""Re-planning when a run drifts from its plan.

The plan is solved from the first step's profile. If the link, the host or the data change later,
the schedule goes stale (the LazyTrain paper names this as its own limitation). ``DriftMonitor``
watches each step's measured time against the plan's prediction. Their ratio is not expected to be
1 (the measured step leaves out the optimizer, a prediction leaves out launch gaps): what counts
is that it *moves*, and stays moved. The median ratio of the ``patience`` steps after a (re)plan is
the baseline; when the median of the last ``patience`` steps has been more than a factor
``1 + threshold`` away from it (slower, or faster) at ``patience`` steps in a row, the training core
re-profiles the next step (no extra call of user code: that step runs as usual with timing on),
measures the links from that step's copies, re-solves, and switches the schedule at the step
boundary when the new plan is predicted at least ``min_gain`` faster than the current schedule on
the new profile. Exactness is unchanged: a switch happens between optimizer steps, as the first
plan's does.

Note: [drift back-off]. On a busy machine (a shared 2-core CPU) a burst of slow steps looks like
drift, and the re-plan it triggers keeps the schedule: nothing changed. So every re-plan raises
the bar for the next one: at back-off level ``k`` (the number of re-plans since the last switch)
with ``s = 1 + backoff * k``, the window and the streak are ``patience * s`` steps and the factor is
``(1 + threshold) ** s`` (defaults: 5 steps and x1.25, then 10 steps and x1.56, 15 and x1.95, 20
and x2.44). A re-plan that switched the schedule (``replanned(switched=True)``) found a real change
and brings the bar back down to level 0. A real, lasting change still passes a raised bar: it only
takes longer to be seen. ``max_replans`` caps the total. The default ``patience`` is 5: with 3 (and
no streak), bursts of 3 to 5 slow steps from other processes on a 2-core CPU moved the median of 3
past +25% in two main jobs (``lazytrain-train``) of three, and each re-plan kept the schedule.

Note: [profile check]. The baseline is taken after the plan, so a plan made from an unrepresentative
profile (one step, timed during a burst of load: 0.33-0.47 s predicted for the main job's 0.045 s
steps with six busy processes on its 2 cores during the profile) would never be corrected: the
ratio is off from the first step and does not move. So
when the first baseline after a (re)plan is beyond a factor ``profile_check`` from 1 either way
(the steps after the plan ran that many times faster or slower than the profiled step predicted),
the monitor asks for a re-profile, once per run: the re-plan then predicts from a second profiled
step, and switches or keeps the schedule as any re-plan (that step's prediction of the schedule,
0.058 s there, is the reference from then on). Measured/predicted is otherwise 0.4-1.1
(bench/RESULTS.md; 0.65-0.85 for the main job on a 2-core CPU).

Note: [profile warm-up]. On a GPU the first training step is not like the others: cuBLAS handles
and workspaces, kernel selection, the allocator's first segments, first touches of pinned host
buffers. On the H200 (1B model, b32) the profiled first step took 12.3 s and the plan predicted
compute at 2.74 s per step against 0.65 s measured after it, until the profile check re-profiled at
the sixth step. ``profile_warmup`` steps run on the provisional schedule, untimed, before the
profiled one: default 1 on CUDA, 0 elsewhere (the CPU has no such first-call costs, and the CPU tests
plan from the first step).
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
    counts as drift (a factor ``1 + threshold`` either way: 0.25 is +25% slower or -20% faster).
    ``patience``: steps in each median, steps of a new baseline, and how many steps in a row the
    median must stay moved. ``min_gain``: switch only to a plan predicted at least this much faster
    than keeping the current schedule. ``max_replans``: at most this many re-profiles in a run.
    ``backoff``: each re-plan that did not switch adds ``backoff`` x ``patience`` steps to the window
    and the streak, and ``backoff`` x ``log(1 + threshold)`` to the factor's logarithm (Note: [drift
    back-off]); 0 turns the back-off off. ``profile_check``: a first baseline beyond this factor from 1
    either way re-profiles, once per run (Note: [profile check]); 0 turns the check off.
    ``profile_warmup``: steps before the first profiled one (Note: [profile warm-up]; None: 1 on CUDA,
    0 elsewhere). It applies with ``enabled=False`` too (it is about the first plan, not re-plans).
    ``race``: time each plan against the baselines it was compared with and keep the fastest (Note: [the
    plan checked by measurement] in core/plan_race.py; None: on with CUDA, off elsewhere), ``patience``
    steps each; ``race_margin``: challengers predicted within a factor ``1 + race_margin`` of the plan;
    ``race_candidates``: at most this many of them (the fastest predicted); a challenger is kept when its
    median step beats the plan's by ``min_gain``."""

    enabled: bool = True
    threshold: float = 0.25
    patience: int = 5
    min_gain: float = 0.05
    max_replans: int = 5
    backoff: float = 1.0
    profile_check: float = 3.0
    profile_warmup: int | None = None
    race: bool | None = None
    race_margin: float = 0.5
    race_candidates: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.threshold:
            raise ValueError(f"replan threshold={self.threshold!r}: must be > 0 (e.g. 0.25 for 25%)")
        if not (isinstance(self.patience, int) and self.patience >= 1):
            raise ValueError(f"replan patience={self.patience!r}: must be an integer >= 1 (steps)")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"replan min_gain={self.min_gain!r}: must be in [0, 1)")
        if not (isinstance(self.max_replans, int) and self.max_replans >= 0):
            raise ValueError(f"replan max_replans={self.max_replans!r}: must be an integer >= 0")
        if isinstance(self.backoff, bool) or not (isinstance(self.backoff, (int, float)) and 0 <= self.backoff <= 10):
            raise ValueError(f"replan backoff={self.backoff!r}: must be a number in [0, 10] (0: no back-off)")
        if self.profile_warmup is not None and not (isinstance(self.profile_warmup, int)
                                                    and not isinstance(self.profile_warmup, bool)
                                                    and self.profile_warmup >= 0):
            raise ValueError(f"replan profile_warmup={self.profile_warmup!r}: must be a number of steps >= 0, or None "
                             "(1 on CUDA, 0 elsewhere)")
        if isinstance(self.profile_check, bool) or not (isinstance(self.profile_check, (int, float)) and
                                                        (self.profile_check == 0 or self.profile_check > 1)):
            raise ValueError(f"replan profile_check={self.profile_check!r}: must be a factor > 1 (e.g. 3) or 0 (off)")

        if self.race is not None and not isinstance(self.race, bool):
            raise ValueError(f"replan race={self.race!r}: must be True, False or None (on with CUDA)")
        if isinstance(self.race_margin, bool) or not (isinstance(self.race_margin, (int, float))
                                                      and 0 <= self.race_margin <= 10):
            raise ValueError(f"replan race_margin={self.race_margin!r}: must be a number in [0, 10] (0.5: challengers "
                             "predicted up to 1.5x the plan's step)")
        if isinstance(self.race_candidates, bool) or not (isinstance(self.race_candidates, int)
                                                          and self.race_candidates >= 1):
            raise ValueError(f"replan race_candidates={self.race_candidates!r}: must be an integer >= 1")

    def races(self, device_type: str) -> bool:
        """Is the plan checked by measurement on this device (Note: [the plan checked by measurement])?"""
        return device_type == "cuda" if self.race is None else self.race

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
    """Decides, step by step, whether the run has drifted from its plan (see the module doc).

    The planner (planning.py) calls ``observe`` after every planned step, and after each re-plan
    ``replanned(switched)`` (or ``reset()``, which leaves the back-off level as it is)."""

    def __init__(self, options: ReplanOptions) -> None:
        self.options = options
        self.baseline: float | None = None
        self.replans = 0
        self.level = 0  # back-off level: re-plans since the last switch (Note: [drift back-off])
        self._ratios: deque[float] = deque(maxlen=self.window)
        self._streak = 0  # consecutive steps whose window median was beyond the bar
        self.profile_checked = False  # the profile check fired (once per run: Note: [profile check])

    @property
    def _scale(self) -> float:
        return 1.0 + self.options.backoff * self.level

    @property
    def window(self) -> int:
        """Steps in each median, in a new baseline and in the streak, at the current level."""
        return max(1, round(self.options.patience * self._scale))

    @property
    def factor(self) -> float:
        """How far (a factor, either way) the median must move from the baseline, at the current level."""
        return (1.0 + self.options.threshold) ** self._scale

    def reset(self) -> None:
        """A (re)plan took effect: the next ``window`` steps set a new baseline."""
        self.baseline = None
        self._ratios = deque(maxlen=self.window)
        self._streak = 0

    def replanned(self, switched: bool) -> None:
        """A re-plan this monitor asked for is done: ``switched`` (a real change) brings the bar back to
        level 0; a kept schedule leaves it raised (``observe`` raised it when it fired). Then ``reset``."""
        if switched:
            self.level = 0
        self.reset()

    def observe(self, measured_s: float, predicted_s: float) -> str | None:
        """Record a step; the reason to re-plan ("drift: ..." or "profile check: ..."), or None."""
        o = self.options
        if not o.enabled or not predicted_s > 0 or not measured_s > 0:
            return None
        self._ratios.append(measured_s / predicted_s)
        n = self.window
        if len(self._ratios) < n:
            return None
        med = statistics.median(self._ratios)
        if self.baseline is None:
            self.baseline = med
            self._ratios.clear()
            return self._check_profile(med)
        factor = self.factor
        moved = med > self.baseline * factor or med < self.baseline / factor
        self._streak = self._streak + 1 if moved else 0
        if self._streak < n or self.replans >= o.max_replans:
            return None
        self.replans += 1
        drift = med / self.baseline - 1.0
        reason = (f"drift: measured/predicted step time moved from {self.baseline:.2f} to {med:.2f} ({drift:+.0%}; "
                  f"bar {factor - 1:+.0%}/{1 / factor - 1:+.0%}) and stayed there for {n} steps "
                  f"(median of {n} steps)")
        # raise the bar until a switch says the change was real (a kept schedule: the usual case on a
        # noisy machine); ``replanned(switched=True)`` lowers it again
        self.level += 1
        self.reset()
        return reason

    def _check_profile(self, ratio: float) -> str | None:
        """Note: [profile check]: a first baseline far from 1 re-profiles (once)."""
        f = self.options.profile_check
        if not f or self.profile_checked or 1 / f <= ratio <= f or self.replans >= self.options.max_replans:
            return None
        self.profile_checked = True
        self.replans += 1
        self.reset()
        how = f"{1 / ratio:.1f}x faster" if ratio < 1 else f"{ratio:.1f}x slower"
        return (f"profile check: the {self.window} steps after the plan ran {how} than the profiled step predicted "
                f"(measured/predicted {ratio:.2f}, beyond {f:g}x either way): that step was not like the others, "
                "re-profiling once")


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
