"""Packaging: a non-editable install from the wheel works outside the repository.

The wheel is built from a copy of the sources (``pip wheel --no-deps --no-build-isolation``, no network) and
installed into a fresh virtual environment (``venv_helpers.make_venv``: ``python -m venv`` without system
site packages, plus a ``.pth`` listing the import path of the interpreter running the tests, so torch,
Lightning and the other dependencies come from wherever this interpreter finds them -- a venv, a conda-like
prefix or the system Python -- and never from the source checkout). Before the wheel is installed the venv
must not find ``lightning_lazytrain`` in the checkout; after, its copy is the venv's (the test checks). The
console scripts then run from a directory outside the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from venv_helpers import make_venv, venv_python

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "lightning_lazytrain", "conf")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", HYDRA_FULL_ERROR="0", PYTHONWARNINGS="ignore",
               PYTHONDONTWRITEBYTECODE="1")
    return env


def _run(cmd: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_package_list_names_every_package_directory():
    setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "lightning_lazytrain").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert set(setuptools_cfg["packages"]) == found | {"lightning_lazytrain.conf"}
    assert setuptools_cfg["package-dir"] == {"lightning_lazytrain.conf": "conf"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w",
          str(root / "dist")], cwd=root)
    (found,) = (root / "dist").glob("lightning_lazytrain-*.whl")
    return found


@pytest.mark.slow
def test_wheel_ships_every_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"lightning_lazytrain/conf/" + p.relative_to(REPO / "conf").as_posix()
                for p in (REPO / "conf").rglob("*.yaml")}
    assert expected and expected <= names
    assert "lightning_lazytrain/conf/plan.yaml" in names and "lightning_lazytrain/conf/hardware/h800.yaml" in names


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    make_venv(env_dir, env=_env())
    python = venv_python(env_dir)
    # the source checkout does not leak in: nothing in the repository provides the package to the venv
    probe = _run([python, "-c", "import importlib.util, json; s = importlib.util.find_spec('lightning_lazytrain'); "
                  "print(json.dumps(s and s.origin))"], cwd=env_dir.parent)
    origin = json.loads(probe.stdout.strip().splitlines()[-1])
    assert origin is None or REPO not in Path(origin).resolve().parents, f"the venv finds the checkout: {origin}"
    # no pip in the venv: the running interpreter's pip (seen through the .pth) installs into the venv's prefix
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
         cwd=env_dir.parent)
    return env_dir


@pytest.mark.slow
def test_installed_wheel_finds_its_configs(venv, tmp_path):
    code = (
        "import json, lightning_lazytrain\n"
        "from lightning_lazytrain.config import CONF_DIR, load_hardware\n"
        "from lightning_lazytrain.lit_module import CausalLMModule\n"
        "module = CausalLMModule(model_name='tiny')\n"
        "print(json.dumps({'file': lightning_lazytrain.__file__, 'conf': str(CONF_DIR),\n"
        "                  'h800': load_hardware('h800').name, 'params': module.num_parameters}))\n")
    out = _run([venv_python(venv), "-c", code], cwd=tmp_path)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    site = Path(info["file"]).resolve()
    assert Path(venv).resolve() in site.parents, f"lightning_lazytrain came from {site}, not the venv"
    assert Path(info["conf"]).resolve() == site.parent / "conf"
    assert info["h800"] == "h800" and info["params"] > 0


@pytest.mark.slow
def test_installed_console_scripts_run_outside_the_repository(venv, tmp_path):
    assert REPO not in tmp_path.resolve().parents
    plan = _run([venv / "bin" / "lazytrain-plan", "hardware=h800", "model=qwen3.6-27b", "train.micro_batch_size=72",
                 "plan.plot=false"], cwd=tmp_path)
    assert "plan (milp)" in plan.stdout and "megatrain" in plan.stdout
    (plan_json,) = (tmp_path / "outputs" / "plan").glob("*/*/plan.json")
    assert json.loads(plan_json.read_text())["hardware"] == "h800"

    train = _run([venv / "bin" / "lazytrain-train", "trainer.max_steps=5", "trainer.val_check_interval=5",
                  "data.max_bytes=300000", "data.val_windows=8", "trainer.enable_progress_bar=false"], cwd=tmp_path)
    assert "final val loss" in train.stdout
    (result,) = (tmp_path / "outputs" / "train").glob("*/*/result.json")
    data = json.loads(result.read_text())
    assert data["steps"] == 5 and data["final_val_loss"] > 0
