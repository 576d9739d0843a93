"""NVMe tier: spill-file I/O, the directory check, and spill-directory lifetime.

File I/O (run on the copy engine's NVMe lanes):
    A spill file holds the raw bytes of one contiguous host tensor. With
    ``direct=True`` it is written/read with O_DIRECT (no page-cache pollution,
    no double copy): the tensor's memory is used directly when its address is
    4 KiB aligned (pinned / pool buffers are) and the unaligned tail goes
    through a page-aligned bounce buffer. Where O_DIRECT is refused (tmpfs on
    old kernels, some network file systems) we fall back to buffered I/O and
    never fsync: spill files are scratch data, durability is irrelevant.

Directory lifetime:
    Each process spills into its own ``lazytrain-spill-<pid>-<token>``
    subdirectory holding an flock'ed ``.lock`` file. The kernel drops an
    flock when its owner dies, even by SIGKILL, so at start-up any spill
    subdirectory whose lock can be taken belongs to a dead run and is removed.
    The directory is created under a hidden temporary name and renamed only
    once its lock is held, so a half-created directory is never mistaken for
    a stale one.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import mmap
import os
import secrets
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import torch

from lightning_lazytrain.planner.units import format_bytes

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

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

ALIGN = 4096  # covers 512 B and 4 KiB logical blocks
_CHUNK = 16 << 20  # bounce-buffer size and max bytes per syscall (multiple of ALIGN)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
SPILL_PREFIX = "lazytrain-spill-"
_LOCK_NAME = ".lock"


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


def probe_direct_io(directory: str | os.PathLike[str]) -> tuple[bool, str]:
    """Can ``directory`` do O_DIRECT with ALIGN-aligned buffers? Returns (ok, reason)."""
    if not _O_DIRECT:
        return False, "O_DIRECT is not available on this platform"
    path = os.path.join(os.fspath(directory), f".odirect-probe-{os.getpid()}-{secrets.token_hex(4)}")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT, 0o600)
        try:
            if os.write(fd, buf) != ALIGN or os.preadv(fd, [buf], 0) != ALIGN:
                return False, "short O_DIRECT transfer"
        finally:
            os.close(fd)
        return True, f"alignment {ALIGN}"
    except OSError as e:
        return False, f"{e.strerror or e} (errno {e.errno})"
    finally:
        buf.close()
        try:
            os.unlink(path)
        except OSError:
            pass


# --------------------------------------------------------------- directory check
class NvmeDirError(RuntimeError):
    """The NVMe spill directory is unusable; the message names path, problem and fix."""


def _file_system(path: Path) -> tuple[Path, str, str]:
    """(mount point, file system type, device) of the file system holding ``path`` (an existing path); the type and
    device are ``"?"`` where ``/proc/self/mounts`` is not readable (not Linux)."""
    mount = path.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    fstype = device = "?"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:  # the last entry for a mount point is the one in effect
                fields = line.split()
                if len(fields) >= 3 and fields[1].replace("\\040", " ") == str(mount):
                    device, fstype = fields[0], fields[2]
    except OSError:
        pass
    return mount, fstype, device


def _describe_file_system(path: Path) -> str:
    mount, fstype, device = _file_system(path)
    return f"file system {fstype} on {device}, mounted at {mount}"


def check_spill_fits(path: str | os.PathLike[str], required_bytes: int) -> int:
    """Refuse a plan whose NVMe spill does not fit: raise ``NvmeDirError`` naming the directory, its file system,
    the free bytes, the bytes the plan needs and the shortfall when ``required_bytes`` exceed the free space of the
    file system holding ``path`` (an existing directory). Returns the free bytes."""
    p = Path(path).expanduser()
    free = int(shutil.disk_usage(p).free)
    required = int(required_bytes)
    if required > free:
        short = required - free
        raise NvmeDirError(
            f"NVMe spill directory {p} has {format_bytes(free, binary=True)} free, but the plan needs "
            f"{format_bytes(required, binary=True)} ({required} bytes) of spill space: short by "
            f"{format_bytes(short, binary=True)} ({short} bytes; {free} bytes free, {_describe_file_system(p)}). "
            "Fix: free space on that file system, point nvme_dir at a larger drive, or plan with fewer "
            "activations on NVMe (more recompute / CPU)."
        )
    return free


def check_nvme_dir(path: str | os.PathLike[str], required_bytes: int = 0) -> Path:
    """Check (creating it if needed) that ``path`` can hold ``required_bytes`` of spill files.

    Logs (this module's logger) the directory, its file system (type, device, mount point) and free space at INFO,
    and a WARNING naming the path when it does not exist and is being created (a misspelt ``nvme_dir`` would
    otherwise put spill files on whatever disk holds it). ``required_bytes > 0``: ``check_spill_fits``."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise NvmeDirError(
            f"NVMe spill directory {p} exists but is not a directory. "
            "Fix: point nvme_dir at a directory on a local NVMe drive, or remove that file."
        )
    if not p.exists():
        log.warning("NVMe spill directory %s does not exist: creating it (check nvme_dir for a typo: spill files "
                    "go to whatever drive holds it)", p)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fix = (f"create it (mkdir -p {p}) with write permission for this user, or choose another nvme_dir (a local "
               "NVMe drive, not a file or a read-only mount)"
               if e.errno in (errno.EACCES, errno.EPERM) else
               f"choose another nvme_dir, on a local NVMe drive ({p} cannot be made there: "
               f"{'a read-only file system' if e.errno == errno.EROFS else 'not a place for files'})")
        raise NvmeDirError(
            f"NVMe spill directory {p} does not exist and cannot be created: {e.strerror or e}. Fix: {fix}."
        ) from e
    try:
        fd, probe = tempfile.mkstemp(prefix=".lazytrain-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        fix = (f"choose another nvme_dir: {p} is on a read-only file system (remount it read-write, or use a local "
               "NVMe drive's directory)" if e.errno == errno.EROFS else
               f"make it writable for this user (chmod u+w / chown {p}), or choose another nvme_dir")
        raise NvmeDirError(f"NVMe spill directory {p} is not writable: {e.strerror or e}. Fix: {fix}.") from e
    if log.isEnabledFor(logging.INFO):
        free = shutil.disk_usage(p).free
        need = f", the plan needs {format_bytes(required_bytes, binary=True)}" if required_bytes > 0 else ""
        log.info("NVMe spill directory %s: %s, %s free%s", p, _describe_file_system(p),
                 format_bytes(free, binary=True), need)
    if required_bytes > 0:
        check_spill_fits(p, required_bytes)
    return p


# ---------------------------------------------------------- spill-dir lifetime
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _parse_pid(name: str) -> int | None:
    body = name.lstrip(".")
    if not body.startswith(SPILL_PREFIX):
        return None
    try:
        return int(body[len(SPILL_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return None


def _owner_alive(d: Path, pid: int) -> bool:
    if fcntl is None:
        return _pid_alive(pid)
    try:
        fd = os.open(d / _LOCK_NAME, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return _pid_alive(pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # a live process holds it
    except OSError:
        return _pid_alive(pid)  # flock unsupported here
    finally:
        os.close(fd)  # also releases the lock if we got it
    return False


def remove_stale_spill_dirs(root: str | os.PathLike[str]) -> list[Path]:
    """Remove spill subdirectories of ``root`` left behind by dead processes."""
    removed: list[Path] = []
    try:
        children = list(Path(root).iterdir())
    except OSError:
        return removed
    for child in children:
        pid = _parse_pid(child.name)
        if pid is None or child.is_symlink() or not child.is_dir():
            continue
        hidden = child.name.startswith(".")  # half-created: no lock yet, judge by pid
        alive = _pid_alive(pid) if hidden else _owner_alive(child, pid)
        if not alive:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


_live: weakref.WeakSet[SpillDir] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for d in list(_live):
        d.close()


class SpillDir:
    """This process's spill subdirectory under ``root``."""

    def __init__(self, root: str | os.PathLike[str], required_bytes: int = 0, *, direct: bool | None = None) -> None:
        self.root = check_nvme_dir(root, required_bytes)
        stale = remove_stale_spill_dirs(self.root)
        if stale:
            log.info("removed %d stale spill dir(s) from crashed runs: %s", len(stale), ", ".join(map(str, stale)))
        name = f"{SPILL_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        tmp = self.root / f".{name}"
        tmp.mkdir(mode=0o700)
        self._lock_fd: int | None = os.open(tmp / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if fcntl is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                log.warning("cannot flock %s (%s); stale-dir detection falls back to pid checks", tmp, e)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        self.path = self.root / name
        os.rename(tmp, self.path)
        self._closed = False
        ok, why = probe_direct_io(self.path) if direct is not False else (False, "disabled by caller")
        self.direct = ok
        if ok:
            log.info("NVMe spill dir %s: O_DIRECT I/O (%s)", self.path, why)
        else:
            log.info("NVMe spill dir %s: buffered I/O without fsync (O_DIRECT unavailable: %s)", self.path, why)
        _live.add(self)

    def file(self, key: object) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(key))
        return self.path / f"{safe}.spill"

    def spill_files(self) -> list[Path]:
        return sorted(self.path.glob("*.spill")) if not self._closed else []

    def clear(self) -> None:
        """Delete every spill file (end of step); the directory and its lock stay."""
        for f in self.spill_files():
            try:
                f.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        _live.discard(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> SpillDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
