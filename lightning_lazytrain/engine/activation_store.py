"""Activation store: boundary activations kept on GPU, CPU or NVMe.

The planner decides, per block boundary, where the boundary activation lives
between the forward and the backward pass (or that it is recomputed, which is
not the store's business). The executor then calls

    offload(key, x, tier)   # forward: hand the activation over
    prefetch(key)           # backward, ahead of time: start bringing it back
    get(key)                # backward: the device tensor (waits / stream-syncs)
    free(key)               # done with it
    end_step()              # drop everything, delete this step's spill files

Data paths (the same on the CPU backend, so the emulated timeline matches):

    GPU : keep the tensor (no copy)
    CPU : d2h into a host buffer            ... h2d back into a fresh device buffer
    NVMe: d2h into a staging buffer, write  ... read into a staging buffer, h2d back

Host buffers come from a pool of page-aligned (pinned on CUDA) byte buffers,
rounded to 4 KiB so O_DIRECT can use them without a bounce copy. Each is a
``HostArena`` of exactly its size class (``host_arena.py``): PyTorch's pinned
allocator would round ``size + 4096`` up to a power of two. Buffers are reused
by size class; at ``end_step`` a class used in the step keeps as many buffers
as the step held at once (a plan that puts fewer boundaries on the host than
the provisional schedule did gives the rest back), classes the step did not
use are kept. ``host_pinned_bytes`` is what the pool holds: for a step's CPU
tier, the sum over its boundaries of their bytes rounded up to 4 KiB (as the
simulator's ``host_bytes`` counts them: ``planner.host_page_bytes``); NVMe staging, as many
buffers as the step had in flight at once (the simulator assumes two of the
largest boundary; nothing here bounds it).

Accounting: ``device_bytes`` counts device memory the store is responsible
for: GPU-tier tensors, sources of offloads still in flight, and prefetched
copies. ``peak_device_bytes`` is its high-water mark (reset with
``reset_peak()``); per-lane bytes come from the copy engine.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from lightning_lazytrain.engine.copy_engine import CopyEngine, CopyHandle, DoneHandle, nbytes_of
from lightning_lazytrain.engine.copy_factory import make_copy_engine
from lightning_lazytrain.engine.host_arena import HostArena
from lightning_lazytrain.engine.nvme import ALIGN, SpillDir

__all__ = ["ActivationStore", "HostBufferPool", "Tier"]


class Tier(str, Enum):
    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"

    @classmethod
    def parse(cls, tier: object) -> Tier:
        """Accept a Tier, a string, or any enum whose name/value is gpu/cpu/nvme."""
        if isinstance(tier, Tier):
            return tier
        raw = getattr(tier, "value", tier)
        for cand in (raw, getattr(tier, "name", None)):
            if isinstance(cand, str) and cand.lower() in cls._value2member_map_:
                return cls(cand.lower())
        raise ValueError(f"unknown activation tier {tier!r}; expected one of gpu, cpu, nvme")


class HostBufferPool:
    """Reusable host byte buffers: 4 KiB aligned, sizes rounded up to 4 KiB, pinned if asked.

    Every buffer is its own ``HostArena`` of exactly its size class (no power-of-two rounding, no
    alignment slack: arenas are page aligned). ``trim()`` gives back what the last step did not need.

    Note: [buffers across batch shapes]
        Under dynamic padding every sequence length is a new size class. A request that may take a
        larger buffer (``get(..., larger=True)``: a host home, read back from its first bytes) takes a
        free one up to ``LARGER`` times its size before a new one is pinned, so a pool that held a long
        batch's buffers serves the shorter ones; an NVMe leg writes and reads the whole buffer and takes
        its exact class. ``trim()`` keeps, per class, only what the last step held at once, and drops
        the free buffers of every class the last step did not use: the pool holds one step's worth
        whatever lengths went before (a class used once stayed for the run before).
    """

    LARGER = 2

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self._arenas: list[HostArena] = []
        self._in_use: dict[int, int] = {}  # size class -> buffers handed out now
        self._high: dict[int, int] = {}  # size class -> most handed out at once since the last trim

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)

    def get(self, nbytes: int, *, larger: bool = False) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (its size class exactly, or with ``larger`` a free one up to
        ``LARGER`` times that: Note: [buffers across batch shapes])."""
        size = self.size_class(nbytes)
        if larger and not self._free.get(size):
            size = min((s for s, bucket in self._free.items() if bucket and size < s <= self.LARGER * size),
                       default=size)
        n = self._in_use[size] = self._in_use.get(size, 0) + 1
        self._high[size] = max(self._high.get(size, 0), n)
        bucket = self._free.get(size)
        if bucket:
            return bucket.pop()
        arena = HostArena(size, pin=self.pin, name=f"activations:{size}")
        self._arenas.append(arena)
        buf = arena.take(size)
        arena.release()  # the buffer holds the memory; it goes when the buffer does
        return buf

    def put(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        self._in_use[size] = max(0, self._in_use.get(size, 0) - 1)
        self._free.setdefault(size, []).append(buf)

    def trim(self) -> None:
        """Keep, per size class, only as many buffers as were used at once since the last trim (none of
        a class unused since then)."""
        for size, bucket in self._free.items():
            keep = max(0, self._high.get(size, 0) - self._in_use.get(size, 0))
            del bucket[keep:]
        self._free = {size: bucket for size, bucket in self._free.items() if bucket}
        self._high = {size: n for size, n in self._in_use.items() if n}
        self._arenas = [a for a in self._arenas if a.alive]

    def clear(self) -> None:
        self._free.clear()
        self._high.clear()
        self._arenas = [a for a in self._arenas if a.alive]

    @property
    def host_pinned_bytes(self) -> int:
        """Bytes of the pool's buffers that exist now (in use or free); pinned on CUDA."""
        return sum(a.reserved_bytes for a in self._arenas)


def _typed(buf: torch.Tensor, shape: torch.Size, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    return buf[:nbytes].view(dtype).view(shape)


@dataclass(eq=False)
class _Entry:
    tier: Tier
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    device: torch.Tensor | None = None  # GPU-tier tensor or prefetched copy (counted)
    src: torch.Tensor | None = None  # offload source, counted until `moved` is done
    host: torch.Tensor | None = None  # CPU tier: pooled buffer holding the bytes
    staging: list[torch.Tensor] | None = None  # NVMe: pooled buffers in flight
    path: Path | None = None
    moved: CopyHandle | None = None  # the d2h that reads `src`
    offload: CopyHandle | None = None  # CPU: the d2h; NVMe: the file write
    prefetch: CopyHandle | None = None
    read: CopyHandle | None = None  # NVMe: the file read of a reload (read_to_host)
    read_buf: torch.Tensor | None = None

    def handles(self) -> list[CopyHandle]:
        return [h for h in (self.moved, self.offload, self.read, self.prefetch) if h is not None]


class ActivationStore:
    """Tensors keyed by id (e.g. boundary index) on three tiers; see module doc."""

    def __init__(
        self,
        device: torch.device | str,
        copy_engine: CopyEngine | None = None,
        nvme_dir: str | os.PathLike[str] | None = None,
        *,
        nvme_required_bytes: int = 0,
        direct_io: bool | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._own_engine = copy_engine is None
        self.engine = copy_engine if copy_engine is not None else make_copy_engine(self.device)
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.pool = HostBufferPool(pin)
        self.spill: SpillDir | None = (
            SpillDir(nvme_dir, nvme_required_bytes, direct=direct_io) if nvme_dir is not None else None
        )
        self._entries: dict[Hashable, _Entry] = {}
        self._device_bytes = 0
        self._peak = 0
        self._closed = False

    # ---- accounting ------------------------------------------------------
    def _count(self, n: int) -> None:
        self._device_bytes += n
        self._peak = max(self._peak, self._device_bytes)

    @property
    def device_bytes(self) -> int:
        self.reap()
        return self._device_bytes

    @property
    def peak_device_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self.reap()
        self._peak = self._device_bytes

    @property
    def bytes_moved(self) -> dict[str, int]:
        return self.engine.bytes_moved

    @property
    def host_pinned_bytes(self) -> int:
        """Host bytes of the pooled buffers (CPU tier and NVMe staging; pinned on CUDA)."""
        return self.pool.host_pinned_bytes

    @property
    def nvme_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.tier is Tier.NVME)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self, key: Hashable) -> int:
        return self._entries[key].nbytes

    def offloaded(self, key: Hashable) -> bool:
        """True once ``key``'s device copy is no longer needed by its offload (or it is gone)."""
        e = self._entries.get(key)
        return e is None or e.moved is None or e.moved.done()

    def reap(self) -> None:
        """Release what finished copies no longer need (sources, staging buffers)."""
        for e in self._entries.values():
            if e.src is not None and e.moved is not None and e.moved.done():
                e.src = None
                self._count(-e.nbytes)
            # A reload's read buffer is still needed after its file read finishes, until the
            # H2D (prefetch) that reads it has been issued and is done.
            if e.staging and all(h.done() for h in e.handles()) and (e.read_buf is None or e.prefetch is not None):
                for buf in e.staging:
                    self.pool.put(buf)
                e.staging = None

    def settle(self, key: Hashable) -> None:
        """Let ``key``'s device source go now, its D2H finished or not: compute waits for that
        copy (CUDA: in stream order, the host does not block; CPU: this thread waits). The plan
        frees an offloaded boundary at the end of its offload window, whatever the copy's speed;
        a late copy costs time there, never memory."""
        e = self._entries.get(key)
        if e is None or e.src is None or e.moved is None:
            return
        e.moved.sync_current_stream()
        e.moved.release_device()
        e.src = None
        self._count(-e.nbytes)

    # ---- API -------------------------------------------------------------
    def offload(self, key: Hashable, tensor: torch.Tensor, tier: Tier | str) -> CopyHandle:
        """Hand ``tensor`` (detached) to the store on ``tier``; the handle finishes when it is there.

        The tensor must not be modified in place before the returned handle is
        done (the copy reads it asynchronously); dropping it is fine.
        """
        self._check_open()
        if key in self._entries:
            raise KeyError(f"activation {key!r} is already stored; free({key!r}) it first")
        t = tensor.detach()
        tier = Tier.parse(tier)
        n = nbytes_of(t)
        e = _Entry(tier, t.shape, t.dtype, n)
        self.reap()
        if tier is Tier.GPU:
            e.device = t
            e.offload = DoneHandle("d2h")
        elif tier is Tier.CPU:
            e.host = self.pool.get(n, larger=True)  # read from its first bytes (Note: [buffers across batch shapes])
            e.src = t
            e.moved = e.offload = self.engine.d2h(_typed(e.host, t.shape, t.dtype, n), t, tag=f"act:{key}")
        else:
            spill = self._require_spill()
            staging = self.pool.get(n)
            e.src, e.staging, e.path = t, [staging], spill.file(key)
            e.moved = self.engine.d2h(_typed(staging, t.shape, t.dtype, n), t, tag=f"act:{key}")
            # The whole padded, aligned buffer goes to disk: O_DIRECT needs no bounce copy.
            e.offload = self.engine.nvme_write(
                e.path, staging, direct=spill.direct, after=[e.moved], tag=f"act:{key}"
            )
        self._count(n)
        self._entries[key] = e
        return e.offload

    def prefetch(self, key: Hashable) -> CopyHandle:
        """Start bringing ``key`` back to the device (idempotent)."""
        self._check_open()
        e = self._entries[key]
        if e.tier is Tier.GPU:
            return e.offload or DoneHandle()
        if e.prefetch is not None:
            return e.prefetch
        self.reap()
        assert e.offload is not None
        dst = self.engine.new_device_buffer(e.shape, e.dtype, self.device)
        tag = f"act:{key}"
        if e.tier is Tier.CPU:
            assert e.host is not None
            src = _typed(e.host, e.shape, e.dtype, e.nbytes)
            e.prefetch = self.engine.h2d(dst, src, after=[e.offload], tag=tag)
        else:
            read = self.read_to_host(key)
            assert e.read_buf is not None
            src = _typed(e.read_buf, e.shape, e.dtype, e.nbytes)
            e.prefetch = self.engine.h2d(dst, src, after=[read], tag=tag)
        e.device = dst
        self._count(e.nbytes)
        return e.prefetch

    def read_to_host(self, key: Hashable) -> CopyHandle:
        """NVMe only: start the file read into a host staging buffer (the first leg of a reload);
        a later ``prefetch`` then only does the H2D. Lets a planner put the two legs in different
        windows. Idempotent; a no-op handle for other tiers."""
        self._check_open()
        e = self._entries[key]
        if e.tier is not Tier.NVME or e.prefetch is not None:
            return DoneHandle("nvme_read")
        if e.read is None:
            spill = self._require_spill()
            assert e.path is not None
            staging = self.pool.get(e.nbytes)
            e.staging = [*(e.staging or []), staging]
            e.read_buf = staging
            e.read = self.engine.nvme_read(e.path, staging, direct=spill.direct, after=[e.offload],
                                           tag=f"act:{key}")
        return e.read

    def get(self, key: Hashable) -> torch.Tensor:
        """The activation on the device; prefetches if needed and makes compute wait for it."""
        e = self._entries[key]
        handle = self.prefetch(key)
        handle.sync_current_stream()
        assert e.device is not None
        return e.device

    def release(self, key: Hashable) -> None:
        """Stop holding ``key``'s device copy (its user holds views of it, freed with them); the
        host copy stays until ``free``. Does not wait: a CUDA copy's buffer is protected by the
        consumer stream recorded when it was waited for (``get``)."""
        e = self._entries[key]
        if e.device is not None and e.tier is not Tier.GPU:
            e.device = None
            self._count(-e.nbytes)

    def free(self, key: Hashable) -> None:
        """Forget ``key``: waits for its copies in flight, recycles buffers, deletes its file."""
        e = self._entries.pop(key)
        for h in e.handles():
            h.wait()
        counted = (e.device is not None) + (e.src is not None)
        self._count(-e.nbytes * counted)
        for buf in [*(e.staging or []), *([e.host] if e.host is not None else [])]:
            self.pool.put(buf)
        if e.path is not None:
            try:
                e.path.unlink()
            except FileNotFoundError:
                pass

    def end_step(self) -> None:
        """Free every activation and delete all of this process's spill files."""
        for key in list(self._entries):
            self.free(key)
        self.pool.trim()
        if self.spill is not None:
            self.spill.clear()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.end_step()
        finally:
            self._closed = True
            if self._own_engine:
                self.engine.close()
            if self.spill is not None:
                self.spill.close()
            self.pool.clear()

    def __enter__(self) -> ActivationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ---------------------------------------------------------
    def _require_spill(self) -> SpillDir:
        if self.spill is None:
            raise ValueError("the NVMe tier needs a spill directory: ActivationStore(..., nvme_dir=...)")
        return self.spill

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("activation store is closed")
