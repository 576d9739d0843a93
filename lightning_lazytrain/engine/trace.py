"""Accounting of one step: tracked device bytes (current and peak, by what holds them) and a
measured timeline in the simulator's ``Segment`` format, so predicted and measured can be drawn
and compared with the same code (``lightning_lazytrain.report``)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_lazytrain.engine.copy_engine import CopyRecord
from lightning_lazytrain.planner.simulator import Segment

_KIND = {"param": "weights", "grad": "grads", "act": "activation"}


@dataclass
class DeviceTracker:
    """Bytes the executor holds on the device, by owner; ``peak`` is the high-water mark."""

    current: int = 0
    peak: int = 0
    by_owner: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, owner: str, nbytes: int) -> None:
        self.by_owner[owner] += nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)

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

    ``sync`` (``torch.cuda.synchronize`` when profiling on CUDA) is called at every mark, so that
    host timestamps bound the device work; without it CUDA segments show launch times only."""

    t0: float = field(default_factory=time.perf_counter)
    compute: list[Segment] = field(default_factory=list)
    windows: list[tuple[str, float]] = field(default_factory=list)  # (name, start)
    sync: Callable[[], None] | None = None

    def window(self, name: str) -> None:
        if self.sync is not None:
            self.sync()
        self.windows.append((name, time.perf_counter() - self.t0))

    def timed(self, window: str, kind: str, index: int):
        trace = self

        class _Timer:
            def __enter__(self):
                if trace.sync is not None:
                    trace.sync()
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                if trace.sync is not None:
                    trace.sync()
                end = time.perf_counter()
                trace.compute.append(Segment(window, "compute", kind, index, self.start - trace.t0, end - trace.t0))

        return _Timer()

    def window_of(self, t: float) -> str:
        name = self.windows[0][0] if self.windows else "?"
        for w, start in self.windows:
            if start <= t:
                name = w
        return name

    def segments(self, records: list[CopyRecord]) -> list[Segment]:
        out = list(self.compute)
        for r in records:
            if r.start < self.t0:
                continue
            prefix, _, index = (r.tag or "?:-1").partition(":")
            try:
                idx = int(index)
            except ValueError:
                idx = -1
            start = r.start - self.t0
            out.append(Segment(self.window_of(start), r.lane, _KIND.get(prefix, prefix), idx, start,
                               r.end - self.t0, float(r.nbytes)))
        return sorted(out, key=lambda s: s.start)
