"""The NVMe spill directory: the check of ``nvme_dir`` (``check_nvme_dir``, ``check_spill_fits``,
``NvmeDirError``) and the lifetime of this process's spill subdirectory (``SpillDir``, and
``remove_stale_spill_dirs`` for those of dead runs). The spill files' bytes are written and read by
nvme.py, which also re-exports these names.

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
import errno
import logging
import os
import secrets
import shutil
import tempfile
import weakref
from pathlib import Path

from lightning_lazytrain.engine.direct_io import probe_direct_io
from lightning_lazytrain.planner.units import format_bytes

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "NvmeDirError",
    "SPILL_PREFIX",
    "SpillDir",
    "check_nvme_dir",
    "check_spill_fits",
    "remove_stale_spill_dirs",
]

log = logging.getLogger("lightning_lazytrain.engine.nvme")  # the NVMe tier's messages, under nvme.py's name

SPILL_PREFIX = "lazytrain-spill-"
_LOCK_NAME = ".lock"


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

    Logs (nvme.py's logger) the directory, its file system (type, device, mount point) and free space at INFO,
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
