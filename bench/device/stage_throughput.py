"""Stage (e): throughput and memory of a ~1B-parameter LlamaLM: MILP plan vs megatrain vs plain.

CUDA (bf16 compute, batch 8 x 1024): a ``LlamaLM`` built from a planner ``ModelSpec`` (20 layers,
hidden 2048, GQA 16/4, SwiGLU 5632, vocab 32000: 1.03B parameters). The workload is measured on
the device (``measure_workload``, optimizer time left out: the kit times forward + backward + the
gradient write-back, not the host optimizer), the link speeds by ``autoplan.measure_hardware``.
The cap is set 40% of the way from the smallest to the keep-all footprint, so the MILP plan must
offload or recompute. Then, one after the other:

* ``milp``: the plan solved at that cap, the dtype conversions placed by the plan (planner/placement.py:
  the masters cast and the gradients widened on the host or on the device, priced from the host lane's
  rates as the profiled step ran it, ``placement.calibrate_host_rates``);
* ``milp_host_conversions``: the plan with every conversion on the host (the engine before the placement);
* ``megatrain``: MegaTrain's policy (K=4) on the same executor, conversions on the host;
* ``plain``: the model in bf16 on the GPU with plain autograd (everything resident).

Each runs one warm-up step and ``--repeats`` timed steps (median reported): tokens/s, measured vs
predicted step seconds, busy seconds per lane (measured in the last step and predicted; ``host``:
the host lane's casts and gradient accumulation), ``max_memory_allocated``/``max_memory_reserved`` against the predicted
peak and the cap, the executor's tracked peak, and ``num_alloc_retries`` during the timed steps.
Then (MILP variants): one more step under the allocator's history recording: what is alive at the
step's peak, by allocation site (``memory_at_peak``, lightning_lazytrain/engine/alloc_trace.py; CUDA only). Then:

* achieved GB/s per lane (executor variants): the bytes the lane moved in the last timed step
  (``StepStats.lane_bytes``) over its busy seconds, the union of that lane's measured
  ``StepStats.segments`` (CUDA: event-timed copies; host lane: casts and accumulation), next to
  the rate the plan assumed (the predicted timeline's bytes over its busy seconds);
* GPU busy fraction (CUDA only): one more step under ``torch.profiler`` (CUDA activity);
  the union of the GPU kernels' intervals (memcpy/memset excluded, overlapping kernels counted
  once) over that step's wall time (``gpu_busy_fraction``), and over the median unprofiled step
  (``gpu_busy_fraction_of_median_step``: the profiler's own overhead left out); the copies'
  union is reported beside it. On the CPU the profiled step runs (the code path is rehearsed)
  and the figure is recorded as skipped with the reason.

Hard failures: the MILP plan's ``max_memory_allocated`` above the cap; an executor's tracked peak
above the predicted peak (the engine's own invariant). Speed, the allocator's retries and
predicted-vs-measured are reported only.

CPU rehearsal: the 4-layer tiny model in fp32, batch 2 x 32, no warm-up, one step per variant
(+ the profiled one); figures recorded (no allocator figures, no GPU busy fraction on the CPU).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time

import torch

from kit import GB, Stage, footprint_range, stage_main, tiny_spec
from lightning_lazytrain.engine.alloc_trace import record_peak
from lightning_lazytrain.planner import MilpOptions, ModelSpec, megatrain, min_memory, simulate
from lightning_lazytrain.planner.placement import HOST_ONLY, calibrate_host_rates, price
from lightning_lazytrain.planner.plan import plan_workload

ONE_B = ModelSpec(name="kit-1b", num_layers=20, hidden=2048, intermediate=5632, heads=16, kv_heads=4, head_dim=128,
                  vocab=32000)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=int, default=None, help="timed steps (default: 3 on CUDA, 1 on the CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="default: 1 on CUDA, 0 on the CPU")
    ap.add_argument("--cap-frac", type=float, default=0.4)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _retries() -> int:
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def time_steps(dev: str, step, warmup: int, repeats: int, between=None) -> dict:
    """Run ``warmup`` + ``repeats`` steps, timing the latter; ``between()`` runs untimed after each."""
    for _ in range(warmup):
        step()
        if between is not None:
            between()
    _sync(dev)
    out: dict = {}
    if dev == "cuda":  # the peaks over the timed steps, across the executor's per-step resets
        from lightning_lazytrain.engine.live_bytes import reset_cuda_peak

        reset_cuda_peak(torch.device("cuda", torch.cuda.current_device()), forget=True)
        retries0 = _retries()
    times = []
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
        if between is not None:
            between()
    out["step_seconds"] = times
    out["median_step_seconds"] = statistics.median(times)
    if dev == "cuda":
        from lightning_lazytrain.engine.live_bytes import max_memory_allocated, max_memory_reserved

        out["max_memory_allocated_gb"] = max_memory_allocated() / GB
        out["max_memory_reserved_gb"] = max_memory_reserved() / GB
        out["num_alloc_retries"] = _retries() - retries0
    return out


def interval_union(intervals) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for a, b in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def lane_rates(segments, lane_bytes: dict | None = None) -> dict[str, dict]:
    """Achieved rate per lane that moved bytes: ``lane_bytes[lane]`` (else the segments' bytes)
    over the union of the lane's segment intervals (seconds)."""
    spans: dict[str, list] = {}
    seg_bytes: dict[str, float] = {}
    for seg in segments:
        spans.setdefault(seg.lane, []).append((seg.start, seg.end))
        seg_bytes[seg.lane] = seg_bytes.get(seg.lane, 0.0) + float(getattr(seg, "bytes", 0.0) or 0.0)
    out = {}
    for lane in sorted(set(spans) | set(lane_bytes or {})):
        nbytes = float((lane_bytes or {}).get(lane) or seg_bytes.get(lane, 0.0))
        busy = interval_union(spans.get(lane, []))
        if nbytes <= 0:
            continue
        out[lane] = {"bytes": int(nbytes), "busy_seconds": round(busy, 6),
                     "gb_per_s": round(nbytes / busy / GB, 4) if busy > 0 else None}
    return out


def _is_copy(name: str) -> bool:
    return name.lower().startswith(("memcpy", "memset"))


def gpu_busy_from_events(events, wall_s: float) -> dict:
    """GPU busy figures from profiler events: ``events`` are ``(name, is_device, start_us, end_us)``;
    kernels are the device events that are not memcpy/memset."""
    kernels = [(a, b) for name, dev, a, b in events if dev and not _is_copy(name)]
    copies = [(a, b) for name, dev, a, b in events if dev and _is_copy(name)]
    busy = interval_union(kernels) / 1e6
    return {"kernels": len(kernels), "kernel_seconds": round(busy, 6),
            "kernel_seconds_summed": round(sum(b - a for a, b in kernels) / 1e6, 6),
            "copy_seconds": round(interval_union(copies) / 1e6, 6), "profiled_step_seconds": round(wall_s, 6),
            "gpu_busy_fraction": busy / wall_s if wall_s > 0 else None}


def profile_step(dev: str, step, between=None) -> dict:
    """One more step under ``torch.profiler`` (CUDA: GPU kernels' busy fraction; CPU: rehearsed,
    recorded as skipped)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # CUDA: device activity only (the kernels' intervals; no host-side op records to slow the step)
    activities = [ProfilerActivity.CUDA] if dev == "cuda" else [ProfilerActivity.CPU]
    _sync(dev)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        _sync(dev)
        wall = time.perf_counter() - t0
    if between is not None:
        between()
    t0 = time.perf_counter()
    device_types = {DeviceType.CUDA, getattr(DeviceType, "PrivateUse1", DeviceType.CUDA)}
    events = [(e.name, e.device_type in device_types, e.time_range.start, e.time_range.end) for e in prof.events()]
    out = gpu_busy_from_events(events, wall)
    out["events"] = len(events)
    out["parse_seconds"] = round(time.perf_counter() - t0, 3)
    if dev != "cuda":
        out.update(status="skipped", reason="CUDA only: the CPU rehearsal has no GPU kernels (the profiled step ran)",
                   gpu_busy_fraction=None)
    else:
        out["status"] = "measured"
    return out


def body(st: Stage, args: argparse.Namespace) -> None:
    from lightning_lazytrain.core.autoplan import measure_hardware
    from lightning_lazytrain.engine.executor import Executor
    from lightning_lazytrain.engine.profiler import measure_workload
    from lightning_lazytrain.models import LlamaLM

    from lightning_lazytrain.core.allocator import MemoryWatch, configure_allocator

    dev = args.device
    cuda = dev == "cuda"
    # expandable segments, and the allocator's reserve in the plan's cap (lightning_lazytrain/core/allocator.py)
    watch = MemoryWatch.for_device(torch.device(dev), configure_allocator(torch.device(dev)))
    spec = ONE_B if cuda else tiny_spec()
    batch = args.batch or (8 if cuda else 2)
    seq = args.seq or (1024 if cuda else 32)
    warmup = args.warmup if args.warmup is not None else (1 if cuda else 0)
    repeats = args.repeats if args.repeats is not None else (3 if cuda else 1)
    dtype = torch.bfloat16 if cuda else torch.float32
    ntok = batch * seq
    t0 = time.perf_counter()
    torch.manual_seed(0)
    if cuda:  # initialise on the GPU (seconds instead of a minute on the host), keep the master on the host
        with torch.device("cuda"):
            model = LlamaLM(spec)
        model = model.cpu()
        torch.cuda.empty_cache()
    else:
        model = LlamaLM(spec)
    nparams = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, spec.vocab, (batch, seq + 1), device=dev)
    st.figures.update({"model": spec.name, "parameters": nparams, "batch": [batch, seq], "dtype": str(dtype),
                       "build_seconds": round(time.perf_counter() - t0, 2), "warmup": warmup, "repeats": repeats})
    print(f"{spec.name}: {nparams / 1e9:.3f}B parameters, batch {batch} x {seq}, {dtype}", flush=True)

    # Workload measured on this device (optimizer time excluded: not timed here).
    t0 = time.perf_counter()
    m = copy.deepcopy(model)
    ex = Executor(m, min_memory(spec.num_layers), device=dev, compute_dtype=dtype, nvme_dir=args.workdir)
    try:
        wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=ntok, warmup=1, opt_params_per_s=1e18)
    finally:
        ex.close()
    m = ex = None  # free the profile's copy before the timed variants
    gc.collect()
    hw = measure_hardware(torch.device(dev), opt_params_per_s=1e18)
    # the host lane's rates as the profiled step ran it (planner/placement.py, Note: [host rates in place])
    hw = calibrate_host_rates(wl, min_memory(spec.num_layers), hw)
    lo, hi = footprint_range(wl, hw.replace(gpu_memory_cap_bytes=hw.gpu_memory_bytes))
    # the cap must force the plan to move and to recompute activations (the setup that shows the plan at work): halve the
    # fraction until the MILP plan does both (at most 3 times), and say so if it never does
    frac = args.cap_frac
    for _ in range(4):
        used, cap = frac, lo + frac * (hi - lo)
        # the cap bounds what the allocator reserves: the plan's allocated peak gets cap / reserve ratio
        sol = plan_workload(wl, hw.replace(gpu_memory_cap_bytes=watch.cap(cap)))  # conversions placed by the plan
        moved = sum(h in ("cpu", "nvme") for h in sol.schedule.homes)
        recomputed = sum(h == "recompute" for h in sol.schedule.homes) + sum(
            not k for k in sol.schedule.keep_internals)
        if moved and recomputed:
            break
        frac /= 2
    hw = hw.replace(gpu_memory_cap_bytes=cap)
    st.figures["reserve_ratio"] = watch.ratio
    st.figures["forced"] = {"cap_frac": used, "forced": bool(moved and recomputed), "boundaries_moved": moved,
                            "recomputed": recomputed}
    if not (moved and recomputed):
        st.note(f"no cap tried (down to {used:.3f} of the footprint range) made the MILP plan both move and "
                f"recompute activations (moved {moved}, recomputed {recomputed}): the comparison is weaker")
    st.figures.update({"profile_and_solve_seconds": round(time.perf_counter() - t0, 2),
                       "h2d_gb_per_s": hw.h2d_bytes_per_s / GB, "d2h_gb_per_s": hw.d2h_bytes_per_s / GB,
                       "footprint_min_gb": lo / GB, "footprint_keep_all_gb": hi / GB, "cap_gb": cap / GB,
                       "milp": {"status": sol.status, "homes": list(sol.schedule.homes),
                                "keep_internals": list(sol.schedule.keep_internals),
                                "resident_weights": list(sol.schedule.resident_weights),
                                "conversions_on_device": list(sol.placement.names)},
                       "host_gb_per_s": hw.host_bytes_per_s / GB,
                       "host_widen_gb_per_s": (hw.host_widen_bytes_per_s or hw.host_bytes_per_s) / GB})
    print(f"cap {cap / GB:.4g} GB (smallest {lo / GB:.4g}, keep-all {hi / GB:.4g}); MILP {sol.status}: "
          f"homes {''.join(h[0] for h in sol.schedule.homes)}; conversions: {sol.placement.label()}", flush=True)
    # the plan with every conversion on the host (the engine before it could place them), for comparison
    host = plan_workload(wl, hw.replace(gpu_memory_cap_bytes=watch.cap(cap)), options=MilpOptions(conversions="host"))

    variants: dict[str, dict] = {}
    for name, plan in (("milp", sol), ("milp_host_conversions", host), ("megatrain", None)):
        schedule = plan.schedule if plan is not None else megatrain(spec.num_layers, 4)
        placement = plan.placement if plan is not None else HOST_ONLY
        pred = simulate(schedule, price(wl, placement, hw), hw.replace(gpu_memory_cap_bytes=hw.gpu_memory_bytes))
        # device bytes alive before this variant's executor exists (the tokens, anything an earlier variant
        # left): part of max_memory_allocated, none of the executor's
        allocated_before = torch.cuda.memory_allocated() / GB if cuda else None
        m = copy.deepcopy(model)
        ex = Executor(m, schedule, device=dev, compute_dtype=dtype, nvme_dir=args.workdir)
        ex.set_placement(**placement.groups(spec.num_layers))
        peaks, last = [], {}

        def step(ex=ex, m=m, peaks=peaks, last=last):
            ex.begin_microbatch()
            m.loss(tokens).backward()
            stats = ex.end_microbatch()
            peaks.append(stats.peak_tracked_bytes)
            last["segments"] = list(stats.segments)
            last["lane_bytes"] = dict(stats.lane_bytes)

        def drop_grads(ex=ex, m=m):
            # as a training loop's ``optimizer.zero_grad()`` (set_to_none): a step's first gradient copy
            # of a group then lands in the host gradient itself (Note: [direct landing]), as priced
            ex.params.wait_host()
            for p in m.parameters():
                p.grad = None

        try:
            r = time_steps(dev, step, warmup, repeats, between=drop_grads)
            r["allocated_before_gb"] = allocated_before
            timed = dict(last)  # the last timed step (the profiled one below is not timed)
            r["gpu_busy"] = profile_step(dev, step, between=drop_grads)
            if name != "megatrain":  # what the allocator holds at the peak, by site (engine/alloc_trace.py)
                r["memory_at_peak"] = record_peak(dev, step)
                drop_grads()
        finally:
            ex.close()
        m = ex = step = None  # drop this variant's host copy before the next one
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        r.update({"tokens_per_s": ntok / r["median_step_seconds"], "predicted_step_seconds": pred.iteration_seconds,
                  "measured_over_predicted": r["median_step_seconds"] / pred.iteration_seconds,
                  "predicted_peak_gb": pred.peak_gpu_bytes / GB, "tracked_peak_gb": max(peaks) / GB,
                  "homes": "".join(h[0] for h in schedule.homes),
                  "conversions_on_device": list(placement.names)})
        # Busy seconds per lane in the last step (the host lane: casts and gradient accumulation off
        # the launching thread), measured and predicted.
        busy: dict[str, float] = {}
        for seg in timed.get("segments", []):
            busy[seg.lane] = busy.get(seg.lane, 0.0) + seg.end - seg.start
        pbusy: dict[str, float] = {}
        for seg in pred.timeline:
            pbusy[seg.lane] = pbusy.get(seg.lane, 0.0) + seg.end - seg.start
        r["lane_busy_seconds"] = {k: round(v, 4) for k, v in sorted(busy.items())}
        r["predicted_lane_busy_seconds"] = {k: round(v, 4) for k, v in sorted(pbusy.items())}
        # Achieved GB/s per lane (bytes / the lane's busy seconds), measured and as planned.
        r["lane_gb_per_s"] = lane_rates(timed.get("segments", []), timed.get("lane_bytes"))
        r["predicted_lane_gb_per_s"] = {k: v["gb_per_s"] for k, v in lane_rates(pred.timeline).items()}
        r["gpu_busy_fraction"] = r["gpu_busy"]["gpu_busy_fraction"]
        if cuda and r["gpu_busy"]["kernel_seconds"]:
            r["gpu_busy_fraction_of_median_step"] = r["gpu_busy"]["kernel_seconds"] / r["median_step_seconds"]
        if not r["lane_gb_per_s"]:
            st.note(f"{name}: no lane moved bytes in the last timed step (no GB/s to report)")
        if cuda:  # what the allocator saw that the executor does not track (logits, a block's transients, ...)
            r["untracked_gb"] = r["max_memory_allocated_gb"] - r["allocated_before_gb"] - max(peaks) / GB
            r["over_cap_gb"] = r["max_memory_allocated_gb"] - cap / GB
        variants[name] = r
        st.check(max(peaks) <= pred.peak_gpu_bytes,
                 f"{name}: tracked peak {max(peaks) / GB:.3f} GB > predicted peak {pred.peak_gpu_bytes / GB:.3f} GB")
        if cuda:  # what the allocator reserves is what runs out of memory (lightning_lazytrain/core/allocator.py)
            r["reserved_over_allocated"] = r["max_memory_reserved_gb"] / max(r["max_memory_allocated_gb"], 1e-9)
        if cuda and name.startswith("milp"):
            st.check(r["max_memory_reserved_gb"] * GB <= cap,
                     f"{name}: max_memory_reserved {r['max_memory_reserved_gb']:.2f} GB > cap {cap / GB:.2f} GB "
                     f"(allocated {r['max_memory_allocated_gb']:.2f} GB, predicted peak {pred.peak_gpu_bytes / GB:.2f} GB)")
        if cuda and r["num_alloc_retries"]:
            st.note(f"{name}: {r['num_alloc_retries']} allocator retries during the timed steps")
        print(f"{name:<10} {r['tokens_per_s']:,.0f} tok/s, step {r['median_step_seconds']:.3f} s "
              f"(predicted {pred.iteration_seconds:.3f}), tracked peak {max(peaks) / GB:.4g} GB "
              f"(predicted {pred.peak_gpu_bytes / GB:.4g})"
              + (f", max allocated {r['max_memory_allocated_gb']:.2f} GB, reserved {r['max_memory_reserved_gb']:.2f} GB"
                 if cuda else "")
              + "; GB/s " + ", ".join(f"{k} {v['gb_per_s']}" for k, v in r["lane_gb_per_s"].items())
              + (f"; GPU busy {r['gpu_busy_fraction']:.1%}" if r["gpu_busy_fraction"] is not None else
                 f"; GPU busy: {r['gpu_busy']['reason']}" if "reason" in r["gpu_busy"] else ""), flush=True)

    # Plain PyTorch: the whole model on the device in the compute dtype, plain autograd.
    plain = copy.deepcopy(model).to(device=dev, dtype=dtype)

    try:
        r = time_steps(dev, lambda: plain.loss(tokens).backward(), warmup, repeats,
                       between=lambda: plain.zero_grad(set_to_none=True))
        r["tokens_per_s"] = ntok / r["median_step_seconds"]
        r["gpu_busy"] = profile_step(dev, lambda: plain.loss(tokens).backward(),
                                     between=lambda: plain.zero_grad(set_to_none=True))
        r["gpu_busy_fraction"] = r["gpu_busy"]["gpu_busy_fraction"]
        if cuda and r["gpu_busy"]["kernel_seconds"]:
            r["gpu_busy_fraction_of_median_step"] = r["gpu_busy"]["kernel_seconds"] / r["median_step_seconds"]
        variants["plain"] = r
        print(f"{'plain':<10} {r['tokens_per_s']:,.0f} tok/s, step {r['median_step_seconds']:.3f} s"
              + (f", max allocated {r['max_memory_allocated_gb']:.2f} GB" if cuda else "")
              + (f"; GPU busy {r['gpu_busy_fraction']:.1%}" if r["gpu_busy_fraction"] is not None else ""),
              flush=True)
    except torch.OutOfMemoryError as e:
        variants["plain"] = {"error": f"out of memory: {e}"[:300]}
        st.note("plain PyTorch does not fit on this device")
    plain = None
    st.figures["variants"] = variants
    if "plain" in variants and "tokens_per_s" in variants["plain"]:
        for name in ("milp", "milp_host_conversions", "megatrain"):
            variants[name]["vs_plain"] = variants[name]["tokens_per_s"] / variants["plain"]["tokens_per_s"]


if __name__ == "__main__":
    raise SystemExit(stage_main("throughput", body, add_args))
