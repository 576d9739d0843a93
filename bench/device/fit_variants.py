"""The fit stage's lazytrain, ``auto`` and FSDP2 CPU offload runs (``stage_fit.py``'s child side).

The model and data helpers the variants share (the 1.03B Llama's fields, random token batches, the
Lightning ``Trainer`` settings and the ``Clock``'s callback, the ``CausalLMModule`` with this stage's
optimizer, the Hugging Face ``LlamaForCausalLM`` the peers train and its loss), lazytrain's budget
(``lazytrain_cap``) and one run each: ``run_lazytrain``, ``run_auto``, ``run_fsdp2``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from fit_clock import Clock, first_line, lane_figures, profile_lines, say
from kit import GB, TINY_FIELDS, footprint_range

# The 1.03B model of stage_throughput (ONE_B there), as fields
ONE_B_FIELDS = dict(name="kit-1b", num_layers=20, hidden=2048, intermediate=5632, heads=16, kv_heads=4, head_dim=128,
                    vocab=32000)


def lightning_probe(clock: Clock):
    import lightning as L

    class Probe(L.Callback):
        reads_gradients_only = True  # times the step, edits no gradient: lazytrain's updates may run in the backward

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clock.start(batch_idx)

        def on_before_backward(self, trainer, pl_module, loss):
            clock.before_backward()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            clock.before_optimizer()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.end(batch_idx)

    return Probe()


def token_batches(n: int, batch: int, seq: int, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(n)]


def loader(batches: list[torch.Tensor]):
    return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)


def trainer_kwargs(workdir: Path, clock: Clock, cuda: bool) -> dict:
    return dict(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=clock.total, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(workdir),
                callbacks=[lightning_probe(clock)])


def timed_hybrid_adamw():
    """``HybridAdamW`` that adds up the seconds of its per-layer updates (on whatever thread runs them:
    the pipelined step's worker or the caller): the host update's own cost, overlapped or not. Wraps a
    private method (``_update_layer``); without it the timing is recorded as not available."""
    from lightning_lazytrain.optim import HybridAdamW

    class TimedHybridAdamW(HybridAdamW):
        def __init__(self, *a: Any, **kw: Any) -> None:
            self.update_seconds = 0.0
            self.update_calls = 0
            self._timing_lock = threading.Lock()
            super().__init__(*a, **kw)

        def update_in_backward(self, layer, after=None):  # noqa: ANN001 - HybridAdamW's signature
            self.in_backward_calls = getattr(self, "in_backward_calls", 0) + 1
            return super().update_in_backward(layer, after)

        if hasattr(HybridAdamW, "_update_layer"):
            def _update_layer(self, layer, plan):  # noqa: ANN001 - HybridAdamW's signature
                t0 = time.perf_counter()
                try:
                    return super()._update_layer(layer, plan)
                finally:
                    with self._timing_lock:
                        self.update_seconds += time.perf_counter() - t0
                        self.update_calls += 1

    TimedHybridAdamW.timed = hasattr(HybridAdamW, "_update_layer")
    return TimedHybridAdamW


def fit_module(optimizer: str, **kw: Any):
    """A ``CausalLMModule`` whose optimizer is this stage's: ``hybrid`` (``HybridAdamW(eight_bit="plan")``,
    timed), ``adamw_fused`` (torch AdamW, fused kernel) or ``ds_cpu_adam`` (``DeepSpeedCPUAdam``, AdamW
    mode). Constant learning rate, no warm-up."""
    from lightning_lazytrain.lit_module import CausalLMModule

    class FitModule(CausalLMModule):
        def configure_optimizers(self):
            groups = self.param_groups()
            hp = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
            if optimizer in ("hybrid", "hybrid_in_backward"):  # Note: [updates in backward] for the latter
                extra = {"updates_in_backward": True, "skip_nonfinite": False} if optimizer != "hybrid" else {}
                return timed_hybrid_adamw()(groups, eight_bit="plan", **extra, **hp)
            if optimizer == "adamw_fused":
                return torch.optim.AdamW(groups, fused=True, **hp)
            if optimizer == "ds_cpu_adam":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(groups, adamw_mode=True, **hp)
            raise ValueError(optimizer)

    return FitModule(optimizer="hybrid_adamw" if optimizer.startswith("hybrid") else "adamw", lr=3e-4,
                     lr_schedule="constant",
                     warmup_steps=0, **kw)


def llama_module(spec_fields: dict, dev: str, optimizer: str):
    """The project's ``LlamaLM`` in a ``CausalLMModule`` (its chunked loss), initialised on ``dev`` with
    seed 0 (seconds on the GPU instead of a minute on the host)."""
    torch.manual_seed(0)
    with torch.device(dev):
        module = fit_module(optimizer, model_name=None, model_overrides=dict(spec_fields))
    return module


def hf_config(spec: dict, seq: int):
    import transformers

    kw = dict(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
              num_hidden_layers=spec["num_layers"], num_attention_heads=spec["heads"],
              num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"], max_position_embeddings=max(2048, seq),
              rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False, use_cache=False)
    try:
        return transformers.LlamaConfig(**kw, attn_implementation="sdpa")
    except (TypeError, ValueError):
        return transformers.LlamaConfig(**kw)


def hf_llama(spec: dict, seq: int, dev: str, checkpointing: bool) -> torch.nn.Module:
    """``LlamaForCausalLM`` of the kit's shapes, initialised on ``dev`` with seed 0, returned on the host;
    with checkpointing: Hugging Face's activation checkpointing per decoder layer (non-reentrant)."""
    import transformers

    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.LlamaForCausalLM(hf_config(spec, seq))
    model = model.cpu()
    if dev == "cuda":
        torch.cuda.empty_cache()
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_enable in 5.x
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def hf_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``tokens[B, S + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``), fp32,
    as ``CausalLMModule`` computes it for a Hugging Face model."""
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lazytrain_cap(module: Any, tokens: torch.Tensor, dev: str, dtype: torch.dtype, frac: float,
                  workdir: Path) -> dict:
    """The budget ``frac`` of the way from the smallest to the keep-all footprint of the workload measured
    on ``dev`` (forward + backward + gradient write-back, as ``stage_throughput`` measures it)."""
    from lightning_lazytrain.core.autoplan import measure_hardware
    from lightning_lazytrain.engine.executor import Executor
    from lightning_lazytrain.engine.profiler import measure_workload
    from lightning_lazytrain.planner import min_memory

    m = copy.deepcopy(module.model)
    ex = Executor(m, min_memory(len(m.layers)), device=dev, compute_dtype=dtype, nvme_dir=workdir)
    try:
        wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=tokens[:, 1:].numel(), warmup=1,
                              opt_params_per_s=1e18)
    finally:
        ex.close()
    m = ex = None  # free the copy before the run
    gc.collect()
    hw = measure_hardware(torch.device(dev), opt_params_per_s=1e18)
    lo, hi = footprint_range(wl, hw.replace(gpu_memory_cap_bytes=hw.gpu_memory_bytes))
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"footprint_min_gb": lo / GB, "footprint_keep_all_gb": hi / GB, "cap_gb": (lo + frac * (hi - lo)) / GB}


def run_lazytrain(a: argparse.Namespace, res: dict, save: Callable[..., None]) -> None:
    import lightning as L

    from lightning_lazytrain.strategy import LazyTrainStrategy

    cuda = a.device == "cuda"
    spec = ONE_B_FIELDS if cuda else TINY_FIELDS
    dtype = torch.bfloat16 if cuda else torch.float32
    precision = "bf16-true" if cuda else "32-true"
    # lead: the profiled step (on CUDA after one warm-up step: core/replan.py, Note: [profile warm-up]), then
    # with --race the plan timed against its baselines (core/plan_race.py, Note: [the plan checked by
    # measurement]) and the winner's first step: the timed steps are the schedule the run keeps
    from lightning_lazytrain.core.plan_race import PlanRace
    from lightning_lazytrain.core.replan import ReplanOptions

    replan = ReplanOptions(race=bool(a.race))
    race = PlanRace.length(replan.patience, replan.race_candidates) + 1 if a.race else 0
    clock = Clock(a.device, (2 if cuda else 1) + race, a.warmup, a.timed)
    data = token_batches(clock.total, a.batch, a.seq, spec["vocab"])
    in_backward = not a.updates_at_step
    # the strategy streams from the host
    module = llama_module(spec, a.device, "hybrid_in_backward" if in_backward else "hybrid").cpu()
    if cuda:
        torch.cuda.empty_cache()
    res["parameters"] = sum(p.numel() for p in module.parameters())
    save(phase="budget")
    if a.cap_gb is not None:
        res["cap_gb"] = a.cap_gb
    else:
        t0 = time.perf_counter()
        res.update(lazytrain_cap(module, data[0].to(a.device), a.device, dtype, a.cap_frac, a.workdir),
                   cap_frac=a.cap_frac, cap_seconds=round(time.perf_counter() - t0, 2))
    say(f"lazytrain: budget {res['cap_gb']:.3f} GB"
        + (f" ({a.cap_frac:g} of the way from {res['footprint_min_gb']:.3g} to {res['footprint_keep_all_gb']:.3g} GB)"
           if "footprint_min_gb" in res else ""))
    fp32_masters = cuda  # needs a 16-bit precision; the CPU rehearsal runs 32-true
    res["settings"] = {
        "strategy": f"LazyTrainStrategy(hardware='measure', gpu_memory_budget_gb={res['cap_gb']:.4g}, "
                    f"fp32_masters={fp32_masters})", "precision": precision,
        "optimizer": "HybridAdamW(eight_bit='plan', impl='fused'"
                     + (", updates_in_backward=True, skip_nonfinite=False" if in_backward else "")
                     + "), lr 3e-4 constant, weight decay 0.1 (matrices), no clip (as the peers)",
        "model": "CausalLMModule(LlamaLM), chunked loss (4096 tokens)", "torch_threads": torch.get_num_threads(),
        "other": "policy='milp', replan=True, keep_compute_copy='auto' (defaults)"
                 + ("; the plan timed against its baselines first (--race)" if a.race else
                    "; replan race=False (the plan's measured check off: --race turns it on)")}
    strategy = LazyTrainStrategy(hardware="measure", gpu_memory_budget_gb=res["cap_gb"], fp32_masters=fp32_masters,
                                 replan=replan)
    if cuda:
        from lightning_lazytrain.engine.live_bytes import max_memory_allocated, reset_cuda_peak

        # the executor starts a new CUDA peak every step: read the peak across those resets
        clock.reset_peak = lambda: reset_cuda_peak(torch.device("cuda", torch.cuda.current_device()), forget=True)
        clock.peak_allocated = max_memory_allocated
    captured: dict = {}

    def opt_counter() -> tuple[float, int]:
        opt = trainer.optimizers[0] if trainer.optimizers else None
        captured["layers"] = len(getattr(opt, "layers", []) or [])
        return (getattr(opt, "update_seconds", float("nan")), getattr(opt, "update_calls", 0))

    clock.hooks["first_timed"].append(lambda: captured.__setitem__("opt0", opt_counter()))
    if os.environ.get("KIT_FIT_CPROFILE") == "1":  # where the training loop's own thread spends the timed steps
        import cProfile

        prof = cProfile.Profile()
        clock.hooks["first_timed"].append(prof.enable)
        clock.hooks["last_timed"].append(lambda: (prof.disable(), res.__setitem__("main_thread_profile",
                                                                                  profile_lines(prof))))
    clock.hooks["profiled_start"].append(lambda: captured.__setitem__("opt1", opt_counter()))
    clock.hooks["last_timed"].append(lambda: captured.__setitem__("stats", trainer.strategy.last_stats))
    clock.hooks["done"].append(lambda: captured.__setitem__("plan", trainer.strategy.plan))
    trainer = L.Trainer(strategy=strategy, precision=precision, **trainer_kwargs(a.workdir / "lazytrain", clock, cuda))
    save(phase="fit")
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader(data))
    res["fit_seconds"] = round(time.perf_counter() - t0, 2)
    res.update(clock.result(a.batch * a.seq))
    plan = captured.get("plan")
    sim = getattr(getattr(plan, "result", None), "sim", None)
    if sim is not None:
        sched = plan.schedule
        res.update(predicted_step_seconds=sim.iteration_seconds, predicted_peak_gb=sim.peak_gpu_bytes / GB,
                   plan={"status": plan.result.status, "homes": "".join(h[0] for h in sched.homes),
                         "keep_internals": "".join("k" if k else "-" for k in sched.keep_internals),
                         "resident_weights": sum(bool(r) for r in sched.resident_weights),
                         "optimizer": getattr(sched, "optimizer", None),
                         # the plan's choice (Note: [updates in the backward pass]), where the run allows it
                         "updates_in_backward": bool(getattr(sched, "updates_in_backward", False)),
                         "updates_in_backward_allowed": bool(getattr(plan.result.workload, "updates_in_backward",
                                                                     False)),
                         "host_norms": bool(getattr(plan.result.workload, "host_norms", True)),
                         "timings_s": {k: round(v, 3) for k, v in getattr(plan, "timings", {}).items()}})
        if res.get("median_step_seconds"):
            res["measured_over_predicted"] = res["median_step_seconds"] / sim.iteration_seconds
    res.update(lane_figures(captured.get("stats"), sim))
    if captured.get("stats") is not None:  # the pipelined update not hidden under the forward (last timed step)
        res["optimizer_wait_seconds"] = round(captured["stats"].optimizer_wait_seconds, 4)
    if captured.get("stats") is not None and captured["stats"].max_memory_allocated is not None:
        res["last_step_max_memory_allocated_gb"] = captured["stats"].max_memory_allocated / GB
    (s0, c0), (s1, c1) = captured.get("opt0", (None, 0)), captured.get("opt1", (None, 0))
    if s0 is not None and s1 is not None and s1 == s1 and c1 > c0 and captured.get("layers"):  # (nan: no timing)
        # per layer update over the timed steps (a pipelined step's updates run into the next step, so the
        # window holds about, not exactly, `timed` steps' worth), times the optimizer's layers
        res["optimizer_update_seconds_per_step"] = (s1 - s0) / (c1 - c0) * captured["layers"]
        res["optimizer_update_layers"] = captured["layers"]
        res["optimizer_update_note"] = ("HybridAdamW's per-layer updates on the host, summed over its layers "
                                        "(pipelined: blocks during the backward with updates_in_backward, the rest "
                                        "under the next step's forward); optimizer_seconds is what the step itself "
                                        "waited for")
    else:
        res["optimizer_update_note"] = "not separable: HybridAdamW's per-layer update could not be timed"
    opt = trainer.optimizers[0] if trainer.optimizers else None
    # Note: [updates in backward]: the layers handed to the optimizer during a backward, over the run
    res["updates_in_backward"] = bool(getattr(opt, "updates_in_backward", False))
    res["layers_updated_in_backward"] = getattr(opt, "in_backward_calls", None)
    # Note: [most urgent first]: of those, the ones still waiting when their step came (queued by the step in
    # the next forward's order instead of ahead of it)
    res["backward_updates_left_at_step"] = getattr(opt, "backward_updates_left_at_step", None)
    res["eight_bit_chosen"] = repr(getattr(opt, "eight_bit", None))  # the plan's choice (e.g. 'none', a fraction)
    res["replans"] = list(getattr(trainer.strategy, "replans", []) or [])
    res["races"] = list(getattr(trainer.strategy, "races", []) or [])  # the plan against its baselines, measured
    for r in res["races"]:
        say("lazytrain: plan timed against its baselines: " + ", ".join(
            f"{e['name']} {e['median_s']:.3f} s (predicted {e['predicted_s']:.3f})" for e in r["entries"]
            if e["median_s"] is not None) + f"; kept {r['kept']}")
    if res["replans"]:
        say(f"lazytrain: {len(res['replans'])} re-plan(s) during the run")
    if cuda and res.get("max_memory_reserved_gb") is not None:
        res["reserved_over_cap_gb"] = res["max_memory_reserved_gb"] - res["cap_gb"]


def run_auto(a: argparse.Namespace, res: dict, save: Callable[..., None]) -> None:
    import lightning as L

    cuda = a.device == "cuda"
    spec = ONE_B_FIELDS if cuda else TINY_FIELDS
    precision = "bf16-mixed" if cuda else "32-true"
    clock = Clock(a.device, 0, a.warmup, a.timed)
    data = token_batches(clock.total, a.batch, a.seq, spec["vocab"])
    module = llama_module(spec, a.device, "adamw_fused")
    res["parameters"] = sum(p.numel() for p in module.parameters())
    res["settings"] = {"strategy": "auto", "precision": precision,
                       "optimizer": "torch.optim.AdamW(fused=True) on the " + ("GPU" if cuda else "CPU"),
                       "model": "CausalLMModule(LlamaLM), chunked loss (4096 tokens)"}
    trainer = L.Trainer(strategy="auto", precision=precision, **trainer_kwargs(a.workdir / "auto", clock, cuda))
    save(phase="fit")
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader(data))
    res["fit_seconds"] = round(time.perf_counter() - t0, 2)
    res.update(clock.result(a.batch * a.seq))
    res["optimizer_note"] = (f"AdamW's step on the {'GPU' if cuda else 'CPU'} (fused), from after the backward to the "
                             "batch's end")


def adamw_for(params: list, cuda: bool) -> tuple[torch.optim.Optimizer, str]:
    """torch AdamW for FSDP2's CPU-offloaded parameters: the fused CPU kernel if it takes them, else foreach."""
    hp = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for impl, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("default", {})):
        try:
            return torch.optim.AdamW(params, **hp, **kw), impl
        except (RuntimeError, ValueError, TypeError) as err:
            say(f"fsdp2_offload: AdamW({impl}) refused: {first_line(err)}")
    raise RuntimeError("no AdamW implementation takes FSDP2's parameters")


def run_fsdp2(a: argparse.Namespace, res: dict, save: Callable[..., None]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = a.device == "cuda"
    spec = ONE_B_FIELDS if cuda else TINY_FIELDS
    ckpt = not a.no_peer_checkpointing
    clock = Clock(a.device, 0, a.warmup, a.timed)
    data = token_batches(clock.total, a.batch, a.seq, spec["vocab"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend="cuda:nccl,cpu:gloo" if cuda else "gloo", rank=0, world_size=1)
    try:
        model = hf_llama(spec, a.seq, a.device, ckpt)
        res["parameters"] = sum(p.numel() for p in model.parameters())
        mesh = init_device_mesh(a.device, (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
            MixedPrecisionPolicy()
        kw = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=cuda))
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opt, impl = adamw_for(list(model.parameters()), cuda)
        res["settings"] = {
            "wrapper": "torch.distributed.fsdp.fully_shard per decoder layer + root, world size 1 (plain loop)",
            "offload": f"CPUOffloadPolicy(pin_memory={cuda})",
            "mixed_precision": "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" if cuda else "fp32",
            "activation_checkpointing": "per decoder layer (Hugging Face, non-reentrant)" if ckpt else "off",
            "optimizer": f"torch.optim.AdamW({impl}) on the CPU, lr 3e-4, weight decay 0.1",
            "model": "transformers.LlamaForCausalLM, fp32 cross-entropy over full logits"}
        save(phase="steps")
        fallback = impl != "default"
        for k in range(clock.total):
            clock.start(k)
            tokens = data[k].to(a.device, non_blocking=True)
            loss = hf_loss(model, tokens)
            clock.before_backward()
            loss.backward()
            clock.before_optimizer()
            try:
                opt.step()
            except (RuntimeError, NotImplementedError) as err:
                if not (fallback and k == 0):
                    raise
                say(f"fsdp2_offload: AdamW({impl}).step failed ({first_line(err)}); using the default implementation")
                opt, impl = torch.optim.AdamW(list(model.parameters()), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                              weight_decay=0.1), "default (after a failed step)"
                res["settings"]["optimizer"] = f"torch.optim.AdamW({impl}) on the CPU"
                opt.step()
            opt.zero_grad(set_to_none=True)
            clock.end(k)
            if k == 0:
                res["first_loss"] = float(loss.detach().float().item())
        res.update(clock.result(a.batch * a.seq))
        res["optimizer_note"] = "optimizer.step + zero_grad on the CPU, after the backward's offloaded gradients landed"
    finally:
        dist.destroy_process_group()
