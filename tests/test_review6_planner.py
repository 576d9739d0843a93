"""Review 6 of the planner side (lazytrain-plan, planner/): properties a user planning real runs relies on,
probed on the shipped hardware and model configs.

Defects are ``xfail(strict=True)`` with an "OPEN:" reason; the rest are regression probes. Solver time
limits are short and the combinations few so the file runs in a couple of minutes on 2 cores.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_lazytrain.cli.plan import plan_job
from lightning_lazytrain.config import CONF_DIR, load_hardware, load_model
from lightning_lazytrain.planner import (
    InfeasibleBudget, MilpOptions, SimResult, TrainSpec, Workload, diagnose, largest_batch, make_plan,
    plan_cluster, simulate,
)
from lightning_lazytrain.planner.policies import min_memory
from lightning_lazytrain.planner.simulator import MEM_TOL

GB = 1e9
FAST = MilpOptions(time_limit=15)


def train(b: int, seq: int = 1024, **kw) -> TrainSpec:
    # conf/train/default.yaml's shape (bf16, 2% 8-bit states)
    return TrainSpec(micro_batch_size=b, seq_len=seq, eight_bit_fraction=kw.pop("eight_bit_fraction", 0.02), **kw)


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="plan", overrides=list(overrides))


def with_cap(hw, cap_gb: float):
    return hw.replace(gpu_memory_cap_bytes=cap_gb * GB, gpu_memory_bytes=max(hw.gpu_memory_bytes, cap_gb * GB))


def _gb(pattern: str, msg: str) -> float:
    m = re.search(pattern, msg)
    assert m, (pattern, msg)
    return float(m.group(1))


def assert_plan_properties(r, hw) -> None:
    s = r.sim
    assert s.peak_gpu_bytes <= hw.gpu_memory_cap_bytes + MEM_TOL
    assert s.peak_cpu_bytes <= hw.cpu_memory_bytes + MEM_TOL
    assert s.nvme_bytes <= hw.nvme_capacity_bytes + MEM_TOL
    assert not r.violations
    for name, base in r.baselines.items():
        if isinstance(base, SimResult):
            assert s.iteration_seconds <= base.iteration_seconds * (1 + 1e-9), name
    again = simulate(r.schedule, r.workload, r.hardware)
    assert again.iteration_seconds == pytest.approx(s.iteration_seconds, rel=1e-9)
    if r.status in ("optimal", "time_limit"):
        # the objective adds the MILP's tie-breaks (ScheduleModel.EPS = 1 us per offloaded boundary or internals move)
        assert r.solver["objective"] == pytest.approx(s.iteration_seconds, rel=1e-4)


# =====================================================================================================
# DEFECTS
# =====================================================================================================

def test_smallest_gpu_budget_suggestion_fits_when_applied():
    hw, model, tr = load_hardware("rtx3090"), load_model("qwen2.5-7b"), train(64)
    with pytest.raises(InfeasibleBudget) as err:
        diagnose(Workload.analytic(model, tr, hw), hw, model, tr)
    suggested = _gb(r"smallest GPU budget for this batch: ([\d.]+) GB", str(err.value))
    hw2 = with_cap(hw, suggested)
    diagnose(Workload.analytic(model, tr, hw2), hw2, model, tr)  # raises: short by 1.14 MB


def test_smallest_host_memory_suggestion_fits_when_applied():
    hw, model, tr = load_hardware("cpu"), load_model("qwen2.5-3b"), train(1, 128)
    with pytest.raises(InfeasibleBudget) as err:
        diagnose(Workload.analytic(model, tr, hw), hw, model, tr)
    assert err.value.tier == "cpu"
    suggested = _gb(r"smallest host memory that works: ([\d.]+) GB", str(err.value))
    hw2 = hw.replace(cpu_memory_bytes=suggested * GB)
    wl2 = Workload.analytic(model, tr, hw2)
    assert wl2.host_static_bytes <= hw2.cpu_memory_bytes  # fails: 51.21 GB < 51.2134 GB


def test_static_floor_suggestion_is_the_smallest_budget_that_works():
    hw, model, tr = with_cap(load_hardware("rtx3090"), 3), load_model("qwen2.5-14b"), train(4)
    with pytest.raises(InfeasibleBudget) as err:
        diagnose(Workload.analytic(model, tr, hw), hw, model, tr)
    suggested = _gb(r"smallest GPU budget that works for this batch: ([\d.]+) GB", str(err.value))
    hw2 = with_cap(hw, suggested)  # the figure as printed (rounded up): the min-memory peak, not the floor
    diagnose(Workload.analytic(model, tr, hw2), hw2, model, tr)  # was: still short (floor 8.43 GB, peak 14.06)


def test_eight_bit_suggestion_not_repeated_when_already_applied():
    hw, model = load_hardware("cpu"), load_model("qwen2.5-3b")
    tr = train(1, 128, eight_bit_fraction=1.0)
    with pytest.raises(InfeasibleBudget) as err:
        diagnose(Workload.analytic(model, tr, hw), hw, model, tr)
    assert err.value.tier == "cpu"
    assert "eight_bit_fraction=1.0" not in err.value.suggestion


def test_largest_batch_counts_schedules_that_use_nvme_or_recompute():
    model, tr = load_model("qwen2.5-7b"), train(16)
    hw0 = load_hardware("h800")
    hw = hw0.replace(cpu_memory_bytes=Workload.analytic(model, tr, hw0).host_static_bytes + 0.5 * GB)
    r = make_plan(model, tr, hw, options=FAST)  # plans fine: recompute, no host activations
    assert_plan_properties(r, hw)
    assert largest_batch(model, tr, hw) >= 16  # returns 2


@pytest.mark.slow
def test_multi_gpu_auto_batch_search_in_shard_mode(tmp_path):
    """Was a DEFECT: micro_batch_size=auto on several GPUs searched with the unsharded host state on 1/n of the
    host, so h800x8 27B shard was 'infeasible (cpu)' where batch 8 plans (Note: [the batch search on several
    GPUs], planner/multi_batch.py)."""
    # the explicit batch plans (regression half: host 765 GB of 2199 per node)
    row = plan_job(compose_cfg("hardware=h800x8", "model=qwen3.6-27b", "plan.data_parallel=shard",
                               "train.micro_batch_size=8", "plan.time_limit=10", "plan.plot=false"),
                   tmp_path / "explicit", out=open(os.devnull, "w"))
    assert row["status"] == "ok" and row["host_fits"]
    auto = plan_job(compose_cfg("hardware=h800x8", "model=qwen3.6-27b", "plan.data_parallel=shard",
                                "train.micro_batch_size=auto", "plan.batch_candidates=[8]", "plan.time_limit=10",
                                "plan.plot=false"), tmp_path / "auto", out=open(os.devnull, "w"))
    assert auto["status"] == "ok" and auto["host_fits"] and auto["micro_batch_size"] == 8, auto
    search = json.loads((tmp_path / "auto" / "plan.json").read_text())["batch_search"]
    assert search["largest_feasible"] >= 8 and [r["micro_batch_size"] for r in search["table"]] == [8], search


def test_multi_gpu_infeasible_names_the_shortfall():
    with pytest.raises(InfeasibleBudget) as err:
        plan_cluster(load_model("qwen3.6-27b"), train(512), load_hardware("h800x8"), "shard",
                     options=MilpOptions(time_limit=10))
    assert err.value.shortfall_bytes > 0, str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("drive", [False, True])
def test_host_and_nvme_shortage_names_a_host_side_tier(drive):
    """Was a DEFECT: host (+ NVMe) too small for any schedule was 'gpu memory short by 0 B' with a pointer to
    diagnose(), which had passed. Now (Note: [no schedule fits], planner/shortage.py) the tier short on the floor
    that fits the GPU, and a fix per floor."""
    model, tr = load_model("qwen3.6-27b"), train(6)
    hw0 = load_hardware("rtx3090")
    hw = hw0.replace(cpu_memory_bytes=Workload.analytic(model, tr, hw0).host_static_bytes + 0.05 * GB,
                     **({} if drive else {"nvme_capacity_bytes": 0.0}))
    with pytest.raises(InfeasibleBudget) as err:
        make_plan(model, tr, hw, options=FAST)
    text = str(err.value)
    assert err.value.tier in ("cpu", "nvme") and err.value.shortfall_bytes > 0, text
    assert "diagnose()" not in text and "every boundary recomputed: gpu short by" in text, text
    assert ("on NVMe" in text) == drive, text
    # each fix named is one: the host memory it names plans
    need = float(text.split("cpu memory of at least ")[1].split(" GB")[0]) * GB
    assert make_plan(model, tr, hw.replace(cpu_memory_bytes=need), options=FAST).sim.peak_cpu_bytes <= need


def test_multi_gpu_replicate_honours_conversion_placement(tmp_path):
    cfg = compose_cfg("hardware=rtx3090x8", "model=qwen2.5-3b", "train.micro_batch_size=8",
                      "plan.data_parallel=replicate", "plan.conversions=device", "plan.time_limit=10",
                      "plan.plot=false")
    plan_job(cfg, tmp_path, out=open(os.devnull, "w"))
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["conversions_on_device"], "conversions=device requested, none placed on the device"


def test_plan_cluster_world_size_one_matches_make_plan():
    hw, model, tr = load_hardware("h200"), load_model("qwen2.5-3b"), train(8)
    single = make_plan(model, tr, hw, options=FAST)
    cluster = plan_cluster(model, tr, hw, "replicate", options=FAST)
    assert cluster.sim.iteration_seconds == pytest.approx(single.sim.iteration_seconds, rel=2e-3)


def test_replicate_host_overflow_is_marked_over_cap(tmp_path):
    row = plan_job(compose_cfg("hardware=rtx3090x8", "model=qwen2.5-7b", "train.micro_batch_size=6",
                               "plan.time_limit=10", "plan.plot=false"), tmp_path, out=open(os.devnull, "w"))
    assert row["host_gb_per_node"] > 512 and row["host_fits"] is False  # the planner knows
    assert row["over_cap"] is True or row["status"] != "ok"


def test_min_memory_nvme_tier_is_a_valid_schedule():
    """The last boundary's reload runs in H, the first backward window, where an NVMe file read has no window
    before it: min_memory(L, "nvme") spills every other moved boundary and keeps that one on the host."""
    s = min_memory(4, "nvme")
    assert s.count_homes().get("nvme") == 2 and s.homes[3] == "cpu"
    assert min_memory(1, "nvme").homes == ("gpu", "gpu")


# =====================================================================================================
# PASSING PROBES (regressions)
# =====================================================================================================

@pytest.mark.slow
@pytest.mark.parametrize("hw_name,model_name,batch", [
    ("rtx3090", "qwen2.5-3b", 8), ("h800", "qwen2.5-7b", 144), ("h200", "qwen2.5-3b", 8),
    ("a100-80gb", "qwen2.5-7b", 8),
])
def test_single_gpu_plan_fits_budgets_beats_baselines_and_matches_simulator(hw_name, model_name, batch):
    hw = load_hardware(hw_name)
    r = make_plan(load_model(model_name), train(batch), hw, options=FAST)
    assert r.status == "optimal"
    assert_plan_properties(r, hw)


def test_tight_host_memory_spills_to_nvme_within_capacity():
    model, tr = load_model("qwen2.5-7b"), train(144)
    hw0 = load_hardware("h800")
    hw = hw0.replace(cpu_memory_bytes=Workload.analytic(model, tr, hw0).host_static_bytes + 5 * GB)
    r = make_plan(model, tr, hw, options=FAST)
    assert_plan_properties(r, hw)
    assert r.sim.nvme_bytes > 0 and r.schedule.count_homes().get("nvme", 0) > 0


@pytest.mark.slow
def test_more_gpu_memory_never_slower():
    model, tr, hw = load_model("qwen2.5-7b"), train(144), load_hardware("h800")
    times = [make_plan(model, tr, with_cap(hw, cap), options=FAST).sim.iteration_seconds for cap in (56, 70, 110)]
    for a, b in zip(times, times[1:]):
        assert b <= a * (1 + 1e-3)  # within the MIP gap
    assert times[-1] < times[0]


@pytest.mark.slow
def test_bigger_model_never_faster_on_same_hardware_and_batch():
    hw = load_hardware("rtx3090")
    times = [make_plan(load_model(m), train(2), hw, options=FAST).sim.iteration_seconds
             for m in ("qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b")]
    assert times == sorted(times) and times[0] < times[-1]


def test_largest_batch_hint_fits_and_one_more_does_not():
    hw, model = load_hardware("rtx3090"), load_model("qwen2.5-7b")
    with pytest.raises(InfeasibleBudget) as err:
        make_plan(model, train(64), hw, options=FAST)
    assert err.value.tier == "gpu" and err.value.shortfall_bytes > 0
    best = int(_gb(r"largest micro-batch that fits: (\d+)", str(err.value)))
    assert best == 45
    r = make_plan(model, train(best), hw, options=FAST)
    assert_plan_properties(r, hw)
    with pytest.raises(InfeasibleBudget):
        make_plan(model, train(best + 1), hw, options=FAST)


def test_cpu_profile_real_models_name_the_host_tier_and_shortfall():
    hw = load_hardware("cpu")
    for name in ("qwen2.5-3b", "qwen3.6-27b"):
        model, tr = load_model(name), train(4, 128)
        wl = Workload.analytic(model, tr, hw)
        with pytest.raises(InfeasibleBudget) as err:
            make_plan(model, tr, hw)
        assert err.value.tier == "cpu"
        assert err.value.shortfall_bytes == pytest.approx(wl.host_static_bytes - hw.cpu_memory_bytes)


@pytest.mark.slow
def test_time_limit_is_reported_honestly():
    # a100 27B b8 does not prove the 0.1% gap within 60 s (observed in the sweep); with 2 s it reports so
    hw = load_hardware("a100-80gb")
    r = make_plan(load_model("qwen3.6-27b"), train(8), hw, options=MilpOptions(time_limit=2))
    assert r.status == "time_limit"
    assert r.solver["mip_gap"] > 1e-3
    assert r.solver["solve_seconds"] < 2 * 2 + 5
    assert_plan_properties(r, hw)


@pytest.mark.slow
def test_multi_gpu_shard_per_rank_figures_are_consistent(tmp_path):
    row = plan_job(compose_cfg("hardware=rtx3090x8", "model=qwen2.5-7b", "train.micro_batch_size=6",
                               "plan.data_parallel=shard", "plan.time_limit=10", "plan.plot=false"),
                   tmp_path, out=open(os.devnull, "w"))
    data = json.loads((tmp_path / "plan.json").read_text())
    dp = data["data_parallel"]
    assert dp["world_size"] == row["world_size"] == 8 and row["host_fits"] is True
    assert dp["per_rank"]["iteration_seconds"] == pytest.approx(row["plan_iteration_s"])
    assert row["cluster_tokens_per_s"] == pytest.approx(8 * row["plan_tokens_per_s"])
    assert row["plan_peak_gpu_gb"] * GB <= 22 * GB + MEM_TOL
    assert row["host_gb_per_node"] <= 512
    assert row["plan_iteration_s"] <= row["megatrain_iteration_s"]
    rec = data["baselines"]["recompute_all"]
    assert row["plan_iteration_s"] <= rec["iteration_seconds"] * (1 + 1e-9)


@pytest.mark.slow
def test_sweep_csv_rows_match_single_runs(tmp_path):
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "lightning_lazytrain.cli.plan", "-m", "hardware=rtx3090",
                           "model=qwen2.5-3b,qwen3.6-27b", "train.micro_batch_size=8", "plan.time_limit=10",
                           "plan.plot=false"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = Path(tmp_path).rglob("sweep.csv")
    rows = {r["model"]: r for r in csv.DictReader(path.open())}
    assert set(rows) == {"qwen2.5-3b", "qwen3.6-27b"}
    ok, bad = rows["qwen2.5-3b"], rows["qwen3.6-27b"]
    single = make_plan(load_model("qwen2.5-3b"), train(8), load_hardware("rtx3090"), options=FAST)
    assert ok["status"] == "ok" and float(ok["plan_iteration_s"]) == pytest.approx(single.sim.iteration_seconds,
                                                                                   rel=1e-3)
    for col in ("plan_tokens_per_s", "plan_peak_gpu_gb", "megatrain_iteration_s", "speedup", "solver_status"):
        assert ok[col] != "", col
    assert bad["status"] == "infeasible" and "gpu memory short by" in bad["reason"]
    assert "largest micro-batch that fits: 6" in bad["reason"]
