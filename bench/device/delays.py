"""Delay injection for race hunting (the ``delays`` stage; ``kit.Delays`` re-exports it): copies and
compute made late at class level, so a missing wait shows as other numbers or an error, and a correct
executor stays bitwise equal."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

import torch


class Delays:
    """Delay injection for race hunting, wrapped around the package at class level (the package
    has no hook of its own):

    * CUDA copies: ``torch.cuda._sleep(cycles)`` on the copy stream just before each H2D/D2H, after
      the copy's waits (``CudaCopyEngine.before_copy``), so the copy itself lands late;
    * host copy lanes (NVMe lanes on both backends, every lane of the CPU engine): a
      ``time.sleep`` inside the lane's worker right before the copy (``LaneWorker.submit``);
    * compute: at each ``ParamStore.bind``, after the bind has made the compute stream wait for
      the weights, ``torch.cuda._sleep`` on the compute stream (CUDA) or ``time.sleep`` (CPU),
      so the compute that reads the slot runs late.

    ``copy_s``/``compute_s``: delay per event in seconds; ``jitter``: each delay is drawn
    uniformly from [0, 2 x delay] with ``random.Random(seed)`` instead of being fixed.
    """

    def __init__(self, device: str, *, copy_s: float = 0.0, compute_s: float = 0.0, jitter: bool = False,
                 seed: int = 0, cycles_per_s: float | None = None) -> None:
        self.device, self.copy_s, self.compute_s, self.jitter = device, copy_s, compute_s, jitter
        self.rng = random.Random(seed)
        self.cycles_per_s = cycles_per_s
        self.counts = {"gpu_copy": 0, "host_copy": 0, "compute": 0}
        self.injected_s = 0.0

    def _draw(self, base: float) -> float:
        return self.rng.uniform(0, 2 * base) if self.jitter else base

    def _gpu_sleep(self, seconds: float) -> None:
        assert self.cycles_per_s is not None
        cycles = int(seconds * self.cycles_per_s)
        if cycles > 0:
            torch.cuda._sleep(cycles)
        self.injected_s += seconds

    @contextlib.contextmanager
    def installed(self) -> Iterator[Delays]:
        from lightning_lazytrain.engine import copy_engine, param_store

        patches: list[tuple[Any, str, Any]] = []
        me = self

        if self.copy_s > 0:
            orig_submit = copy_engine.LaneWorker.submit

            def submit(worker, nbytes, fn, *rest, **kw):
                d = me._draw(me.copy_s)
                me.counts["host_copy"] += 1
                me.injected_s += d

                def late() -> object:
                    time.sleep(d)
                    return fn()

                return orig_submit(worker, nbytes, late, *rest, **kw)

            patches.append((copy_engine.LaneWorker, "submit", submit))
            if self.device == "cuda":
                from lightning_lazytrain.engine import copy_cuda

                def before_copy(lane: str) -> None:  # on the copy stream, after the copy's waits
                    me.counts["gpu_copy"] += 1
                    me._gpu_sleep(me._draw(me.copy_s))

                patches.append((copy_cuda.CudaCopyEngine, "before_copy", staticmethod(before_copy)))

        if self.compute_s > 0:
            orig_bind = param_store.ParamStore.bind

            @contextlib.contextmanager
            def bind(store, *args, **kw):
                with orig_bind(store, *args, **kw):
                    me.counts["compute"] += 1
                    d = me._draw(me.compute_s)
                    if store.device.type == "cuda":
                        me._gpu_sleep(d)
                    else:
                        time.sleep(d)
                        me.injected_s += d
                    yield

            patches.append((param_store.ParamStore, "bind", bind))

        # a class's own attribute, or none (the method is a mixin's: ParamStore.bind is ParamBinding's), put back after
        saved = [(obj, attr, obj.__dict__.get(attr, _INHERITED)) for obj, attr, _ in patches]
        try:
            for obj, attr, fn in patches:
                setattr(obj, attr, fn)
            yield self
        finally:
            for obj, attr, fn in saved:
                if fn is _INHERITED:
                    delattr(obj, attr)
                else:
                    setattr(obj, attr, fn)


_INHERITED = object()  # Delays.installed: the patched class had no attribute of its own


def cuda_cycles_per_s() -> float:
    """Clock cycles per second of ``torch.cuda._sleep`` on this GPU (measured)."""
    n = 1_000_000
    torch.cuda._sleep(n)  # warm-up
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10 * n)
    b.record()
    b.synchronize()
    return 10 * n / (a.elapsed_time(b) / 1e3)
