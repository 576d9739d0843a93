"""Checkpoints that are written atomically and verified when read.

``torch.load`` does not check the CRCs of the zip archive ``torch.save`` writes, so a checkpoint
with flipped bytes loads silently and resumes with corrupted weights or optimizer state. The
strategy's default ``CheckpointIO`` writes to a temporary file in the same directory, fsyncs and
renames it into place (a crash leaves the old checkpoint or none, never half of one), and before
loading checks every member's CRC (``zipfile.ZipFile.testzip``: one read of the file).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["CorruptCheckpoint", "VerifiedCheckpointIO"]


class CorruptCheckpoint(RuntimeError):
    """A checkpoint failed its integrity check; the message names the file and the fix."""


class VerifiedCheckpointIO(TorchCheckpointIO):
    def __init__(self, verify: bool = True) -> None:
        super().__init__()
        self.verify = verify

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return None

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if self.verify and "://" not in str(path) and Path(path).is_file():
            check_integrity(path)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


def check_integrity(path: str | os.PathLike[str]) -> None:
    """Raise ``CorruptCheckpoint`` if the archive at ``path`` is damaged (CRC or structure)."""
    fix = "Fix: resume from an earlier checkpoint (or copy this one again from where it was made)."
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except zipfile.BadZipFile as err:
        if not zipfile.is_zipfile(path) and _legacy_format(path):
            return  # torch's pre-1.6 format: no CRCs to check
        raise CorruptCheckpoint(f"checkpoint {path} is damaged ({err}). {fix}") from err
    except (OSError, EOFError, ValueError, RuntimeError) as err:  # zlib errors surface as these
        raise CorruptCheckpoint(f"checkpoint {path} cannot be read back intact ({err}). {fix}") from err
    if bad is not None:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupted: its member {bad!r} fails the CRC check. {fix}")


def _legacy_format(path: str | os.PathLike[str]) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x80\x02"  # a bare pickle (torch.save(_use_new_zipfile_serialization=False))
