"""Real device bytes, measured: the allocator's own figures on CUDA, a storage tracker on CPU.

The executor's ``DeviceTracker`` is its own bookkeeping (what the plan says it holds). To check
the plan against reality, and to measure the transient working sets the plan must also count
(a layer's temporaries, the loss head's logits and their gradient), something must see every
allocation:

- CUDA: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` (the caching allocator's
  counters; ``reset_peak_memory_stats`` starts a new peak).
- CPU: ``LiveBytes``, a ``TorchDispatchMode`` that sees every op's outputs in this thread; an
  output whose storage is not one of the op's inputs' is a new allocation, counted until the
  storage is freed (``weakref.finalize`` on the storage: PyTorch keeps a storage's Python object
  alive exactly as long as the storage). ``paused()`` leaves out host-tier buffers (activation
  offload staging, gradient landing buffers) that share the CPU with the emulated device.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes", "DeviceBytes", "reset_cuda_peak", "max_memory_allocated", "max_memory_reserved"]

# Note: [peaks across resets]
#     The executor starts a new CUDA peak at each step (``lazytrain/max_memory_allocated_gb`` is per
#     step) and, while measuring, at each window; that resets the counter user code reads with
#     ``torch.cuda.max_memory_allocated``. Every reset goes through ``reset_cuda_peak``, which first
#     folds the counter into a running maximum per device; ``max_memory_allocated`` is the peak since
#     the process started (or since the caller's own ``torch.cuda.reset_peak_memory_stats`` before
#     the run: call ``reset_cuda_peak(device, forget=True)`` instead, which clears the running maximum
#     too), as if nothing had been reset.
_RUNNING_PEAK: dict[int, int] = {}
_RUNNING_RESERVED: dict[int, int] = {}  # the same for max_memory_reserved (what runs out of memory)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def reset_cuda_peak(device: torch.device, *, forget: bool = False) -> None:
    """``torch.cuda.reset_peak_memory_stats(device)``, keeping the peak so far in the running maximum
    (``forget``: drop that too: a new measurement starts here)."""
    i = _index(device)
    kept = 0 if forget else max(_RUNNING_PEAK.get(i, 0), int(torch.cuda.max_memory_allocated(device)))
    _RUNNING_PEAK[i] = kept
    _RUNNING_RESERVED[i] = 0 if forget else max(_RUNNING_RESERVED.get(i, 0), int(torch.cuda.max_memory_reserved(device)))
    torch.cuda.reset_peak_memory_stats(device)


def max_memory_allocated(device: torch.device | str | int | None = None) -> int:
    """The CUDA allocator's peak bytes on ``device`` across the executor's resets (Note: [peaks across
    resets]): what ``torch.cuda.max_memory_allocated`` would say had no one reset it."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return max(_RUNNING_PEAK.get(_index(device), 0), int(torch.cuda.max_memory_allocated(device)))


def max_memory_reserved(device: torch.device | str | int | None = None) -> int:
    """The CUDA allocator's peak reserved bytes across the executor's resets (as ``max_memory_allocated``)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return max(_RUNNING_RESERVED.get(_index(device), 0), int(torch.cuda.max_memory_reserved(device)))


_DISPATCH_COST: float | None = None


def dispatch_cost() -> float:
    """Seconds a ``TorchDispatchMode`` adds to each op it sees, besides its own body (the trip into Python
    and back), measured once per process: small ops with an empty mode against the same ops without."""
    global _DISPATCH_COST
    if _DISPATCH_COST is None:
        class _Empty(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                return func(*args, **(kwargs or {}))

        a, n = torch.ones(4), 500

        def run() -> float:
            t = time.perf_counter()
            for _ in range(n):
                torch.add(a, a)
            return time.perf_counter() - t

        plain, moded = [], []
        for _ in range(5):
            plain.append(run())
            with _Empty():
                moded.append(run())
        _DISPATCH_COST = max(0.0, (min(moded) - min(plain)) / n)
    return _DISPATCH_COST


class LiveBytes(TorchDispatchMode):
    """Bytes of storages allocated (by ops in this thread) while active and still alive.

    Note: [the tracker's own time] The mode costs the ops it sees time (on a small model it doubles a step:
    ~6 us per op to enter it, ~14 us of its bookkeeping). ``overhead_s`` is that time so far: its body's
    measured seconds after each op plus ``dispatch_cost()`` per op. A profiled step on the CPU runs under
    it; with ``Executor.tracker_time_out`` (off by default: see its comment) its trace takes that time out of
    the compute it times (``StepTrace(overhead=...)``), so the plan prices the compute a step without the
    tracker runs."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._paused = 0
        self._seen: set[int] = set()
        self.on_change: Any = None  # called after every allocation (for peaks of derived figures)
        self.overhead_s = 0.0
        self._fixed = dispatch_cost()

    def reset_peak(self) -> None:
        self.peak = self.current

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _freed(self, key: int, nbytes: int) -> None:
        t = time.perf_counter()
        self._seen.discard(key)
        self.current -= nbytes
        self.overhead_s += time.perf_counter() - t + self._fixed  # the finalizer's call: a trip into Python too

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        t = time.perf_counter()
        try:
            return self._count(out, args, kwargs)
        finally:
            self.overhead_s += time.perf_counter() - t + self._fixed

    def _count(self, out: Any, args: tuple, kwargs: dict | None) -> Any:
        if self._paused:
            return out
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        grew = False
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            key = id(storage)
            if ptr in inputs or key in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(key)
            nbytes = storage.nbytes()
            self.current += nbytes
            weakref.finalize(storage, self._freed, key, nbytes)
            grew = True
        if grew:
            self.peak = max(self.peak, self.current)
            if self.on_change is not None:
                self.on_change()
        return out


class DeviceBytes:
    """One interface over both: ``current``/``peak`` bytes allocated since ``start()`` (CPU: by
    tracked ops; CUDA: the allocator's counters, whole device), ``mark()`` starts a new peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.live: LiveBytes | None = None
        self._exit = contextlib.ExitStack()

    def start(self) -> None:
        if self.device.type == "cuda":
            reset_cuda_peak(self.device)
        else:
            self.live = self._exit.enter_context(LiveBytes())

    def stop(self) -> None:
        self._exit.close()

    def paused(self) -> contextlib.AbstractContextManager:
        return self.live.paused() if self.live is not None else contextlib.nullcontext()

    @property
    def overhead_s(self) -> float:
        """The CPU tracker's own time so far (Note: [the tracker's own time]); 0 on CUDA."""
        return self.live.overhead_s if self.live is not None else 0.0

    @property
    def current(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return self.live.current if self.live is not None else 0

    @property
    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.live.peak if self.live is not None else 0

    def mark(self) -> None:
        if self.device.type == "cuda":
            reset_cuda_peak(self.device)
        elif self.live is not None:
            self.live.reset_peak()
