"""Stage (c2): race hunting by delay injection; results must be bitwise equal to undelayed runs.

A missing wait between a copy and the compute that uses (or overwrites) its buffer shows up as
different numbers once one side is made late. Each schedule of the equivalence stage is trained
(2 steps x 2 micro-batches, fp32) without delays twice (the runs must agree bitwise, or the
comparison means nothing), then under each delay pattern (see ``kit.Delays``):

* ``copies``: every copy late by ``--delay-ms`` (CUDA: ``torch.cuda._sleep`` on the copy stream
  before the copy; host lanes: a sleep in the lane's worker);
* ``compute``: compute late by ``--delay-ms`` at every ``ParamStore.bind``;
* ``jitter0``, ``jitter1``: both, each delay drawn from [0, 2 x delay] with seeds 0 and 1.

The first schedule also runs with bf16 compute copies of the fp32 masters (``<name>@bf16``): its
casts run on the host lane and each H2D waits for its cast (CUDA: dispatched when the cast is
done), so the host lane's dependencies are raced too (``copies`` delays every host-lane job).

Every loss, gradient and parameter must be bitwise equal to the undelayed run. On CUDA the runs
use deterministic algorithms and the math attention kernel, so equal inputs give equal bits.
On the CPU the same runs use host sleeps: the CPU engine's copies run on worker threads, so the
interleavings are real there too.
"""

from __future__ import annotations

import argparse
import time

import torch

from kit import (
    Delays,
    Stage,
    compare,
    cuda_cycles_per_s,
    deterministic_cuda,
    fixed_schedules,
    make_batches,
    measure,
    milp_schedule,
    run_executor,
    stage_main,
    strict_fp32,
    tiny_model,
    tiny_spec,
)

PATTERNS = {
    "copies": dict(copy=True, compute=False, jitter=False, seed=0),
    "compute": dict(copy=False, compute=True, jitter=False, seed=0),
    "jitter0": dict(copy=True, compute=True, jitter=True, seed=0),
    "jitter1": dict(copy=True, compute=True, jitter=True, seed=1),
}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--delay-ms", type=float, default=None, help="default: 1 ms on CUDA, 2 ms on the CPU")
    ap.add_argument("--schedules", default="", help="comma-separated subset (default: all + milp)")
    ap.add_argument("--patterns", default=",".join(PATTERNS))


def body(st: Stage, args: argparse.Namespace) -> None:
    dev = args.device
    strict_fp32()
    cycles = None
    if dev == "cuda":
        deterministic_cuda()
        cycles = cuda_cycles_per_s()
        st.figures["sleep_cycles_per_s"] = cycles
    delay_s = (args.delay_ms if args.delay_ms is not None else (1.0 if dev == "cuda" else 2.0)) / 1e3
    st.figures["delay_ms"] = delay_s * 1e3
    model = tiny_model()
    batches = make_batches(tiny_spec(), 2, 2)
    schedules = fixed_schedules()
    wanted = [s for s in args.schedules.split(",") if s]
    if not wanted or "milp" in wanted:
        schedules["milp"] = milp_schedule(measure(model, batches[0][0].to(dev), dev, args.workdir), st)
    if wanted:
        schedules = {k: v for k, v in schedules.items() if k in wanted}
    runs = [(name, schedule, torch.float32) for name, schedule in schedules.items()]
    if runs:
        runs.append((f"{runs[0][0]}@bf16", runs[0][1], torch.bfloat16))
    patterns = [p for p in args.patterns.split(",") if p]
    results: dict[str, dict] = {}
    for name, schedule, dtype in runs:
        row: dict[str, object] = {}
        results[name] = row
        run = lambda: run_executor(model, schedule, batches, dev, args.workdir, compute_dtype=dtype)  # noqa: E731
        try:
            base = run()
            again = run()
        except Exception as e:  # noqa: BLE001
            st.fail(f"{name} undelayed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        _, problems = compare(again, base, exact=True, tol=0)
        row["undelayed_repeatable"] = not problems
        if not st.check(not problems, f"{name}: two undelayed runs differ ({problems[:1]}): nondeterminism "
                                      "(a race, or a nondeterministic kernel)"):
            continue
        for pat in patterns:
            p = PATTERNS[pat]
            d = Delays(dev, copy_s=delay_s if p["copy"] else 0.0, compute_s=delay_s if p["compute"] else 0.0,
                       jitter=p["jitter"], seed=p["seed"], cycles_per_s=cycles)
            t0 = time.perf_counter()
            try:
                with d.installed():
                    got = run()
            except Exception as e:  # noqa: BLE001
                st.fail(f"{name} [{pat}]: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                row[pat] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                continue
            _, problems = compare(got, base, exact=True, tol=0)
            row[pat] = {"bitwise_equal": not problems, "delays": dict(d.counts),
                        "injected_ms": round(d.injected_s * 1e3, 1), "seconds": round(time.perf_counter() - t0, 3),
                        "problems": problems[:5]}
            st.check(not problems, f"{name} [{pat}]: {problems[0] if problems else ''}")
            if sum(d.counts.values()) == 0:
                st.fail(f"{name} [{pat}]: no delay was injected: the hooks it wraps (ParamStore.bind, "
                        "CudaCopyEngine._submit, LaneWorker.submit) were not used")
        ok = all(isinstance(v, dict) and v.get("bitwise_equal") for k, v in row.items() if k in patterns)
        print(f"{name:<26} {'bitwise equal under every delay' if ok else 'DIFFERS'}  "
              + " ".join(f"{k}={v.get('delays') if isinstance(v, dict) else v}" for k, v in row.items()
                         if k in patterns), flush=True)
    st.figures["schedules"] = results
    if dev == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    raise SystemExit(stage_main("delays", body, add_args))
