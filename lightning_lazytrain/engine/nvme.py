"""NVMe tier: spill-file I/O -- a host tensor's bytes written to a spill file and read back
(``write_tensor``, ``read_tensor``) and the readable error
of a failed transfer (``spill_io_error``). The spill directory (the ``nvme_dir`` check, this process's
subdirectory and the removal of dead runs' ones) is spill_dir.py, the O_DIRECT probe (``probe_direct_io``)
direct_io.py; their names are importable from here too.

File I/O (run on the copy engine's NVMe lanes):
    A spill file holds the raw bytes of one contiguous host tensor. With
    ``direct=True`` it is written/read with O_DIRECT (no page-cache pollution,
    no double copy): the tensor's memory is used directly when its address is
    4 KiB aligned (pinned / pool buffers are) and the unaligned tail goes
    through a page-aligned bounce buffer. Where O_DIRECT is refused (tmpfs on
    old kernels, some network file systems) we fall back to buffered I/O and
    never fsync: spill files are scratch data, durability is irrelevant.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import shutil
import threading

import torch

from lightning_lazytrain.engine.direct_io import _O_DIRECT, ALIGN, probe_direct_io
from lightning_lazytrain.engine.spill_dir import (
    SPILL_PREFIX,
    NvmeDirError,
    SpillDir,
    check_nvme_dir,
    check_spill_fits,
    remove_stale_spill_dirs,
)
from lightning_lazytrain.planner.units import format_bytes

__all__ = [
    "ALIGN",
    "NvmeDirError",
    "SPILL_PREFIX",
    "SpillDir",
    "check_nvme_dir",
    "check_spill_fits",
    "probe_direct_io",
    "read_tensor",
    "remove_stale_spill_dirs",
    "write_tensor",
]

log = logging.getLogger(__name__)

_CHUNK = 16 << 20  # bounce-buffer size and max bytes per syscall (multiple of ALIGN)


# --------------------------------------------------------------------------- I/O
def _mem(ptr: int, n: int) -> memoryview:
    """A writable byte view of raw memory (the owner must stay alive)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


_local = threading.local()


def _bounce() -> tuple[mmap.mmap, int]:
    """Per-thread page-aligned scratch buffer (anonymous mmap is page aligned)."""
    buf = getattr(_local, "bounce", None)
    if buf is None:
        m = mmap.mmap(-1, _CHUNK)
        buf = (m, ctypes.addressof(ctypes.c_char.from_buffer(m)))
        _local.bounce = buf
    return buf


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _host_bytes(t: torch.Tensor) -> tuple[int, int]:
    if t.device.type != "cpu":
        raise ValueError(f"spill I/O needs a host tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("spill I/O needs a contiguous tensor")
    return t.data_ptr(), t.numel() * t.element_size()


def _write_all(fd: int, mv: memoryview) -> None:
    off = 0
    while off < len(mv):
        off += os.write(fd, mv[off : off + _CHUNK])


def _read_all(fd: int, mv: memoryview, path: str) -> None:
    off = 0
    while off < len(mv):
        got = os.readv(fd, [mv[off : off + _CHUNK]])
        if got == 0:
            raise EOFError(f"spill file {path} is truncated ({off} of {len(mv)} bytes)")
        off += got


def _direct_io(fd: int, ptr: int, n: int, write: bool, path: str) -> None:
    # Aligned body straight from/to the tensor's memory; the rest via the bounce buffer.
    body = n - n % ALIGN if ptr % ALIGN == 0 else 0
    if body:
        if write:
            _write_all(fd, _mem(ptr, body))
        else:
            _read_all(fd, _mem(ptr, body), path)
    bounce, bptr = _bounce()
    off = body
    while off < n:
        k = min(_CHUNK, n - off)
        view = memoryview(bounce)[: _round_up(k)]  # O_DIRECT wants whole blocks
        try:
            if write:
                ctypes.memmove(bptr, ptr + off, k)
                _write_all(fd, view)
            else:
                got = os.readv(fd, [view])
                if got < k:
                    raise EOFError(f"spill file {path} is truncated ({off + got} of {n} bytes)")
                ctypes.memmove(ptr + off, bptr, k)
        finally:
            view.release()
        off += k


def write_tensor(path: str, t: torch.Tensor, *, direct: bool = False) -> bool:
    """Write the raw bytes of host tensor ``t`` to ``path``; True if O_DIRECT was used."""
    t = t.detach()
    if t.device.type == "cpu" and not t.is_contiguous():
        t = t.contiguous()
    ptr, n = _host_bytes(t)
    if direct and _O_DIRECT:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info("O_DIRECT refused for %s; falling back to buffered I/O", path)
        else:
            try:
                _direct_io(fd, ptr, n, True, path)
                os.ftruncate(fd, n)  # drop the padding of the last block
            finally:
                os.close(fd)
            return True
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        _write_all(fd, _mem(ptr, n))  # no fsync: scratch data
    finally:
        os.close(fd)
    return False


def read_tensor(path: str, out: torch.Tensor, *, direct: bool = False) -> bool:
    """Fill contiguous host tensor ``out`` from the first bytes of ``path``; True if O_DIRECT was used."""
    ptr, n = _host_bytes(out)
    flags = os.O_RDONLY | os.O_CLOEXEC
    if direct and _O_DIRECT:
        try:
            fd = os.open(path, flags | _O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            try:
                _direct_io(fd, ptr, n, False, path)
            finally:
                os.close(fd)
            return True
    fd = os.open(path, flags)
    try:
        _read_all(fd, _mem(ptr, n), path)
    finally:
        os.close(fd)
    return False


class SpillIOError(OSError):
    """A spill-file write or read failed. The message is one sentence: the operation, the file, the OS
    error (strerror and errno name), what it means here and the fix that fits it; ``errno``,
    ``strerror`` and ``filename`` are the failed call's (its error is chained)."""

    def __init__(self, message: str, cause: BaseException | None = None, path: str | None = None) -> None:
        super().__init__(message)
        if isinstance(cause, OSError):
            self.errno, self.strerror = cause.errno, cause.strerror
        if path is not None:
            self.filename = path

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


def spill_io_error(write: bool, path: str, err: OSError | EOFError) -> SpillIOError:
    """The readable error for a failed spill transfer of ``path`` (``write``: writing it, else reading
    it back), by the OS error: ENOSPC/EDQUOT a full drive, EIO a failing drive (on a read the
    activation is lost), EACCES/EPERM permissions, EROFS a read-only mount, ENOENT a removed
    directory, EOFError a truncated file."""
    parent = os.path.dirname(path)
    root = os.path.dirname(parent) if os.path.basename(parent).startswith(SPILL_PREFIX) else parent
    nvme_dir = f"nvme_dir={root or '.'}"
    verb = "write" if write else "read"
    restart = "then restart from the last checkpoint"
    lost = "" if write else ", and the activation in this file is lost"
    if isinstance(err, EOFError):
        detail = str(err).replace(f"spill file {path} is ", "")
        return SpillIOError(
            f"could not read spill file {path}: it is {detail}; it was cut short after it was written (by another "
            f"process or a file-system error){lost}. Fix: keep {nvme_dir} for this run alone and check the drive "
            f"(dmesg), {restart}.", None, path)
    code = err.errno or 0
    name = errno.errorcode.get(code, f"errno {code}")
    what = f"could not {verb} spill file {path}: {err.strerror or err} ({name})"
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f" ({format_bytes(shutil.disk_usage(root or '.').free, binary=True)} free)"
        except OSError:
            free = ""
        why = (f"the drive of {nvme_dir} is full{free}" if code == errno.ENOSPC
               else f"the disk quota on {nvme_dir} is used up")
        fix = (f"free space on that drive or point nvme_dir at a larger one (or plan fewer activations on NVMe), "
               f"{restart}")
    elif code == errno.EIO:
        why = f"the drive of {nvme_dir} reported an I/O error: it may be failing{lost}"
        fix = f"check the drive (dmesg, smartctl) and {restart} with nvme_dir on a healthy drive"
    elif code in (errno.EACCES, errno.EPERM):
        why = f"the permissions of {nvme_dir} changed while training ran{lost}"
        fix = (f"make it {'writable' if write else 'readable'} for this user again (chmod/chown) or choose another "
               f"nvme_dir, {restart}")
    elif code == errno.EROFS:
        why = f"the drive of {nvme_dir} is mounted read-only now (the kernel does that after drive errors)"
        fix = f"check the drive (dmesg), remount it read-write or choose another nvme_dir, {restart}"
    elif code == errno.ENOENT:
        why = f"the spill {'directory' if write else 'file or its directory'} was removed while training ran{lost}"
        fix = f"keep {nvme_dir} in place while training runs (no cleanup job or other run clearing it), {restart}"
    else:
        why = f"the spill transfer failed{lost}"
        fix = (f"check {nvme_dir} (free space, permissions, the drive's health: dmesg) or choose another nvme_dir, "
               f"{restart}")
    return SpillIOError(f"{what}; {why}. Fix: {fix}.", err, path)


