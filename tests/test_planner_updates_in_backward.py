"""The plan chooses and prices updates in the backward where the run allows them
(``Workload.updates_in_backward``; ``Schedule.updates_in_backward``; Note: [updates in the backward
pass] in core/optimizer_steps.py): a pipelined optimizer updates layer t+1 in the last micro-batch's
B{t}, after its accumulate; T updates the non-block parts and layer 0; no F window updates. The
MILP's window times equal the simulator's there too, and its plan is the best of the enumerated
space, which holds every pipelined schedule both ways."""

from __future__ import annotations

import dataclasses
import random

import pytest

from lightning_lazytrain.planner import InfeasibleSchedule, recompute_all, simulate, solve
from lightning_lazytrain.planner.milp import MilpOptions, ScheduleModel
from planner_helpers import hardware, milp_space
from test_planner_optimizer_mode import TIGHT, small_instance


def in_backward(wl):
    return dataclasses.replace(wl, updates_in_backward=True)


def both_ways(schedules):
    """Every schedule, and each pipelined one also with its updates in the backward."""
    for s in schedules:
        yield s
        if s.optimizer == "pipelined" and not s.serial_layers:
            yield dataclasses.replace(s, updates_in_backward=True)


def cpu_ops(window):
    return [op.index for op in window.ops if op.lane == "cpu"]


@pytest.mark.parametrize("accum", [1, 3])
def test_the_windows_update_each_layer_after_its_last_accumulate(accum):
    s = recompute_all(4)
    first = {w.name: w for w in s.windows(first_microbatch=True, last_microbatch=accum == 1,
                                          updates_in_backward=True)}
    last = {w.name: w for w in s.windows(first_microbatch=accum == 1, last_microbatch=True, updates_in_backward=True)}
    assert all(cpu_ops(first[f"F{j}"]) == [] for j in range(4))  # no update rides a forward window
    for t in range(3):  # B{t} updates layer t+1, after the accumulate of layer t+1's gradients
        ops = last[f"B{t}"].ops
        k = next(i for i, op in enumerate(ops) if op.lane == "cpu")
        assert ops[k].index == t + 1 and ops[ops[k].after].kind == "accumulate" and ops[ops[k].after].index == t + 1
        if accum > 1:
            assert cpu_ops(first[f"B{t}"]) == []  # not the step's last gradients
    assert cpu_ops(last["B3"]) == [] and cpu_ops(last["T"]) == [-1, 0]
    # without the flag, or serial: as before
    plain = {w.name: w for w in s.windows()}
    assert cpu_ops(plain["F0"]) == [1] and cpu_ops(plain["B0"]) == []
    serial = dataclasses.replace(s, optimizer="serial")
    assert cpu_ops(serial.windows(updates_in_backward=True)[-1]) == [-1, 0, 1, 2, 3]


def test_a_long_update_hides_under_the_backward():
    """Updates as long as a forward: in the F windows each one stalls the forward; in the B windows
    (twice as long) they hide, and the step is shorter by what the forwards waited."""
    wl, hw = small_instance(random.Random(7), 3)
    wl = dataclasses.replace(wl, grad_accum=1, layers=tuple(dataclasses.replace(x, opt_seconds=x.fwd_seconds * 1.5)
                                                              for x in wl.layers))
    s = recompute_all(3)
    before = simulate(s, in_backward(wl), hardware(1e15), check=False).iteration_seconds
    after = simulate(dataclasses.replace(s, updates_in_backward=True), in_backward(wl), hardware(1e15),
                     check=False).iteration_seconds
    assert after < before
    # a run that does not allow it is priced as it runs: at the step
    assert simulate(dataclasses.replace(s, updates_in_backward=True), wl, hardware(1e15),
                    check=False).iteration_seconds == pytest.approx(before)
    res = solve(in_backward(wl), hardware(1e15), mip_gap=TIGHT, time_limit=30)
    assert res.schedule.updates_in_backward and res.simulated.iteration_seconds <= after * (1 + 1e-9)
    assert not solve(wl, hardware(1e15), mip_gap=TIGHT, time_limit=30).schedule.updates_in_backward


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.slow
def test_milp_window_times_equal_the_simulator_with_updates_in_backward(seed):
    """Every schedule of both modes, accumulation 2-4 (the last micro-batch's own B windows) and 1."""
    import pyomo.environ as pyo

    base, hw = small_instance(random.Random(1500 + seed), 3)
    for accum in (base.grad_accum, 1):
        wl = in_backward(dataclasses.replace(base, grad_accum=accum))
        model = ScheduleModel(wl, hw, MilpOptions())
        n = 0
        for s in both_ways(milp_space(3, nvme=False, pipelined=None)):
            model.seed_from(s)
            assert pyo.value(model.iteration_time()) == pytest.approx(
                simulate(s, wl, hw, check=False).iteration_seconds, rel=1e-9), s
            n += 1
        assert n > 60


@pytest.mark.parametrize("seed", range(2))
def test_the_plan_is_the_best_enumerated_schedule_with_updates_in_backward(seed):
    wl, hw = small_instance(random.Random(1600 + seed), 3)
    wl = in_backward(wl)
    best = float("inf")
    for s in both_ways(milp_space(3, pipelined=None)):
        try:
            best = min(best, simulate(s, wl, hw).iteration_seconds)
        except InfeasibleSchedule:
            continue
    res = solve(wl, hw, mip_gap=TIGHT, time_limit=30, serial_layers=False)
    assert res.status == "optimal"
    assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-6)
    assert res.simulated.iteration_seconds == pytest.approx(best, rel=1e-6)
    assert res.schedule.serial_layers == ()


def test_the_choice_is_part_of_the_schedule():
    s = dataclasses.replace(recompute_all(4), updates_in_backward=True)
    assert type(s).from_json(s.to_json()) == s
    assert "updates_in_backward" not in recompute_all(4).to_json()
    from lightning_lazytrain.planner import InvalidInput

    with pytest.raises(InvalidInput, match="updates_in_backward"):
        dataclasses.replace(recompute_all(4), optimizer="serial", updates_in_backward=True)
    with pytest.raises(InvalidInput, match="updates_in_backward"):
        dataclasses.replace(recompute_all(4), serial_layers=(2,), updates_in_backward=True)
