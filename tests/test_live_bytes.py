"""Note: [peaks across resets] (engine/live_bytes.py): the executor's per-step resets of CUDA's peak
counter keep the run's peak, read back with ``live_bytes.max_memory_allocated``. The CUDA counters are
replaced by a fake allocator here, so the bookkeeping runs on CPU; tests/test_device_kit.py's GPU run
reads it on a real device."""

from __future__ import annotations

import torch

from lightning_lazytrain.engine import live_bytes


class FakeAllocator:
    def __init__(self) -> None:
        self.current, self.peak = 0, 0

    def alloc(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n: int) -> None:
        self.current -= n

    def reset(self, device=None) -> None:
        self.peak = self.current


def test_the_peak_survives_the_executors_resets(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    monkeypatch.setattr(live_bytes, "_RUNNING_PEAK", {})
    dev = torch.device("cuda", 0)
    live_bytes.reset_cuda_peak(dev, forget=True)  # a measurement starts
    fake.alloc(700)
    fake.free(600)  # step 1 peaked at 700
    live_bytes.reset_cuda_peak(dev)  # the executor's next step
    assert torch.cuda.max_memory_allocated(dev) == 100  # what a bare reset leaves a user
    fake.alloc(300)
    fake.free(300)
    live_bytes.reset_cuda_peak(dev)
    fake.alloc(50)
    assert live_bytes.max_memory_allocated(dev) == 700  # the run's peak, as if nothing was reset
    fake.alloc(800)
    assert live_bytes.max_memory_allocated(dev) == 950
    live_bytes.reset_cuda_peak(dev, forget=True)  # a new measurement forgets the old peak
    assert live_bytes.max_memory_allocated(dev) == 950  # the current bytes
    fake.free(900)
    assert live_bytes.max_memory_allocated(dev) == 950
    live_bytes.reset_cuda_peak(dev, forget=True)
    assert live_bytes.max_memory_allocated(dev) == 50
