"""The host lane (casts before weight fetches, gradient accumulation after D2Hs): workload fields,
op layout, simulator timing, and the MILP's algebra against the simulator and against enumeration."""

from __future__ import annotations

import json
import random

import pytest

from lightning_lazytrain.planner import (
    Hardware, InfeasibleSchedule, InvalidInput, ModelSpec, TrainSpec, Workload, keep_all, megatrain, recompute_all,
    simulate, solve,
)
from lightning_lazytrain.planner.hardware import DEFAULT_HOST_BYTES_PER_S
from lightning_lazytrain.planner.milp import MilpOptions, ScheduleModel
from lightning_lazytrain.planner.schedule import Op, Schedule, Window
from planner_helpers import G, hardware, milp_space, with_host_costs, workload

TINY = ModelSpec(name="tiny", num_layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, head_dim=16, vocab=256)
H800 = dict(name="h800", gpu_memory_gb=80, gpu_memory_cap_gb=70, peak_tflops=989, efficiency=0.5, h2d_gb_per_s=12,
            d2h_gb_per_s=12, nvme_read_gb_per_s=2.83, nvme_write_gb_per_s=3.35, nvme_capacity_gb=32,
            cpu_memory_gb=2199, cpu_adam_gparams_per_s=4, cpu_adam8_gparams_per_s=3)


# ---- inputs --------------------------------------------------------------------------------------
def test_analytic_cast_is_zero_for_same_dtype_masters_and_priced_by_the_host_rate_otherwise():
    hw = Hardware.from_gb(**H800, host_gb_per_s=8)
    assert hw.host_bytes_per_s == 8e9
    assert Hardware.from_gb(**H800).host_bytes_per_s == DEFAULT_HOST_BYTES_PER_S  # profiles without it
    fp32 = Workload.analytic(TINY, TrainSpec(micro_batch_size=1, seq_len=64, dtype="fp32", grad_dtype="fp32"), hw)
    bf16 = Workload.analytic(TINY, TrainSpec(micro_batch_size=1, seq_len=64), hw)
    p, nb = TINY.block_params, TINY.embedding_params + TINY.head_params
    assert all(layer.cast_seconds == 0.0 for layer in fp32.layers) and fp32.nonblock_cast_seconds == 0.0
    # fp32 masters -> bf16 staging: read 4 + write 2 bytes per parameter
    assert all(layer.cast_seconds == pytest.approx(p * 6 / 8e9) for layer in bf16.layers) and p > 0
    assert bf16.nonblock_cast_seconds == pytest.approx(nb * 6 / 8e9)
    # landed grad (grad dtype) + read/write fp32 host grad + its norm read
    assert bf16.layers[0].accum_seconds == pytest.approx(p * (2 + 8 + 4) / 8e9)
    assert fp32.layers[0].accum_seconds == pytest.approx(p * (4 + 8 + 4) / 8e9)
    assert bf16.nonblock_accum_seconds == pytest.approx(nb * 14 / 8e9)
    with pytest.raises(InvalidInput, match="hardware.host_bytes_per_s"):
        hw.replace(host_bytes_per_s=0.0)


def test_workload_host_fields_default_validate_and_round_trip():
    wl = workload([1.0, 1.0])  # from_measured without the host arguments
    assert [(l.cast_seconds, l.accum_seconds) for l in wl.layers] == [(0.0, 0.0)] * 2
    assert (wl.nonblock_cast_seconds, wl.nonblock_accum_seconds) == (0.0, 0.0)
    old = wl.to_json()  # JSON written before the host lane existed
    for layer in old["layers"]:
        del layer["cast_seconds"], layer["accum_seconds"]
    del old["nonblock_cast_seconds"], old["nonblock_accum_seconds"]
    assert Workload.from_json(json.loads(json.dumps(old))) == wl
    hosted = with_host_costs(wl, [0.1, 0.2], [0.3, 0.4], nonblock_cast=0.5, nonblock_accum=0.6)
    assert Workload.from_json(json.loads(hosted.dumps())) == hosted
    kw = {k: [v] * 2 for k, v in dict(fwd_seconds=1.0, bwd_seconds=2.0, params=1, param_bytes=1.0, grad_bytes=1.0,
                                         internal_bytes=1.0, fwd_work_bytes=0.0, bwd_work_bytes=0.0,
                                         opt_seconds=0.0).items()}
    kw.update(boundary_bytes=[1.0] * 3, head_seconds=0.0, head_work_bytes=0.0, nonblock_params=0,
              nonblock_gpu_bytes=0.0, nonblock_param_bytes=0.0, nonblock_grad_bytes=0.0, nonblock_opt_seconds=0.0, host_static_bytes=0.0,
              tokens=1)
    got = Workload.from_measured(**kw, cast_seconds=[0.1, 0.2], accum_seconds=[0.3, 0.4], nonblock_cast_seconds=0.5,
                                 nonblock_accum_seconds=0.6)
    assert [l.cast_seconds for l in got.layers] == [0.1, 0.2] and got.nonblock_accum_seconds == 0.6
    with pytest.raises(InvalidInput, match="cast_seconds"):
        Workload.from_measured(**kw, cast_seconds=[0.1])
    with pytest.raises(InvalidInput, match=r"layers\[1\].accum_seconds"):
        with_host_costs(wl, 0.0, [0.0, -1.0])
    with pytest.raises(InvalidInput, match="nonblock_cast_seconds"):
        with_host_costs(wl, 0.0, 0.0, nonblock_cast=float("nan"))


# ---- op layout -----------------------------------------------------------------------------------
def strip_host(window: Window) -> list[tuple]:
    """The window without host ops, each ``after`` passed through the host op it pointed to."""
    ops, keep = window.ops, [i for i, op in enumerate(window.ops) if op.lane != "host"]
    pos = {i: n for n, i in enumerate(keep)}

    def dep(a: int) -> int:
        while a >= 0 and ops[a].lane == "host":
            a = ops[a].after
        return pos[a] if a >= 0 else -1

    return [(ops[i].lane, ops[i].kind, ops[i].index, dep(ops[i].after)) for i in keep]


def test_every_fetch_waits_for_its_cast_every_grads_d2h_is_accumulated_and_the_rest_is_unchanged():
    L = 4
    sched = Schedule(num_layers=L, homes=("gpu", "nvme", "recompute", "cpu", "gpu"),
                     keep_internals=(True, False, False, False), resident_weights=(False, False, False, True),
                     offload_window=(None, 1, None, 3, None), reload_window=(None, 3, None, 4, None))
    for s in (sched, megatrain(L, 2), keep_all(L)):
        for first in (True, False):
            for last in (True, False):
                for w in s.windows(first_microbatch=first, last_microbatch=last):
                    ops, casts = w.ops, 0
                    for i, op in enumerate(ops):
                        if op.lane == "h2d" and op.kind in ("weights", "recompute_weights"):
                            cast = ops[op.after]
                            assert (cast.lane, cast.kind, cast.index) == ("host", "cast", op.index), (w.name, i)
                            casts += 1
                        if op.lane == "d2h" and op.kind == "grads":
                            acc = [o for o in ops if o.kind == "accumulate" and o.after == i]
                            assert acc == [Op("host", "accumulate", op.index, after=i)], (w.name, i)
                    host = [op for op in ops if op.lane == "host"]
                    assert sum(op.kind == "cast" for op in host) == casts
                    if w.name != "T":  # a window's casts come before its accumulates (FIFO lane)
                        kinds = [op.kind for op in host]
                        assert kinds == sorted(kinds, key=lambda k: k == "accumulate"), w.name
    # T: the optimizer waits for the accumulates, each fetch's cast for its update (as the fetch did)
    t = {w.name: w for w in keep_all(L).windows()}["T"]
    assert strip_host(t) == [("d2h", "grads", 0, -1), ("d2h", "grads", -1, -1), ("cpu", "optimizer", -1, 1),
                             ("cpu", "optimizer", 0, 1), ("h2d", "weights", -1, 2), ("h2d", "weights", 0, 3)]
    assert t.ops[4] == Op("cpu", "optimizer", -1, after=3) and t.ops[3] == Op("host", "accumulate", -1, after=2)
    f1 = {w.name: w for w in keep_all(L).windows()}["F1"]
    assert strip_host(f1) == [("compute", "forward", 1, -1), ("cpu", "optimizer", 2, -1), ("h2d", "weights", 2, 1)]
    b3 = {w.name: w for w in megatrain(L, 2).windows()}["B3"]  # no prefetch: the compute waits for the fetch
    # ... and the re-run of layer 2 waits for its own weights (which queue behind layer 3's)
    assert strip_host(b3) == [("h2d", "weights", 3, -1), ("h2d", "recompute_weights", 2, -1),
                              ("compute", "recompute", 2, 1), ("compute", "local_recompute", 3, 0),
                              ("compute", "backward", 3, 0)]
    assert b3.ops[4] == Op("compute", "recompute", 2, after=3)  # op 3: its fetch, behind its cast (op 2)
    assert Schedule.loads(sched.dumps()).windows() == sched.windows()


# ---- timing: a hand-checkable instance -------------------------------------------------------------
def test_host_lane_lengthens_windows_in_the_simulator_and_the_milp():
    # Free links, plenty of memory (keep everything). Casting layer 1 takes 1.5 s, layer 0 0.5 s;
    # accumulating layer 1's grads 3 s, layer 0's 0.25 s. Windows:
    #   F0  optimizer(0) -> cast 1 (1.5) -> fetch            1.5 (compute: 1)
    #   F1  forward                                          1
    #   H   head 0.5; fetching layer 1 again would cast 1.5 s, so layer 1 stays resident   0.5
    #   B1  backward 2 | cast 0 (0.5) -> fetch               2
    #   B0  backward 2 | grads 1 -> accumulate (3)           3   (compute: 2)
    #   T   grads 0 -> accumulate (0.25), updates, cast 0 (0.5) -> fetch   0.75
    wl = with_host_costs(workload([1.0, 1.0], head=0.5, opt=0.0), [0.5, 1.5], [0.25, 3.0])
    hw = hardware(100 * G)
    res = solve(wl, hw)
    s, sim = res.schedule, res.simulated
    assert s.keep_internals == (True, True) and s.resident_weights[1]
    expected = {"F0": 1.5, "F1": 1.0, "H": 0.5, "B1": 2.0, "B0": 3.0, "T": 0.75}
    assert sim.window_seconds == pytest.approx(expected, abs=1e-6)
    assert sim.iteration_seconds == pytest.approx(8.75, abs=1e-6)
    assert res.objective == pytest.approx(8.75, abs=1e-6)
    host = [seg for seg in sim.timeline if seg.lane == "host"]
    expected = {("F0", "cast", 1), ("B0", "accumulate", 1), ("T", "accumulate", 0), ("T", "accumulate", -1),
                ("T", "cast", -1), ("T", "cast", 0)}
    if not s.resident_weights[0]:  # a tie: layer 0's B1 cast and fetch hide under the backward either way
        expected.add(("B1", "cast", 0))
    assert {(seg.window, seg.kind, seg.index) for seg in host} == expected
    assert sim.lane_bytes.get("host", 0.0) == 0.0
    # the same schedule without residency pays the second cast of layer 1 in H
    again = simulate(Schedule(**{**_fields(s), "resident_weights": (False, False)}), wl, hw)
    assert again.window_seconds["H"] == pytest.approx(1.5, abs=1e-6)


def _fields(s: Schedule) -> dict:
    return dict(num_layers=s.num_layers, homes=s.homes, keep_internals=s.keep_internals,
                resident_weights=s.resident_weights, offload_window=s.offload_window, reload_window=s.reload_window,
                backward_prefetch=s.backward_prefetch, optimizer=s.optimizer)


# ---- the MILP's algebra is the simulator's timing rule -----------------------------------------------
def random_instance(rng: random.Random, L: int, *, host: bool = True):
    fwd = [rng.uniform(0.1, 2.0) for _ in range(L)]
    A = rng.uniform(0.2, 2.0) * G
    wl = workload(fwd, A=A, internal=A * rng.uniform(1.0, 5.0), param_bytes=rng.uniform(0.1, 3.0) * G,
                  fwd_work=0.2 * A, bwd_work=0.5 * A, opt=rng.uniform(0.0, 0.5), head=rng.uniform(0.01, 1.0),
                  grad_accum=rng.choice([1, 2]))
    if host:
        wl = with_host_costs(wl, [rng.uniform(0.0, 1.0) for _ in range(L)], [rng.uniform(0.0, 2.0) for _ in range(L)],
                             nonblock_cast=rng.uniform(0.0, 0.5), nonblock_accum=rng.uniform(0.0, 0.5))
    bw = rng.uniform(0.5, 5.0) * G
    nvme = rng.random() < 0.3
    peak = lambda s: simulate(s, wl, hardware(1e15), check=False).peak_gpu_bytes  # noqa: E731
    floor, top = min(peak(megatrain(L, 2)), peak(recompute_all(L))), peak(keep_all(L))
    cap = floor + rng.uniform(0.2, 1.0) * max(0.0, top - floor)
    hw = hardware(cap, cpu=1 * G + rng.uniform(0.0, 3.0) * A, h2d=bw, d2h=bw * rng.uniform(0.5, 2.0),
                  nvme_cap=100 * G if nvme else 0.0, nvme_bw=bw / 3 if nvme else 0.0)
    return wl, hw, nvme


def milp_time_equals_simulator_for_every_schedule(wl, hw, nvme: bool, pipelined: bool, internals: bool = True) -> int:
    """Seed the MILP with each schedule of its space (``internals``: with the moved internals'
    choices); its iteration time (window variables at their tight lower bounds) equals the
    simulator's. Returns how many schedules were checked."""
    import pyomo.environ as pyo

    model = ScheduleModel(wl, hw, MilpOptions(pipelined_optimizer=pipelined))
    n = 0
    for s in milp_space(wl.num_layers, nvme=nvme, pipelined=pipelined, internals=internals):
        model.seed_from(s)
        sim = simulate(s, wl, hw, check=False)
        assert pyo.value(model.iteration_time()) == pytest.approx(sim.iteration_seconds, rel=1e-9), s
        n += 1
    return n


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.slow
def test_milp_window_times_match_the_simulator_on_every_schedule_with_host_costs(seed):
    rng = random.Random(seed)
    wl, hw, nvme = random_instance(rng, 3)
    assert milp_time_equals_simulator_for_every_schedule(wl, hw, nvme, pipelined=seed % 2 == 0) > 20


@pytest.mark.slow
def test_milp_window_times_match_the_simulator_on_every_four_layer_schedule():
    rng = random.Random(11)
    for pipelined in (True, False):
        wl, hw, _ = random_instance(rng, 4)  # (moved internals: tests/test_planner_internals.py, 10x the space)
        assert milp_time_equals_simulator_for_every_schedule(wl, hw, True, pipelined, internals=False) > 2000


def best_enumerated(wl, hw, nvme: bool) -> float:
    best = float("inf")
    for s in milp_space(wl.num_layers, nvme=nvme, pipelined=None):  # the MILP chooses the optimizer mode
        try:
            best = min(best, simulate(s, wl, hw).iteration_seconds)
        except InfeasibleSchedule:
            continue
    return best


@pytest.mark.parametrize("seed", range(3))
def test_milp_finds_the_best_enumerated_schedule_with_host_costs(seed):
    rng = random.Random(100 + seed)
    wl, hw, nvme = random_instance(rng, 3)
    best = best_enumerated(wl, hw, nvme)
    assert best < float("inf")
    res = solve(wl, hw, time_limit=30)
    assert res.status == "optimal"
    sim = simulate(res.schedule, wl, hw)
    assert res.objective == pytest.approx(sim.iteration_seconds, rel=1e-2)
    assert best * (1 - 1e-9) <= sim.iteration_seconds <= best * (1 + 1e-3) + 1e-9


# ---- kept compute copies (engine/param_staging.py, Note: [kept compute copy]) ---------------------
@pytest.mark.parametrize("seed", range(3))
def test_kept_copies_cast_once_per_microbatch_in_the_simulator_and_the_milp(seed):
    """With ``kept_copies`` only a layer's first fetch of a micro-batch casts (F and T windows);
    H's and every B window's fetches do not. The MILP's window algebra still equals the simulator's
    timing on every schedule, and no window gets longer."""
    from dataclasses import replace

    rng = random.Random(300 + seed)
    wl, hw, nvme = random_instance(rng, 3)
    kept = replace(wl, kept_copies=True)
    assert Workload.from_json(kept.to_json()).kept_copies
    assert milp_time_equals_simulator_for_every_schedule(kept, hw, nvme, pipelined=seed % 2 == 0) > 20
    for s in (megatrain(3, 2), recompute_all(3), keep_all(3)):
        a, b = simulate(s, wl, hw, check=False), simulate(s, kept, hw, check=False)
        host = {w: [g for g in b.timeline if g.window == w and g.lane == "host" and g.kind == "cast"]
                for w in b.window_seconds}
        for w, segs in host.items():
            refetch = w == "H" or w.startswith("B")
            assert all((g.end - g.start == 0.0) == refetch for g in segs if g.index >= 0), (s.policy, w)
            assert b.window_seconds[w] <= a.window_seconds[w] + 1e-12, (s.policy, w)
