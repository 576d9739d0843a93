"""The optimizer mode (serial / pipelined) is a decision of the MILP.

``MilpOptions.optimizer_mode="auto"`` (the default) puts one binary into the model; ``serial`` /
``pipelined`` force the mode (ablation), as does the older ``pipelined_optimizer=False`` (serial
only). The auto result must equal the better of the two forced solves, agree with the simulator, and
be the best schedule of the enumerated space with both modes.
"""

from __future__ import annotations

import random

import pytest

from lightning_lazytrain.planner import InfeasibleSchedule, InvalidInput, keep_all, recompute_all, simulate, solve
from lightning_lazytrain.planner.milp import MilpOptions, ScheduleModel
from planner_helpers import G, hardware, milp_space, with_host_costs, workload

TIGHT = 1e-9  # mip_gap for the small instances: the comparisons below are then exact to ~1e-9


def small_instance(rng: random.Random, L: int, *, slow: bool = True):
    """A few layers, gradient accumulation, a slow link (fetches about as long as the forwards or
    longer; ``slow=False``: 5-20 GB/s), host-side updates of the order of a forward, host-lane costs;
    memory between the smallest baseline peak and keep-all."""
    fwd = [rng.uniform(0.2, 1.0) for _ in range(L)]
    A = rng.uniform(0.3, 1.0) * G
    wl = workload(fwd, A=A, internal=A * rng.uniform(1.5, 4.0), param_bytes=rng.uniform(0.3, 2.0) * G,
                  fwd_work=0.2 * A, bwd_work=0.5 * A, opt=rng.uniform(0.1, 1.0), head=rng.uniform(0.05, 0.5),
                  grad_accum=rng.choice([2, 3, 4]))
    wl = with_host_costs(wl, [rng.uniform(0.0, 0.3) for _ in range(L)], [rng.uniform(0.0, 0.3) for _ in range(L)],
                         nonblock_cast=rng.uniform(0.0, 0.2), nonblock_accum=rng.uniform(0.0, 0.2))
    bw = (rng.uniform(0.3, 1.5) if slow else rng.uniform(5.0, 20.0)) * G
    peak = lambda s: simulate(s, wl, hardware(1e15), check=False).peak_gpu_bytes  # noqa: E731
    floor, top = peak(recompute_all(L)), peak(keep_all(L))
    cap = floor + rng.uniform(0.3, 1.2) * max(0.0, top - floor)
    return wl, hardware(cap, cpu=1 * G + 2 * A, h2d=bw, d2h=bw * rng.uniform(0.7, 1.5))


def _three(wl, hw):
    # the two pure modes (the per-layer mode, ``serial_layers``, is tested in test_serial_layers.py)
    auto = solve(wl, hw, mip_gap=TIGHT, time_limit=30, serial_layers=False)
    serial = solve(wl, hw, mip_gap=TIGHT, time_limit=30, optimizer_mode="serial", serial_layers=False)
    pipelined = solve(wl, hw, mip_gap=TIGHT, time_limit=30, optimizer_mode="pipelined", serial_layers=False)
    for r in (auto, serial, pipelined):
        assert r.status == "optimal"
        # the MILP's objective is the simulator's iteration time for the schedule it returns
        assert r.objective == pytest.approx(r.simulated.iteration_seconds, rel=1e-2)
        assert r.objective == pytest.approx(r.simulated.iteration_seconds, rel=1e-6)
    assert serial.schedule.optimizer == "serial" and pipelined.schedule.optimizer == "pipelined"
    return auto, serial, pipelined


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.slow
def test_auto_equals_the_better_forced_mode_on_small_instances(seed):
    rng = random.Random(1200 + seed)
    wl, hw = small_instance(rng, 3 + seed % 3, slow=seed < 6)
    auto, serial, pipelined = _three(wl, hw)
    t_s, t_p = serial.simulated.iteration_seconds, pipelined.simulated.iteration_seconds
    best = min(t_s, t_p)
    assert auto.simulated.iteration_seconds == pytest.approx(best, rel=1e-6)
    if abs(t_s - t_p) > 1e-6 * best:
        assert auto.schedule.optimizer == ("serial" if t_s < t_p else "pipelined")


def test_both_modes_win_somewhere():
    """The instances above are not all one-sided: the choice matters."""
    winners = set()
    for seed in range(8):
        wl, hw = small_instance(random.Random(1200 + seed), 3 + seed % 3, slow=seed < 6)
        winners.add(solve(wl, hw, mip_gap=TIGHT).schedule.optimizer)
    assert winners == {"serial", "pipelined"}


def test_slow_link_hand_instance_picks_serial():
    # 4 layers, forward 0.5 s, a layer's fetch 1 s, its update 0.5 s, 2 micro-batches, no host costs.
    # Pipelined: each of F0..F2 of the first micro-batch runs update -> fetch (1.5 s instead of 1 s);
    # serial: T runs all four updates (2 s) while layer 0's fetch (after its update: 0.5 + 1 s) overlaps
    # them, so T is 0.5 s longer and the three F windows 1.5 s shorter: serial wins by 1 s.
    wl = workload([0.5] * 4, param_bytes=1 * G, opt=0.5, grad_accum=2)
    hw = hardware(100 * G, h2d=1 * G, d2h=1 * G)
    auto, serial, pipelined = _three(wl, hw)
    assert auto.schedule.optimizer == "serial"
    assert pipelined.simulated.iteration_seconds - serial.simulated.iteration_seconds == pytest.approx(1.0, rel=1e-6)
    assert auto.simulated.iteration_seconds == pytest.approx(serial.simulated.iteration_seconds, rel=1e-9)
    # the serial T window (grads 1 s, the updates 2 s) and F1 window (the fetch, 1 s)
    assert serial.simulated.window_seconds["T"] == pytest.approx(1 + 2, rel=1e-6)
    assert serial.simulated.window_seconds["F0"] == pytest.approx(1, rel=1e-6)
    assert pipelined.simulated.window_seconds["F0"] == pytest.approx(1.5, rel=1e-6)


def test_fast_link_hand_instance_picks_pipelined():
    # the same with a free link: the pipelined updates hide under the forwards
    wl = workload([1.0] * 4, param_bytes=0.1 * G, opt=0.5, grad_accum=2)
    hw = hardware(100 * G, h2d=1 * G, d2h=1 * G)
    auto, serial, pipelined = _three(wl, hw)
    assert auto.schedule.optimizer == "pipelined"
    assert auto.simulated.iteration_seconds == pytest.approx(pipelined.simulated.iteration_seconds, rel=1e-9)
    assert serial.simulated.iteration_seconds > pipelined.simulated.iteration_seconds + 1.0


@pytest.mark.parametrize("seed", range(3))
def test_auto_finds_the_best_enumerated_schedule_of_both_modes(seed):
    rng = random.Random(1300 + seed)
    wl, hw = small_instance(rng, 3)
    best = {}
    for s in milp_space(3, pipelined=None):
        try:
            t = simulate(s, wl, hw).iteration_seconds
        except InfeasibleSchedule:
            continue
        best[s.optimizer] = min(best.get(s.optimizer, float("inf")), t)
    assert set(best) == {"serial", "pipelined"}
    res = solve(wl, hw, mip_gap=TIGHT, time_limit=30, serial_layers=False)  # the enumerated space: pure modes
    assert res.status == "optimal"
    assert res.simulated.iteration_seconds == pytest.approx(min(best.values()), rel=1e-6)
    assert best[res.schedule.optimizer] == pytest.approx(min(best.values()), rel=1e-6)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.slow
def test_milp_window_times_equal_the_simulator_in_both_modes(seed):
    """Seeded with every schedule of both modes, the auto model's iteration time (the window variables
    at their tight lower bounds, ``pipe`` set from the schedule) is the simulator's."""
    import pyomo.environ as pyo

    wl, hw = small_instance(random.Random(1400 + seed), 3)
    model = ScheduleModel(wl, hw, MilpOptions())
    n = 0
    for s in milp_space(3, nvme=False, pipelined=None):
        model.seed_from(s)
        assert pyo.value(model.iteration_time()) == pytest.approx(simulate(s, wl, hw, check=False).iteration_seconds,
                                                                  rel=1e-9), s
        n += 1
    assert n > 40


def test_options():
    assert MilpOptions().optimizer_modes() == ("serial", "pipelined")
    assert MilpOptions(optimizer_mode="serial").optimizer_modes() == ("serial",)
    assert MilpOptions(optimizer_mode="pipelined").optimizer_modes() == ("pipelined",)
    assert MilpOptions(pipelined_optimizer=False).optimizer_modes() == ("serial",)  # the older switch
    assert MilpOptions(time_objective=False).optimizer_modes() == ("pipelined",)  # its objective cannot see it
    with pytest.raises(InvalidInput):
        MilpOptions(optimizer_mode="fast").optimizer_modes()
    with pytest.raises(InvalidInput):
        MilpOptions(optimizer_mode="pipelined", pipelined_optimizer=False).optimizer_modes()
    # a forced mode adds no variable; auto adds one binary
    wl, hw = workload([1.0] * 3), hardware(100 * G)
    assert not hasattr(ScheduleModel(wl, hw, MilpOptions(optimizer_mode="serial")).m, "pipe")
    assert ScheduleModel(wl, hw, MilpOptions()).m.pipe.is_binary()


@pytest.mark.slow
def test_27b_h800_with_a_3_gb_per_s_link_picks_serial():
    """The audit's case: at 27B / H800 / batch 72 with a 3 GB/s link the serial optimizer tail is
    faster than the pipelined one (a layer's update + cast + fetch per forward window)."""
    from hydra import compose, initialize_config_dir

    from lightning_lazytrain.config import CONF_DIR, to_hardware, to_model, to_train
    from lightning_lazytrain.planner import Workload

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):  # as bench/bench_planner.py
        cfg = compose(config_name="plan", overrides=["hardware=h800", "model=qwen3.6-27b"])
    hw = to_hardware(cfg).replace(h2d_bytes_per_s=3e9, d2h_bytes_per_s=3e9)
    wl = Workload.analytic(to_model(cfg), to_train(cfg, micro_batch_size=72), hw)
    auto = solve(wl, hw, serial_layers=False)  # with the per-layer mode: test_serial_layers.py
    pipelined = solve(wl, hw, optimizer_mode="pipelined", serial_layers=False)
    assert auto.status == "optimal" and auto.mip_gap <= 1e-3
    assert auto.schedule.optimizer == "serial"
    assert auto.objective == pytest.approx(auto.simulated.iteration_seconds, rel=1e-2)
    assert auto.simulated.iteration_seconds < pipelined.simulated.iteration_seconds * (1 - 1e-2)
