"""Where the dtype conversions run (engine/copy_engine.py, Note: [conversion on the device]; the
plan's ``planner.placement``): fp32 masters cast into 16-bit compute copies on the host or by the
device, 16-bit gradients widened on the host or by the device, a gradient copy landing in the host
gradient itself (grad_writeback.py, Note: [direct landing]). Every placement trains bit-equal to the
host path, moves the bytes it says over each link, and does the host work it says."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.param_store import REST
from test_executor import SCHEDULES, SPEC, LlamaLM

L = SPEC.num_layers
BLOCKS = tuple(range(L))
PLACEMENTS = {
    "host": {},
    "cast": {"cast_on_device": BLOCKS + (REST,)},
    "widen": {"widen_on_device": BLOCKS + (REST,)},
    "both": {"cast_on_device": BLOCKS + (REST,), "widen_on_device": BLOCKS + (REST,)},
    "mixed": {"cast_on_device": (0, 2, REST), "widen_on_device": (1, 3)},
}


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return LlamaLM(SPEC), torch.randint(0, SPEC.vocab, (4, 33))


def train(model, tokens, schedule, placement, tmp_path, *, micro=2, steps=2, dtype=torch.bfloat16, keep=False,
          links=None, zero_to_none=True):
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES[schedule], nvme_dir=tmp_path, compute_dtype=dtype, keep_compute_copy=keep, links=links)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, lanes, tags = [], [], []
    try:
        set_to = ex.set_placement(**placement)
        for _ in range(steps):
            for k in range(micro):
                ex.begin_microbatch(first=k == 0, last=k == micro - 1)
                loss = m.loss(tokens[k::micro])
                loss.backward()
                stats = ex.end_microbatch()
                losses.append(loss.detach())
            lanes.append(dict(stats.lane_bytes))
            tags.append(Counter((r.lane, (r.tag or "").split(":")[0]) for r in ex.engine.records()))
            opt.step()
            opt.zero_grad(set_to_none=zero_to_none)
        direct = ex.params.direct_landings
    finally:
        ex.close()
    return m, losses, lanes, tags, set_to, direct


@pytest.mark.parametrize("schedule", ["megatrain_K2", "recompute_all", "cpu_homes", "kept_internals_resident"])
@pytest.mark.parametrize("name", ["cast", "widen", "both", "mixed"])
def test_every_placement_trains_bit_equal_to_the_host_path(reference, tmp_path, schedule, name):
    model, tokens = reference
    want_model, want, want_lanes, _, _, _ = train(model, tokens, schedule, {}, tmp_path)
    links = {"h2d": LinkSpec(2e8, 1e-4), "d2h": LinkSpec(2e8, 1e-4)}  # copies queue: ordering is tested
    got_model, got, lanes, _, set_to, _ = train(model, tokens, schedule, PLACEMENTS[name], tmp_path, links=links)
    assert set_to == {k: sorted(PLACEMENTS[name].get(k, ())) for k in ("cast_on_device", "widen_on_device")}
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for (n, p), q in zip(got_model.named_parameters(), want_model.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q), n
    # the link bytes: fp32 (4 bytes) instead of bf16 (2) for what the device converts
    for got_step, want_step in zip(lanes, want_lanes):
        if name in ("cast", "both"):
            assert got_step["h2d"] > want_step["h2d"]
        else:
            assert got_step["h2d"] == want_step["h2d"] or name == "mixed"
        if name in ("widen", "both"):
            assert got_step["d2h"] > want_step["d2h"]


def test_widened_gradients_land_in_the_host_gradient_without_a_host_addition(reference, tmp_path):
    """Note: [direct landing]: with ``zero_grad(set_to_none=True)`` a step's first copy of each group
    lands in the host gradient; with ``set_to_none=False`` (the grads are zeros, not None) it cannot
    know, and adds. Both train bit-equal to the host path."""
    model, tokens = reference
    want_model, want, _, _, _, none = train(model, tokens, "megatrain_K2", {}, tmp_path, micro=1)
    assert none == 0  # bf16 gradients into fp32 host grads: a host addition each
    for to_none in (True, False):
        got_model, got, _, _, _, direct = train(model, tokens, "megatrain_K2", PLACEMENTS["widen"], tmp_path, micro=1,
                                                zero_to_none=to_none)
        # two steps, every group once per step: L blocks and the non-block group; the first step's
        # grads are None from the start, the second's only after set_to_none
        assert direct == (2 if to_none else 1) * (L + 1)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        for (n, p), q in zip(got_model.named_parameters(), want_model.parameters()):
            assert torch.equal(p, q), n


def test_fp32_compute_lands_directly_and_trains_as_before(reference, tmp_path):
    """fp32 compute: the gradients already have the masters' dtype, so a step's first copy of each
    group lands in the host gradient (no placement needed) and later micro-batches add."""
    model, tokens = reference
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for _ in range(2):
        for k in range(2):
            loss = ref.loss(tokens[k::2])
            loss.backward()
            want.append(loss.detach())
        opt.step()
        opt.zero_grad()
    got_model, got, _, _, _, direct = train(model, tokens, "cpu_homes", {}, tmp_path, dtype=torch.float32)
    assert direct >= 2 * L  # each step's first copy of every block (layer 0's, non-block: device-accumulated)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for (n, p), q in zip(got_model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_device_conversions_leave_the_host_lane_without_casts(reference, tmp_path):
    model, tokens = reference
    _, _, _, host_tags, _, _ = train(model, tokens, "megatrain_K2", {}, tmp_path, steps=1)
    _, _, _, dev_tags, _, _ = train(model, tokens, "megatrain_K2", PLACEMENTS["both"], tmp_path, steps=1)
    assert host_tags[0][("host", "cast")] > 0
    assert dev_tags[0][("host", "cast")] == 0  # every cast ran on the device side of the H2D


# ---- the plan's side (planner/placement.py, Note: [conversion placement]) ----------------------------

def _analytic(hw_name: str = "h800", **hw_changes):
    from lightning_lazytrain.config import load_hardware, load_model
    from lightning_lazytrain.planner import TrainSpec, Workload

    hw = load_hardware(hw_name)
    hw = hw.replace(**hw_changes) if hw_changes else hw
    wl = Workload.analytic(load_model("qwen2.5-3b"), TrainSpec(micro_batch_size=4, seq_len=1024), hw)
    return wl, hw


def test_pricing_moves_the_conversions_work_between_the_host_lane_and_the_links():
    from lightning_lazytrain.planner.placement import CONVERSION_BUFFER_ELEMENTS, Placement, price

    wl, hw = _analytic()
    assert wl.compute_bytes == 2 and wl.device_conversions == ()
    dev = price(wl, Placement(cast_blocks=True, widen_blocks=True, cast_rest=True, widen_rest=True), hw)
    a, b = wl.layers[1], dev.layers[1]
    assert b.param_bytes == a.param_bytes and b.param_widen == 2.0  # fp32 over the link, bf16 on the device
    assert b.cast_seconds == 0 < a.cast_seconds
    assert b.grad_widen == 2.0 and b.accum_seconds < a.accum_seconds  # a step's copy lands: the norm only
    assert b.accum_seconds == pytest.approx(b.params * 4 / hw.host_bytes_per_s)
    assert dev.nonblock_param_widen == 2.0 and dev.nonblock_cast_seconds == 0
    assert dev.conversion_gpu_bytes == 2 * 4 * CONVERSION_BUFFER_ELEMENTS  # one buffer per lane
    assert dev.static_gpu_bytes == wl.static_gpu_bytes + dev.conversion_gpu_bytes
    assert price(dev, Placement(), hw).layers[1] == a  # and back, exactly
    # the norms at their own rate (Hardware.host_norm_bytes_per_s: torch's serial CPU 2-norm per tensor)
    slow_norms = hw.replace(host_norm_bytes_per_s=hw.host_bytes_per_s / 4)
    landed = price(wl, Placement(widen_blocks=True), slow_norms).layers[1]
    assert landed.accum_seconds == pytest.approx(landed.params * 4 / slow_norms.host_norm_bytes_per_s)
    on_host = price(price(wl, Placement(widen_blocks=True), hw), Placement(), slow_norms).layers[1]
    assert on_host.accum_seconds == pytest.approx(a.accum_seconds + a.params * 4 * 3 / hw.host_bytes_per_s)


def test_with_accumulation_the_norms_are_priced_once_per_step():
    """The executor takes a group's norms at a step's last gradient copy only: per copy, the host lane's
    norm seconds are 1/n of a step's (n copies per step), on the host path and where the device widens;
    the non-block gradients, accumulated on the device, cross once per step and keep the whole norm."""
    from lightning_lazytrain.config import load_hardware, load_model
    from lightning_lazytrain.planner import TrainSpec, Workload
    from lightning_lazytrain.planner.placement import Placement, price

    hw = load_hardware("h800")
    hw = hw.replace(host_norm_bytes_per_s=hw.host_bytes_per_s / 4)  # norms slower than the adds: visible
    model = load_model("qwen2.5-3b")
    one, four = (Workload.analytic(model, TrainSpec(micro_batch_size=4, seq_len=1024, grad_accum=g), hw) for g in (1, 4))
    params = one.layers[1].params
    norm = params * 4 / hw.host_norm_bytes_per_s
    assert one.layers[1].accum_seconds - four.layers[1].accum_seconds == pytest.approx(norm * 3 / 4)
    assert one.nonblock_accum_seconds == four.nonblock_accum_seconds
    dev = price(four, Placement(widen_blocks=True), hw).layers[1]
    same = hw.host_add_bytes_per_s or hw.host_bytes_per_s
    assert dev.accum_seconds == pytest.approx(params * (3 * 12 / 4 / same) + norm / 4)
    assert price(price(four, Placement(widen_blocks=True), hw), Placement(), hw).layers[1] == four.layers[1]


@pytest.mark.slow
def test_the_plan_puts_the_conversions_where_they_are_fastest():
    from lightning_lazytrain.planner import MilpOptions, simulate
    from lightning_lazytrain.planner.plan import plan_workload

    # a slow host lane beside a fast link: the device converts; a slow link beside a fast host: the host
    slow_host, hw1 = _analytic(h2d_bytes_per_s=55e9, d2h_bytes_per_s=55e9, host_bytes_per_s=5e9)
    slow_link, hw2 = _analytic(h2d_bytes_per_s=4e9, d2h_bytes_per_s=4e9, host_bytes_per_s=100e9)
    fast = plan_workload(slow_host, hw1)
    assert {"cast_blocks", "widen_blocks"} <= set(fast.placement.names)
    assert plan_workload(slow_link, hw2).placement.names == ()
    host_only = plan_workload(slow_host, hw1, options=MilpOptions(conversions="host"))
    assert host_only.placement.names == ()
    assert fast.sim.iteration_seconds < host_only.sim.iteration_seconds
    # the plan's figures are its priced workload's, and the MILP times it as the simulator does
    again = simulate(fast.schedule, fast.workload, hw1)
    assert again.iteration_seconds == pytest.approx(fast.sim.iteration_seconds, rel=1e-9)
    assert fast.solver["objective"] == pytest.approx(fast.sim.iteration_seconds, rel=0.01)


def test_the_profiled_host_lane_calibrates_the_rates():
    """Note: [host rates in place]: a profile whose host lane ran k times slower than the rates say
    scales the rates by 1/k; priced from them, the profiled schedule's host seconds are the measured."""
    from dataclasses import replace

    from lightning_lazytrain.planner import megatrain, simulate
    from lightning_lazytrain.planner.placement import Placement, calibrate_host_rates, priced_from_rates

    wl, hw = _analytic()
    k, k_acc = 2.5, 4.0  # the casts ran 2.5x, the gradient adds 4x slower than the rates say
    measured = replace(wl, layers=tuple(replace(x, cast_seconds=k * x.cast_seconds,
                                                accum_seconds=k_acc * x.accum_seconds) for x in wl.layers),
                       nonblock_cast_seconds=k * wl.nonblock_cast_seconds,
                       nonblock_accum_seconds=k_acc * wl.nonblock_accum_seconds)
    s = megatrain(wl.num_layers, 4)
    cal = calibrate_host_rates(measured, s, hw)
    assert cal.host_bytes_per_s == pytest.approx(hw.host_bytes_per_s / k)
    assert cal.host_widen_bytes_per_s == pytest.approx((hw.host_widen_bytes_per_s or hw.host_bytes_per_s) / k_acc)
    assert cal.host_add_bytes_per_s == pytest.approx((hw.host_add_bytes_per_s or hw.host_bytes_per_s) / k_acc)
    assert cal.host_norm_bytes_per_s == pytest.approx(cal.host_add_bytes_per_s)  # unset: the adds' rate

    def host(w, h, kind):
        return sum(x.end - x.start for x in simulate(s, w, h, check=False).timeline
                   if x.lane == "host" and x.kind == kind)

    for kind in ("cast", "accumulate"):
        assert host(priced_from_rates(measured, Placement(), cal), cal, kind) == pytest.approx(
            host(measured, hw, kind), rel=1e-6)


def test_every_host_lane_job_carries_the_fixed_cost_once():
    """Hardware.host_job_seconds: a fetch's cast and a gradient copy's accumulation are one job each
    (the non-block group: one per part), each its bytes at its rate plus the fixed cost; the analytic
    workload and the placement's pricing agree, and a job moved to the device takes its cost along."""
    from dataclasses import replace

    from lightning_lazytrain.planner.placement import Placement, price

    f = 7e-4
    wl, hw = _analytic()
    wlf, hwf = _analytic(host_job_seconds=f)
    a, b = wl.layers[1], wlf.layers[1]
    assert b.cast_seconds == pytest.approx(a.cast_seconds + f) and b.accum_seconds == pytest.approx(a.accum_seconds + f)
    assert wlf.nonblock_cast_seconds == pytest.approx(wl.nonblock_cast_seconds + f)
    assert wlf.nonblock_accum_seconds == pytest.approx(wl.nonblock_accum_seconds + f)
    both = Placement(cast_blocks=True, widen_blocks=True, cast_rest=True, widen_rest=True)
    dev, devf = price(wl, both, hw), price(wlf, both, hwf)
    assert devf.layers[1].cast_seconds == 0 == devf.nonblock_cast_seconds  # no job left on the host
    assert devf.layers[1].accum_seconds == pytest.approx(dev.layers[1].accum_seconds + f)  # the norms: still a job
    assert price(devf, Placement(), hwf).layers[1] == wlf.layers[1]  # and back, exactly
    # the non-block group in three parts: three jobs per copy
    parts = replace(wlf, nonblock_parts=(wlf.nonblock_params - 2000, 1000, 1000)).validate()
    p3 = price(parts, both, hwf)
    assert p3.nonblock_accum_seconds == pytest.approx(dev.nonblock_accum_seconds + 3 * f)
    assert price(p3, Placement(), hwf).nonblock_cast_seconds == pytest.approx(wl.nonblock_cast_seconds + 3 * f)


def test_the_calibration_keeps_the_fixed_cost_and_scales_the_bytes():
    """Note: [host rates in place] with a fixed cost per job: a profile whose jobs took f + k x their
    bytes' time is reproduced by the calibrated rates (scaled by 1/k, f kept), and the placement whose
    host jobs are smallest (the norms alone) is then priced as such a lane runs it -- which a per-byte
    calibration (f = 0) under-prices: it spreads the profile's fixed costs over the bytes of big jobs."""

    from lightning_lazytrain.planner import keep_all, megatrain, simulate
    from lightning_lazytrain.planner.placement import Placement, calibrate_host_rates, priced_from_rates

    wl, hw = _analytic()
    k, f = 3.0, 0.02  # the lane ran its bytes 3x slower than the rates say, plus 20 ms a job
    truth = hw.replace(host_bytes_per_s=hw.host_bytes_per_s / k, host_job_seconds=f)  # the lane as it ran
    measured = priced_from_rates(wl, Placement(), truth)  # the profile: every conversion on the host
    both = Placement(cast_blocks=True, widen_blocks=True, cast_rest=True, widen_rest=True)

    def host(w, h, s):
        return sum(x.end - x.start for x in simulate(s, w, h, check=False).timeline if x.lane == "host")

    for s in (keep_all(wl.num_layers), megatrain(wl.num_layers, 4)):
        cal = calibrate_host_rates(measured, s, hw.replace(host_job_seconds=f))
        assert cal.host_job_seconds == f
        assert cal.host_bytes_per_s == pytest.approx(hw.host_bytes_per_s / k)
        assert cal.host_norm_bytes_per_s == pytest.approx(hw.host_bytes_per_s / k)
        for p in (Placement(), both, Placement(widen_blocks=True, widen_rest=True)):
            assert host(priced_from_rates(measured, p, cal), cal, s) == pytest.approx(
                host(priced_from_rates(measured, p, truth), truth, s), rel=1e-6)
        per_byte = calibrate_host_rates(measured, s, hw)  # no fixed cost: the profile's is spread over bytes
        assert per_byte.host_job_seconds == 0
        assert host(priced_from_rates(measured, Placement(), per_byte), per_byte, s) == pytest.approx(
            host(measured, hw, s), rel=1e-6)  # it still reproduces the profile itself ...
        small_truth = host(priced_from_rates(measured, both, truth), truth, s)
        assert host(priced_from_rates(measured, both, per_byte), per_byte, s) < 0.9 * small_truth  # ... not the rest


def test_the_fixed_cost_cannot_exceed_what_the_profiled_jobs_took():
    """A fixed cost above what a kind's jobs took in the profile is cut to ``JOB_SHARE_MAX`` of the
    shortest kind's seconds per job; the profile is still reproduced, every rate stays positive."""
    from lightning_lazytrain.planner import keep_all, simulate
    from lightning_lazytrain.planner.placement import JOB_SHARE_MAX, Placement, calibrate_host_rates, priced_from_rates

    wl, hw = _analytic()
    s = keep_all(wl.num_layers)

    def per_kind(w, h):
        out: dict[str, list[float]] = {}
        for x in simulate(s, w, h, check=False).timeline:
            if x.lane == "host":
                out.setdefault(x.kind, []).append(x.end - x.start)
        return out

    profile = per_kind(wl, hw)
    cal = calibrate_host_rates(wl, s, hw.replace(host_job_seconds=10.0))  # far above any job's seconds
    assert cal.host_job_seconds == pytest.approx(JOB_SHARE_MAX * min(sum(v) / len(v) for v in profile.values()))
    assert cal.host_bytes_per_s > 0 and cal.host_norm_bytes_per_s > 0
    again = per_kind(priced_from_rates(wl, Placement(), cal), cal)
    for kind, seconds in profile.items():
        assert sum(again[kind]) == pytest.approx(sum(seconds), rel=1e-6)


def test_host_job_seconds_validates_and_converts():
    from lightning_lazytrain.planner import Hardware
    from lightning_lazytrain.planner.errors import InvalidInput

    _, hw = _analytic()
    assert hw.host_job_seconds == 0.0  # unset: per-byte pricing, every existing plan unchanged
    assert hw.replace(host_job_seconds=1e-3).host_job_seconds == 1e-3
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(InvalidInput, match="host_job_seconds"):
            hw.replace(host_job_seconds=bad)
    kw = dict(name="x", gpu_memory_gb=80, gpu_memory_cap_gb=70, peak_tflops=900, efficiency=0.5, h2d_gb_per_s=20,
              d2h_gb_per_s=20, nvme_read_gb_per_s=0, nvme_write_gb_per_s=0, nvme_capacity_gb=0, cpu_memory_gb=500,
              cpu_adam_gparams_per_s=1, cpu_adam8_gparams_per_s=1)
    assert Hardware.from_gb(**kw, host_job_seconds=5e-4).host_job_seconds == 5e-4  # seconds stay seconds
    assert Hardware.from_gb(**kw).host_job_seconds == 0.0


def test_several_profiled_steps_calibrate_as_their_median_step():
    """``median_host_seconds``: steps whose host lanes ran 1x, 1.2x, 0.9x, 1.1x and, once, 3x (an
    outlier: the lane's jobs waited) calibrate as the median step (1.1x), not as the outlier, nor as
    the sum of per-layer medians; the other figures are the first step's."""
    from dataclasses import replace

    from lightning_lazytrain.planner import megatrain, simulate
    from lightning_lazytrain.planner.placement import calibrate_host_rates, median_host_seconds

    wl, hw = _analytic()

    def scaled(k_cast: float, k_acc: float):
        return replace(wl, layers=tuple(replace(x, cast_seconds=k_cast * x.cast_seconds,
                                                accum_seconds=k_acc * x.accum_seconds) for x in wl.layers),
                       nonblock_cast_seconds=k_cast * wl.nonblock_cast_seconds,
                       nonblock_accum_seconds=k_acc * wl.nonblock_accum_seconds)

    steps = [scaled(1.0, 2.0), scaled(1.2, 2.4), scaled(0.9, 1.8), scaled(1.1, 2.2), scaled(3.0, 6.0)]
    merged = median_host_seconds(steps)
    assert merged.layers[0].cast_seconds == pytest.approx(1.1 * wl.layers[0].cast_seconds)
    assert merged.nonblock_accum_seconds == pytest.approx(2.2 * wl.nonblock_accum_seconds)
    assert merged.layers[3].params == wl.layers[3].params and merged.layers[3].fwd_seconds == wl.layers[3].fwd_seconds
    s = megatrain(wl.num_layers, 4)
    cal, typical = calibrate_host_rates(merged, s, hw), calibrate_host_rates(steps[3], s, hw)
    assert cal.host_bytes_per_s == pytest.approx(typical.host_bytes_per_s)
    assert cal.host_widen_bytes_per_s == pytest.approx(typical.host_widen_bytes_per_s)

    def host(w):
        return sum(x.end - x.start for x in simulate(s, w, hw, check=False).timeline if x.lane == "host")

    assert host(merged) == pytest.approx(host(steps[3]), rel=1e-6)
    # one layer's jobs slow in one step, another's in another: the step totals' median (1.0x), not
    # the layers' medians, which would miss every slow job
    a = replace(wl, layers=(replace(wl.layers[0], cast_seconds=4 * wl.layers[0].cast_seconds), *wl.layers[1:]))
    b = replace(wl, layers=(wl.layers[0], replace(wl.layers[1], cast_seconds=4 * wl.layers[1].cast_seconds),
                            *wl.layers[2:]))
    c = replace(wl, layers=(*wl.layers[:2], replace(wl.layers[2], cast_seconds=4 * wl.layers[2].cast_seconds),
                            *wl.layers[3:]))
    total = sum(x.cast_seconds for x in a.layers) + a.nonblock_cast_seconds
    merged = median_host_seconds([a, b, c])
    assert sum(x.cast_seconds for x in merged.layers) + merged.nonblock_cast_seconds == pytest.approx(total)
    assert median_host_seconds([wl]) == wl
    with pytest.raises(ValueError, match="at least one"):
        median_host_seconds([])


def test_the_fixed_cost_per_job_is_the_mean_of_the_probe_jobs(monkeypatch):
    """``autoplan.host_job_seconds``: the probe's jobs add up in a step, so their mean (less their
    bytes at the norm rate), not their median: bimodal durations (beside compute / after it) put a
    median anywhere between the modes."""
    from lightning_lazytrain.core import autoplan
    from lightning_lazytrain.engine.copy_engine import CopyEngine, CopyRecord

    # per step: six jobs of 1 ms beside compute, three of 0.1 ms after it (median 1 ms, mean 0.7 ms), 1 MB each
    fake = [CopyRecord("host", 10**6, 0.0, d, tag="accum:0") for d in [1e-3] * 6 + [1e-4] * 3]
    monkeypatch.setattr(CopyEngine, "records", lambda self: list(fake))
    monkeypatch.setattr(autoplan, "_HOST_JOB", {})
    monkeypatch.setattr(autoplan, "host_rates", lambda device: (1e10, 1e10, 1e10, 1e10, 1e9))  # 0.1 ms per MB
    assert autoplan.host_job_seconds(torch.device("cpu"), steps=2) == pytest.approx(0.7e-3 - 1e-4)
