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


def assert_window_times_equal_the_simulator(wl, hw):
    """The MILP's iteration time, seeded from every schedule of both modes (each pipelined one both ways),
    is the simulator's."""
    import pyomo.environ as pyo

    model = ScheduleModel(wl, hw, MilpOptions())
    n = 0
    for s in both_ways(milp_space(3, nvme=False, pipelined=None)):
        model.seed_from(s)
        assert pyo.value(model.iteration_time()) == pytest.approx(
            simulate(s, wl, hw, check=False).iteration_seconds, rel=1e-9), s
        n += 1
    assert n > 60


def assert_plan_is_the_best_enumerated(wl, hw):
    """The solved plan is optimal, its objective the simulator's, and as fast as the best enumerated
    schedule of both modes."""
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
    return res


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
    base, hw = small_instance(random.Random(1500 + seed), 3)
    for accum in (base.grad_accum, 1):
        assert_window_times_equal_the_simulator(in_backward(dataclasses.replace(base, grad_accum=accum)), hw)


@pytest.mark.parametrize("seed", range(2))
def test_the_plan_is_the_best_enumerated_schedule_with_updates_in_backward(seed):
    wl, hw = small_instance(random.Random(1600 + seed), 3)
    res = assert_plan_is_the_best_enumerated(in_backward(wl), hw)
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


def with_early_parts(wl, rng, parts=(600, 400), early=(1,), opt=(0.2, 1.0)):
    """The non-block group in parts (elements), ``early`` of them complete before the blocks' backward
    (Note: [early non-block parts]); its update (``opt``: seconds, low..high), gradients and weights of
    the order of a layer's."""
    return dataclasses.replace(wl, nonblock_params=sum(parts), nonblock_parts=parts, early_parts=early,
                               nonblock_opt_seconds=rng.uniform(*opt), nonblock_grad_bytes=rng.uniform(0.3, 1.5) * 1e9,
                               nonblock_param_bytes=rng.uniform(0.3, 1.5) * 1e9).validate()


@pytest.mark.parametrize("accum", [1, 3])
def test_early_parts_are_updated_in_the_first_backward_window(accum):
    """The early parts' D2H, accumulate and update end the last micro-batch's B{L-1}; T only fetches
    them; the other parts and layer 0 as before."""
    s = recompute_all(4)
    kw = dict(nonblock_parts=3, updates_in_backward=True, early_parts=(1, 2))
    last = {w.name: w for w in s.windows(first_microbatch=accum == 1, last_microbatch=True, **kw)}
    ops = last["B3"].ops
    assert [(op.lane, op.kind, op.index) for op in ops if op.index < 0] == [
        ("d2h", "grads", -2), ("host", "accumulate", -2), ("cpu", "optimizer", -2),
        ("d2h", "grads", -3), ("host", "accumulate", -3), ("cpu", "optimizer", -3)]
    assert all(ops[ops[k].after].kind == "accumulate" for k, op in enumerate(ops) if op.lane == "cpu")
    t = last["T"].ops
    assert cpu_ops(last["T"]) == [-1, 0]
    assert [op.index for op in t if op.kind == "accumulate"] == [0, -1]
    assert [op.index for op in t if op.lane == "h2d"] == [-1, -2, -3, 0]  # every part is still fetched in T
    if accum > 1:
        first = {w.name: w for w in s.windows(first_microbatch=True, last_microbatch=False, **kw)}
        assert all(op.index >= 0 for op in first["B3"].ops)  # not the step's last gradients
    # without the updates in the backward the early parts mean nothing
    plain = {w.name: w for w in s.windows(nonblock_parts=3, early_parts=(1, 2))}
    assert all(op.index >= 0 for op in plain["B3"].ops) and cpu_ops(plain["T"]) == [-1, -2, -3, 0]


def test_a_workload_names_valid_early_parts():
    from lightning_lazytrain.planner import InvalidInput

    wl, _ = small_instance(random.Random(3), 3)
    for bad in ((0,), (2,), (1, 1)):
        with pytest.raises(InvalidInput, match="early_parts"):
            with_early_parts(wl, random.Random(0), early=bad)
    ok = with_early_parts(wl, random.Random(0))
    assert type(ok).from_json(ok.to_json()) == ok
    assert ok.backward_parts(True) == () and in_backward(ok).backward_parts(True) == (1,)
    assert in_backward(ok).backward_parts(False) == ()


def test_an_early_head_part_leaves_t():
    """An update of the head part as long as a forward: in T it waits for the backward's end; in B{L-1}
    it runs beside the blocks' backward, and the step is shorter by about what T lost."""
    rng = random.Random(11)
    wl, _ = small_instance(rng, 3)
    wl = in_backward(with_early_parts(dataclasses.replace(wl, grad_accum=1), rng))
    s = dataclasses.replace(recompute_all(3), updates_in_backward=True)
    hw = hardware(1e15)
    late = simulate(s, dataclasses.replace(wl, early_parts=()), hw, check=False)
    early = simulate(s, wl, hw, check=False)
    assert early.window_seconds["T"] < late.window_seconds["T"]
    assert early.iteration_seconds < late.iteration_seconds
    res = solve(wl, hw, mip_gap=TIGHT, time_limit=30)
    assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-6)


@pytest.mark.parametrize("seed,parts,early", [(0, (600, 400), (1,)),
                                               pytest.param(1, (600, 400), (1,), marks=pytest.mark.slow),
                                               pytest.param(0, (500, 300, 200), (1, 2), marks=pytest.mark.slow),
                                               pytest.param(1, (500, 300, 200), (1, 2), marks=pytest.mark.slow)])
def test_milp_window_times_equal_the_simulator_with_early_parts(seed, parts, early):
    rng = random.Random(1700 + seed)
    base, hw = small_instance(rng, 3)
    base = with_early_parts(base, rng, parts, early, opt=(2.0, 6.0))  # the early chain outlasts B{L-1}
    # and one where the window's casts, not the parts' D2H, hold their accumulates back
    casts = dataclasses.replace(base, nonblock_grad_bytes=1e6, nonblock_opt_seconds=20.0, layers=tuple(
        dataclasses.replace(x, cast_seconds=x.bwd_seconds * 3) for x in base.layers))
    for wl in (base, casts, dataclasses.replace(base, grad_accum=1), dataclasses.replace(casts, grad_accum=1)):
        assert_window_times_equal_the_simulator(in_backward(wl), hw)


@pytest.mark.parametrize("seed", range(2))
def test_the_plan_is_the_best_enumerated_schedule_with_early_parts(seed):
    rng = random.Random(1800 + seed)
    wl, hw = small_instance(rng, 3)
    assert_plan_is_the_best_enumerated(in_backward(with_early_parts(wl, rng)), hw)
