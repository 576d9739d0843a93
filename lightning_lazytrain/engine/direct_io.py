"""Can a directory do O_DIRECT (``probe_direct_io``), with the alignment the spill files use (``ALIGN``): read by the
spill directory when it is made (spill_dir.py) and by the spill-file I/O (nvme.py)."""

from __future__ import annotations

import mmap
import os
import secrets

__all__ = ["ALIGN", "probe_direct_io"]

ALIGN = 4096  # covers 512 B and 4 KiB logical blocks
_O_DIRECT = getattr(os, "O_DIRECT", 0)


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
