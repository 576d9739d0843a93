"""Checkpoints that are written atomically and verified when read.

``torch.load`` does not check the CRCs of the zip archive ``torch.save`` writes, so a checkpoint
with flipped bytes loads silently and resumes with corrupted weights or optimizer state. The
strategy's default ``CheckpointIO`` writes to a temporary file in the same directory, fsyncs and
renames it into place (a crash leaves the old checkpoint or none, never half of one), and before
loading checks the file (``check_integrity``).

Note: [checkpoint damage]
    Every kind of damage is reported as ``CorruptCheckpoint``, naming the file, what is wrong and
    the fix (resume from an earlier checkpoint), never as the error the damage happens to cause
    deeper down (torch's zip reader, the unpickler):

    - an empty file; a file that is neither a zip archive (``torch.save``'s format) nor torch's
      legacy (pre-1.6) format;
    - a zip archive whose end is missing (truncated), whose directory cannot be read, or whose
      directory torch's own reader understands differently from Python's ``zipfile`` (both must
      find every member at the same offset with the same size: damage in the zip central directory
      that ``zipfile`` tolerates and torch's reader does not, or reads elsewhere);
    - a member whose CRC-32 differs from the one stored with it (``zipfile.ZipFile.testzip``: one
      read of the file; skipped with ``verify=False``, the only check that reads the whole file);
    - legacy format: it has no CRCs, so its structure is checked instead: the magic number and
      protocol header, the pickle's opcodes up to its end (not executed), its storage references,
      the list of storages, and that the file holds every storage's bytes. Genuine legacy
      checkpoints load as before. A flipped byte inside a legacy pickle that keeps it well formed
      cannot be found without CRCs: it loads wrong, or fails with torch's own error.

    A directory is a sharded checkpoint (``core/sharded_checkpoint.py``), damaged or not: it is loaded
    and checked there (a missing ``.metadata``, manifest, or file; a manifest that is not JSON).

    A write that fails (full disk, quota, permissions) raises ``CheckpointWriteError``: an
    ``OSError`` with the same ``errno`` whose message names the target, how much was being
    written and the fix; no temporary file is left and an older checkpoint at the path stays.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_lazytrain.core.checkpoint_files import (
    FIX,
    CheckpointWriteError,
    CorruptCheckpoint,
    check_integrity,
    failed_write_cause,
    gib_text,
    short_reader_error,
    tensor_bytes,
    torch_says_damaged,
    write_error,
)
from lightning_lazytrain.core.sharded_checkpoint import load_sharded

__all__ = ["CheckpointWriteError", "CorruptCheckpoint", "VerifiedCheckpointIO", "check_integrity", "failed_write_cause",
           "write_error"]


def _remove_dead_writers_files(target: Path) -> None:
    """A save killed mid-write leaves ``.<name>.tmp-<pid>`` (a checkpoint-sized file no load picks up; the next
    save of that name may go to ``<name>-v1`` instead); before writing into a directory, remove the temporary
    files there of writers no longer alive (review 24: one half checkpoint leaked per crash inside a save)."""
    for stale in target.parent.glob(".*.tmp-*"):
        m = re.fullmatch(r"\..+\.tmp-(\d{1,9})", stale.name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))) or not stale.is_file():
            continue
        try:
            stale.unlink()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (PermissionError: another user's live process)
        return True
    return True


class VerifiedCheckpointIO(TorchCheckpointIO):
    def __init__(self, verify: bool = True) -> None:
        super().__init__()
        self.verify = verify

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _remove_dead_writers_files(target)
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except (OSError, RuntimeError) as err:
            needed = tensor_bytes(checkpoint)
            cause = failed_write_cause(err, target.parent if target.parent.exists() else "/", needed)
            if cause is None:
                raise
            try:
                written = tmp.stat().st_size
            except OSError:
                written = 0
            size = f"about {gib_text(needed)} (its tensors)" + (f", {gib_text(written)} of it written" if written else "")
            raise write_error(target, cause, size=size) from err
        finally:
            tmp.unlink(missing_ok=True)
        return None

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        local = "://" not in str(path)
        if local and Path(path).is_dir():  # a sharded checkpoint (core/sharded_checkpoint.py), checked there
            return load_sharded(path, weights_only=weights_only, verify=self.verify)
        if local and Path(path).is_file():
            check_integrity(path, crcs=self.verify)
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except (RuntimeError, EOFError) as err:
            if not local or not torch_says_damaged(err):
                raise
            raise CorruptCheckpoint(f"checkpoint {path} is damaged: torch cannot read it ({short_reader_error(err)}). "
                                    f"{FIX}") from err
