"""Accounting of one step: tracked device bytes (current and peak, by what holds them) and a
measured timeline in the simulator's ``Segment`` format, so predicted and measured can be drawn
and compared with the same code (``lightning_lazytrain.planner.report``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_lazytrain.engine.copy_engine import CopyRecord
from lightning_lazytrain.planner.simulator import Segment

_KIND = {"param": "weights", "grad": "grads", "act": "activation", "cast": "cast", "accum": "accumulate"}


@dataclass
class DeviceTracker:
    """Bytes the executor holds on the device, by owner; ``peak`` is the high-water mark."""

    current: int = 0
    peak: int = 0
    window_peak: int = 0  # since ``reset_window``
    by_owner: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, owner: str, nbytes: int) -> None:
        self.by_owner[owner] += nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self.window_peak = max(self.window_peak, self.current)

    def reset_window(self) -> None:
        self.window_peak = self.current

    def sub(self, owner: str, nbytes: int) -> None:
        self.add(owner, -nbytes)

    def drop(self, owner: str) -> None:
        """Forget everything ``owner`` holds."""
        self.current -= self.by_owner.pop(owner, 0)

    def reset_peak(self) -> None:
        self.peak = self.current


@dataclass
class StepTrace:
    """Compute segments of one step plus the copy records, as ``Segment``s.

    Times come from ``stamp`` / ``resolve`` (the copy engine's clock: host ``perf_counter`` on CPU,
    compute-stream events on CUDA, Note: [one clock] in copy_cuda.py), resolved only when read, so
    marking costs no synchronisation. ``sync`` (``torch.cuda.synchronize`` when profiling on CUDA)
    is still called at every mark when given. ``overhead`` (the CPU memory tracker's own seconds so far, Note:
    [the tracker's own time] in live_bytes.py) is taken out of what the trace times: a compute segment ends
    that much earlier, and ``span`` between two windows leaves it out."""

    stamp: Callable[[], Any] = time.perf_counter
    resolve: Callable[[Any], float] = float
    sync: Callable[[], None] | None = None
    t0: float = field(default_factory=time.perf_counter)
    overhead: Callable[[], float] | None = None
    _compute: list[tuple[str, str, int, Any, Any, float]] = field(default_factory=list)
    _windows: list[tuple[str, Any, float]] = field(default_factory=list)

    def _overhead(self) -> float:
        return self.overhead() if self.overhead is not None else 0.0

    def window(self, name: str) -> None:
        if self.sync is not None:
            self.sync()
        self._windows.append((name, self.stamp(), self._overhead()))

    @property
    def windows(self) -> list[tuple[str, float]]:
        """(name, start) of every window mark, in seconds since ``t0``."""
        return [(name, self.resolve(st) - self.t0) for name, st, _ in self._windows]

    def span(self, first: str, then: str) -> float:
        """Seconds from the first mark of window ``first`` to the first of ``then``, without the tracker's
        own time between them (0 when either is missing)."""
        marks: dict[str, tuple[float, float]] = {}
        for name, st, ov in self._windows:
            marks.setdefault(name, (self.resolve(st), ov))
        if first not in marks or then not in marks:
            return 0.0
        (a, oa), (b, ob) = marks[first], marks[then]
        return max(0.0, (b - a) - (ob - oa))

    @property
    def compute(self) -> list[Segment]:
        out = []
        for w, kind, index, a, b, ov in self._compute:
            start, end = self.resolve(a) - self.t0, self.resolve(b) - self.t0
            # without the tracker's own time; never below a tenth of what the clock saw
            out.append(Segment(w, "compute", kind, index, start, max(end - ov, start + 0.1 * (end - start))))
        return out

    def timed(self, window: str, kind: str, index: int):
        trace = self

        class _Timer:
            def __enter__(self):
                if trace.sync is not None:
                    trace.sync()
                self.start = trace.stamp()
                self.ov = trace._overhead()

            def __exit__(self, *exc):
                if trace.sync is not None:
                    trace.sync()
                end = trace.stamp()
                trace._compute.append((window, kind, index, self.start, end, trace._overhead() - self.ov))

        return _Timer()

    @staticmethod
    def _window_of(windows: list[tuple[str, float]], t: float) -> str:
        name = windows[0][0] if windows else "?"
        for w, start in windows:
            if start <= t:
                name = w
        return name

    def segments(self, records: list[CopyRecord]) -> list[Segment]:
        out = self.compute
        windows = self.windows
        for r in records:
            if r.start < self.t0:
                continue
            prefix, _, index = (r.tag or "?:-1").partition(":")
            try:
                idx = int(index)
            except ValueError:
                idx = -1
            start = r.start - self.t0
            out.append(Segment(self._window_of(windows, start), r.lane, _KIND.get(prefix, prefix), idx, start,
                               r.end - self.t0, float(r.nbytes)))
        return sorted(out, key=lambda s: s.start)
