"""CUDA copy engine: dedicated H2D / D2H streams, events, pinned host memory.

Only constructed for a CUDA device; importing this module never touches CUDA,
so it is safe on CPU-only machines.

Note: [d2h waits for producer]
    A D2H copy reads a tensor that kernels on the caller's compute stream may
    still be writing. At submission time we record an event on the caller's
    current stream and make the D2H stream wait on it, so the copy sees every
    write queued before the call (and none queued after: compute keeps going).

Note: [allocator ownership]
    The caching allocator hands memory back per stream. A handle references
    the device-side tensor of its copy until the copy is done, so dropping it
    early is safe. An h2d dst also gets ``record_stream(copy_stream)``. A d2h
    src does not: the activation store lets an offloaded boundary go at the
    end of the window the plan gives its offload, after the compute stream
    waits for the copy (``sync_current_stream()`` then ``release_device()``);
    from then on compute-stream order alone keeps the memory safe, and it is
    reusable at once (a recorded copy stream would hold it until every copy
    queued behind it on the D2H stream finished, past what the plan counts).
    Conversely, buffers from
    ``new_device_buffer`` are allocated *on* the H2D stream (so the copy need
    not wait for unrelated compute that last used that memory) and get
    ``record_stream(consumer_stream)`` when the consumer syncs on the handle.

Note: [keep host memory alive]
    The pinned caching host allocator only protects blocks it allocated itself;
    a handle therefore references its source and destination until the end
    event has completed (released on wait() or when reaped after query()).

Note: [h2d buffer reuse]
    An H2D into a buffer that compute may still read (a double-buffer slot) is
    a write-after-read hazard the engine cannot see. The caller passes
    ``after=[engine.record_compute()]`` taken when compute was done with it.

Note: [deferred dispatch]
    A CUDA copy that depends on a host-side handle (an NVMe read) cannot be
    enqueued until that read finished. Instead of blocking the caller, it is
    enqueued by the finishing thread via a done-callback; ``wait()`` and
    ``sync_current_stream()`` first wait for the dispatch.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from lightning_lazytrain.engine.copy_engine import CopyEngine, CopyRecord, Lane, LinkSpec, copy_through, link_bytes
from lightning_lazytrain.engine.worker import CopyError, CopyHandle, ThreadHandle

__all__ = ["CudaCopyEngine", "CudaHandle"]


class CudaHandle(CopyHandle):
    """A copy enqueued (or to be enqueued, see [deferred dispatch]) on a copy stream."""

    def __init__(
        self, lane: Lane, nbytes: int, keep: tuple[Any, ...], consumer: torch.Tensor | None, tag: str | None
    ) -> None:
        self.lane = lane
        self.nbytes = nbytes
        self.tag = tag
        self._keep: tuple[Any, ...] | None = keep
        self._consumer = consumer  # device tensor that compute will read (h2d dst)
        self._lock = threading.Lock()
        self._dispatched = threading.Event()
        self._on_dispatch: list[Callable[[CudaHandle], None]] = []
        self._exc: BaseException | None = None
        self.start_event: torch.cuda.Event | None = None
        self.end_event: torch.cuda.Event | None = None

    @classmethod
    def after_event(cls, lane: Lane, nbytes: int, end: torch.cuda.Event, tag: str | None = None) -> CudaHandle:
        """A handle for work already queued on some stream that finishes when ``end`` (recorded
        after it) has completed: compute so far (``record_compute``), a collective on a side stream
        (shard_grads.py)."""
        h = cls(lane, nbytes, (), consumer=None, tag=tag)
        h._set_dispatched(None, end)
        return h

    # -- dispatch state ---------------------------------------------------
    def _set_dispatched(self, start: torch.cuda.Event | None, end: torch.cuda.Event | None,
                        exc: BaseException | None = None) -> None:
        with self._lock:
            self.start_event, self.end_event, self._exc = start, end, exc
            if exc is not None:
                self._keep = None
            self._dispatched.set()
            callbacks, self._on_dispatch = self._on_dispatch, []
        for cb in callbacks:
            cb(self)

    def when_dispatched(self, fn: Callable[[CudaHandle], None]) -> None:
        with self._lock:
            if not self._dispatched.is_set():
                self._on_dispatch.append(fn)
                return
        fn(self)

    @property
    def exception(self) -> BaseException | None:
        return self._exc

    def _raise(self) -> None:
        if self._exc is not None:
            raise CopyError.of(self.lane, self.nbytes, self._exc) from self._exc

    # -- CopyHandle -------------------------------------------------------
    def done(self) -> bool:
        if not self._dispatched.is_set():
            return False
        return self._exc is not None or self.end_event is None or self.end_event.query()

    def wait(self) -> None:
        self._dispatched.wait()
        self._raise()
        if self.end_event is not None:
            self.end_event.synchronize()
        if self._consumer is not None:  # host-synchronised, but compute may use it next
            self._protect_consumer(torch.cuda.current_stream(self._consumer.device))
        self._release()

    def sync_current_stream(self) -> None:
        self._dispatched.wait()
        self._raise()
        stream = torch.cuda.current_stream(self._device())
        if self.end_event is not None:
            stream.wait_event(self.end_event)
        self._protect_consumer(stream)

    def _device(self) -> torch.device | None:
        return self._consumer.device if self._consumer is not None else None

    def _protect_consumer(self, stream: torch.cuda.Stream) -> None:
        # See Note: [allocator ownership] (consumer side).
        if self._consumer is not None:
            self._consumer.record_stream(stream)

    def _release(self) -> None:
        self._keep = None

    def release_device(self) -> None:
        with self._lock:
            if self._keep is not None:
                self._keep = tuple(t for t in self._keep if not (isinstance(t, torch.Tensor) and t.is_cuda))


class CudaCopyEngine(CopyEngine):
    kind = "cuda"

    # A test hook (the device kit's delay injection), a static function of the lane: called on the
    # copy stream after the copy's waits and right before it, so work it queues delays the copy itself.
    before_copy: Callable[[str], None] | None = None

    def __init__(self, device: torch.device, links: Mapping[str, LinkSpec] | None = None,
                 *, timeline: bool = True) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyEngine needs CUDA; use the CPU engine (make_copy_engine('cpu'))")
        links = dict(links or {})
        if {"h2d", "d2h"} & set(links):
            raise ValueError("link emulation of h2d/d2h is CPU-only; the CUDA engine uses the real PCIe lanes")
        super().__init__(links)
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.timeline = timeline
        with torch.cuda.device(self.device):
            self._streams = {"h2d": torch.cuda.Stream(self.device), "d2h": torch.cuda.Stream(self.device)}
            # Anchor for converting event times to perf_counter time.
            self._ref_event = torch.cuda.Event(enable_timing=True)
            self._ref_event.record(self._streams["h2d"])
            self._ref_event.synchronize()
            self._ref_host = time.perf_counter()
        self._inflight: list[CudaHandle] = []
        self._inflight_lock = threading.Lock()
        self._warned_pageable = False

    @property
    def h2d_stream(self) -> torch.cuda.Stream:
        return self._streams["h2d"]

    def _warn_pageable(self, what: str) -> None:
        if not self._warned_pageable:
            self._warned_pageable = True
            warnings.warn(f"{what} is not pinned: the copy is synchronous and slow; use pinned host buffers",
                          stacklevel=3)

    # ---- submission ------------------------------------------------------
    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, after: Iterable[CopyHandle] = (),
            tag: str | None = None, via: torch.Tensor | None = None) -> CopyHandle:
        self._check_open()
        if dst.device.type != "cuda" or src.device.type != "cpu" or dst.shape != src.shape:
            raise ValueError(f"h2d needs same-shape host src -> cuda dst, got {src.device}{tuple(src.shape)} "
                             f"-> {dst.device}{tuple(dst.shape)}")
        if not src.is_pinned():
            self._warn_pageable("h2d source")
        h = CudaHandle("h2d", link_bytes("h2d", dst, src, via), (dst, src, via), consumer=dst, tag=tag)
        return self._submit(h, dst, src, device_side=dst, extra_wait=None, after=list(after), via=via)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, after: Iterable[CopyHandle] = (),
            tag: str | None = None, via: torch.Tensor | None = None) -> CopyHandle:
        self._check_open()
        if src.device.type != "cuda" or dst.device.type != "cpu" or dst.shape != src.shape:
            raise ValueError(f"d2h needs same-shape cuda src -> host dst, got {src.device}{tuple(src.shape)} "
                             f"-> {dst.device}{tuple(dst.shape)}")
        if not dst.is_pinned():
            self._warn_pageable("d2h destination")
        # See Note: [d2h waits for producer] - captured now, on the caller's stream.
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(src.device))
        h = CudaHandle("d2h", link_bytes("d2h", dst, src, via), (dst, src, via), consumer=None, tag=tag)
        return self._submit(h, dst, src, device_side=src, extra_wait=produced, after=list(after), via=via)

    def _submit(self, h: CudaHandle, dst: torch.Tensor, src: torch.Tensor, *, device_side: torch.Tensor,
                extra_wait: torch.cuda.Event | None, after: Sequence[CopyHandle],
                via: torch.Tensor | None = None) -> CopyHandle:
        stream = self._streams[h.lane]

        def issue() -> None:
            try:
                for d in after:
                    cause = d.exception if isinstance(d, (CudaHandle, ThreadHandle)) else None
                    if cause is not None:  # the copy that failed first names itself
                        raise CopyError.of(d.lane, d.nbytes, cause) from cause
                with torch.cuda.device(self.device):
                    if extra_wait is not None:
                        stream.wait_event(extra_wait)
                    for d in after:
                        if isinstance(d, CudaHandle) and d.end_event is not None:
                            stream.wait_event(d.end_event)
                    start = torch.cuda.Event(enable_timing=self.timeline)
                    end = torch.cuda.Event(enable_timing=self.timeline)
                    with torch.cuda.stream(stream), torch.no_grad():
                        if self.before_copy is not None:
                            self.before_copy(h.lane)
                        start.record(stream)
                        copy_through(h.lane, dst, src, via, non_blocking=True)  # Note: [conversion on the device]
                        end.record(stream)
                    if h.lane == "h2d":
                        device_side.record_stream(stream)  # Note: [allocator ownership]
            except BaseException as e:  # noqa: BLE001 - delivered to the waiter
                h._set_dispatched(None, None, e)
            else:
                h._set_dispatched(start, end)

        # See Note: [deferred dispatch]. Host handles must be done, CUDA
        # handles only enqueued (the stream waits on their end event).
        blockers: list[CopyHandle] = []
        for d in after:
            if isinstance(d, CudaHandle):
                if not d._dispatched.is_set():
                    blockers.append(d)
            elif isinstance(d, ThreadHandle):
                if not d.done():
                    blockers.append(d)
            else:
                raise TypeError(f"unsupported dependency handle {type(d).__name__}")
        if not blockers:
            issue()
        else:
            remaining = [len(blockers)]
            lock = threading.Lock()

            def on_ready(_: object) -> None:
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    issue()

            for d in blockers:
                if isinstance(d, CudaHandle):
                    d.when_dispatched(on_ready)
                else:
                    assert isinstance(d, ThreadHandle)
                    d.add_done_callback(on_ready)
        with self._inflight_lock:
            self._inflight.append(h)
        self._reap()
        return self._track(h)

    def record_compute(self) -> CopyHandle:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return CudaHandle.after_event("h2d", 0, ev, tag="compute")

    def new_device_buffer(self, shape: Sequence[int], dtype: torch.dtype,
                          device: torch.device | str) -> torch.Tensor:
        # See Note: [allocator ownership]: owned by the H2D stream.
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d_stream):
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    # ---- timeline ----------------------------------------------------------
    # Note: [one clock] Compute segments are timed with events on the compute stream, converted
    # with the same anchor as the copies' events, so a timeline compares device times with device
    # times (host timestamps would show kernel launches, not their execution).
    def stamp(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def stamp_seconds(self, stamp: Any) -> float:
        if not isinstance(stamp, torch.cuda.Event):
            return float(stamp)
        stamp.synchronize()
        return self._ref_host + self._ref_event.elapsed_time(stamp) / 1e3

    def _reap(self) -> None:
        """Turn finished copies into records and drop their references."""
        with self._inflight_lock:
            finished = [h for h in self._inflight if h.done()]
            gone = {id(h) for h in finished}
            self._inflight = [h for h in self._inflight if id(h) not in gone]
        for h in finished:
            if self.timeline and h.exception is None and h.start_event is not None and h.end_event is not None:
                start = self._ref_host + self._ref_event.elapsed_time(h.start_event) / 1e3
                end = self._ref_host + self._ref_event.elapsed_time(h.end_event) / 1e3
                self._add_record(CopyRecord(h.lane, h.nbytes, start, end, h.tag))
            h._release()

    def records(self) -> list[CopyRecord]:
        self._reap()
        return super().records()

    def synchronize(self) -> None:
        super().synchronize()
        self._reap()
