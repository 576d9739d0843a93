"""Exit codes of the three console scripts, called exactly as pip's generated scripts call them:
``sys.exit(<entry point>())`` with ``sys.argv`` set, in a fresh interpreter, from a directory outside the
repository. The entry points are read from pyproject.toml (the source of the installed scripts)."""

from __future__ import annotations

import json
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


@pytest.mark.slow
def test_lazytrain_plan_exit_codes(tmp_path):
    ok = run_script("lazytrain-plan", "hardware=cpu", "model=tiny", "train=cpu", "plan.plot=false", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "plan (milp)" in ok.stdout
    bad = run_script("lazytrain-plan", "hardware=cpu", "model=tiny", "train=cpu", "hardware.gpu_memory_cap_gb=0.0001",
                     "hardware.gpu_memory_gb=0.0001", cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert "Traceback" not in bad.stderr
    for args, message in ((["+plan.time_limt=5"], "lazytrain-plan: unknown key plan.time_limt"),
                          (["hardware=h800", "hardware.gpu_memory_cap_gb=100"], "lazytrain-plan: invalid "
                           "hardware.gpu_memory_cap_gb=100.0: exceeds hardware.gpu_memory_gb=80")):
        work = tmp_path / "empty"
        work.mkdir()
        bad = run_script("lazytrain-plan", *args, cwd=work)
        lines = [line for line in bad.stderr.splitlines() if line.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), bad.stderr
        assert list(work.iterdir()) == []  # no output directory
        work.rmdir()


# lazytrain-train three times in one interpreter (Lightning imports once): two configs that cannot run, then a run
RUN_MANY = ("import contextlib, io, json, os, sys\n"
            "from importlib import import_module\n"
            "module, _, attr = sys.argv[1].partition(':')\n"
            "entry = getattr(import_module(module), attr)\n"
            "runs = json.loads(sys.argv[2])\n"
            "report = []\n"
            "for args in runs:\n"
            "    sys.argv = [args[0], *args[1:]]\n"
            "    out, err = io.StringIO(), io.StringIO()\n"
            "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
            "        try:\n"
            "            code = entry()\n"
            "        except SystemExit as e:\n"
            "            code = e.code\n"
            "    report.append({'code': 0 if code is None else code, 'stdout': out.getvalue(), 'stderr': err.getvalue(),\n"
            "                   'left': sorted(os.listdir('.'))})\n"
            "print('REPORT=' + json.dumps(report))\n")


@pytest.mark.slow
def test_lazytrain_train_exit_codes_one_line_and_no_directory_left(tmp_path):
    """Exit 0 after a run; a config that cannot run: exit 2, one line on stderr, no traceback, no output directory
    left behind: a strategy name nobody knows, trainer=gpu on a machine without one, a key the schema does not know, + or not (Hydra's own hint after a typo), a renamed key, a value of the wrong
    type, an nvme_dir that is a file, a precision the strategy does not run, an infinite budget. ``--help`` lists the
    app's own config groups only."""
    import torch

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    bad = {"strategy.name=nonsense": "strategy.name='nonsense' is not a strategy: use lazytrain or lazytrain_megatrain",
           "+trainer.max_step=10": "unknown key trainer.max_step: trainer (TrainerConfig) has no key 'max_step'",
           "trainer.max_step=10": "did you mean trainer.max_steps?",
           "+optim.lr_shedule=constant": "unknown key optim.lr_shedule",
           "data.val_every=5": "data.val_every was renamed data.holdout_every",
           "trainer.max_steps=many": "trainer.max_steps: Value 'many' of type 'str' could not be converted to Integer",
           "train=cpu": "train=...: this app has no config group 'train' (its groups: data, hardware, model, trainer)",
           f"strategy.nvme_dir={blocker}": f"strategy.nvme_dir='{blocker}': {blocker} exists and is not a directory",
           "trainer.precision=64-true": "trainer.precision='64-true' is not supported by strategy.name=lazytrain",
           "strategy.gpu_memory_budget_gb=inf": "strategy.gpu_memory_budget_gb=inf: must be a number of GB > 0",
           "hardware.gpu_memory_cap_gb=100":
               "invalid hardware.gpu_memory_cap_gb=100.0: exceeds hardware.gpu_memory_gb=4"}
    if not torch.cuda.is_available():
        bad["trainer=gpu"] = "needs a CUDA GPU and this machine has none"
    runs = [["lazytrain-train", override] for override in bad]
    runs.append(["lazytrain-train", "--help"])
    runs.append(["lazytrain-train", "trainer.max_steps=2", "trainer.val_check_interval=2", "data.max_bytes=200000",
                 "data.val_windows=4", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false"])
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, "-c", RUN_MANY, SCRIPTS["lazytrain-train"], json.dumps(runs)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *failed, help_run, ok = json.loads(proc.stdout.split("REPORT=")[-1])
    for run, message in zip(failed, bad.values()):
        assert run["code"] == 2, run
        lines = [line for line in run["stderr"].splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("lazytrain-train: ") and message in lines[0], run
        assert "Traceback" not in run["stdout"] + run["stderr"] and "bytes" not in lines[0]
        assert run["left"] == [], run  # no outputs/ directory
    assert help_run["code"] == 0, help_run
    groups = help_run["stdout"].split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert [line.split(":")[0] for line in groups.splitlines() if ": " in line and "group=option" not in line] == \
        ["data", "hardware", "model", "trainer"], groups
    assert ok["code"] == 0, ok
    assert "final val loss" in ok["stdout"] and ok["left"] == ["outputs"]


@pytest.mark.slow
def test_lazytrain_cli_fit_exits_0_and_prints_no_object(tmp_path):
    ok = run_script("lazytrain-cli", "fit", "--trainer.fast_dev_run=2", "--trainer.accelerator=cpu",
                    "--trainer.strategy=lazytrain", "--trainer.enable_progress_bar=false",
                    "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}",
                    "--data.max_bytes=200000", "--data.seq_len=32", "--data.batch_size=2", "--data.val_windows=4",
                    cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "LightningCLI object" not in ok.stdout + ok.stderr
