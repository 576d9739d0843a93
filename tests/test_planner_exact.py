"""Hand-solvable 3-4 layer instances whose optimal decisions are known exactly."""

from __future__ import annotations

import pytest

from lightning_lazytrain.planner import keep_all, recompute_all, simulate, solve
from planner_helpers import FAST, G, hardware, workload

STATIC = 4e6  # two slots of 1e6 weight bytes + 1e6 grad bytes


def test_plenty_of_memory_keeps_everything():
    wl = workload([1.0, 1.0, 1.0])
    res = solve(wl, hardware(100 * G))
    s = res.schedule
    assert s.homes == ("gpu",) * 4
    assert s.keep_internals == (True, True, True)
    assert s.recompute_blocks == ()
    # no recompute: 3 fwd + head + 3 bwd; transfers and the optimizer take ~0
    assert res.simulated.iteration_seconds == pytest.approx(3 + 0.5 + 6, rel=1e-6)
    assert res.status == "optimal"


def test_one_kept_layer_goes_to_the_slowest_forward():
    # All-GPU boundaries with no kept internals peak at 6 GB (B2: A0..A2 + internals 3 GB);
    # each kept layer adds 3 GB until its backward, any two exceed 9 GB at H, and without host
    # memory or NVMe the only alternative is recompute, which costs more. So exactly one layer
    # keeps its internals: the one whose local recompute is most expensive (fwd = 3 s).
    wl = workload([1.0, 3.0, 2.0], host_static=1 * G)
    hw = hardware(9 * G + STATIC, cpu=1 * G)
    res = solve(wl, hw)
    s = res.schedule
    assert s.keep_internals == (False, True, False)
    assert s.homes == ("gpu",) * 4
    assert s.recompute_blocks == ()
    assert res.simulated.iteration_seconds == pytest.approx(6 + 0.5 + 12 + (1 + 2), rel=1e-6)
    assert res.simulated.peak_gpu_bytes == pytest.approx(9 * G + STATIC)


def test_tight_memory_without_host_room_forces_block_recompute():
    # 4 layers, no host room, no NVMe, no kept internals. All-GPU boundaries peak at B3 with
    # A0..A3 + 3 GB = 7 GB; the cap is 6 GB, so one inner boundary is recomputed:
    # - boundary 3 (block (2,4)) does not help: it is recomputed right where B3 peaks;
    # - boundary 1 (block (0,2)) costs fwd[0] = 2 s; boundary 2 (block (1,3)) costs fwd[1] = 1 s.
    wl = workload([2.0, 1.0, 0.5, 1.0])
    hw = hardware(6 * G + STATIC + 1e6, cpu=1 * G)  # + room for the recompute weight buffer
    res = solve(wl, hw, keep_internals=False)
    s = res.schedule
    assert s.recompute_blocks == ((1, 3),)
    assert s.homes == ("gpu", "gpu", "recompute", "gpu", "gpu")
    # 4.5 fwd + 0.5 head + 9 bwd + 4.5 local recompute + 1 block recompute
    assert res.simulated.iteration_seconds == pytest.approx(19.5, rel=1e-6)


def test_fast_host_link_offloads_instead_of_recomputing():
    # Same 7 GB all-GPU peak at B3, 6 GB cap. A reloaded boundary occupies the device during the
    # window that brings it back, so the all-host schedule also peaks at 6 GB; with a free link,
    # moving one boundary costs nothing while recomputing costs >= 1 s.
    wl = workload([1.0, 1.0, 1.0, 1.0])
    hw = hardware(6 * G + STATIC, cpu=100 * G)
    res = solve(wl, hw, keep_internals=False)
    s = res.schedule
    assert s.recompute_blocks == ()
    assert s.count_homes()["cpu"] == 1  # one move is enough; the tie-breaker avoids more
    assert res.simulated.iteration_seconds == pytest.approx(4 + 0.5 + 8 + 4, rel=1e-6)


def test_slow_host_link_recomputes_instead_of_offloading():
    # moving a boundary takes 100 s each way; recomputing one layer takes 1 s
    wl = workload([1.0, 1.0, 1.0, 1.0])
    hw = hardware(6 * G + STATIC + 1e6, cpu=100 * G, h2d=1e7, d2h=1e7)
    res = solve(wl, hw, keep_internals=False)
    s = res.schedule
    assert "cpu" not in s.homes
    assert len(s.recompute_blocks) == 1


def test_nvme_tier_used_when_host_memory_is_short():
    # internals == boundary, so only boundaries matter: all-GPU peaks at 7 GB (H), the cap is 3 GB,
    # which needs four boundaries off the device. Host room is 2.5 GB: two boundaries, or the NVMe
    # staging buffers (2 x 1 GB). Recompute costs 10 s a layer; NVMe is free.
    wl = workload([10.0] * 6, internal=1 * G)
    hw = hardware(3 * G + STATIC + 1e6, cpu=1 * G + 2.5 * G, nvme_cap=100 * G, nvme_bw=FAST)
    res = solve(wl, hw, keep_internals=False)
    s = res.schedule
    assert s.count_homes()["nvme"] >= 3
    assert "cpu" not in s.homes
    assert s.recompute_blocks == ()
    assert res.simulated.nvme_bytes == pytest.approx(s.count_homes()["nvme"] * G)


def test_exposed_weight_fetch_at_the_turnaround_makes_the_last_layer_resident():
    # fetching a layer takes 1 s; the head takes 0.1 s, so B3's weights fetched during H are exposed
    wl = workload([2.0, 2.0, 2.0, 2.0], param_bytes=1 * G, head=0.1)
    hw = hardware(100 * G, h2d=1 * G, d2h=1 * G)
    res = solve(wl, hw)
    assert res.schedule.resident_weights[3] is True
    assert res.simulated.window_seconds["H"] == pytest.approx(0.1, rel=1e-6)


def test_milp_agrees_with_simulator_and_beats_baselines_on_hand_instances():
    wl = workload([1.0, 2.0, 1.5], param_bytes=0.5 * G)
    hw = hardware(12 * G, h2d=2 * G, d2h=2 * G)
    res = solve(wl, hw)
    assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-2)
    for base in (keep_all(3), recompute_all(3)):
        try:
            t = simulate(base, wl, hw).iteration_seconds
        except Exception:
            continue
        assert res.simulated.iteration_seconds <= t * (1 + 1e-3)


def test_warm_start_is_valued_correctly():
    # Found by the property test: HiGHS valued the warm start 1 s too low (presolve offset) and
    # returned it as optimal. solve() must detect that and return a correctly valued optimum.
    wl = workload([1, 1, 1, 0.5, 0.5, 1], A=0.75 * G, internal=2.25 * G, param_bytes=2 * G, fwd_work=0.15 * G,
                  bwd_work=0.375 * G, head=1.0, opt=0.0)
    hw = hardware(14.375 * G, cpu=1 * G, h2d=1 * G, d2h=1 * G)
    res = solve(wl, hw)
    assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-9)
    assert res.simulated.iteration_seconds == pytest.approx(33.0, rel=1e-9)
    assert res.mip_gap is not None and res.mip_gap <= 1e-3
