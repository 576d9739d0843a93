"""A fresh virtual environment that sees the packages of the interpreter running the tests.

``python -m venv --system-site-packages`` sees the *base* interpreter's packages: when the tests run
from a virtual environment (or from a venv made by a tool on top of another Python), torch, Lightning
and Hydra live in the running environment, not in its base, and the new venv does not see them.
:func:`make_venv` instead creates a plain venv (``python -m venv --without-pip``, no system site
packages) and writes a ``.pth`` file into its ``site-packages`` that lists the running interpreter's
import path (:func:`visible_paths`). That works the same from a venv, a conda-like prefix and the
system Python, whatever ``python3`` on ``PATH`` is (only ``sys.executable`` is started).

The source checkout does not leak in: the ``.pth`` holds plain directory lines (Python adds them to
``sys.path`` *after* the venv's own ``site-packages``, and does not run the ``.pth`` files found in
them, so an editable install's finder is not installed), and every entry in the repository (the
checkout's root, ``tests/``, ``bench/``...) is left out, except a ``site-packages`` of a virtual
environment kept inside the checkout (``.venv/``). Import hooks that other ``.pth`` files install
(editable installs of *other* projects) are not carried over.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PTH_NAME = "_lazytrain_running_interpreter.pth"


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def visible_paths(exclude: Path = REPO) -> list[str]:
    """The running interpreter's ``sys.path`` entries that exist, in order, without those in
    ``exclude`` (the source checkout) unless they are a ``site-packages``/``dist-packages`` folder
    or inside one. Standard-library entries are kept: the new venv has the same base, so Python
    skips them as duplicates."""
    out: list[str] = []
    root = exclude.resolve()
    for entry in sys.path:
        if not entry or not os.path.isabs(entry) or not os.path.exists(entry):
            continue  # '' / cwd, and hooks' markers such as an editable install's __path_hook__
        path = Path(entry).resolve()
        if _inside(path, root) and not {"site-packages", "dist-packages"} & set(path.relative_to(root).parts):
            continue
        if str(path) not in out:
            out.append(str(path))
    return out


def venv_python(env_dir: Path) -> Path:
    return env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def make_venv(env_dir: Path, paths: list[str] | None = None, env: dict | None = None) -> Path:
    """Create a venv at ``env_dir`` from ``sys.executable`` that sees ``paths`` (default:
    :func:`visible_paths`) after its own ``site-packages``; return that ``site-packages``. No pip of
    its own: ``python -m pip`` there runs the running interpreter's pip, which installs into the
    venv's prefix."""
    env = env if env is not None else {k: v for k, v in os.environ.items()
                                       if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, env=env,
                   capture_output=True, text=True, timeout=120)
    probe = subprocess.run([str(venv_python(env_dir)), "-c",
                            "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, env=env, capture_output=True, text=True, timeout=60)
    site = Path(probe.stdout.strip().splitlines()[-1])
    site.mkdir(parents=True, exist_ok=True)
    lines = visible_paths() if paths is None else paths
    (site / PTH_NAME).write_text("".join(f"{p}\n" for p in lines))
    return site
