"""A run's output directory, for the two Hydra apps (``lazytrain-plan``, ``lazytrain-train``).

Note: [a failed run leaves what it found]
    A run that cannot go on (an infeasible plan, a config that cannot run) leaves no output directory behind --
    but only what it made itself goes: ``hydra.run.dir`` may name a directory that already holds a user's
    files, or the working directory itself (``hydra.run.dir=.``). ``RunDir`` notes the directory's entries when
    the job starts (Hydra has then written its own: ``.hydra/`` and the job's log); on failure ``remove_created``
    deletes the entries made since, Hydra's own files, then each directory it leaves empty up to (not including)
    the working directory. A directory that held anything else before the run keeps it.

``check_output_dirs``: a ``hydra.run.dir`` / ``hydra.sweep.dir`` given on the command line that cannot be made
(a file in the way, no write permission) is one line and exit 2 before Hydra starts, like other bad input.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["RunDir", "check_output_dirs"]

# what Hydra writes into a job's output directory before the job runs
HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


class RunDir:
    """A job's output directory as the job found it (Note: [a failed run leaves what it found])."""

    def __init__(self, path: str | Path, job_name: str | None = None) -> None:
        self.path = Path(path).resolve()
        self.hydra_files = [*HYDRA_FILES, *([f"{job_name}.log"] if job_name else [])]
        self.found = set(os.listdir(self.path)) if self.path.is_dir() else set()

    def remove_created(self) -> None:
        """Delete what the job made, Hydra's files, and the directories left empty (not the working one)."""
        if self.path.is_dir():
            for name in set(os.listdir(self.path)) - self.found:
                target = self.path / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    target.unlink(missing_ok=True)
            for rel in self.hydra_files:
                (self.path / rel).unlink(missing_ok=True)
        cwd = Path.cwd().resolve()

        def removable(d: Path) -> bool:  # never the working directory or one above it
            return d != cwd and d not in cwd.parents

        hydra_dir = self.path / ".hydra"
        if removable(hydra_dir):
            try:
                hydra_dir.rmdir()  # only if empty
            except OSError:
                pass
        d = self.path  # then the directory, and its parents below the working directory, each only if empty
        while removable(d) and (d == self.path or cwd in d.parents):
            try:
                d.rmdir()
            except OSError:
                break
            d = d.parent


def _override_value(arg: str, key: str) -> str | None:
    body = arg.lstrip("+")
    return body[len(key) + 1:] if body.startswith(f"{key}=") else None


def check_output_dirs(argv: Sequence[str]) -> str | None:
    """One line naming an output directory given on the command line that cannot be made, else None."""
    for arg in argv:
        for key in ("hydra.run.dir", "hydra.sweep.dir"):
            value = _override_value(arg, key)
            if value is None or not value or "${" in value:
                continue
            path = Path(value).expanduser()
            path = path if path.is_absolute() else Path.cwd() / path
            probe = path
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            if not probe.is_dir():
                return (f"{key}={value} cannot be made: {probe} is a file, not a directory. Fix: point {key} at a "
                        "directory (or a path that can be created)")
            if not os.access(probe, os.W_OK | os.X_OK):
                what = "is not writable" if probe == path else f"cannot be made in {probe} (not writable)"
                return f"{key}={value} {what} for this user. Fix: point {key} at a writable directory"
            try:  # what access() cannot tell (/proc, /sys, a full or read-only file system): make one and remove it
                os.rmdir(tempfile.mkdtemp(prefix=".lazytrain-probe-", dir=probe))
            except OSError as err:
                return (f"{key}={value} cannot be made in {probe} ({err.strerror or err}). Fix: point {key} at a "
                        "writable directory")
    return None
