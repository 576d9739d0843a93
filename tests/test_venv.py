"""The tests pass from a virtual environment, whatever ``python3`` on ``PATH`` is.

A throwaway venv (``python -m venv``, no system site packages) sees this interpreter's packages only
through a ``.pth`` (``venv_helpers.make_venv``), and its own ``site-packages`` holds a marker module
that its base interpreter cannot see: the situation of a developer's venv, whose packages are in the
venv and not in the Python it was made from. ``PATH`` starts with a ``python3``/``python`` that exits
1, then the venv's ``bin`` (as if activated). From there:

* a venv made by the tests' helper (as ``tests/test_packaging.py`` makes its own) sees the running
  venv's packages (the marker; ``--system-site-packages`` would see only the base's) and not the
  source checkout;
* that venv's pytest passes the packaging test (the installed wheel finds its configs) and the
  device kit's check of the carried wheels;
* the device kit (``check.sh``), given ``PYTHON``, runs a CPU stage with that interpreter, and
  without it refuses the broken ``python3`` with exit 2 and the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from venv_helpers import make_venv, venv_python, visible_paths

REPO = Path(__file__).resolve().parents[1]
MARKER = "lazytrain_outer_venv_marker"


@pytest.fixture(scope="module")
def outer(tmp_path_factory):
    """(python, env): a venv with the marker module, and an environment whose PATH starts with a
    ``python3`` that exits 1, then the venv's ``bin``."""
    root = tmp_path_factory.mktemp("outer")
    base_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHON")}
    site = make_venv(root / "venv", env=base_env)
    (site / f"{MARKER}.py").write_text("WHERE = 'the outer venv'\n")
    shims = root / "shims"
    shims.mkdir()
    for name in ("python3", "python"):
        shim = shims / name
        shim.write_text("#!/bin/sh\necho 'shim: not the interpreter running the tests' >&2\nexit 1\n")
        shim.chmod(0o755)
    bin_dir = venv_python(root / "venv").parent
    env = {**base_env, "PATH": os.pathsep.join([str(shims), str(bin_dir), os.environ.get("PATH", "")]),
           "VIRTUAL_ENV": str(root / "venv"), "PYTHONDONTWRITEBYTECODE": "1", "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    probe = subprocess.run(["python3", "-c", "pass"], env=env, capture_output=True, text=True)
    assert probe.returncode == 1 and "shim" in probe.stderr  # the first python3 on PATH is not this one
    return venv_python(root / "venv"), env


def test_visible_paths_leave_out_the_checkout_but_not_a_venv_inside_it(tmp_path, monkeypatch):
    checkout, other = tmp_path / "checkout", tmp_path / "elsewhere" / "site-packages"
    inner_site = checkout / ".venv" / "lib" / "python3" / "site-packages"
    for d in (checkout / "tests", inner_site, other):
        d.mkdir(parents=True)
    monkeypatch.setattr(sys, "path", ["", str(checkout), str(checkout / "tests"), str(inner_site), str(other),
                                      str(other), str(tmp_path / "missing"), "relative", "x.__path_hook__"])
    assert visible_paths(exclude=checkout) == [str(inner_site.resolve()), str(other.resolve())]


def _run(cmd, env, cwd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_a_venv_made_by_the_tests_sees_the_running_venvs_packages_not_the_checkout(outer, tmp_path):
    python, env = outer
    code = ("import subprocess, sys\n"
            f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
            "from venv_helpers import make_venv, venv_python\n"
            "from pathlib import Path\n"
            "make_venv(Path(sys.argv[1]))\n"
            "subprocess.run([sys.executable, '-m', 'venv', '--without-pip', '--system-site-packages', sys.argv[2]],"
            " check=True)\n")
    made = _run([python, "-c", code, tmp_path / "inner", tmp_path / "system_site"], env, tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    check = ("import importlib.util, json\n"
             "spec = importlib.util.find_spec('lightning_lazytrain')\n"
             f"print(json.dumps({{m: importlib.util.find_spec(m) is not None for m in ({MARKER!r}, 'hydra', 'pyomo',"
             " 'torch')} | {'lightning_lazytrain': spec and spec.origin}))\n")
    r = _run([venv_python(tmp_path / "inner"), "-c", check], env, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen[MARKER] and seen["hydra"] and seen["pyomo"] and seen["torch"], seen
    origin = seen["lightning_lazytrain"]
    assert origin is None or REPO not in Path(origin).resolve().parents, f"the checkout leaks in: {origin}"
    # what --system-site-packages gives instead: the base interpreter's packages, not the running venv's
    r = _run([venv_python(tmp_path / "system_site"), "-c", check], env, tmp_path)
    assert r.returncode == 0 and not json.loads(r.stdout.strip().splitlines()[-1])[MARKER], r.stdout + r.stderr


@pytest.mark.slow  # a nested pytest that builds and installs the wheel, and a kit stage: ~40 s on 2 cores
def test_packaging_and_device_kit_pass_from_a_venv_whatever_python3_is(outer, tmp_path):
    python, env = outer
    tests = ["tests/test_packaging.py::test_installed_wheel_finds_its_configs",
             "tests/test_device_kit.py::test_check_sh_refuses_wheels_of_another_python"]
    r = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", tmp_path / "inner_pytest", *tests],
             env, REPO, timeout=600)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]

    out = tmp_path / "kit"
    kit_env = {**env, "PYTHON": str(python), "KIT_ONLY": "nvme", "LAZYTRAIN_NVME_DIR": str(tmp_path)}
    r = _run(["bash", REPO / "bench" / "device" / "check.sh", "--rehearse", out], kit_env, REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["ok"] and [s["name"] for s in doc["stages"]] == ["nvme"] and doc["stages"][0]["status"] == "pass"
    assert Path(doc["environment"]["executable"]) == python  # every stage started with PYTHON
    assert f"$ {python} " in (out / "log.txt").read_text()

    r = _run(["bash", REPO / "bench" / "device" / "check.sh", "--rehearse", tmp_path / "kit2"],
             {k: v for k, v in kit_env.items() if k != "PYTHON"}, REPO)
    assert r.returncode == 2 and "does not run" in r.stderr and "set PYTHON" in r.stderr, r.stdout + r.stderr
