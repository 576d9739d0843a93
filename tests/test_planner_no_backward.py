"""Layers without a backward in the plan (Note: [layers without a backward] in planner/workload.py).

The engine runs no backward for a block no gradient reaches (a frozen first part of the stack under a frozen
embedding; every block of a head-only fine-tune): its B window computes nothing, re-runs nothing, fetches no
weights (but layer 0's) and sends no gradients. The profile records those blocks (``Workload.no_backward``);
``Schedule.windows(no_backward=...)`` leaves those ops out, so the simulator times what runs, and the MILP
prices the same (its objective is the simulated time). Checked against the engine: on a frozen prefix, the
bytes it moves per lane and the forwards it re-runs equal the simulator's, under every schedule.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from test_executor import SCHEDULES, big_host, custom, measured, plain_grads, run
from test_executor import L as LAYERS
from test_planner_host_lane import random_instance
from test_planner_optimizer_mode import small_instance

from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import InvalidInput, Workload, keep_all, megatrain, recompute_all, simulate, solve
from lightning_lazytrain.planner.milp import ScheduleModel
from test_executor import SPEC

TIGHT = 1e-6


def frozen(wl: Workload, k: int, *, costs: bool = False) -> Workload:
    """``wl`` with its first ``k`` layers frozen as the profile would see them: no backward seconds, no
    gradient bytes or host adds, no optimizer update, and listed in ``no_backward`` (``costs``: keep their
    figures, so that every op the windows keep or leave out for them costs time: a stricter algebra check)."""
    layers = tuple(dataclasses.replace(x, bwd_seconds=0.0, grad_bytes=0.0, accum_seconds=0.0, opt_seconds=0.0)
                   if j < k and not costs else x for j, x in enumerate(wl.layers))
    return dataclasses.replace(wl, layers=layers, no_backward=tuple(range(k))).validate()


def ops(schedule, nb, **kw):
    return {w.name: w.ops for w in schedule.windows(no_backward=nb, **kw)}


def backward_side(windows):
    return {name: o for name, o in windows.items() if name == "H" or name.startswith("B")}


@pytest.mark.parametrize("schedule", [recompute_all(6), megatrain(6, 3), keep_all(6),
                                      dataclasses.replace(megatrain(6, 2), backward_prefetch=False)],
                         ids=["recompute_all", "megatrain3", "keep_all", "no_prefetch"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_the_windows_leave_out_what_the_engine_skips(schedule, k):
    nb = tuple(range(k))
    got, full = ops(schedule, nb), ops(schedule, ())
    assert [n for n in got] == [n for n in full]  # the same windows
    for name, window in backward_side(got).items():
        for op in window:
            # no compute for a layer without a backward, and no re-run of a block ending at one
            if name.startswith("B") and int(name[1:]) < k:
                assert op.lane != "compute", (name, op)
            # its weights are not fetched again (but layer 0's, for the next micro-batch's F0; a re-run for a
            # block ending above it fetches them: recompute_weights); its gradients are not sent
            if op.kind == "weights":
                assert op.index == 0 or op.index >= k, (name, op)
                assert window[op.after] == dataclasses.replace(op, lane="host", kind="cast", after=-1)
            if op.kind in ("grads", "accumulate") and op.index >= 0:
                assert op.index >= k, (name, op)
    # the forward side is unchanged, and so is every window of a layer that runs its backward
    for name in full:
        if name.startswith("F") or name == "T" or (name.startswith("B") and int(name[1:]) >= k + 1):
            assert got[name] == full[name], name
    # a block ending at a layer that runs its backward still re-runs the layers below it
    for s, e in schedule.recompute_blocks:
        if e - 1 >= k:
            reruns = [op.index for op in got[f"B{e - 1}"] if op.kind == "recompute"]
            assert reruns == list(range(s, e - 1)), (s, e, reruns)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_milp_prices_a_frozen_prefix_as_the_simulator_times_it(seed, k):
    """Random small instances (accumulation, host lane, a slow link): the MILP's objective is the simulated
    iteration time of its schedule (plus its tie-breaks), it is no slower than any baseline, and the frozen
    prefix costs less than the same layers training."""
    wl, hw = small_instance(random.Random(seed), 5)
    nb = frozen(wl, k)
    res = solve(nb, hw, mip_gap=TIGHT, time_limit=60)
    assert res.status == "optimal"
    s = res.schedule
    moves = sum(h == "cpu" for h in s.homes) + 2 * sum(h == "nvme" for h in s.homes) + len(s.offloaded_internals)
    sim = simulate(s, nb, hw)
    assert res.objective - ScheduleModel.EPS * moves == pytest.approx(sim.iteration_seconds, rel=1e-7)
    assert not any(s.keep_internals[j] or s.partial_keep[j] for j in range(k))  # nothing to keep for no backward
    for base in (recompute_all(5), megatrain(5, 2), keep_all(5)):
        for mode in ("serial", "pipelined"):
            try:
                b = simulate(dataclasses.replace(base, optimizer=mode), nb, hw)
            except Exception:  # does not fit
                continue
            assert sim.iteration_seconds <= b.iteration_seconds * (1 + 1e-6), (base.policy, mode)
    # the same layers, frozen but priced as if they ran their backward (only the windows differ): never
    # faster; with a fast link (compute-bound B windows) the frozen layers' local re-runs are gone
    as_before = dataclasses.replace(nb, no_backward=())
    roomy = hw.replace(gpu_memory_bytes=1e15, gpu_memory_cap_bytes=1e15)
    assert simulate(recompute_all(5), nb, roomy).iteration_seconds <= \
        simulate(recompute_all(5), as_before, roomy).iteration_seconds
    fast, fast_hw = small_instance(random.Random(seed), 5, slow=False)
    fast = dataclasses.replace(fast, layers=tuple(dataclasses.replace(x, fwd_seconds=10 * x.fwd_seconds)
                                                  for x in fast.layers))  # compute-bound windows
    fast, fast_hw = frozen(fast, k), fast_hw.replace(gpu_memory_bytes=1e15, gpu_memory_cap_bytes=1e15)
    gain = simulate(recompute_all(5), dataclasses.replace(fast, no_backward=()), fast_hw).iteration_seconds - \
        simulate(recompute_all(5), fast, fast_hw).iteration_seconds
    assert gain >= 0.5 * fast.grad_accum * sum(x.fwd_seconds for x in fast.layers[:k]), gain


@pytest.mark.parametrize("mode", ["none", "shard", "replicate", "replicate_overlap"])
@pytest.mark.parametrize("seed", range(2))
def test_the_milp_times_every_schedule_as_the_simulator_with_a_frozen_prefix(mode, seed):
    """Every schedule of the MILP's space (homes, kept and moved internals, resident layers, blocks), seeded
    into the model: its iteration time equals the simulator's, to 1e-9, with the frozen layers' figures kept
    (so each op the windows leave out would cost time), one rank and the data-parallel modes; and so do its
    device bytes per window."""
    import pyomo.environ as pyo

    from planner_helpers import milp_space
    from test_planner_internals import gpu_rows
    from test_planner_multi import _multi_instance

    from lightning_lazytrain.planner.simulator import window_memory

    from lightning_lazytrain.planner.milp import MilpOptions

    k = 2 + seed  # a prefix of 2 of 3 layers, and all 3
    if mode == "none":
        wl, hw, nvme = random_instance(random.Random(seed), 3)
    else:
        wl, hw, nvme = _multi_instance(seed, mode)
    wl = frozen(wl, k, costs=True)
    model = ScheduleModel(wl, hw, MilpOptions())
    n = 0
    for s in milp_space(wl.num_layers, nvme=nvme, pipelined=None):
        s = dataclasses.replace(s, data_parallel=wl.data_parallel)
        model.seed_from(s)
        sim = simulate(s, wl, hw, check=False)
        assert pyo.value(model.iteration_time()) == pytest.approx(sim.iteration_seconds, rel=1e-9), s
        # and its device bytes in every window (T aside: the MILP has no row for it)
        assert gpu_rows(model) == pytest.approx(window_memory(s, wl)[:-1], rel=1e-12), s
        n += 1
    assert n > 20


def test_no_backward_is_checked_and_kept_in_json():
    wl, _ = small_instance(random.Random(0), 4)
    nb = frozen(wl, 2)
    assert Workload.from_json(nb.to_json()).no_backward == (0, 1)
    for bad in ((1, 0), (0, 0), (4,), (-1,)):
        with pytest.raises(InvalidInput, match="no_backward"):
            dataclasses.replace(wl, no_backward=bad).validate()


# ---- against the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_and_tokens():
    torch.manual_seed(0)
    return LlamaLM(SPEC), torch.randint(0, SPEC.vocab, (2, 33))


def freeze(model, k):
    m = copy.deepcopy(model)
    m.embed_tokens.requires_grad_(False)
    for block in m.layers[:k]:
        block.requires_grad_(False)
    return m


FAST = ("recompute_all", "megatrain_K2", "keep_all", "cpu_homes", "milp")


@pytest.mark.parametrize("k", [2, LAYERS])
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow)
                                  for n in [*SCHEDULES, "milp"]])
def test_the_engine_moves_and_reruns_what_the_simulator_counts_for_a_frozen_prefix(model_and_tokens, tmp_path,
                                                                                    name, k):
    model, tokens = model_and_tokens
    model = freeze(model, k)
    wl = measured(model, tokens, tmp_path)
    assert wl.no_backward == tuple(range(k))
    hw = big_host(wl)
    if name == "milp":
        lo = simulate(recompute_all(LAYERS), wl, hw).peak_gpu_bytes
        hi = simulate(keep_all(LAYERS), wl, hw).peak_gpu_bytes
        schedule = solve(wl, hw.replace(gpu_memory_cap_bytes=(lo + hi) / 2)).schedule
    else:
        schedule = SCHEDULES[name]
    sim = simulate(schedule, wl, hw)
    want_losses, want_grads = plain_grads(model, tokens)
    m, losses, stats = run(model, schedule, tokens, tmp_path)
    assert torch.equal(losses[0], want_losses[0])
    for (pname, p), g in zip(m.named_parameters(), want_grads):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g), pname
    for lane in ("h2d", "d2h", "nvme_read", "nvme_write"):
        assert stats.lane_bytes[lane] == pytest.approx(sim.lane_bytes.get(lane, 0.0), abs=0), lane
    assert stats.recomputed_forwards == sim.recomputed_forwards
    assert 0 < stats.peak_tracked_bytes <= sim.peak_gpu_bytes


def test_without_no_backward_the_plan_counts_fetches_the_engine_skips(model_and_tokens, tmp_path):
    """The mutation check of the test above: the same profile priced without ``no_backward`` counts more H2D
    bytes and re-runs than the engine does."""
    model, tokens = model_and_tokens
    model = freeze(model, 2)
    wl = measured(model, tokens, tmp_path)
    schedule = custom(["gpu", "recompute", "gpu", "recompute", "gpu"])
    _, _, stats = run(model, schedule, tokens, tmp_path)
    right = simulate(schedule, wl, big_host(wl))
    wrong = simulate(schedule, dataclasses.replace(wl, no_backward=()), big_host(wl))
    assert stats.lane_bytes["h2d"] == right.lane_bytes["h2d"] < wrong.lane_bytes["h2d"]
    assert stats.recomputed_forwards == right.recomputed_forwards != wrong.recomputed_forwards


@pytest.mark.parametrize("name", ["recompute_all", "keep_all", "kept_internals_resident"])
def test_a_block_that_trains_a_little_holds_its_whole_gradient_buffer_in_the_plan(model_and_tokens, tmp_path, name):
    """Every block trains only its first norm (a fine-tune's adapters, in miniature): the gradient copies move
    that (``grad_bytes``), but a slot's device gradient buffer is the whole group's, and the plan counts it
    (``LayerWork.grad_buffer_bytes``). Exact against autograd; the engine's tracked peak within the plan's,
    which it exceeds when the slots are counted at the copies' size."""
    model, tokens = model_and_tokens
    model = copy.deepcopy(model)
    model.embed_tokens.requires_grad_(False)
    for block in model.layers:
        block.requires_grad_(False)
        block.input_layernorm.requires_grad_(True)
    wl = measured(model, tokens, tmp_path)
    assert wl.no_backward == () and all(0 < x.grad_bytes < x.param_bytes / 10 for x in wl.layers)
    schedule = SCHEDULES[name]
    sim = simulate(schedule, wl, big_host(wl))
    want_losses, want_grads = plain_grads(model, tokens)
    m, losses, stats = run(model, schedule, tokens, tmp_path)
    assert torch.equal(losses[0], want_losses[0])
    for (pname, p), g in zip(m.named_parameters(), want_grads):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g), pname
    assert stats.lane_bytes["d2h"] == sim.lane_bytes["d2h"]
    assert 0 < stats.peak_tracked_bytes <= sim.peak_gpu_bytes
    if name != "kept_internals_resident":  # where the plan is tight (that one's resident layers are not)
        copies_only = 2 * (wl.max_param_bytes + wl.max_grad_bytes)  # the slots as the plan counted them before
        assert stats.peak_tracked_bytes > sim.peak_gpu_bytes - wl.weight_buffer_bytes + copies_only
