"""Copy engine: one interface for every byte the engine moves.

Four copy lanes, each FIFO: ``h2d`` and ``d2h`` (host <-> device), ``nvme_read`` and
``nvme_write`` (host <-> spill files); and a ``host`` lane (one worker thread) for host-side work
that belongs to the copies (casting masters into the H2D staging, accumulating landed gradients)
so that it runs off the thread that launches compute. Every copy returns a :class:`CopyHandle`
(``wait()`` / ``done()``), bumps a per-lane byte counter and, once finished,
leaves a :class:`CopyRecord` with perf_counter start/end times, so a step's
measured transfer timeline can be compared with the planner's model.

Backends (pick with ``copy_factory.make_copy_engine``):

* CUDA (``copy_cuda.py``): dedicated H2D and D2H streams, events, pinned memory.
* CPU  (``copy_cpu.py``): one worker thread per lane. Optional link emulation
  (:class:`LinkSpec`) makes a copy of n bytes take ``latency + n / bandwidth``
  wall time, so overlap and ordering can be tested without a GPU.

The NVMe lanes are worker threads in both backends (file I/O is a host thing);
the file format and O_DIRECT handling live in ``nvme.py``.

Dependencies: every copy takes ``after=`` handles that must finish before it
starts. Within one lane the order is the submission order. The lanes that run on the host are
each a ``worker.Worker`` (a failed copy fails the lane's later copies until ``synchronize``:
Note: [one worker, one error rule]); the handle types and ``CopyError`` live in worker.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_lazytrain.engine.worker import CopyError, CopyHandle, DoneHandle, ThreadHandle, Worker

log = logging.getLogger(__name__)

__all__ = [
    "LANES",
    "CopyEngine",
    "CopyError",
    "CopyHandle",
    "CopyRecord",
    "DoneHandle",
    "Lane",
    "LinkSpec",
    "ThreadHandle",
    "copy_through",
    "link_bytes",
    "nbytes_of",
]

Lane = Literal["h2d", "d2h", "nvme_read", "nvme_write", "host"]
LANES: tuple[Lane, ...] = ("h2d", "d2h", "nvme_read", "nvme_write", "host")


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Note: [conversion on the device] A copy may change dtype on the device side of the link: an H2D of
# fp32 masters into a 16-bit slot crosses the link in fp32 and is cast by the device, a D2H of 16-bit
# gradients into an fp32 host buffer is widened by the device and crosses in fp32 (the plan decides
# per parameter group: planner/placement.py). ``via`` is a device buffer in the link's dtype (src's
# for an H2D, dst's for a D2H) through which the copy runs in chunks of ``via.numel()`` elements, so
# the device holds one bounded buffer per lane, not a copy of the tensor; on the copy's own stream
# (or lane thread), so chunk k+1 reuses the buffer after chunk k is done with it. A cast is the same
# rounding wherever it runs: the result is bit-identical to casting on the host.
def copy_through(lane: str, dst: torch.Tensor, src: torch.Tensor, via: torch.Tensor | None, *,
                 non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for a copy of ``lane``, converted on the device side through ``via``."""
    if via is None:
        dst.copy_(src, non_blocking=non_blocking)
        return
    d, s, step = dst.reshape(-1), src.reshape(-1), via.numel()
    for i in range(0, d.numel(), step):
        k = min(step, d.numel() - i)
        buf = via[:k]
        if lane == "h2d":  # the link in src's dtype, then the device casts
            buf.copy_(s[i:i + k], non_blocking=non_blocking)
            d[i:i + k].copy_(buf)
        else:  # the device casts, then the link in dst's dtype
            buf.copy_(s[i:i + k])
            d[i:i + k].copy_(buf, non_blocking=non_blocking)


def link_bytes(lane: str, dst: torch.Tensor, src: torch.Tensor, via: torch.Tensor | None) -> int:
    """Bytes a copy moves over its link: the source's, or through ``via`` the link dtype's."""
    return nbytes_of(src) if via is None else src.numel() * via.element_size()


@dataclass(frozen=True)
class LinkSpec:
    """An emulated link: a copy of n bytes takes ``latency_s + n / bandwidth``."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")

    def duration_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class CopyRecord:
    """One finished copy on the measured timeline (times from time.perf_counter)."""

    lane: Lane
    nbytes: int
    start: float
    end: float
    tag: str | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


class LaneWorker:
    """One copy lane on a ``Worker`` (worker.py: FIFO, Note: [one worker, one error rule]): each job
    is timed from the end of its waits, lasts at least what ``link`` gives its bytes (emulation),
    and leaves a ``CopyRecord``."""

    def __init__(self, engine: CopyEngine, lane: Lane, link: LinkSpec | None) -> None:
        self.engine = engine
        self.lane = lane
        self.link = link
        self.worker = Worker(f"lazytrain-{lane}")

    def submit(
        self,
        nbytes: int,
        fn: Callable[[], object],
        after: Sequence[CopyHandle],
        tag: str | None,
        keep: tuple[Any, ...],
    ) -> ThreadHandle:
        def run() -> None:
            start = time.perf_counter()
            fn()
            if self.link is not None:
                # Emulated link: the real copy already happened; sleep for
                # whatever is left of latency + n / bandwidth.
                remaining = start + self.link.duration_s(nbytes) - time.perf_counter()
                if remaining > 0:
                    time.sleep(remaining)
            end = time.perf_counter()
            self.engine._add_record(CopyRecord(self.lane, nbytes, start, end, tag))

        return self.worker.submit(run, lane=self.lane, nbytes=nbytes, after=after, keep=keep)

    def close(self) -> None:
        self.worker.close()


class CopyEngine(ABC):
    """Backend-independent part: counters, records, NVMe lanes, bookkeeping."""

    kind: str = "abstract"

    def __init__(self, links: Mapping[str, LinkSpec] | None = None) -> None:
        links = dict(links or {})
        unknown = set(links) - set(LANES)
        if unknown:
            raise ValueError(f"unknown lane(s) {sorted(unknown)} in links; lanes are {LANES}")
        self.links: dict[str, LinkSpec] = links
        self._stats_lock = threading.Lock()
        self._bytes: dict[str, int] = dict.fromkeys(LANES, 0)
        self._count: dict[str, int] = dict.fromkeys(LANES, 0)
        self._records: list[CopyRecord] = []
        self._pending: list[CopyHandle] = []
        self._closed = False
        # the lanes that run on the host (Note: [one worker, one error rule] in worker.py); the CPU
        # backend adds h2d and d2h
        self._workers: dict[str, LaneWorker] = {
            lane: LaneWorker(self, lane, links.get(lane)) for lane in ("nvme_read", "nvme_write", "host")
        }

    # ---- statistics -------------------------------------------------------
    @property
    def bytes_moved(self) -> dict[str, int]:
        """Bytes submitted per lane since the last reset_stats()."""
        with self._stats_lock:
            return dict(self._bytes)

    @property
    def copies(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._count)

    def records(self) -> list[CopyRecord]:
        """Finished copies, ordered by start time."""
        with self._stats_lock:
            return sorted(self._records, key=lambda r: r.start)

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._bytes = dict.fromkeys(LANES, 0)
            self._count = dict.fromkeys(LANES, 0)
            self._records = []

    @contextlib.contextmanager
    def paused_stats(self) -> Iterator[None]:
        """The copies made inside are not counted: bytes, counts and records as they were before (an
        evaluation between an accumulated step's micro-batches is not part of the step)."""
        self.synchronize()
        with self._stats_lock:
            saved = dict(self._bytes), dict(self._count), len(self._records)
        try:
            yield
        finally:
            self.synchronize()
            with self._stats_lock:
                self._bytes, self._count = saved[0], saved[1]
                del self._records[saved[2]:]

    def _add_record(self, record: CopyRecord) -> None:
        with self._stats_lock:
            self._records.append(record)

    def _track(self, handle: CopyHandle) -> CopyHandle:
        with self._stats_lock:
            self._bytes[handle.lane] += handle.nbytes
            self._count[handle.lane] += 1
            self._pending = [h for h in self._pending if not h.done()]
            self._pending.append(handle)
        return handle

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("copy engine is closed")

    # ---- copies -----------------------------------------------------------
    @abstractmethod
    def h2d(
        self, dst: torch.Tensor, src: torch.Tensor, *, after: Iterable[CopyHandle] = (), tag: str | None = None,
        via: torch.Tensor | None = None,
    ) -> CopyHandle:
        """Copy host ``src`` into device ``dst`` (shapes must match; dtypes may differ); with ``via``
        (a device buffer of src's dtype) the device casts (Note: [conversion on the device])."""

    @abstractmethod
    def d2h(
        self, dst: torch.Tensor, src: torch.Tensor, *, after: Iterable[CopyHandle] = (), tag: str | None = None,
        via: torch.Tensor | None = None,
    ) -> CopyHandle:
        """Copy device ``src`` into host ``dst``. Ordered after work already queued on the compute stream;
        with ``via`` (a device buffer of dst's dtype) the device casts before the copy."""

    def nvme_write(
        self,
        path: str | os.PathLike[str],
        src: torch.Tensor,
        *,
        direct: bool = False,
        after: Iterable[CopyHandle] = (),
        tag: str | None = None,
    ) -> CopyHandle:
        """Write the bytes of host tensor ``src`` to ``path`` (overwriting it)."""
        from lightning_lazytrain.engine.nvme import write_tensor

        self._check_open()
        if src.device.type != "cpu":
            raise ValueError(f"nvme_write needs a host tensor, got one on {src.device}")
        fpath = os.fspath(path)
        worker = self._workers["nvme_write"]
        h = worker.submit(nbytes_of(src), lambda: _spill_io("writing", fpath, write_tensor, src, direct), list(after),
                          tag, (src,))
        return self._track(h)

    def nvme_read(
        self,
        path: str | os.PathLike[str],
        dst: torch.Tensor,
        *,
        direct: bool = False,
        after: Iterable[CopyHandle] = (),
        tag: str | None = None,
    ) -> CopyHandle:
        """Fill host tensor ``dst`` (contiguous) with the first bytes of ``path``."""
        from lightning_lazytrain.engine.nvme import read_tensor

        self._check_open()
        if dst.device.type != "cpu" or not dst.is_contiguous():
            raise ValueError("nvme_read needs a contiguous host tensor as destination")
        fpath = os.fspath(path)
        worker = self._workers["nvme_read"]
        h = worker.submit(nbytes_of(dst), lambda: _spill_io("reading", fpath, read_tensor, dst, direct), list(after),
                          tag, (dst,))
        return self._track(h)

    def host(self, fn: Callable[[], object], *, after: Iterable[CopyHandle] = (), tag: str | None = None,
             nbytes: int = 0) -> CopyHandle:
        """Run ``fn()`` on the host lane's worker thread after ``after``; FIFO with other host work.
        A device copy may take the returned handle as ``after=`` (CUDA: dispatched when it is done).
        ``nbytes``: host bytes the work touches (for the timeline; the lane's byte counter)."""
        self._check_open()

        def run() -> None:
            with torch.no_grad():
                fn()

        h = self._workers["host"].submit(nbytes, run, list(after), tag, ())
        return self._track(h)

    # ---- one clock for compute and copies --------------------------------------------------
    def stamp(self) -> Any:
        """A timestamp of the compute stream's progress, on the clock copy records use: on CPU the
        host's ``perf_counter`` (compute is synchronous); on CUDA an event recorded on the compute
        stream (see ``CudaCopyEngine``), resolved by ``stamp_seconds`` once it has completed."""
        return time.perf_counter()

    def stamp_seconds(self, stamp: Any) -> float:
        """``perf_counter`` seconds of a ``stamp`` (waits for a CUDA event to complete)."""
        return float(stamp)

    def record_compute(self) -> CopyHandle:
        """A handle that finishes when the work queued so far on the compute stream has.

        Pass it as ``after=`` to a copy that overwrites a buffer compute may still read.
        On CPU, compute is synchronous, so this is already done.
        """
        return DoneHandle()

    def new_device_buffer(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A fresh device tensor that is safe to fill with ``h2d`` (see copy_cuda.py)."""
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def synchronize(self) -> None:
        """Wait for every copy submitted so far; then re-raise the first failure. The lanes a failed
        copy stopped run again afterwards (Note: [one worker, one error rule] in worker.py)."""
        with self._stats_lock:
            pending, self._pending = self._pending, []
        first: CopyError | None = None
        for h in pending:
            try:
                h.wait()
            except CopyError as err:
                first = first or err
        for w in self._workers.values():
            w.worker.clear()
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for the copies in flight and stop the workers. Never raises for a failed copy: the
        failure was (or will never be) reported where the copy was waited for; closing must still
        release threads and buffers."""
        if self._closed:
            return
        try:
            self.synchronize()
        except CopyError as err:
            log.warning("closing the copy engine after a failed copy: %s", err)
        finally:
            self._closed = True
            self._close_workers()

    def _close_workers(self) -> None:
        for w in self._workers.values():
            w.close()

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _spill_io(what: str, path: str, fn: Callable[..., Any], t: torch.Tensor, direct: bool) -> None:
    """Run a spill-file transfer; an OS error (or a truncated file) becomes ``nvme.SpillIOError``: one
    sentence naming the transfer, the file, the OS error and the fix that fits it."""
    from lightning_lazytrain.engine.nvme import spill_io_error

    try:
        fn(path, t, direct=direct)
    except (OSError, EOFError) as err:
        raise spill_io_error(what == "writing", path, err) from err
