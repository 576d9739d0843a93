"""Issue 12: a block recompute waits for its own weights (and, as the engine's two recompute buffers
impose, a fetch waits for the re-run two layers back; the prefetch of layer t-1 for the whole
block), in the schedule's ops, the simulator and the MILP alike."""

from __future__ import annotations

import random

import pyomo.environ as pyo
import pytest

from lightning_lazytrain.planner import simulate, solve
from lightning_lazytrain.planner.milp import MilpOptions, ScheduleModel
from lightning_lazytrain.planner.schedule import Op, Schedule
from planner_helpers import G, hardware, milp_space, with_host_costs, workload

L = 5
# Block (0, 4): B3 re-runs layers 0, 1, 2; every other boundary stays on the GPU.
BLOCK = Schedule(num_layers=L, homes=("gpu", "recompute", "recompute", "recompute", "gpu", "gpu"),
                 keep_internals=(False,) * L, resident_weights=(False,) * L, offload_window=(None,) * (L + 1),
                 reload_window=(None,) * (L + 1))


def test_ops_of_a_recompute_block():
    b3 = {w.name: w for w in BLOCK.windows()}["B3"]
    assert b3.ops == (
        Op("host", "cast", 0), Op("h2d", "recompute_weights", 0, after=0), Op("compute", "recompute", 0, after=1),
        Op("host", "cast", 1), Op("h2d", "recompute_weights", 1, after=3), Op("compute", "recompute", 1, after=4),
        # layer 2 reuses layer 0's buffer: its cast (and so its fetch) waits for layer 0's re-run
        Op("host", "cast", 2, after=2), Op("h2d", "recompute_weights", 2, after=6),
        Op("compute", "recompute", 2, after=7),
        Op("compute", "local_recompute", 3), Op("compute", "backward", 3), Op("d2h", "grads", 4),
        # the prefetch of layer 2 uses the spare buffer, free once the block is re-run
        Op("host", "cast", 2, after=8), Op("h2d", "weights", 2, after=12),
        Op("host", "accumulate", 4, after=11),
    )


def milp_iteration(s: Schedule, wl, hw) -> tuple[float, dict[str, float]]:
    """The MILP's iteration time for ``s`` (window variables at their tight lower bounds)."""
    model = ScheduleModel(wl, hw, MilpOptions())
    model.seed_from(s)
    windows = {name: pyo.value(var) for name, (var, _) in model.lane_loads.items()}
    return pyo.value(model.iteration_time()), windows


def test_with_a_slow_link_shows_it():
    # Every fetch takes 1 s (1 GB at 1 GB/s), every re-run 0.5 s, backward 1 s; no host costs.
    #   B3: fetch 0 [0, 1], re-run 0 [1, 1.5]; fetch 1 [1, 2], re-run 1 [2, 2.5]; fetch 2 [2, 3]
    #       (its buffer was free at 1.5), re-run 2 [3, 3.5]; then local re-run 3 and backward 3
    #       [3.5, 5]; prefetch of 2 after the block [3.5, 4.5]                        -> 5 s
    #   without the waits: compute 3 * 0.5 + 0.5 + 1 = 3 s, H2D 4 fetches = 4 s     -> 4 s
    wl = workload([0.5] * L, [1.0] * L, param_bytes=1 * G, A=0.1 * G, internal=0.2 * G)
    hw = hardware(1000 * G, h2d=1 * G, d2h=1 * G)
    sim = simulate(BLOCK, wl, hw)
    fetched = {(seg.window, seg.index): seg.end for seg in sim.timeline if seg.kind == "recompute_weights"}
    reruns = [seg for seg in sim.timeline if seg.kind == "recompute"]
    assert len(reruns) == 3
    for seg in reruns:  # (a) every re-run starts once its weights have landed
        assert seg.start >= fetched[(seg.window, seg.index)] - 1e-12
    start = sim.timeline[[s.window for s in sim.timeline].index("B3")].start
    # ... and the wait binds: each re-run starts when its fetch ends, with the compute lane idle
    assert [seg.start - start for seg in reruns] == pytest.approx([1.0, 2.0, 3.0])
    assert sim.window_seconds["B3"] == pytest.approx(5.0)
    # (b) the MILP's prediction is the simulator's, window by window and in total
    total, windows = milp_iteration(BLOCK, wl, hw)
    assert total == pytest.approx(sim.iteration_seconds, rel=1e-9)
    assert windows["tB[3]"] == pytest.approx(5.0)
    # (c) and it is longer than the old, dependency-free value (each lane on its own, summed)
    b3 = {w.name: w for w in BLOCK.windows()}["B3"]
    compute = sum(wl.layers[op.index].fwd_seconds for op in b3.ops if op.kind in ("recompute", "local_recompute"))
    compute += wl.layers[3].bwd_seconds
    h2d = sum(wl.layers[op.index].param_bytes for op in b3.ops if op.lane == "h2d") / hw.h2d_bytes_per_s
    old_b3 = max(compute, h2d)
    assert old_b3 == pytest.approx(4.0)
    old = sim.iteration_seconds - sim.window_seconds["B3"] + old_b3
    assert sim.iteration_seconds == pytest.approx(old + 1.0)


def test_with_slow_casts_the_buffer_wait_binds():
    # Casts of 0.75 s (host), fetches 0.25 s, re-runs 0.5 s. Layer 2's cast waits for re-run 0:
    #   casts 0 [0, .75], 1 [.75, 1.5]; fetches 0 [.75, 1], 1 [1.5, 1.75]; re-runs 0 [1, 1.5],
    #   1 [1.75, 2.25]; cast 2 [1.5, 2.25] (host free at 1.5, re-run 0 done at 1.5), fetch 2
    #   [2.25, 2.5], re-run 2 [2.5, 3]; local re-run + backward 3 [3, 4.5]; prefetch: cast 2
    #   [3, 3.75], fetch [3.75, 4]                                                    -> 4.5 s
    wl = with_host_costs(workload([0.5] * L, [1.0] * L, param_bytes=0.25 * G, A=0.1 * G, internal=0.2 * G),
                         0.75, 0.0)
    hw = hardware(1000 * G, h2d=1 * G, d2h=1 * G)
    sim = simulate(BLOCK, wl, hw)
    assert sim.window_seconds["B3"] == pytest.approx(4.5)
    total, windows = milp_iteration(BLOCK, wl, hw)
    assert total == pytest.approx(sim.iteration_seconds, rel=1e-9)
    assert windows["tB[3]"] == pytest.approx(4.5)


def test_the_milp_plans_with_the_wait():
    # Device memory for BLOCK's peak, none on the host for boundaries: the solver needs a recompute
    # block, and its predicted time is the simulator's for the schedule it returns.
    wl = workload([0.5] * L, [1.0] * L, param_bytes=1 * G, A=1 * G, internal=1 * G)
    probe = simulate(BLOCK, wl, hardware(1e15, h2d=1 * G, d2h=1 * G), check=False)
    hw = hardware(probe.peak_gpu_bytes, cpu=1 * G, h2d=1 * G, d2h=1 * G)
    res = solve(wl, hw, time_limit=30)
    assert res.status == "optimal"
    assert res.schedule.recompute_blocks
    sim = simulate(res.schedule, wl, hw)
    assert res.objective == pytest.approx(sim.iteration_seconds, rel=1e-3)
    for seg in sim.timeline:
        if seg.kind == "recompute":
            landed = [f.end for f in sim.timeline if f.kind == "recompute_weights" and f.window == seg.window
                      and f.index == seg.index]
            assert seg.start >= max(landed) - 1e-12


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.slow
def test_milp_window_times_match_the_simulator_on_every_four_layer_schedule_with_a_slow_link(seed):
    # Fetches (0.7-3 s) longer than re-runs (0.1-0.6 s), and host casts: the waits bind.
    rng = random.Random(1200 + seed)
    n = 4
    wl = workload([rng.uniform(0.1, 0.6) for _ in range(n)], param_bytes=rng.uniform(0.7, 3.0) * G, A=0.5 * G,
                  internal=1 * G, opt=rng.uniform(0.0, 0.5), head=0.3, grad_accum=1 + seed)
    wl = with_host_costs(wl, [rng.uniform(0.0, 0.8) for _ in range(n)], [rng.uniform(0.0, 1.0) for _ in range(n)])
    hw = hardware(1000 * G, h2d=1 * G, d2h=1.5 * G, nvme_cap=100 * G, nvme_bw=0.5 * G)
    model = ScheduleModel(wl, hw, MilpOptions())
    checked = waited = 0
    for s in milp_space(n, nvme=True, internals=False):  # moved internals: test_planner_internals.py
        model.seed_from(s)
        sim = simulate(s, wl, hw, check=False)
        assert pyo.value(model.iteration_time()) == pytest.approx(sim.iteration_seconds, rel=1e-9), s
        checked += 1
        fetched = {(f.window, f.index): f.end for f in sim.timeline if f.kind == "recompute_weights"}
        waited += any(seg.kind == "recompute" and seg.start == pytest.approx(fetched[(seg.window, seg.index)])
                      for seg in sim.timeline)
    assert checked > 2000 and waited > 100
