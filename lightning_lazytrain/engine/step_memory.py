"""A step's device memory, for the executor: the measured windows (``WindowMemory``), the boundaries it holds
(saved, recomputed, in the activation store) and the offloads it settles and reaps. A mixin of ``Executor``
(its ``acts``, ``tracker``, ``trace``, ``schedule``, ``params``, ``stats``)."""

from __future__ import annotations

import contextlib

import torch

from lightning_lazytrain.engine.window_memory import WindowMemory


class StepMemory:
    """``Executor``'s device-memory side."""

    def _window(self, name: str, *, carried: int = 0) -> None:
        """Mark the start of window ``name``: the trace, and the memory of the window that ends."""
        self.trace.window(name)
        self._memory_window(name, carried=carried)

    def _memory_window(self, name: str, *, carried: int = 0) -> None:
        """Close the open memory window and open ``name`` (``WindowMemory.window``). ``carried``
        (bytes alive at the mark that belong to the new window's working set) is counted by the
        untracked bytes themselves (Note: [untracked device bytes] in window_memory.py)."""
        if self._mem is not None:
            self._mem.window(name, self.tracker, self.stats)

    def _start_memory(self) -> None:
        if not (self.measure_memory or self.profiling) or self._mem is not None:
            return
        assert self.params is not None
        # Gradient buffers of the two block slots and of the non-block weights exist from here on
        # (they are static device bytes, not a window's work).
        self.params.ensure_grad_buffers(0, min(1, self.params.num_slots - 1))
        # On CPU the tracker sees allocations from here on; what the store holds already is added.
        # CUDA's counters see everything.
        static = 0 if self.device.type == "cuda" else self.params.device_bytes
        self._mem = WindowMemory(self.device, static, self.tracker)

    def _tracker_seconds(self) -> float:
        """The CPU memory tracker's own seconds in this step so far (Note: [the tracker's own time] in
        live_bytes.py); 0 on CUDA and while no step measures memory."""
        return self._mem.mem.overhead_s if self._mem is not None else 0.0

    def _stop_memory(self) -> None:
        if self._mem is not None:
            self._mem.stop()
            self._mem = None

    def _host_side(self) -> contextlib.AbstractContextManager:
        """Host-tier allocations (offload staging, grad landing) are not device bytes (CPU runs)."""
        return self._mem.paused() if self._mem is not None else contextlib.nullcontext()

    def _settle_offloads(self, w: int) -> None:
        """Before forward window ``w`` (H: ``w`` = L): boundaries whose offload window is over leave
        the device now, their copy done or not (``ActivationStore.settle``: a slow copy makes
        compute wait, it never holds memory past the window the plan frees it in)."""
        assert self.acts is not None
        s = self.schedule
        for i, home in enumerate(s.homes):
            off = s.offload_window[i]
            if home in ("cpu", "nvme") and off is not None and off < w and i in self.acts:
                self.acts.settle(i)
        for j, moving in self._internals.items():  # Note: [offloaded internals]
            if s.internals_offload_window[j] < w and moving.state == "offloaded":
                moving.settle(self.acts)
                self.tracker.drop(f"internals{j}")
        self._reap_offloads()

    def _reap_offloads(self) -> None:
        """Let go of offloaded boundaries whose D2H has finished, and stop counting them."""
        assert self.acts is not None
        self.acts.reap()
        for owner in [o for o in self.tracker.by_owner if o.startswith("offload")]:
            if self.acts.offloaded(int(owner[len("offload"):])):
                self.tracker.drop(owner)

    # ---- boundaries ----------------------------------------------------------------------------
    def _boundary(self, i: int) -> torch.Tensor:
        assert self.acts is not None
        if i in self._saved:
            return self._saved[i]
        if i in self._recomputed:
            return self._recomputed[i]
        if i in self.acts:
            return self.acts.get(i)
        raise RuntimeError(f"boundary {i} is neither stored nor recomputed (schedule {self.schedule.policy!r})")

    def _free_boundary(self, i: int) -> None:
        assert self.acts is not None
        if self._saved.pop(i, None) is not None:
            self.tracker.drop(f"boundary{i}")
        if self._recomputed.pop(i, None) is not None:
            self.tracker.drop(f"recomputed{i}")
        if i in self.acts:
            self.acts.free(i)
            self.tracker.drop(f"reload{i}")
            self.tracker.drop(f"offload{i}")

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()
