"""Exit codes of the three console scripts, called exactly as pip's generated scripts call them:
``sys.exit(<entry point>())`` with ``sys.argv`` set, in a fresh interpreter, from a directory outside the
repository. The entry points are read from pyproject.toml (the source of the installed scripts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]

RUNNER = ("import sys\n"
          "from importlib import import_module\n"
          "module, _, attr = sys.argv[1].partition(':')\n"
          "sys.argv = sys.argv[2:]\n"
          "sys.exit(getattr(import_module(module), attr)())\n")


def run_script(name: str, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", RUNNER, SCRIPTS[name], name, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_three_scripts_are_declared():
    assert set(SCRIPTS) == {"lazytrain-plan", "lazytrain-train", "lazytrain-cli"}


def test_lazytrain_plan_exit_codes(tmp_path):
    ok = run_script("lazytrain-plan", "hardware=cpu", "model=tiny", "train=cpu", "plan.plot=false", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "plan (milp)" in ok.stdout
    bad = run_script("lazytrain-plan", "hardware=cpu", "model=tiny", "train=cpu", "hardware.gpu_memory_cap_gb=0.0001",
                     "hardware.gpu_memory_gb=0.0001", cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert "Traceback" not in bad.stderr


def test_lazytrain_train_exit_code(tmp_path):
    ok = run_script("lazytrain-train", "trainer.max_steps=2", "trainer.val_check_interval=2", "data.max_bytes=200000",
                    "data.val_windows=4", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
                    cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "final val loss" in ok.stdout


def test_lazytrain_cli_fit_exits_0_and_prints_no_object(tmp_path):
    ok = run_script("lazytrain-cli", "fit", "--trainer.fast_dev_run=2", "--trainer.accelerator=cpu",
                    "--trainer.strategy=lazytrain", "--trainer.enable_progress_bar=false",
                    "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}",
                    "--data.max_bytes=200000", "--data.seq_len=32", "--data.batch_size=2", "--data.val_windows=4",
                    cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "LightningCLI object" not in ok.stdout + ok.stderr
    bad = run_script("lazytrain-cli", "fit", "--trainer.no_such_option=1", cwd=tmp_path)
    assert bad.returncode == 2
