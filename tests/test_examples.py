"""The examples run as scripts (subprocesses) with small settings: the CPU quick start (env var), the 27B/H800
planning example (argv: a small model so the solve is quick), and the Hugging Face example (needs transformers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(tmp_path: Path, script: str, *args: str, env: dict | None = None, timeout: float = 180):
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_quickstart_cpu(tmp_path):
    out = run(tmp_path, "quickstart_cpu.py", env={"QUICKSTART_STEPS": "3"})
    assert "lazytrain plan" in out  # the strategy planned the run
    assert "quickstart: 3 steps with strategy='lazytrain', held-out val loss" in out
    val = float(out.split("held-out val loss ")[1].split()[0])
    assert 0 < val < 5.545  # below an untrained byte model (ln 256) after 3 steps
    assert not list(tmp_path.iterdir())  # logger=False: nothing written into the working directory


@pytest.mark.slow
def test_plan_example(tmp_path):
    out = run(tmp_path, "plan_27b_h800.py", "--model", "tiny", "--hardware", "cpu", "--batch", "4", "--seq-len",
              "128", "--time-limit", "10")
    for text in ("tiny", "on cpu", "plan (milp)", "megatrain", "keep_all", "recompute_all", "tokens/s",
                 "boundary homes"):
        assert text in out


def test_plan_example_defaults_are_the_papers_run():
    src = (EXAMPLES / "plan_27b_h800.py").read_text()
    assert 'default="qwen3.6-27b"' in src and 'default="h800"' in src and "default=72" in src


@pytest.mark.slow
def test_hf_example(tmp_path):
    pytest.importorskip("transformers")
    out = run(tmp_path, "hf_causal_lm.py", env={"HF_EXAMPLE_STEPS": "2"})
    assert "model.model.layers" in out  # the strategy found the HF decoder layers
    assert "hf_causal_lm: LlamaForCausalLM" in out and "strategy='lazytrain'" in out
