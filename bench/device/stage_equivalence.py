"""Stage (b): the executor equals plain autograd under every schedule, with gradient accumulation.

For each schedule (keep_all, recompute_all, megatrain K=1/2/4, CPU homes, NVMe homes, kept
internals + resident weights, offloaded internals, a MILP plan solved on the workload measured on
this device), a
tiny Llama is trained for ``--steps`` optimizer steps of ``--micro`` micro-batches (SGD on the
host masters) through the executor, and the same with plain autograd on the same device. Every
micro-batch loss, every parameter's accumulated gradient before each step, every parameter after
each step and a final evaluation loss (``Executor.inference``) are compared:

* CPU: bitwise (``torch.equal``): the same kernels run on the same inputs in the same order;
* CUDA, fp32 (TF32 off): relative error <= ``--tol`` (1e-5) per tensor
  (max |a - b| / max |b|), since the streamed weights go through other kernels' launch order.

Run under ``TORCH_CUDA_SANITIZER=1`` by the ``sanitizer`` stage (with ``--steps 1``): any race the
CUDA sanitizer reports raises inside the run and fails that schedule.
"""

from __future__ import annotations

import argparse
import os
import time

from kit import (
    Stage,
    compare,
    fixed_schedules,
    make_batches,
    measure,
    milp_schedule,
    run_executor,
    run_plain,
    stage_main,
    strict_fp32,
    tiny_model,
    tiny_spec,
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--schedules", default="", help="comma-separated subset (default: all + milp)")


def body(st: Stage, args: argparse.Namespace) -> None:
    dev = args.device
    strict_fp32()
    sanitizer = "TORCH_CUDA_SANITIZER" in os.environ  # torch enables CSAN at import when it is set
    if sanitizer and dev == "cuda":
        import torch.cuda._sanitizer as csan

        st.check(csan.cuda_sanitizer.enabled, "TORCH_CUDA_SANITIZER is set but the sanitizer is not enabled")
    st.figures.update({"steps": args.steps, "micro_batches": args.micro, "sanitizer": sanitizer,
                       "comparison": "bitwise" if dev == "cpu" else f"relative error <= {args.tol:g}"})
    model = tiny_model()
    batches = make_batches(tiny_spec(), args.steps, args.micro)
    schedules = fixed_schedules()
    wanted = [s for s in args.schedules.split(",") if s]
    if not wanted or "milp" in wanted:
        t0 = time.perf_counter()
        wl = measure(model, batches[0][0].to(dev), dev, args.workdir)
        schedules["milp"] = milp_schedule(wl, st)
        st.figures["milp"]["measure_and_solve_seconds"] = round(time.perf_counter() - t0, 3)
    if wanted:
        schedules = {k: v for k, v in schedules.items() if k in wanted}
    ref = run_plain(model, batches, dev)
    results = {}
    for name, schedule in schedules.items():
        t0 = time.perf_counter()
        try:
            got = run_executor(model, schedule, batches, dev, args.workdir)
        except Exception as e:  # noqa: BLE001 - one schedule's error must not hide the others
            st.fail(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        worst, problems = compare(got, ref, exact=dev == "cpu", tol=args.tol)
        results[name] = {"max_rel_err": worst, "seconds": round(time.perf_counter() - t0, 3),
                         "lane_bytes": got.stats.lane_bytes if got.stats else None,
                         "problems": problems[:10]}
        print(f"{name:<26} max rel err {worst:.2e}  {'ok' if not problems else problems[0]}", flush=True)
        st.check(not problems, f"{name}: {problems[0] if problems else ''}")
    st.figures["schedules"] = results
    st.figures["max_rel_err"] = max((r.get("max_rel_err", 0.0) for r in results.values()), default=0.0)


if __name__ == "__main__":
    raise SystemExit(stage_main("equivalence", body, add_args))
