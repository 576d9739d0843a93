"""Stage (b): the executor equals plain autograd under every schedule, with gradient accumulation.

Three parts (``--parts``, default all), each ``--steps`` (3) optimizer steps of ``--micro`` (2)
micro-batches (SGD on the host masters) through the executor and the same with plain autograd on
the same device, then an evaluation loss (``Executor.inference``, model in eval mode). Every
micro-batch loss, every parameter's accumulated gradient before each step, every parameter after
each step and the evaluation loss are compared:

* ``fp32``: a tiny Llama in fp32 under every schedule (keep_all, recompute_all, megatrain K=1/2/4,
  CPU homes, NVMe homes, kept internals + resident weights, offloaded internals, and a MILP plan
  solved on the workload measured on this device). CPU: bitwise (``torch.equal``: the same kernels
  run on the same inputs in the same order); CUDA (TF32 off): relative error <= ``--tol`` (1e-5)
  per tensor (max |a - b| / max |b|), since the streamed weights go through other kernels'
  launch order.
* ``bf16``: bf16-mixed, the same model and schedules with the forward (and the evaluation) under
  ``torch.autocast(dtype=torch.bfloat16)`` over the fp32 masters (streamed in fp32, cast by
  autocast, as the strategy does for ``precision="bf16-mixed"``; backward outside autocast, so
  every re-run must replay the forward's autocast state), against plain autograd under the same
  autocast. CPU: bitwise, losses included; CUDA: relative error <= ``--bf16-tol`` (2e-3) per
  tensor, with deterministic algorithms and the math attention kernel for this part (both runs),
  so that only the executor's own doing can separate them; the largest relative error, the
  largest absolute loss difference and the number of bitwise-equal tensors are reported. (The
  tolerance is set below what a lost autocast state in the re-runs costs: ~5e-3 on this model.)
* ``gpt2``: a 4-block ``transformers`` GPT-2 (hidden 64, dropout 0.1 on embeddings, attention and
  residuals, eager attention) under recomputing schedules (recompute_all, megatrain K=2, CPU homes;
  and recompute_all under bf16 autocast): the re-runs must replay the dropout masks (the CPU and
  the CUDA random state of the forward). Same seed before both runs. CPU: bitwise; CUDA
  (deterministic algorithms, as the bf16 part): fp32 within ``--tol``, autocast within
  ``--bf16-tol``. A lost random state costs ~1e-3 on a loss and ~0.5 on a gradient.

* ``copies``: fp32 masters with bf16 compute copies (``compute_dtype=torch.bfloat16``, what
  ``LazyTrainStrategy(fp32_masters=True)`` runs), the copies kept on the host (engine/param_store.py,
  Note: [kept compute copy]: one cast per group and micro-batch, pinned copies read by every later
  fetch) against a cast per fetch, every schedule: the copies must change nothing but the host
  work. CPU: bitwise; CUDA (deterministic algorithms): within ``--tol``. A stale copy (a master
  updated by the step but not re-cast) costs ~1e-2 on this model; the number of casts per step of
  each run is reported.

Run under ``TORCH_CUDA_SANITIZER=1`` by the ``sanitizer`` stage (with ``--steps 1 --parts
fp32,gpt2``): any race the CUDA sanitizer reports raises inside the run and fails that schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

from kit import (
    Stage,
    compare,
    deterministic_cuda,
    fixed_schedules,
    hf_loss,
    make_batches,
    measure,
    milp_schedule,
    run_executor,
    run_plain,
    stage_main,
    strict_fp32,
    tiny_gpt2,
    tiny_model,
    tiny_spec,
)

PARTS = ("fp32", "bf16", "gpt2", "copies")
#: GPT-2 runs: (schedule, autocast dtype or None); every schedule re-runs blocks (dropout replay).
GPT2_RUNS = {"recompute_all": ("recompute_all", None), "megatrain_K2": ("megatrain_K2", None),
             "cpu_homes": ("cpu_homes", None), "recompute_all_bf16": ("recompute_all", torch.bfloat16)}
GPT2_SEED = 1234


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--tol", type=float, default=1e-5, help="CUDA fp32: relative error per tensor")
    ap.add_argument("--bf16-tol", type=float, default=2e-3, help="CUDA bf16 autocast: relative error per tensor")
    ap.add_argument("--schedules", default="", help="comma-separated subset (default: all + milp)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")


@contextlib.contextmanager
def deterministic(dev: str):
    """CUDA: deterministic algorithms and the math attention kernel inside, restored after (the
    stage's process has ``CUBLAS_WORKSPACE_CONFIG`` from the runner). Nothing on the CPU."""
    if dev != "cuda":
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             {n: getattr(torch.backends.cuda, n)() for n in ("flash_sdp_enabled", "mem_efficient_sdp_enabled",
                                                             "cudnn_sdp_enabled", "math_sdp_enabled")
              if hasattr(torch.backends.cuda, n)})
    deterministic_cuda()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        for n, on in saved[2].items():
            getattr(torch.backends.cuda, "enable_" + n.removesuffix("_enabled"))(on)


def bitwise_equal_tensors(got, want) -> tuple[int, int]:
    """(tensors bitwise equal, tensors compared) over losses, gradients, parameters, eval loss."""
    pairs = [(a, b) for la, lb in zip(got.losses, want.losses) for a, b in zip(la, lb)]
    for s, g in enumerate(want.grads):
        pairs += [(got.grads[s][n], g[n]) for n in g] + [(got.params[s][n], want.params[s][n]) for n in g]
    if got.eval_loss is not None and want.eval_loss is not None:
        pairs.append((got.eval_loss, want.eval_loss))
    return sum(bool(a.shape == b.shape and torch.equal(a, b)) for a, b in pairs), len(pairs)


def max_loss_diff(got, want) -> float:
    """Largest |a - b| over the micro-batch losses and the evaluation loss."""
    diffs = [abs(float(a) - float(b)) for la, lb in zip(got.losses, want.losses) for a, b in zip(la, lb)]
    if got.eval_loss is not None and want.eval_loss is not None:
        diffs.append(abs(float(got.eval_loss) - float(want.eval_loss)))
    return max(diffs, default=0.0)


def run_part(st: Stage, part: str, model, schedules: dict, ref, batches, args, *,
             autocast: torch.dtype | None = None, runs: dict | None = None, **kw) -> dict:
    """Every schedule of ``schedules`` under ``autocast`` (or ``runs``: label -> (schedule name,
    autocast)) against ``ref`` (a plain run, or a dict autocast -> plain run)."""
    dev = args.device
    runs = runs or {name: (name, autocast) for name in schedules}
    results = {}
    for label, (name, autocast) in runs.items():
        if name not in schedules:
            continue
        want = ref[autocast] if isinstance(ref, dict) else ref
        t0 = time.perf_counter()
        try:
            got = run_executor(model, schedules[name], batches, dev, args.workdir, autocast=autocast, **kw)
        except Exception as e:  # noqa: BLE001 - one schedule's error must not hide the others
            st.fail(f"{part} {label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            results[label] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        limit = args.tol if autocast is None or kw.get("compute_dtype") is not None else args.bf16_tol
        worst, problems = compare(got, want, exact=dev == "cpu", tol=limit)
        equal, total = bitwise_equal_tensors(got, want)
        results[label] = {"max_rel_err": worst, "max_abs_loss_diff": max_loss_diff(got, want),
                          "bitwise_equal_tensors": f"{equal}/{total}",
                          "autocast": str(autocast) if autocast is not None else None,
                          "seconds": round(time.perf_counter() - t0, 3),
                          "lane_bytes": got.stats.lane_bytes if got.stats else None,
                          "recomputed_forwards": dict(got.stats.recomputed_forwards) if got.stats else None,
                          "problems": problems[:10]}
        print(f"{part:<5} {label:<26} max rel err {worst:.2e}  {'ok' if not problems else problems[0]}", flush=True)
        st.check(not problems, f"{part} {label}: {problems[0] if problems else ''}")
    return results


def body(st: Stage, args: argparse.Namespace) -> None:
    dev = args.device
    strict_fp32()
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown part(s) {sorted(unknown)}; parts: {PARTS}")
    sanitizer = "TORCH_CUDA_SANITIZER" in os.environ  # torch enables CSAN at import when it is set
    if sanitizer and dev == "cuda":
        import torch.cuda._sanitizer as csan

        st.check(csan.cuda_sanitizer.enabled, "TORCH_CUDA_SANITIZER is set but the sanitizer is not enabled")
    exact = dev == "cpu"
    st.figures.update({"steps": args.steps, "micro_batches": args.micro, "sanitizer": sanitizer, "parts": parts,
                       "comparison": "bitwise" if exact else f"relative error <= {args.tol:g}",
                       "comparison_bf16": "bitwise" if exact else f"relative error <= {args.bf16_tol:g}"})
    model = tiny_model()
    batches = make_batches(tiny_spec(), args.steps, args.micro)
    schedules = fixed_schedules()
    wanted = [s for s in args.schedules.split(",") if s]
    if ("fp32" in parts or "bf16" in parts) and (not wanted or "milp" in wanted):
        t0 = time.perf_counter()
        wl = measure(model, batches[0][0].to(dev), dev, args.workdir)
        schedules["milp"] = milp_schedule(wl, st)
        st.figures["milp"]["measure_and_solve_seconds"] = round(time.perf_counter() - t0, 3)
    if wanted:
        schedules = {k: v for k, v in schedules.items() if k in wanted}

    if "fp32" in parts:
        ref = run_plain(model, batches, dev)
        res = run_part(st, "fp32", model, schedules, ref, batches, args)
        st.figures["schedules"] = res
        st.figures["max_rel_err"] = max((r.get("max_rel_err", 0.0) for r in res.values()), default=0.0)

    if "bf16" in parts:
        bf16 = torch.bfloat16
        with deterministic(dev):
            ref = run_plain(model, batches, dev, autocast=bf16)
            res = run_part(st, "bf16", model, schedules, ref, batches, args, autocast=bf16)
        st.figures["bf16_mixed"] = res
        st.figures["bf16_max_rel_err"] = max((r.get("max_rel_err", 0.0) for r in res.values()), default=0.0)
        st.figures["bf16_max_abs_loss_diff"] = max((r.get("max_abs_loss_diff", 0.0) for r in res.values()),
                                                   default=0.0)
        st.figures["bf16_losses_plain"] = [[float(x) for x in step] for step in ref.losses]

    if "gpt2" in parts:
        gpt2 = tiny_gpt2()
        gpt2_schedules = fixed_schedules()
        runs = {k: v for k, v in GPT2_RUNS.items() if not wanted or v[0] in wanted}
        with deterministic(dev):
            refs = {ac: run_plain(gpt2, batches, dev, loss_fn=hf_loss, autocast=ac, seed=GPT2_SEED)
                    for ac in {ac for _, ac in runs.values()}}
            res = run_part(st, "gpt2", gpt2, gpt2_schedules, refs, batches, args, runs=runs,
                           loss_fn=hf_loss, seed=GPT2_SEED)
        for label, r in res.items():  # the replay was exercised: blocks were re-run
            reruns = sum((r.get("recomputed_forwards") or {}).values())
            st.check("error" in r or reruns > 0, f"gpt2 {label}: no block was re-run (the dropout replay is untested)")
        st.figures["gpt2"] = res
        st.figures["gpt2_config"] = {"n_layer": gpt2.config.n_layer, "n_embd": gpt2.config.n_embd,
                                     "dropout": gpt2.config.resid_pdrop,
                                     "attn_implementation": gpt2.config._attn_implementation,
                                     "parameters": sum(p.numel() for p in gpt2.parameters())}
        st.figures["gpt2_max_rel_err"] = max((r.get("max_rel_err", 0.0) for r in res.values()), default=0.0)

    if "copies" in parts:
        bf16 = torch.bfloat16
        fixed = {k: v for k, v in schedules.items() if k != "milp"}
        casts: dict[str, dict[str, int]] = {}

        def counting(label: str):
            def on_stats(ex, _stats) -> None:
                casts.setdefault(label, {})[str(ex.keep_compute_copy)] = sum(
                    1 for r in ex.engine.records() if (r.tag or "").startswith("cast"))
            return on_stats

        res = {}
        with deterministic(dev):
            for name, schedule in fixed.items():
                ref = run_executor(model, schedule, batches, dev, args.workdir, compute_dtype=bf16,
                                   on_stats=counting(name))
                res.update(run_part(st, "copies", model, {name: schedule}, ref, batches, args, compute_dtype=bf16,
                                    keep_compute_copy=True, on_stats=counting(name)))
        for name, r in res.items():
            r["casts_per_step"] = {"per_fetch": casts.get(name, {}).get("False"),
                                   "kept": casts.get(name, {}).get("True")}
            n = r["casts_per_step"]
            st.check("error" in r or (n["kept"] is not None and n["per_fetch"] is not None
                                      and n["kept"] < n["per_fetch"]),
                     f"copies {name}: the kept copies did not save a cast ({n})")
        st.figures["copies"] = res
        st.figures["copies_max_rel_err"] = max((r.get("max_rel_err", 0.0) for r in res.values()), default=0.0)


if __name__ == "__main__":
    raise SystemExit(stage_main("equivalence", body, add_args))
