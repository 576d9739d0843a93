"""Host arenas: one exactly-sized host buffer per kind of buffer, sliced by hand.

Why not ``torch.empty(..., pin_memory=True)`` per buffer
    PyTorch's pinned caching host allocator rounds every request up to a power of two
    (``c10::llvm::PowerOf2Ceil`` in ``ATen/core/CachingHostAllocator.h``, unless the process sets
    ``pinned_max_round_threshold``) and keeps freed blocks cached: a 27B block's 1.48 GB fp32 master
    pins 2 GiB, a 64 MiB activation buffer plus 4 KiB of alignment slack pins 128 MiB, and one
    buffer for all masters (~95 GB) would pin 128 GiB. An arena asks the OS for exactly the pages it
    needs (an anonymous ``mmap``: page aligned, whole pages) and, on CUDA, page-locks those pages
    with ``cudaHostRegister``. The caching allocator never sees them, so the bytes pinned are the
    arena's size, which ``planner.workload.host_arena_bytes`` computes from the slice sizes without
    torch.

Layout
    ``take`` hands out views at multiples of ``HOST_ARENA_ALIGN`` = 256 bytes (64 fp32 elements,
    like ``param_store.ALIGN``: CPU kernels round differently on misaligned operands); an arena is
    whole pages, so a slice that starts on a page boundary (the activation pool's) can do O_DIRECT
    without a bounce copy. The memory is zero-filled and committed when the arena is made (``MAP_POPULATE``
on Linux: no page faults inside a step).

Note: [arena lifetime]
    Slices are views: the memory lives while any slice (or the arena) does, like any storage. The
    tensor holds a ``memoryview`` of the mmap; a finalizer on that memoryview holds the mmap itself.
    When the last view goes, the finalizer runs first (``cudaHostUnregister``), then drops the mmap
    (``munmap``): pages are never unmapped while registered (an mmap's own weakref callbacks run
    after it is unmapped, hence the memoryview). No DMA is in flight then: the copy engine keeps a
    copy's tensors until it completed (Note: [keep host memory alive] in ``copy_cuda.py``).
    Finalizers do not run at interpreter exit (the process's pages go anyway; CUDA may be gone).
"""

from __future__ import annotations

import mmap
import threading
import warnings
import weakref
from typing import Any

import torch

from lightning_lazytrain.planner.workload import HOST_ARENA_ALIGN, HOST_PAGE, host_arena_bytes

__all__ = ["HOST_ARENA_ALIGN", "HOST_PAGE", "HostArena", "host_arena_bytes", "torch_pinned_bytes"]

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, as cudaHostAlloc's default pinned memory is used
_lock = threading.Lock()
_warned_fallback = False


def torch_pinned_bytes(nbytes: int) -> int:
    """What ``torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)`` reserves with PyTorch's default
    pinned-allocator settings: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _unregister(mm: mmap.mmap, ptr: int, device: int) -> None:
    # Called when the last view of the arena is gone (Note: [arena lifetime]); ``mm`` is unmapped
    # when this returns and the finalizer drops its reference.
    try:
        with torch.cuda.device(device):
            if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
                clear_cuda_error()  # nothing to report to at this point; the pages are freed anyway
    except Exception:  # noqa: BLE001 - as above
        pass


_get_last_error: Any = None


def clear_cuda_error() -> None:
    """Note: [a failed runtime call leaves its error] ``torch.cuda.cudart()``'s calls return the runtime's error
    without clearing it, and torch checks every later kernel launch with ``cudaGetLastError``: a failed
    ``cudaHostRegister`` (the fallback below handles it) would surface as an error of some unrelated op later
    on this thread. torch's binding has no ``cudaGetLastError``; this calls the CUDA runtime this process has
    loaded (found in /proc/self/maps), which clears this thread's last error. Does nothing where none is found."""
    global _get_last_error
    if _get_last_error is None:
        _get_last_error = False
        try:
            import ctypes

            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart" in line.rsplit("/", 1)[-1]}
            for path in sorted(paths):
                fn = getattr(ctypes.CDLL(path), "cudaGetLastError", None)
                if fn is not None:
                    _get_last_error = fn
                    break
        except Exception:  # noqa: BLE001 - no runtime to ask: nothing to clear
            _get_last_error = False
    if _get_last_error:
        _get_last_error()


class HostArena:
    """One host buffer of ``nbytes`` rounded up to whole pages, pinned when ``pin``; ``take`` slices it.

    ``nbytes`` (the reservation: what is pinned on CUDA), ``used`` (bytes up to the end of the
    last slice), ``pinned`` (page-locked, by ``cudaHostRegister`` or, if that failed, by PyTorch's
    allocator: then ``nbytes`` is that allocator's power-of-two reservation and a warning says so).
    """

    def __init__(self, nbytes: int, *, pin: bool = False, name: str = "") -> None:
        if nbytes < 0:
            raise ValueError(f"arena size must be >= 0, got {nbytes}")
        self.name = name
        self.nbytes = _round_up(int(nbytes), HOST_PAGE)
        self.used = 0
        self.pinned = False
        self.pinned_by = "none"  # "cudaHostRegister", "torch" (fallback) or "none"
        self._finalizer: weakref.finalize | None = None
        if self.nbytes == 0:
            self._buf = torch.empty(0, dtype=torch.uint8)
            return
        # anonymous: page aligned, zero-filled; populated now (a first touch mid-step would fault every
        # page: the first step, which is the profile, would run its host work at a fraction of its speed)
        mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        view = memoryview(mm)
        self._buf = torch.frombuffer(view, dtype=torch.uint8)  # holds `view`, which holds `mm`
        if pin:
            self._pin(mm, view)
        else:
            # Only to tell when the memory is gone (``alive``); holds `mm` until then, like the pinned case.
            self._finalizer = weakref.finalize(view, _noop, mm)
            self._finalizer.atexit = False

    @classmethod
    def for_sizes(cls, sizes: list[int] | tuple[int, ...], *, pin: bool = False, name: str = "") -> HostArena:
        """An arena exactly large enough for slices of ``sizes`` bytes taken in any order."""
        return cls(host_arena_bytes(sizes), pin=pin, name=name)

    def _pin(self, mm: mmap.mmap, view: memoryview) -> None:
        global _warned_fallback
        if not torch.cuda.is_available():
            raise RuntimeError("pinned host memory needs CUDA (pin_memory=True without a CUDA device)")
        ptr, device = self._buf.data_ptr(), torch.cuda.current_device()
        err: Any = None
        try:
            err = torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, _CUDA_HOST_REGISTER_PORTABLE)
            torch.cuda.check_error(err)
        except Exception as e:  # noqa: BLE001 - fall back to PyTorch's allocator, loudly
            clear_cuda_error()  # Note: [a failed runtime call leaves its error]
            with _lock:
                warn, _warned_fallback = not _warned_fallback, True
            if warn:
                warnings.warn(f"cudaHostRegister failed ({e}); pinned host buffers fall back to PyTorch's caching "
                              "allocator, which rounds each one up to a power of two", stacklevel=3)
            need = self.nbytes
            self._buf = torch.empty(need, dtype=torch.uint8, pin_memory=True)
            self.nbytes = torch_pinned_bytes(need)  # what that allocator reserves for it
            self.pinned, self.pinned_by = True, "torch"
            self._finalizer = weakref.finalize(self._buf, _noop)
            self._finalizer.atexit = False
            return
        self.pinned, self.pinned_by = True, "cudaHostRegister"
        self._finalizer = weakref.finalize(view, _unregister, mm, ptr, device)
        self._finalizer.atexit = False

    # ---- slicing -----------------------------------------------------------------------------
    def take(self, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A flat ``dtype`` view of ``numel`` elements at the next ``HOST_ARENA_ALIGN``-aligned offset."""
        if self._buf is None:
            raise RuntimeError(f"host arena {self.name!r} was released")
        size = int(numel) * torch.empty((), dtype=dtype).element_size()
        start = _round_up(self.used, HOST_ARENA_ALIGN)
        capacity = self._buf.numel()
        if start + size > capacity:
            raise MemoryError(f"host arena {self.name!r} is full: {size} bytes at offset {start} of {capacity}")
        self.used = start + size if size else self.used
        return self._buf[start : start + size].view(dtype)

    def release(self) -> None:
        """Drop the arena's own reference; the memory goes once no slice is left (Note: [arena lifetime])."""
        self._buf = None  # type: ignore[assignment]

    # ---- accounting --------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Is the memory still allocated (the arena or some slice of it still referenced)?"""
        return self._finalizer is not None and self._finalizer.alive

    @property
    def reserved_bytes(self) -> int:
        """Bytes this arena holds now (0 once its memory is gone)."""
        return self.nbytes if self.alive else 0

    def report(self) -> dict[str, Any]:
        return {"name": self.name, "reserved_bytes": self.reserved_bytes, "used_bytes": self.used,
                "pinned": self.pinned, "pinned_by": self.pinned_by,
                "torch_pinned_bytes": torch_pinned_bytes(self.used)}

    def __repr__(self) -> str:
        return (f"HostArena({self.name!r}, reserved={self.nbytes}, used={self.used}, "
                f"pinned={self.pinned_by if self.pinned else False}, alive={self.alive})")


def _noop(*_: object) -> None:
    pass
