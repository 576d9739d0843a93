"""Real device bytes per window of a step, against what the executor tracks.

Note: [untracked device bytes] (step_stats.py) A window's working set is what the device holds
beyond what the executor tracks, at the window's peak, above what it held untracked when the
step began (U_base: workspaces and buffers of earlier steps, a model's caches): transients, the
incoming gradient, what a layer's forward leaves for later (a KV cache), the head's gradients
kept for the backward. What the step leaves behind for good (P: a cuBLAS workspace its first
matmul made) becomes static in the plan (U_base + P = ``StepStats.untracked_bytes``), so a
window's work is its peak less P when P was there already: when at least P untracked bytes were
held at the start of it and of every later window (else its full peak). Static + work then
covers every window, before and after P appeared, in this step and in the next ones (where P
is there all along).
"""

from __future__ import annotations

import contextlib

import torch

from lightning_lazytrain.engine.live_bytes import DeviceBytes
from lightning_lazytrain.engine.step_stats import StepStats
from lightning_lazytrain.engine.trace import DeviceTracker

__all__ = ["WindowMemory"]


class WindowMemory:
    """The executor's measurement of one step's real device bytes (``Executor.measure_memory``,
    always while profiling): started when the step begins, a mark per window, the step's figures
    into its ``StepStats`` when it ends (Note: [untracked device bytes])."""

    def __init__(self, device: torch.device, static_bytes: int, tracker: DeviceTracker) -> None:
        # ``static_bytes``: device bytes held before the measurement that its counters do not see
        # (CPU: what the store holds already; CUDA: 0, the allocator's counters see everything)
        self.static = static_bytes
        self.mem = DeviceBytes(device)
        self.mem.start()
        self.open: str | None = None  # the window being measured
        # what the device holds untracked as the step begins
        self.base = self.static + self.mem.current - tracker.current
        self.peak: dict[str, int] = {}  # per window: its untracked peak
        self.start: dict[str, int] = {}  # per window, in order: the least untracked at its start

    def window(self, name: str, tracker: DeviceTracker, stats: StepStats) -> None:
        """Close the open window and open ``name`` (a no-op when ``name`` is open: F0 opens before
        the embedding runs, as the plan counts boundary 0 and its making in F0)."""
        if self.open == name:
            return
        mem, static = self.mem, self.static
        if self.open is not None:
            prev = self.open
            untracked = static + mem.peak - tracker.window_peak - self.base
            self.peak[prev] = max(self.peak.get(prev, 0), untracked)
            stats.window_peak_bytes[prev] = max(stats.window_peak_bytes.get(prev, 0), static + mem.peak)
            stats.real_peak_bytes = max(stats.real_peak_bytes, static + mem.peak)
        mem.mark()
        tracker.reset_window()
        self.open = name
        start = static + mem.current - tracker.current - self.base
        self.start[name] = min(self.start.get(name, start), start)

    def finish(self, tracker: DeviceTracker, stats: StepStats) -> None:
        """The step's untracked bytes and each window's work, into ``stats``."""
        untracked = self.static + self.mem.current - tracker.current
        stats.untracked_bytes = max(0, untracked)
        left = max(0, untracked - self.base)  # P: what the step left behind for good
        held, floors = left, {}
        for w in reversed(list(self.start)):  # held from w's start to the end: P there
            held = min(held, self.start[w])
            floors[w] = left if held >= left else 0
        stats.window_work = {w: max(0, u - floors.get(w, 0)) for w, u in self.peak.items()}

    def paused(self) -> contextlib.AbstractContextManager:
        """Host-tier allocations (offload staging, grad landing) are not device bytes (CPU runs)."""
        return self.mem.paused()

    def stop(self) -> None:
        self.mem.stop()
