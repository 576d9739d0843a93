"""Stage (d): the Lightning strategy against ``strategy="auto"``, same data, same seed.

``Trainer(strategy=LazyTrainStrategy(hardware="measure", gpu_memory_budget_gb=B))`` trains a
``CausalLMModule`` (a ``LlamaLM`` from a planner ``ModelSpec``) with ``HybridAdamW`` (8-bit states
for every eligible tensor), gradient clipping (``gradient_clip_val``: fused into the optimizer
under the strategy, ``clip_grad_norm_`` under auto), gradient accumulation (2), a warmup + cosine
LR schedule and validation twice during the run; then the same with ``strategy="auto"``. ``B`` is
half way between the smallest and the keep-all footprint of the workload measured first on the
device (in the dtype the strategy streams for that precision), so the plan must move or
recompute activations.

* CUDA: ``accelerator="gpu"``, ``precision="bf16-mixed"``: train and validation losses within
  bf16 tolerance (``--tol``: |a - b| <= tol x max(1, |b|)). Not bitwise: the strategy keeps the
  optimizer states on the host (bitsandbytes' CPU kernel) where auto runs the CUDA kernel, and
  the kernels' launch order differs. Memory, a hard check: ``max_memory_reserved`` (what runs
  out of memory; the allocator's peak over the strategy's whole ``fit``: its profiled first step,
  training, validation, across the executor's per-step resets) must stay within the
  ``gpu_memory_budget_gb`` it was given (lightning_lazytrain/core/allocator.py, Note: [the budget is
  what the allocator reserves]); ``max_memory_allocated`` and their ratio are reported beside it.
* CPU rehearsal: ``accelerator="cpu"``, ``precision="32-true"``, two pairs of runs: with the clip
  routed but inactive (``gradient_clip_val=100``) every loss must be bitwise equal; with an active
  clip (0.5) the first loss bitwise and the rest within ``--cpu-tol`` (1e-5): the clip's global
  norm is summed per layer under the strategy, per tensor under ``clip_grad_norm_``. The memory
  check is recorded as skipped, with the reason (no device allocator on the CPU).

What the plan does is read from the run's ``plan.json`` schedule and recorded (``plan.summary``,
printed): where each boundary lives (GPU, host, NVMe, recomputed), which layers keep their
internals on the GPU, move them to the host and back, keep them partially or re-run locally,
and which weights stay resident. A note is made only when the plan moves and recomputes nothing
(every boundary and every layer's internals stay on the GPU), i.e. the budget forced nothing.

Train losses are recorded as Lightning reports them (divided by ``accumulate_grad_batches``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from kit import GB, Stage, footprint_range, measure, stage_main, tiny_model, tiny_spec
from lightning_lazytrain.planner import ModelSpec

GPU_SPEC = ModelSpec(name="kit-small", num_layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=4, head_dim=64,
                     vocab=4096)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument("--tol", type=float, default=0.05, help="CUDA bf16: |a - b| <= tol * max(1, |b|)")
    ap.add_argument("--cpu-tol", type=float, default=1e-5)
    ap.add_argument("--clip", type=float, default=0.5)


class Record:
    def __init__(self) -> None:
        self.train: list[float] = []
        self.val: list[float] = []

    def callback(self):
        import lightning as L

        rec = self

        class _Cb(L.Callback):
            reads_gradients_only = True  # records losses, reads no weight: the step may stay pipelined

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                rec.train.append(float(outputs["loss"].item()))

            def on_validation_end(self, trainer, module):
                if not trainer.sanity_checking:
                    rec.val.append(float(trainer.callback_metrics["val_loss"].item()))

        return _Cb()


def batches(vocab: int, n: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def fit(strategy, spec: ModelSpec, train, val, *, accelerator: str, precision: str, steps: int, clip: float,
        logdir: Path):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_lazytrain.lit_module import CausalLMModule

    torch.manual_seed(0)
    module = CausalLMModule(model_name=None, model_overrides=dataclasses.asdict(spec), optimizer="hybrid_adamw",
                            eight_bit="all", lr=3e-3, warmup_steps=2, lr_schedule="cosine")
    rec = Record()
    trainer = L.Trainer(strategy=strategy, accelerator=accelerator, devices=1, precision=precision, max_steps=steps,
                        accumulate_grad_batches=2, gradient_clip_val=clip, val_check_interval=len(train) // 2,
                        limit_val_batches=len(val), num_sanity_val_steps=0, logger=CSVLogger(logdir, name=""),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rec.callback()], deterministic=False)
    loader = torch.utils.data.DataLoader(train, batch_size=None)
    vloader = torch.utils.data.DataLoader(val, batch_size=None)
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=vloader)
    seconds = time.perf_counter() - t0
    opt = trainer.optimizers[0] if trainer.optimizers else None
    return rec, seconds, opt, Path(trainer.log_dir or logdir)


def describe_schedule(sched) -> dict:
    """What a plan's ``Schedule`` does with each boundary, each layer's internals and weights."""
    L = sched.num_layers
    offloaded = set(sched.offloaded_internals)
    partial = set(sched.partial_layers)
    d = {
        "boundaries": sched.count_homes(),
        "internals_kept_on_gpu": [j for j in range(L) if sched.keep_internals[j] and j not in offloaded],
        "internals_offloaded_to_host": sorted(offloaded),
        "internals_partially_kept": sorted(partial),
        "internals_rerun_locally": [j for j in range(L) if not sched.keep_internals[j] and j not in partial],
        "recompute_blocks": [list(b) for b in sched.recompute_blocks],
        "resident_weights": [j for j in range(L) if sched.resident_weights[j]],
        "extra_forwards_per_microbatch": sched.recomputed_layers,
    }
    homes = d["boundaries"]
    d["moves_or_recomputes"] = bool(any(n for h, n in homes.items() if h != "gpu") or offloaded or partial
                                    or d["internals_rerun_locally"] or sched.recomputed_layers)
    parts = [f"boundaries {', '.join(f'{n} {h}' for h, n in homes.items() if n)} (of {L + 1})",
             f"internals kept on the GPU {d['internals_kept_on_gpu']}"]
    for key, what in (("internals_offloaded_to_host", "offloaded to the host and back"),
                      ("internals_partially_kept", "partially kept"), ("internals_rerun_locally", "re-run locally"),
                      ("recompute_blocks", "recompute blocks"), ("resident_weights", "resident weights")):
        if d[key]:
            parts.append(f"{what} {d[key]}")
    parts.append(f"{sched.recomputed_layers} extra layer forwards per micro-batch")
    d["text"] = "; ".join(parts)
    return d


def body(st: Stage, args: argparse.Namespace) -> None:
    dev = args.device
    from lightning_lazytrain import strategy as strategy_module

    if dev == "cuda":
        spec, batch, seq, accelerator, precision = GPU_SPEC, 8, 256, "gpu", "bf16-mixed"
    else:
        spec, batch, seq, accelerator, precision = tiny_spec(), 4, 32, "cpu", "32-true"
    # the dtype the strategy streams weights in for this precision (bf16-mixed: fp32 under autocast)
    dtype = strategy_module.COMPUTE_DTYPES.get(precision, torch.float32)
    train = batches(spec.vocab, 2 * args.steps, batch, seq, seed=1)
    val = batches(spec.vocab, 2, batch, seq, seed=2)

    # The budget: half way between the smallest and the keep-all footprint measured here.
    model = tiny_model(0, spec)
    probe = train[0].to(dev)
    if dev == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            wl = measure(model, probe, dev, args.workdir, compute_dtype=dtype)
    else:
        wl = measure(model, probe, dev, args.workdir, compute_dtype=dtype)
    del model, probe
    if dev == "cuda":
        torch.cuda.empty_cache()
    lo, hi = footprint_range(wl)
    budget_gb = (lo + 0.5 * (hi - lo)) / GB
    st.figures.update({"model": dataclasses.asdict(spec), "batch": [batch, seq], "precision": precision,
                       "streamed_dtype": str(dtype),
                       "optimizer_steps": args.steps, "accumulate_grad_batches": 2,
                       "train_loss_note": "as Lightning reports it: divided by accumulate_grad_batches",
                       "footprint_min_gb": lo / GB, "footprint_keep_all_gb": hi / GB, "budget_gb": budget_gb})

    if dev == "cuda":
        runs = {"clipped": (args.clip, args.tol)}
    else:  # bitwise with the clip routed but inactive; then with an active clip
        runs = {"clip_inactive": (100.0, 0.0), "clipped": (args.clip, args.cpu_tol)}
    for tag, (clip, tol) in runs.items():
        compare_pair(st, tag, spec, train, val, accelerator=accelerator, precision=precision, steps=args.steps,
                     clip=clip, tol=tol, budget_gb=budget_gb, workdir=args.workdir, cuda=dev == "cuda")


def compare_pair(st: Stage, tag: str, spec: ModelSpec, train, val, *, accelerator: str, precision: str, steps: int,
                 clip: float, tol: float, budget_gb: float, workdir: Path, cuda: bool) -> None:
    from lightning_lazytrain.strategy import LazyTrainStrategy

    from lightning_lazytrain.core.autoplan import load_schedule

    strategy = LazyTrainStrategy(hardware="measure", gpu_memory_budget_gb=budget_gb)
    from lightning_lazytrain.engine.live_bytes import max_memory_allocated, max_memory_reserved, reset_cuda_peak

    if cuda:  # the peak over the strategy's whole fit (across the executor's per-step resets), nothing before it
        torch.cuda.synchronize()
        reset_cuda_peak(torch.device("cuda", torch.cuda.current_device()), forget=True)
        allocated_before = torch.cuda.memory_allocated()
    lazy, t_lazy, opt, logdir = fit(strategy, spec, train, val, accelerator=accelerator, precision=precision,
                                    steps=steps, clip=clip, logdir=workdir / f"{tag}-lazytrain")
    if cuda:
        torch.cuda.synchronize()
        memory = {"status": "measured", "budget_gb": budget_gb, "allocated_before_fit_gb": allocated_before / GB,
                  "max_memory_allocated_gb": max_memory_allocated() / GB,
                  "max_memory_reserved_gb": max_memory_reserved() / GB}
        memory["headroom_gb"] = budget_gb - memory["max_memory_reserved_gb"]
        memory["reserved_over_allocated"] = memory["max_memory_reserved_gb"] / max(memory["max_memory_allocated_gb"], 1e-9)
    else:
        memory = {"status": "skipped", "budget_gb": budget_gb,
                  "reason": "CUDA only: torch.cuda.max_memory_allocated has no counterpart on the CPU"}
    auto, t_auto, _, _ = fit("auto", spec, train, val, accelerator=accelerator, precision=precision,
                             steps=steps, clip=clip, logdir=workdir / f"{tag}-auto")
    fig: dict = {"gradient_clip_val": clip, "seconds_lazytrain": round(t_lazy, 2), "seconds_auto": round(t_auto, 2),
                 "train_loss_lazytrain": lazy.train, "train_loss_auto": auto.train,
                 "val_loss_lazytrain": lazy.val, "val_loss_auto": auto.val,
                 "optimizer": type(opt).__name__ if opt is not None else None,
                 "skipped_steps": getattr(opt, "skipped_steps", None), "memory": memory}
    st.figures[tag] = fig
    if cuda:
        # the budget bounds what the allocator reserves (lightning_lazytrain/core/allocator.py)
        st.check(memory["max_memory_reserved_gb"] <= budget_gb,
                 f"{tag}: max_memory_reserved {memory['max_memory_reserved_gb']:.4f} GB > the strategy's "
                 f"gpu_memory_budget_gb {budget_gb:.4f} (allocated {memory['max_memory_allocated_gb']:.4f} GB)")
    print(f"{tag}: memory " + (f"max allocated {memory['max_memory_allocated_gb']:.4f} GB, reserved "
                               f"{memory['max_memory_reserved_gb']:.4f} GB, budget {budget_gb:.4f} GB" if cuda
                               else f"check skipped ({memory['reason']})"), flush=True)
    plan_path = logdir / "plan.json"
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        sched = plan.get("schedule", {})
        fig["plan"] = {"status": plan.get("status"), "homes": sched.get("homes"),
                       "keep_internals": sched.get("keep_internals"),
                       "internals_offload_window": sched.get("internals_offload_window"),
                       "resident_weights": sched.get("resident_weights"), "predicted": plan.get("predicted")}
        summary = describe_schedule(load_schedule(plan_path))
        fig["plan"]["summary"] = summary
        print(f"{tag}: plan ({plan.get('status')}): {summary['text']}", flush=True)
        if not summary["moves_or_recomputes"]:
            st.note(f"{tag}: the budget did not force the plan to move or recompute anything: every boundary and "
                    f"every layer's internals stay on the GPU ({summary['text']})")
    else:
        st.note(f"{tag}: no plan.json in {logdir}")

    st.check(type(opt).__name__ == "HybridAdamW", f"{tag}: the optimizer is {type(opt).__name__}, not HybridAdamW")
    if type(opt).__name__ == "HybridAdamW":
        sb = opt.state_bytes()
        fig.update({"eight_bit_numel": sb.eight_bit_numel, "numel": sb.numel, "last_grad_norm": opt.last_grad_norm})
        st.check(sb.eight_bit_numel > 0, f"{tag}: no parameter has 8-bit states")
        if clip < 10 and not opt.last_grad_norm > clip:
            st.note(f"{tag}: last gradient norm {opt.last_grad_norm:.3g} <= clip {clip:g}: the clip was not active")
    st.check(len(lazy.train) == len(auto.train) == len(train),
             f"{tag}: train losses: {len(lazy.train)} (lazytrain) vs {len(auto.train)} (auto), expected {len(train)}")
    st.check(len(lazy.val) == len(auto.val) >= 1, f"{tag}: validations: {len(lazy.val)} vs {len(auto.val)}")
    st.check(all(math.isfinite(x) for x in lazy.train + lazy.val), f"{tag}: non-finite loss under lazytrain")
    pairs = list(zip(lazy.train, auto.train)) + list(zip(lazy.val, auto.val))
    diffs = [abs(a - b) for a, b in pairs]
    worst = max(diffs, default=0.0)
    fig.update({"max_abs_loss_diff": worst, "bitwise_equal_losses": sum(d == 0 for d in diffs),
                "compared_losses": len(diffs), "tolerance": tol})
    if cuda:
        bad = [(i, a, b) for i, (a, b) in enumerate(pairs) if abs(a - b) > tol * max(1.0, abs(b))]
        st.check(not bad, f"{tag}: losses differ beyond bf16 tolerance {tol:g}: first (index, lazytrain, auto) {bad[:1]}")
    else:
        st.check(bool(lazy.train) and lazy.train[0] == auto.train[0],
                 f"{tag}: first loss differs: {lazy.train[:1]} vs {auto.train[:1]}")
        st.check(worst <= tol, f"{tag}: losses differ by {worst:.3g} > {tol:g}")
        if worst > 0:
            st.note(f"{tag}: losses not bitwise equal once the clip is active (max diff {worst:.3g}): "
                    "the global norm is summed in another order")
    print(f"{tag}: max |loss diff| {worst:.3g} over {len(diffs)} losses ({fig['bitwise_equal_losses']} bitwise "
          f"equal); lazytrain {t_lazy:.1f} s, auto {t_auto:.1f} s; budget {budget_gb:.4f} GB", flush=True)

if __name__ == "__main__":
    raise SystemExit(stage_main("lightning", body, add_args))
