"""Start-up: the planner and ``lazytrain-plan`` never import torch or Lightning, and ``import lightning_lazytrain``
still registers ``strategy="lazytrain"`` with the Trainer and with Fabric (whichever is imported first).

Each check runs in a fresh interpreter (``sys.modules`` of the test process already holds torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "transformers", "bitsandbytes")

REPORT_HEAVY = ("import json, sys\n"
                f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
                "print('HEAVY=' + json.dumps(heavy))\n")


def _python(code: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _heavy(proc: subprocess.CompletedProcess) -> list:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HEAVY=")]
    assert lines, f"no report\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(lines[-1][len("HEAVY="):])


def test_planner_import_loads_neither_torch_nor_lightning(tmp_path):
    proc = _python("import lightning_lazytrain.planner, lightning_lazytrain.config, lightning_lazytrain.report\n"
                   + REPORT_HEAVY, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _heavy(proc) == []


def test_plan_app_help_loads_neither_torch_nor_lightning(tmp_path):
    code = ("import sys\n"
            "sys.argv = ['lazytrain-plan', '--help']\n"
            "from lightning_lazytrain.cli.plan import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            + REPORT_HEAVY)
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "lazytrain-plan" in proc.stdout and "Powered by Hydra" in proc.stdout
    assert _heavy(proc) == []


def test_plan_app_run_loads_neither_torch_nor_lightning(tmp_path):
    code = ("import sys\n"
            "sys.argv = ['lazytrain-plan', 'hardware=cpu', 'model=tiny', 'train=cpu', 'plan.time_limit=10']\n"
            "from lightning_lazytrain.cli.plan import main\n"
            "main()\n" + REPORT_HEAVY)
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plan (milp)" in proc.stdout
    assert list(tmp_path.glob("outputs/plan/*/*/timeline.png"))
    assert _heavy(proc) == []


REGISTERED = ("from lightning.pytorch.strategies import StrategyRegistry\n"
              "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
              "names = ('lazytrain', 'lazytrain_megatrain')\n"
              "assert all(n in StrategyRegistry for n in names), StrategyRegistry.available_strategies()\n"
              "assert all(n in STRATEGY_REGISTRY for n in names), STRATEGY_REGISTRY.available_strategies()\n"
              "import lightning\n"
              "assert type(lightning.__loader__).__name__ == 'SourceFileLoader', lightning.__loader__\n"
              "assert type(lightning.__spec__.loader).__name__ == 'SourceFileLoader', lightning.__spec__.loader\n"
              "assert not [f for f in sys.meta_path if type(f).__name__ == '_LightningImportHook']\n"
              "from lightning.fabric import Fabric\n"
              "from lightning.pytorch import Trainer\n"
              "f = Fabric(strategy='lazytrain', accelerator='cpu', devices=1)\n"
              "assert type(f.strategy).__name__ == 'LazyTrainFabricStrategy', type(f.strategy)\n"
              "t = Trainer(strategy='lazytrain_megatrain', accelerator='cpu', logger=False, enable_progress_bar=False,\n"
              "            enable_model_summary=False, enable_checkpointing=False)\n"
              "assert type(t.strategy).__name__ == 'LazyTrainStrategy', type(t.strategy)\n"
              "assert t.strategy.policy == 'megatrain', t.strategy.policy\n"
              "print('REGISTERED')\n")


def test_import_registers_before_lightning_is_imported(tmp_path):
    code = ("import sys\n"
            "import lightning_lazytrain\n"
            "assert 'lightning' not in sys.modules and 'torch' not in sys.modules\n"
            "import lightning as L\n" + REGISTERED)
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "REGISTERED" in proc.stdout


@pytest.mark.slow
def test_import_registers_when_only_fabric_is_imported(tmp_path):
    code = ("import sys\n"
            "import lightning_lazytrain\n"
            "from lightning.fabric import Fabric\n" + REGISTERED)
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "REGISTERED" in proc.stdout


@pytest.mark.slow
def test_import_registers_when_lightning_came_first(tmp_path):
    code = ("import sys\n"
            "import lightning.pytorch\n"
            "import lightning_lazytrain\n" + REGISTERED)
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "REGISTERED" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("first", ["lightning_lazytrain.checkpoint_io", "lightning_lazytrain.sharded_checkpoint",
                                   "lightning_lazytrain.distributed", "lightning_lazytrain.strategy"])
def test_import_registers_whichever_module_comes_first(tmp_path, first):
    """A submodule that imports Lightning itself (checkpoint_io does) triggers the registration
    while it is half initialised: nothing the registration imports may need it at module level."""
    code = f"import sys\nimport warnings\nwarnings.simplefilter('error')\nimport {first}\n" + REGISTERED
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "REGISTERED" in proc.stdout
