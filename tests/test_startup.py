"""Start-up: the planner and ``lazytrain-plan`` never import torch or Lightning, the training core never
imports Lightning, and importing ``lightning_lazytrain.strategy`` / ``lightning_lazytrain.fabric_strategy``
registers ``strategy="lazytrain"`` with the Trainer and with Fabric (``import lightning_lazytrain`` alone
registers nothing and leaves Lightning's import alone).

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
    proc = _python("import lightning_lazytrain.planner, lightning_lazytrain.config, lightning_lazytrain.planner.report\n"
                   + REPORT_HEAVY, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _heavy(proc) == []


@pytest.mark.slow
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


@pytest.mark.slow
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
              "assert not [f for f in sys.meta_path if 'lazytrain' in type(f).__module__]\n"
              "from lightning.fabric import Fabric\n"
              "from lightning.pytorch import Trainer\n"
              "f = Fabric(strategy='lazytrain', accelerator='cpu', devices=1)\n"
              "assert type(f.strategy).__name__ == 'LazyTrainFabricStrategy', type(f.strategy)\n"
              "t = Trainer(strategy='lazytrain_megatrain', accelerator='cpu', logger=False, enable_progress_bar=False,\n"
              "            enable_model_summary=False, enable_checkpointing=False)\n"
              "assert type(t.strategy).__name__ == 'LazyTrainStrategy', type(t.strategy)\n"
              "assert t.strategy.policy == 'megatrain', t.strategy.policy\n"
              "print('REGISTERED')\n")

EXPLICIT = "import lightning_lazytrain.strategy\nimport lightning_lazytrain.fabric_strategy\n"


@pytest.mark.slow
def test_the_package_registers_nothing_and_rewrites_no_loader(tmp_path):
    """``import lightning_lazytrain`` imports neither torch nor Lightning and leaves Lightning's import alone:
    the names are registered by importing the strategy modules (below), nothing else."""
    code = ("import sys\n"
            "import lightning_lazytrain\n"
            "assert 'lightning' not in sys.modules and 'torch' not in sys.modules\n"
            "assert not [f for f in sys.meta_path if 'lazytrain' in type(f).__module__]\n"
            "import lightning\n"
            "assert type(lightning.__loader__).__name__ == 'SourceFileLoader', lightning.__loader__\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
            "assert 'lazytrain' not in StrategyRegistry and 'lazytrain' not in STRATEGY_REGISTRY\n"
            "print('NOTHING')\n")
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "NOTHING" in proc.stdout


@pytest.mark.slow
def test_importing_the_strategy_modules_registers_the_names(tmp_path):
    code = "import sys\nimport lightning as L\n" + EXPLICIT + REGISTERED
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "REGISTERED" in proc.stdout


@pytest.mark.slow
def test_the_strategy_modules_register_before_lightning_is_imported_elsewhere(tmp_path):
    code = "import sys\n" + EXPLICIT + REGISTERED
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "REGISTERED" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("first", ["lightning_lazytrain.adapters.checkpoint_io",
                                   "lightning_lazytrain.core.sharded_checkpoint",
                                   "lightning_lazytrain.core.grad_sync", "lightning_lazytrain.core",
                                   "lightning_lazytrain.fabric_strategy"])
def test_the_strategy_modules_register_whichever_module_comes_first(tmp_path, first):
    """Any module of the package imported first (one that imports Lightning itself, or the core, which
    does not), then the strategy modules: no import cycle, no warning, the names registered."""
    code = f"import sys\nimport warnings\nwarnings.simplefilter('error')\nimport {first}\n" + EXPLICIT + REGISTERED
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "REGISTERED" in proc.stdout


@pytest.mark.slow
def test_the_core_imports_no_lightning(tmp_path):
    """The training core (core/) sits below the Lightning adapters: it imports torch, never Lightning."""
    code = "import sys\nimport lightning_lazytrain.core\n" + REPORT_HEAVY
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    heavy = _heavy(proc)
    assert "torch" in heavy and not [m for m in heavy if m.startswith(("lightning", "pytorch_lightning"))], heavy
