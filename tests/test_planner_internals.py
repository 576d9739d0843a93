"""Issue 12, item 5: a layer that keeps its internals may move them (its saved tensors but its input
boundary) to host memory over a later forward window's D2H lane and bring them back over a backward
window's H2D lane before its own backward. Schedule fields and validation, the windows' ops, the
simulator's timing / lifetimes / bytes by hand, the MILP against the simulator and against
enumeration."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pyomo.environ as pyo
import pytest

from lightning_lazytrain.planner import InfeasibleSchedule, InvalidInput, keep_all, recompute_all, simulate, solve
from lightning_lazytrain.planner.milp import MilpOptions, ScheduleModel
from lightning_lazytrain.planner.schedule import Op, Schedule
from lightning_lazytrain.planner.simulator import host_bytes, window_memory
from planner_helpers import G, hardware, internals_choices, milp_space, with_host_costs, workload

L = 4


def sched(keep=(True, True, False, False), homes=("gpu",) * 5, off=(), rel=(), boff=None, brel=None, **kw):
    n = len(keep)
    return Schedule(num_layers=n, homes=tuple(homes), keep_internals=tuple(keep), resident_weights=(False,) * n,
                    offload_window=tuple(boff or [None] * (n + 1)), reload_window=tuple(brel or [None] * (n + 1)),
                    internals_offload_window=tuple(off), internals_reload_window=tuple(rel), **kw)


# ---- the fields ---------------------------------------------------------------------------------------
def test_empty_means_none_and_old_json_still_loads():
    s = sched()
    assert s.internals_offload_window == (None,) * L and s.internals_reload_window == (None,) * L
    assert s.offloaded_internals == ()
    assert s == sched(off=(None,) * L, rel=(None,) * L)
    data = s.to_json()
    assert "internals_offload_window" not in data and "internals_reload_window" not in data  # as before
    assert Schedule.loads(s.dumps()) == s
    moved = sched(off=(2, None, None, None), rel=(4, None, None, None))
    data = json.loads(moved.dumps())
    assert data["internals_offload_window"] == [2, None, None, None]
    assert data["internals_reload_window"] == [4, None, None, None]
    assert Schedule.from_json(data) == moved
    assert moved.offloaded_internals == (0,)
    assert moved.version == s.version == 1


@pytest.mark.parametrize("off, rel, match", [
    ((1, None, None, None), (None,) * L, "both set or both None"),
    ((None,) * L, (2, None, None, None), "both set or both None"),
    ((None, None, 3, None), (None, None, 3, None), "does not keep its internals"),  # layer 2 recomputes
    ((0, None, None, None), (1, None, None, None), r"\[1, 3\]"),  # F0 produces them: too early
    ((4, None, None, None), (1, None, None, None), r"\[1, 3\]"),  # no F4
    ((None, 1, None, None), (None, 2, None, None), r"\[2, 3\]"),
    ((1, None, None, None), (0, None, None, None), r"\[1, 4\]"),  # B0 is the layer's own backward
    ((1, None, None, None), (5, None, None, None), r"\[1, 4\]"),
    ((1, None, None), (1, None, None), "needs 4 entries"),
])
def test_validation(off, rel, match):
    with pytest.raises(InvalidInput, match=match):
        sched(off=off, rel=rel)


def test_a_layer_without_a_later_forward_window_cannot_offload():
    with pytest.raises(InvalidInput):
        sched(keep=(False, False, False, True), off=(None, None, None, 3), rel=(None, None, None, 4))


# ---- the ops ------------------------------------------------------------------------------------------
def test_ops_sit_after_the_boundary_transfers_of_their_windows():
    # boundary 2 (cpu) leaves in F2 and comes back in B3; layers 0 and 1 keep their internals, both
    # leave in F2 (ascending), come back in B3 and H.
    s = sched(homes=("gpu", "gpu", "cpu", "gpu", "gpu"), boff=[None, None, 2, None, None],
              brel=[None, None, 3, None, None], off=(2, 2, None, None), rel=(3, 4, None, None))
    w = {win.name: win.ops for win in s.windows()}
    assert w["F2"] == (Op("compute", "forward", 2), Op("d2h", "offload", 2), Op("d2h", "offload_internals", 0),
                       Op("d2h", "offload_internals", 1), Op("cpu", "optimizer", 3), Op("host", "cast", 3, after=4),
                       Op("h2d", "weights", 3, after=5))
    assert w["H"] == (Op("compute", "head", -1), Op("host", "cast", 3), Op("h2d", "weights", 3, after=1),
                      Op("h2d", "reload_internals", 1))
    assert w["B3"] == (Op("compute", "local_recompute", 3), Op("compute", "backward", 3), Op("host", "cast", 2),
                       Op("h2d", "weights", 2, after=2), Op("h2d", "reload", 2), Op("h2d", "reload_internals", 0))
    # nothing else moves: the same windows without the decision, less these ops (``after`` as the op it names)
    def named(ops):
        key = lambda op: (op.lane, op.kind, op.index)  # noqa: E731
        return [key(op) + (key(ops[op.after]) if op.after >= 0 else None,) for op in ops
                if not op.kind.endswith("_internals")]

    plain = replace(s, internals_offload_window=(), internals_reload_window=())
    assert [w.name for w in s.windows()] == [w.name for w in plain.windows()]
    for a, b in zip(s.windows(), plain.windows()):
        assert named(a.ops) == named(b.ops)


# ---- the simulator, by hand ---------------------------------------------------------------------------
# 4 layers, forward 1 s, backward 2 s; boundaries 1 GB, saved internals 6 GB (5 GB beyond the input);
# weights of 1 byte (their transfers take nothing); links of 1 GB/s.
WL = workload([1.0] * L, A=1 * G, internal=6 * G, param_bytes=1.0, head=0.5, opt=0.0)
HW = hardware(1000 * G, h2d=1 * G, d2h=1 * G)
MOVED = sched(keep=(True, False, False, False), off=(1, None, None, None), rel=(1, None, None, None))
KEPT = sched(keep=(True, False, False, False))


def test_simulator_lifetimes_bytes_and_times_by_hand():
    sim, kept = simulate(MOVED, WL, HW), simulate(KEPT, WL, HW)
    # device: layer 0's 5 GB are away from the end of F1 until B1 brings them back (F2, F3, H, B3, B2)
    names = MOVED.window_names()
    diff = {n: a - b for n, a, b in zip(names, window_memory(KEPT, WL), window_memory(MOVED, WL))}
    assert diff == {n: (5 * G if n in ("F2", "F3", "H", "B3", "B2") else 0.0) for n in names}
    # host: + 5 GB
    assert host_bytes(MOVED, WL)[0] - host_bytes(KEPT, WL)[0] == 5 * G
    assert sim.peak_cpu_bytes - kept.peak_cpu_bytes == 5 * G
    # per lane: 5 GB more each way
    assert sim.lane_bytes["d2h"] - kept.lane_bytes["d2h"] == pytest.approx(5 * G, abs=1)
    assert sim.lane_bytes["h2d"] - kept.lane_bytes["h2d"] == pytest.approx(5 * G, abs=1)
    # time: F1 = max(forward 1 s, D2H 5 s); B1 = max(local re-run 1 s + backward 2 s, H2D 5 s)
    assert sim.window_seconds["F1"] == pytest.approx(5.0)
    assert sim.window_seconds["B1"] == pytest.approx(5.0)
    assert sim.iteration_seconds - kept.iteration_seconds == pytest.approx((5 - 1) + (5 - 3))
    segs = [g for g in sim.timeline if g.kind.endswith("_internals")]
    assert [(g.window, g.lane, g.kind, g.index, g.bytes) for g in segs] == [
        ("F1", "d2h", "offload_internals", 0, 5 * G), ("B1", "h2d", "reload_internals", 0, 5 * G)]


def test_the_simulator_checks_host_memory_for_them():
    tight = hardware(1000 * G, cpu=host_bytes(KEPT, WL)[0] + 4 * G, h2d=1 * G, d2h=1 * G)
    simulate(KEPT, WL, tight)
    with pytest.raises(InfeasibleSchedule, match="host memory"):
        simulate(MOVED, WL, tight)


# ---- the MILP: its algebra is the simulator's ---------------------------------------------------------
def random_instance(rng: random.Random, n: int):
    """Tight device memory, room on the host, links fast enough that moving internals can pay."""
    fwd = [rng.uniform(0.5, 2.0) for _ in range(n)]
    A = rng.uniform(0.3, 1.0) * G
    wl = workload(fwd, A=A, internal=A * rng.uniform(2.0, 6.0), param_bytes=rng.uniform(0.05, 1.0) * G,
                  fwd_work=0.2 * A, bwd_work=0.5 * A, opt=rng.uniform(0.0, 0.3), head=rng.uniform(0.1, 2.0),
                  grad_accum=rng.choice([1, 2]))
    wl = with_host_costs(wl, [rng.uniform(0.0, 0.3) for _ in range(n)], [rng.uniform(0.0, 0.3) for _ in range(n)])
    bw = rng.uniform(1.0, 8.0) * G
    peak = lambda s: simulate(s, wl, hardware(1e15), check=False).peak_gpu_bytes  # noqa: E731
    floor, top = peak(recompute_all(n)), peak(keep_all(n))
    cap = floor + rng.uniform(0.1, 0.9) * (top - floor)
    hw = hardware(cap, cpu=1 * G + rng.uniform(1.0, 3.0) * wl.layers[0].internal_bytes, h2d=bw,
                  d2h=bw * rng.uniform(0.5, 2.0))
    return wl, hw


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.slow
def test_milp_time_equals_the_simulator_on_every_schedule(seed):
    wl, hw = random_instance(random.Random(500 + seed), 3)
    model = ScheduleModel(wl, hw, MilpOptions())
    n = moved = 0
    for s in milp_space(3, pipelined=None):
        model.seed_from(s)
        sim = simulate(s, wl, hw, check=False)
        assert pyo.value(model.iteration_time()) == pytest.approx(sim.iteration_seconds, rel=1e-9), s
        n += 1
        moved += bool(s.offloaded_internals)
    assert n > 1000 and moved > 800


@pytest.mark.slow
def test_milp_time_equals_the_simulator_on_four_layer_schedules_with_slow_links_and_blocks():
    # every 15th schedule of the 4-layer space (NVMe, both modes): moved internals behind recompute
    # blocks' fetch chains in B windows, behind boundary reloads and NVMe legs
    rng = random.Random(77)
    wl, hw = random_instance(rng, 4)
    hw = hardware(hw.gpu_memory_cap_bytes, cpu=hw.cpu_memory_bytes, h2d=0.5 * G, d2h=0.7 * G, nvme_cap=100 * G,
                  nvme_bw=0.3 * G)
    model = ScheduleModel(wl, hw, MilpOptions())
    n = moved = 0
    for k, s in enumerate(milp_space(4, nvme=True, pipelined=None)):
        if k % 15:
            continue
        model.seed_from(s)
        sim = simulate(s, wl, hw, check=False)
        assert pyo.value(model.iteration_time()) == pytest.approx(sim.iteration_seconds, rel=1e-9), s
        n += 1
        moved += bool(s.offloaded_internals and s.recompute_blocks)
    assert n > 5000 and moved > 900


def gpu_rows(model: ScheduleModel) -> list[float]:
    """The MILP's device bytes per window (F0.., H, B{L-1}..B0) at the seeded values."""
    rows = [model.gpu_bytes_forward(w) for w in range(model.L)] + [model.gpu_bytes_head()]
    rows += [model.gpu_bytes_backward(u) for u in range(model.L - 1, -1, -1)]
    return [pyo.value(r) for r in rows]


@pytest.mark.slow
def test_milp_memory_and_host_rows_equal_the_simulator():
    wl, hw = random_instance(random.Random(7), 4)
    model = ScheduleModel(wl, hw, MilpOptions())
    checked = 0
    for s in milp_space(4):
        if not s.offloaded_internals or s.resident_weights != (False,) * 4 or s.optimizer != "pipelined":
            continue
        model.seed_from(s)
        assert gpu_rows(model) == pytest.approx(window_memory(s, wl)[:-1], rel=1e-12), s
        assert pyo.value(model.host_bytes()) == pytest.approx(host_bytes(s, wl)[0], rel=1e-12)
        checked += 1
    assert checked > 1000


# ---- the MILP chooses it ------------------------------------------------------------------------------
def moved_all(n: int) -> Schedule:
    """Every layer keeps its internals; all but the last move them: F{j+1} out, B{j+1} back."""
    return sched(keep=(True,) * n, off=tuple(j + 1 if j + 1 < n else None for j in range(n)),
                 rel=tuple(j + 1 if j + 1 < n else None for j in range(n)))


def test_the_milp_moves_internals_when_the_links_are_idle_and_memory_is_short():
    # Recomputing a layer costs 1 s; its 3 GB of internals move in 3 ms each way. The cap fits every
    # layer's internals only if they travel, so the plan keeps and moves them and runs at the compute bound.
    wl = workload([1.0] * L, A=1 * G, internal=4 * G, param_bytes=1e3, head=0.5, opt=0.0)
    fast = dict(h2d=1000 * G, d2h=1000 * G)
    cap = simulate(moved_all(L), wl, hardware(1e15, **fast)).peak_gpu_bytes + 0.01 * G  # (+ room for residents)
    hw = hardware(cap, **fast)
    with pytest.raises(InfeasibleSchedule, match="gpu_memory"):
        simulate(keep_all(L), wl, hw)
    res = solve(wl, hw)
    s = res.schedule
    assert res.status == "optimal"
    assert s.keep_internals == (True,) * L and len(s.offloaded_internals) >= 1
    assert res.simulated.recompute_seconds == 0.0
    assert res.simulated.iteration_seconds == pytest.approx(4 * 1 + 0.5 + 4 * 2, abs=0.05)
    assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-6)
    # switched off: back to local recompute somewhere, and slower by at least one re-run
    off = solve(wl, hw, offload_internals=False)
    assert off.schedule.offloaded_internals == () and not all(off.schedule.keep_internals)
    assert off.simulated.iteration_seconds >= res.simulated.iteration_seconds + 1.0 - 1e-6
    # the ablated model has no variable of the decision
    model = ScheduleModel(wl, hw, MilpOptions(offload_internals=False))
    assert len(model.m.f) == len(model.m.oi) == len(model.m.qi) == 0


def test_the_milp_leaves_them_when_the_link_is_slow():
    # same memory, but moving 3 GB takes 30 s: recomputing (1 s) is cheaper
    wl = workload([1.0] * L, A=1 * G, internal=4 * G, param_bytes=1e3, head=0.5, opt=0.0)
    cap = simulate(moved_all(L), wl, hardware(1e15)).peak_gpu_bytes + 0.01 * G
    res = solve(wl, hardware(cap, h2d=0.1 * G, d2h=0.1 * G))
    assert res.schedule.offloaded_internals == ()


# ---- exhaustive: the MILP finds the best schedule of its space -----------------------------------------
def test_the_enumerated_space_is_the_milps():
    opt = MilpOptions()
    assert internals_choices(4, 0) == [(None, None)] + [(w, t) for w in (1, 2) for t in (1, 2, 4)]
    assert internals_choices(4, 2) == [(None, None), (3, 3), (3, 4)]
    assert internals_choices(4, 3) == [(None, None)]
    assert internals_choices(4, 0, MilpOptions(offload_internals=False)) == [(None, None)]
    model = ScheduleModel(*random_instance(random.Random(1), 4), opt)
    assert sorted(model.internals.off_idx) == sorted({(j, w) for j in range(4) for w, _ in internals_choices(4, j)[1:]})
    assert sorted(model.internals.rel_idx) == sorted({(j, t) for j in range(4) for _, t in internals_choices(4, j)[1:]})


@pytest.mark.slow
def test_milp_finds_the_best_enumerated_schedule_with_and_without_the_decision():
    """Per instance: the MILP's plan is the best schedule of its space (with the decision), and the
    ablated MILP's the best of the schedules that move no internals; on some instances the two differ."""
    pays = 0
    for seed in range(6):
        wl, hw = random_instance(random.Random(900 + seed), 3)
        best = {True: float("inf"), False: float("inf")}
        for s in milp_space(3, pipelined=None):
            try:
                t = simulate(s, wl, hw).iteration_seconds
            except InfeasibleSchedule:
                continue
            best[True] = min(best[True], t)
            if not s.offloaded_internals:
                best[False] = min(best[False], t)
        assert best[False] < float("inf")
        for switch in (True, False):
            res = solve(wl, hw, mip_gap=1e-9, time_limit=30, offload_internals=switch)
            assert res.status == "optimal"
            assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-6)
            assert res.simulated.iteration_seconds == pytest.approx(best[switch], rel=1e-6), (seed, switch)
            assert switch or not res.schedule.offloaded_internals
        pays += best[True] < best[False] * (1 - 1e-6)
    assert pays >= 2, pays
