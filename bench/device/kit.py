"""Shared pieces of the device validation kit's stages.

Every stage is a script ``bench/device/stage_<name>.py`` run by ``run_checks.py`` in its own
process as ``python bench/device/stage_<name>.py --out RESULT.json --device cuda|cpu [options]``.
It writes one JSON object (``status`` pass/fail/skipped, ``reason``, ``figures``) through
:func:`stage_main`; an exception becomes ``fail`` with its traceback in the log.

The executor cases (model, schedules, training loop, comparison) live here because three stages
replay them: equivalence to plain autograd, the same under the CUDA sanitizer, and the same with
injected delays.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the package is used from the working tree
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Importing any part of lightning_lazytrain imports Lightning (the package registers its strategy)
# and the planner imports Pyomo: seconds each, so the package is imported where it is used and a
# stage that needs little of it (pytest_gpu, nvme) starts fast.

GB = 1e9

# ---------------------------------------------------------------------------------------- results


class StageSkipped(Exception):
    """Raise from a stage body to record ``skipped`` with this reason."""


@dataclass
class Stage:
    """What a stage reports. ``fail(msg)`` records a hard failure and keeps going, so one run
    shows every failing case; ``note(msg)`` records a soft finding (speed, figures out of line)."""

    name: str
    device: str
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        print(f"FAIL: {msg}", flush=True)
        self.failures.append(msg)

    def note(self, msg: str) -> None:
        print(f"note: {msg}", flush=True)
        self.notes.append(msg)

    def check(self, ok: bool, msg: str) -> bool:
        if not ok:
            self.fail(msg)
        return ok


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def stage_main(name: str, body: Callable[[Stage, argparse.Namespace], None],
               add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """Parse ``--out``/``--device`` (+ the stage's own), run ``body``, write the result JSON."""
    ap = argparse.ArgumentParser(description=f"device kit stage {name}")
    ap.add_argument("--out", type=Path, required=True, help="result JSON to write")
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: next to --out)")
    ap.add_argument("--name", default=name, help="the name recorded (a stage may be run as another, e.g. sanitizer)")
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args()
    name = args.name
    args.workdir = args.workdir or args.out.parent / f"{name}.work"
    args.workdir.mkdir(parents=True, exist_ok=True)
    st = Stage(name, args.device)
    t0 = time.perf_counter()
    status, reason = "pass", None
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        body(st, args)
        if st.failures:
            status, reason = "fail", "; ".join(st.failures[:5]) + (f" (+{len(st.failures) - 5} more)"
                                                                   if len(st.failures) > 5 else "")
    except StageSkipped as e:
        status, reason = "skipped", str(e)
    except BaseException as e:  # noqa: BLE001 - recorded, the runner goes on with the next stage
        traceback.print_exc()
        status, reason = "fail", f"{type(e).__name__}: {e}".splitlines()[0][:500]
    out = {"name": name, "status": status, "reason": reason, "device": args.device,
           "seconds_inside": round(time.perf_counter() - t0, 3), "figures": _jsonable(st.figures),
           "failures": st.failures, "notes": st.notes}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"stage {name}: {status}" + (f" ({reason})" if reason else ""), flush=True)
    return 0 if status != "fail" else 1


# ------------------------------------------------------------------------------------ numerics


def strict_fp32() -> None:
    """fp32 means fp32 on the GPU too: no TF32 in matmuls (equivalence is judged at 1e-5)."""
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    except (AttributeError, RuntimeError, TypeError):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def deterministic_cuda() -> None:
    """Bitwise-repeatable CUDA runs (for comparing delayed with undelayed runs): deterministic
    algorithms and the math attention kernel (its backward has no atomics). The settings are
    global, so they also hold in autograd's device thread, where the executor's re-runs happen.
    ``warn_only``: an op without a deterministic kernel warns instead of failing the stage; the
    stage's two undelayed runs must still agree bitwise. (Deterministic mode also fills
    ``torch.empty`` with NaN, so a read of a slot before its copy landed shows as NaN.)"""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # must precede the first cuBLAS call
    torch.use_deterministic_algorithms(True, warn_only=True)
    for name in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        fn = getattr(torch.backends.cuda, name, None)
        if fn is not None:
            fn(False)
    torch.backends.cuda.enable_math_sdp(True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return 0.0 if diff == 0 else diff / max(scale, 1e-30)


# --------------------------------------------------------------------------- executor cases

TINY_FIELDS = dict(name="kit-tiny", num_layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, head_dim=16,
                   vocab=256)


def tiny_spec():
    """The 4-layer model of ``tests/test_executor.py`` (217,664 parameters)."""
    from lightning_lazytrain.planner import ModelSpec

    return ModelSpec(**TINY_FIELDS)


def _custom(L: int, homes, keep=None, res=None, off=None, rel=None, ioff=(), irel=()):
    from lightning_lazytrain.planner import Schedule

    return Schedule(num_layers=L, homes=tuple(homes), keep_internals=tuple(keep or [False] * L),
                    resident_weights=tuple(res or [False] * L), offload_window=tuple(off or [None] * (L + 1)),
                    reload_window=tuple(rel or [None] * (L + 1)), internals_offload_window=tuple(ioff),
                    internals_reload_window=tuple(irel), policy="custom")


def fixed_schedules(L: int = 4) -> dict:
    """Every routing of tensors the executor has, for a 4-layer stack (the same cases as
    ``tests/test_executor.py``); the MILP plan is added by :func:`milp_schedule`."""
    from lightning_lazytrain.planner import keep_all, megatrain, recompute_all

    assert L == 4, "the hand-written schedules are for 4 layers"
    return {
        "keep_all": keep_all(L),
        "recompute_all": recompute_all(L),
        "megatrain_K1": megatrain(L, 1),
        "megatrain_K2": megatrain(L, 2),
        "megatrain_K4": megatrain(L, 4),
        "cpu_homes": _custom(L, ["gpu", "cpu", "recompute", "cpu", "gpu"], off=[None, 1, None, 3, None],
                             rel=[None, 3, None, 4, None]),
        "nvme_homes": _custom(L, ["gpu", "nvme", "nvme", "gpu", "gpu"], off=[None, 1, 2, None, None],
                              rel=[None, 2, 3, None, None]),
        "kept_internals_resident": _custom(L, ["gpu", "gpu", "recompute", "gpu", "gpu"],
                                           keep=[True, False, False, True], res=[False, False, True, True]),
        "offloaded_internals": _custom(L, ["gpu", "gpu", "gpu", "cpu", "gpu"], keep=[True, True, True, False],
                                       off=[None, None, None, 3, None], rel=[None, None, None, 4, None],
                                       ioff=[1, 3, None, None], irel=[2, 4, None, None]),
    }


def big_host(name: str = "kit"):
    """Hardware with room for anything: only the schedules' relative footprints matter."""
    from lightning_lazytrain.planner import Hardware

    return Hardware(name=name, gpu_memory_bytes=1e12, gpu_memory_cap_bytes=1e12, peak_tflops=1, efficiency=1,
                    h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
                    nvme_capacity_bytes=1e12, cpu_memory_bytes=1e12, cpu_adam_params_per_s=1e9,
                    cpu_adam8_params_per_s=1e9)


def measure(model: torch.nn.Module, tokens: torch.Tensor, device: str, workdir: Path,
            compute_dtype: torch.dtype = torch.float32, **kw: Any):
    """A measured ``Workload`` of ``model`` on ``device`` (recompute_all, one micro-batch)."""
    from lightning_lazytrain.engine.executor import Executor
    from lightning_lazytrain.engine.profiler import measure_workload
    from lightning_lazytrain.planner import recompute_all

    m = copy.deepcopy(model)
    ex = Executor(m, recompute_all(len(m.layers)), device=device, nvme_dir=workdir, compute_dtype=compute_dtype)
    try:
        return measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=tokens[:, 1:].numel(), **kw)
    finally:
        ex.close()


def footprint_range(wl, hw=None) -> tuple[float, float]:
    """(smallest, keep-all) predicted peak device bytes of a workload."""
    from lightning_lazytrain.planner import keep_all, min_memory, simulate

    hw = hw or big_host()
    lo = simulate(min_memory(wl.num_layers), wl, hw).peak_gpu_bytes
    hi = simulate(keep_all(wl.num_layers), wl, hw).peak_gpu_bytes
    return lo, hi


def milp_schedule(wl, st: Stage | None = None, frac: float = 0.5):
    """The MILP plan at a device budget ``frac`` of the way from the smallest to the keep-all
    footprint: a mixed plan (some boundaries moved or recomputed)."""
    from lightning_lazytrain.planner import solve

    hw = big_host()
    lo, hi = footprint_range(wl, hw)
    res = solve(wl, hw.replace(gpu_memory_cap_bytes=lo + frac * (hi - lo)))
    if st is not None:
        st.figures.setdefault("milp", {}).update(
            {"status": res.status, "homes": list(res.schedule.homes), "keep_internals": list(res.schedule.keep_internals),
             "resident_weights": list(res.schedule.resident_weights), "cap_bytes": lo + frac * (hi - lo)})
        if res.status != "optimal":
            st.note(f"MILP status {res.status} (not optimal); its schedule is used anyway")
    return res.schedule


def make_batches(spec, steps: int, micro: int, batch: int = 2, seq: int = 32,
                 seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, spec.vocab, (batch, seq + 1), generator=g) for _ in range(micro)] for _ in range(steps)]


def tiny_model(seed: int = 0, spec=None) -> torch.nn.Module:
    from lightning_lazytrain.models import LlamaLM

    torch.manual_seed(seed)
    return LlamaLM(spec or tiny_spec())


@dataclass
class RunResult:
    """What one training run produced: per step the micro-batch losses, every parameter's
    gradient before the optimizer step and every parameter after it; the final eval loss."""

    losses: list[list[torch.Tensor]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    eval_loss: torch.Tensor | None = None
    stats: Any = None


def _snapshot(model: torch.nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        t = p.grad if grads else p
        out[n] = torch.zeros(p.shape) if t is None else t.detach().float().cpu().clone()
    return out


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The loss of the kit's ``LlamaLM`` (``model.loss``)."""
    return model.loss(tokens)


def hf_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The loss of a Hugging Face causal LM, called as a training loop calls it."""
    return model(input_ids=tokens, labels=tokens).loss


GPT2_FIELDS = dict(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.1,
                   embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A 4-block GPT-2 (``transformers.GPT2LMHeadModel`` from a config, no download) with dropout
    0.1 on embeddings, attention and residuals, eager attention: every re-run of a block must
    replay the forward's random state (CPU and CUDA generators) to be exact."""
    import transformers

    cfg = transformers.GPT2Config(**GPT2_FIELDS, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def _forward_ctx(device: str, autocast: torch.dtype | None):
    """Autocast around the forward only (as Lightning's bf16-mixed: backward runs outside it)."""
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=autocast)


def _eval_loss(m: torch.nn.Module, tokens: torch.Tensor, device: str, loss_fn, autocast) -> torch.Tensor:
    was = m.training
    m.eval()  # dropout off: the evaluation loss is deterministic
    try:
        with _forward_ctx(device, autocast):
            return loss_fn(m, tokens.to(device)).detach().float().cpu()
    finally:
        m.train(was)


def run_plain(model: torch.nn.Module, batches, device: str, lr: float = 0.05, *,
              loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = lm_loss,
              autocast: torch.dtype | None = None, seed: int | None = None) -> RunResult:
    """Plain autograd on ``device`` (fp32 parameters), SGD; the reference. ``autocast``: the
    forward (and the evaluation) under ``torch.autocast(dtype=autocast)`` over the fp32
    parameters, as ``precision="bf16-mixed"``; ``seed``: ``torch.manual_seed`` before the first
    step (models with dropout)."""
    m = copy.deepcopy(model).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    r = RunResult()
    if seed is not None:
        torch.manual_seed(seed)
    for step in batches:
        r.losses.append([])
        for tokens in step:
            with _forward_ctx(device, autocast):
                loss = loss_fn(m, tokens.to(device))
            loss.backward()
            r.losses[-1].append(loss.detach().float().cpu())
        r.grads.append(_snapshot(m, grads=True))
        opt.step()
        opt.zero_grad()
        r.params.append(_snapshot(m, grads=False))
    with torch.no_grad():
        r.eval_loss = _eval_loss(m, batches[0][0], device, loss_fn, autocast)
    return r


def run_executor(model: torch.nn.Module, schedule, batches, device: str, workdir: Path,
                 lr: float = 0.05, compute_dtype: torch.dtype = torch.float32,
                 on_executor: Callable[[Any], Callable[[], None] | None] | None = None,
                 on_stats: Callable[[Any, Any], None] | None = None,
                 loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = lm_loss,
                 autocast: torch.dtype | None = None, seed: int | None = None,
                 **executor_kwargs: Any) -> RunResult:
    """The same training through the executor (fp32 compute unless ``compute_dtype``: 16-bit
    compute copies of the fp32 masters, cast on the host lane; host SGD on the masters).
    ``loss_fn``, ``autocast`` and ``seed`` as in :func:`run_plain` (under ``autocast`` the fp32
    masters are streamed in fp32 and autocast casts them, as the strategy does for bf16-mixed).
    ``on_executor(ex)`` runs once the executor is built (it may return a cleanup, run before the
    executor closes); ``on_stats(ex, stats)`` after each step's last micro-batch, before the step.
    ``executor_kwargs`` go to the ``Executor`` (e.g. ``shard_group``)."""
    from lightning_lazytrain.engine.executor import Executor

    m = copy.deepcopy(model)
    ex = Executor(m, schedule, device=device, nvme_dir=workdir, compute_dtype=compute_dtype, **executor_kwargs)
    cleanup = on_executor(ex) if on_executor is not None else None
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    r = RunResult()
    if seed is not None:
        torch.manual_seed(seed)
    try:
        for step in batches:
            r.losses.append([])
            for k, tokens in enumerate(step):
                ex.begin_microbatch(first=k == 0, last=k == len(step) - 1)
                with _forward_ctx(device, autocast):
                    loss = loss_fn(m, tokens.to(device))
                loss.backward()
                stats = ex.end_microbatch()
                if stats is not None:
                    r.stats = stats
                    if on_stats is not None:
                        on_stats(ex, stats)
                r.losses[-1].append(loss.detach().float().cpu())
            r.grads.append(_snapshot(m, grads=True))
            opt.step()
            opt.zero_grad()
            r.params.append(_snapshot(m, grads=False))
        with ex.inference(), torch.no_grad():
            r.eval_loss = _eval_loss(m, batches[0][0], device, loss_fn, autocast)
    finally:
        if cleanup is not None:
            cleanup()
        ex.close()
    return r


def compare(got: RunResult, want: RunResult, *, exact: bool, tol: float) -> tuple[float, list[str]]:
    """(largest relative error, problems). ``exact``: every tensor must be bitwise equal."""
    worst, problems = 0.0, []

    def one(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        nonlocal worst
        if a.shape != b.shape:
            problems.append(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
            return
        e = rel_err(a, b)
        worst = max(worst, e)
        if exact and not torch.equal(a, b):
            problems.append(f"{what}: not bitwise equal (rel err {e:.2e})")
        elif not exact and not e <= tol:
            problems.append(f"{what}: rel err {e:.2e} > {tol:g}")

    for s, (la, lb) in enumerate(zip(got.losses, want.losses)):
        for k, (a, b) in enumerate(zip(la, lb)):
            one(f"step {s} micro {k} loss", a, b)
        for n in want.grads[s]:
            one(f"step {s} grad {n}", got.grads[s][n], want.grads[s][n])
            one(f"step {s} param {n}", got.params[s][n], want.params[s][n])
    if got.eval_loss is not None and want.eval_loss is not None:
        one("eval loss", got.eval_loss, want.eval_loss)
    return worst, problems


from delays import Delays, cuda_cycles_per_s  # noqa: E402,F401  (the stages and tests name kit.Delays)
