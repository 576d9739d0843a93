"""The device validation kit (bench/device/): its CPU rehearsal passes, and its race hunt works.

The rehearsal runs every stage that can run without CUDA, each in its own process, exactly as
``bash bench/device/check.sh --rehearse OUTDIR`` does on a developer's machine (~70-110 s on 2
cores, most of it the stages' imports).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "bench" / "device"
CUDA_STAGES = {"sanitizer", "sync_debug", "pytest_gpu"}
CPU_STAGES = {"equivalence", "delays", "lightning", "throughput", "distributed", "nvme"}


@pytest.fixture(scope="module")
def kit():
    sys.path.insert(0, str(KIT))
    try:
        import kit as kit_module

        yield kit_module
    finally:
        sys.path.remove(str(KIT))


def test_rehearsal_passes_every_cpu_stage_and_skips_the_cuda_ones(tmp_path):
    out = tmp_path / "kit"
    r = subprocess.run(["bash", str(KIT / "check.sh"), "--rehearse", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{log[-5000:]}"
    doc = json.loads((out / "results.json").read_text())
    assert doc["mode"] == "rehearse" and doc["ok"] is True and doc["finished"]
    stages = {s["name"]: s for s in doc["stages"]}
    assert len(stages) == len(doc["stages"]) == len(CUDA_STAGES | CPU_STAGES)
    assert set(stages) == CUDA_STAGES | CPU_STAGES
    for name, s in stages.items():
        assert s["status"] in ("pass", "fail", "skipped"), name
        assert isinstance(s["seconds"], (int, float)) and s["seconds"] >= 0, name
        assert isinstance(s["figures"], dict), name
    for name in CUDA_STAGES:
        assert stages[name]["status"] == "skipped" and stages[name]["reason"], name
    for name in CPU_STAGES:
        assert stages[name]["status"] == "pass", (name, stages[name].get("reason"))
    # the figures say what was compared
    eq = stages["equivalence"]["figures"]
    assert eq["comparison"] == "bitwise" and eq["max_rel_err"] == 0
    assert {"keep_all", "recompute_all", "megatrain_K1", "megatrain_K2", "cpu_homes", "nvme_homes",
            "kept_internals_resident", "milp"} <= set(eq["schedules"])
    assert stages["lightning"]["figures"]["clip_inactive"]["max_abs_loss_diff"] == 0
    assert "6 GPU tests" in stages["pytest_gpu"]["reason"] or "GPU tests collected" in stages["pytest_gpu"]["reason"]
    assert not (out / "site").exists()  # installed packages do not travel back with the results
    assert "## equivalence" in log


def test_delay_injection_exposes_a_planted_race_and_leaves_correct_runs_alone(kit, tmp_path):
    """Compute that does not wait for its weights (a missing wait, planted here) gives other
    numbers once the copies are late; the correct executor stays bitwise equal under delays."""
    from lightning_lazytrain.engine import copy_engine, param_store

    model = kit.tiny_model()
    batches = kit.make_batches(kit.tiny_spec(), 1, 2)
    schedule = kit.fixed_schedules()["cpu_homes"]
    base = kit.run_executor(model, schedule, batches, "cpu", tmp_path)
    binds_before = param_store.ParamStore.bind
    with kit.Delays("cpu", copy_s=1e-3, compute_s=1e-3, jitter=True).installed() as d:
        delayed = kit.run_executor(model, schedule, batches, "cpu", tmp_path)
    assert d.counts["host_copy"] > 0 and d.counts["compute"] > 0
    assert param_store.ParamStore.bind is binds_before  # unwrapped again
    assert kit.compare(delayed, base, exact=True, tol=0)[1] == []

    wait = copy_engine.ThreadHandle.sync_current_stream
    copy_engine.ThreadHandle.sync_current_stream = lambda self: None  # the planted race
    try:
        with kit.Delays("cpu", copy_s=2e-3).installed():
            raced = kit.run_executor(model, schedule, batches, "cpu", tmp_path)
    except RuntimeError as err:  # the race can also show as an error: compute read a buffer a
        raced = None  # copy was still writing (autograd sees a saved tensor change under it)
        assert "in place" in str(err) or "nan" in str(err).lower(), err
    finally:
        copy_engine.ThreadHandle.sync_current_stream = wait
    assert raced is None or kit.compare(raced, base, exact=True, tol=0)[1]


def test_pytest_summary_parsing(kit):
    from stage_pytest_gpu import summary_counts

    assert summary_counts("ssssss [100%]\n6 skipped, 443 deselected in 9.77s\n") == {"skipped": 6, "deselected": 443}
    assert summary_counts("==== 1 failed, 4 passed, 2 errors, 1 warning in 12.30s ====") == {
        "failed": 1, "passed": 4, "error": 2, "warning": 1}
    assert summary_counts("no tests ran in 0.01s") == {}


def test_wheel_list_is_what_the_gpu_image_lacks(kit):
    import fetch_wheels  # bench/device is on sys.path through the kit fixture

    wanted = fetch_wheels.wanted()
    assert {"pyomo", "highspy", "hydra-core", "omegaconf", "antlr4-python3-runtime", "bitsandbytes",
            "jsonargparse"} <= set(wanted)
    assert not {"torch", "lightning", "transformers", "numpy", "pytest", "matplotlib", "pyyaml"} & set(wanted)
    needed = (KIT / "check.sh").read_text()
    for module in ("pyomo", "highspy", "hydra", "omegaconf", "bitsandbytes", "jsonargparse", "antlr4"):
        assert module in needed.split("NEEDED=", 1)[1].splitlines()[0], module
