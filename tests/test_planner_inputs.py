"""Bad input gets a clear error; the Schedule round-trips through JSON; the planner needs no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_lazytrain.planner import (
    Hardware, InfeasibleBudget, InfeasibleSchedule, InvalidInput, ModelSpec, Schedule, TrainSpec, Workload,
    diagnose, keep_all, largest_batch, make_plan, megatrain, min_memory, simulate, solve,
)
from lightning_lazytrain.planner.units import format_bytes
from planner_helpers import G, hardware, workload

H800 = dict(name="h800", gpu_memory_gb=80, gpu_memory_cap_gb=70, peak_tflops=989, efficiency=0.5, h2d_gb_per_s=12,
            d2h_gb_per_s=12, nvme_read_gb_per_s=2.83, nvme_write_gb_per_s=3.35, nvme_capacity_gb=32,
            cpu_memory_gb=2199, cpu_adam_gparams_per_s=4, cpu_adam8_gparams_per_s=3)
Q7B = ModelSpec(name="qwen2.5-7b", num_layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4,
                head_dim=128, vocab=152064, qkv_bias=True)


def test_nonsense_inputs_name_the_key():
    with pytest.raises(InvalidInput, match="hardware.h2d_bytes_per_s"):
        Hardware.from_gb(**{**H800, "h2d_gb_per_s": -1})
    with pytest.raises(InvalidInput, match="model.num_layers"):
        Q7B.replace(num_layers=0)
    with pytest.raises(InvalidInput, match="train.micro_batch_size"):
        TrainSpec(micro_batch_size=0, seq_len=1024).validate()
    with pytest.raises(InvalidInput, match="hardware.efficiency"):
        Hardware.from_gb(**{**H800, "efficiency": 1.5})
    with pytest.raises(InvalidInput, match="model.kv_heads"):
        Q7B.replace(kv_heads=5)


def test_budget_below_static_footprint_is_rejected_with_the_shortfall():
    hw = Hardware.from_gb(**{**H800, "gpu_memory_gb": 4, "gpu_memory_cap_gb": 3})
    wl = Workload.analytic(Q7B, TrainSpec(micro_batch_size=1, seq_len=1024), hw)
    with pytest.raises(InfeasibleBudget) as err:
        diagnose(wl, hw)
    assert err.value.tier == "gpu"
    assert err.value.shortfall_bytes == pytest.approx(wl.static_gpu_bytes - hw.gpu_memory_cap_bytes)
    assert "smallest GPU budget" in str(err.value) and "GB" in str(err.value)


def test_small_budgets_print_in_a_readable_unit_not_as_zero_gb():
    # a 0.2M-parameter model against sub-MB budgets: every figure keeps three significant digits
    # (these messages used to read "need 0.00 GB ..., the cap is 0.00 GB (gpu memory short by 0.00 GB)")
    tiny = ModelSpec(name="tiny", num_layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, head_dim=16,
                     vocab=256)
    train = TrainSpec(micro_batch_size=1, seq_len=64)
    small = {**H800, "gpu_memory_gb": 1, "gpu_memory_cap_gb": 1}
    wl = Workload.analytic(tiny, train, Hardware.from_gb(**small))
    tight = simulate(min_memory(4), wl, Hardware.from_gb(**small), check=False)
    cases = [  # (budget override, short tier, figures the message must show)
        ({"gpu_memory_cap_gb": 250e-6}, "gpu",
         [f"need {format_bytes(wl.static_gpu_bytes)} before", "the cap is 250 kB"]),
        ({"gpu_memory_cap_gb": (tight.peak_gpu_bytes - 100e3) / 1e9}, "gpu",
         [f"the peak is {format_bytes(tight.peak_gpu_bytes)}", "short by 100 kB",
          f"smallest GPU budget for this batch: {format_bytes(tight.peak_gpu_bytes, digits=4)}"]),
        ({"cpu_memory_gb": 2e-3}, "cpu", [f"need {format_bytes(wl.host_static_bytes)} of", "has 2.00 MB"]),
    ]
    for override, tier, figures in cases:
        with pytest.raises(InfeasibleBudget) as err:
            make_plan(tiny, train, Hardware.from_gb(**{**small, **override}))
        msg = str(err.value)
        assert err.value.tier == tier and "0.00" not in msg and " GB" not in msg, msg
        assert f"({tier} memory short by {format_bytes(err.value.shortfall_bytes)})" in msg, msg
        for figure in figures:
            assert figure in msg, (figure, msg)


def test_batch_too_large_names_gpu_shortfall_and_largest_batch():
    hw = Hardware.from_gb(**{**H800, "gpu_memory_gb": 24, "gpu_memory_cap_gb": 22})
    train = TrainSpec(micro_batch_size=512, seq_len=1024)
    best = largest_batch(Q7B, train, hw)
    assert 0 < best < 512
    with pytest.raises(InfeasibleBudget) as err:
        make_plan(Q7B, train, hw)
    msg = str(err.value)
    assert err.value.tier == "gpu" and err.value.shortfall_bytes > 0
    assert f"largest micro-batch that fits: {best}" in msg
    make_plan(Q7B, train.replace(micro_batch_size=best), hw, options=None)  # and that one plans


def test_host_memory_too_small_names_cpu_tier():
    hw = Hardware.from_gb(**{**H800, "cpu_memory_gb": 64})
    with pytest.raises(InfeasibleBudget) as err:
        make_plan(Q7B, TrainSpec(micro_batch_size=8, seq_len=1024), hw)
    assert err.value.tier == "cpu"
    assert "eight_bit_fraction" in str(err.value)


def test_simulator_names_the_violated_resource():
    wl = workload([1.0, 1.0, 1.0])
    with pytest.raises(InfeasibleSchedule) as err:
        simulate(keep_all(3), wl, hardware(5 * G))
    assert err.value.resource == "gpu_memory" and err.value.window is not None
    s = solve(wl, hardware(100 * G)).schedule
    with pytest.raises(InfeasibleSchedule, match="cpu_memory"):
        simulate(s, wl, hardware(100 * G, cpu=0.5 * G))


def test_schedule_json_round_trip_and_validation():
    wl = workload([1.0, 1.0, 0.5, 1.0])
    s = solve(wl, hardware(6 * G + 5e6, cpu=100 * G)).schedule
    again = Schedule.loads(json.dumps(s.to_json()))
    assert again == s
    assert again.windows() == s.windows()
    data = s.to_json()
    data["version"] = 99
    with pytest.raises(InvalidInput, match="schedule.version"):
        Schedule.from_json(data)
    with pytest.raises(InvalidInput, match="keep_internals"):
        Schedule(num_layers=2, homes=("gpu", "recompute", "gpu"), keep_internals=(False, True),
                 resident_weights=(False, False), offload_window=(None,) * 3, reload_window=(None,) * 3)
    with pytest.raises(InvalidInput, match="reload_window"):  # must end before first use in B1
        Schedule(num_layers=3, homes=("gpu", "cpu", "gpu", "gpu"), keep_internals=(False,) * 3,
                 resident_weights=(False,) * 3, offload_window=(None, 1, None, None),
                 reload_window=(None, 1, None, None))


def test_gradient_accumulation_milp_agrees_with_simulator():
    hw = Hardware.from_gb(**H800)
    train = TrainSpec(micro_batch_size=16, seq_len=1024, grad_accum=3)
    res = solve(Workload.analytic(Q7B, train, hw), hw)
    assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-3)
    # one T per iteration, then every extra micro-batch adds the same (optimizer-free) time
    t = [simulate(res.schedule, Workload.analytic(Q7B, train.replace(grad_accum=g), hw), hw).iteration_seconds
         for g in (1, 2, 3)]
    assert t[2] - t[1] == pytest.approx(t[1] - t[0], rel=1e-9)
    assert t[2] == pytest.approx(res.simulated.iteration_seconds, rel=1e-12)


def test_megatrain_policy_moves_weights_three_times():
    hw = Hardware.from_gb(**H800)
    wl = Workload.analytic(Q7B, TrainSpec(micro_batch_size=8, seq_len=1024), hw)
    sim = simulate(megatrain(28, 4), wl, hw)
    per_layer = wl.layers[0].param_bytes
    # forward (28) + block recompute (3 of every 4 layers: 21) + backward (28), and the updated
    # non-block weights once per step
    assert sim.lane_bytes["h2d"] == pytest.approx((28 + 21 + 28) * per_layer + wl.nonblock_param_bytes)


def test_planner_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import lightning_lazytrain.planner as p\n"
            "from planner_helpers import workload, hardware\n"
            "r = p.solve(workload([1.0, 2.0]), hardware(1e12))\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print(r.status)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=__file__.rsplit("/", 1)[0], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "optimal"


@pytest.mark.slow
def test_time_limit_keeps_the_incumbent_or_falls_back_with_a_warning():
    hw = Hardware.from_gb(**H800)
    m27 = ModelSpec(name="27b", num_layers=64, hidden=5120, intermediate=16720, heads=24, kv_heads=4, head_dim=256,
                    vocab=248320, qk_norm=True)
    wl = Workload.analytic(m27, TrainSpec(micro_batch_size=72, seq_len=1024), hw)
    seeded = solve(wl, hw, time_limit=1e-3)  # the warm start is an incumbent from the first node
    assert seeded.status in ("time_limit", "optimal")
    simulate(seeded.schedule, wl, hw)
    with pytest.warns(UserWarning, match="falling back"):
        cold = solve(wl, hw, time_limit=1e-3, seed=False)
    assert cold.status == "fallback"
    assert cold.schedule.policy.split("(")[0] in ("megatrain", "keep_all", "recompute_all")
    simulate(cold.schedule, wl, hw)


@pytest.mark.slow
def test_batch_search_finds_largest_and_best_throughput():
    from lightning_lazytrain.planner import search_batch

    hw = Hardware.from_gb(**{**H800, "gpu_memory_gb": 24, "gpu_memory_cap_gb": 22})
    res = search_batch(Q7B, TrainSpec(micro_batch_size=1, seq_len=1024), hw)
    assert res.largest_feasible == largest_batch(Q7B, TrainSpec(micro_batch_size=1, seq_len=1024), hw)
    assert not make_plan_fits(res.largest_feasible + 1, hw)
    best = max(res.table, key=lambda r: r["tokens_per_s"])
    assert res.best_throughput == best["micro_batch_size"]
    assert {r["micro_batch_size"] for r in res.table} >= {1, 2, 4, res.largest_feasible}


def make_plan_fits(batch: int, hw) -> bool:
    try:
        make_plan(Q7B, TrainSpec(micro_batch_size=batch, seq_len=1024), hw)
        return True
    except InfeasibleBudget:
        return False
