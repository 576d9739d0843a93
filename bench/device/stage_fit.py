"""Stage: end to end, a Lightning ``fit`` of the ~1B Llama with its optimizer -- lazytrain vs
``strategy="auto"`` vs torch FSDP2 CPU offload vs DeepSpeed ZeRO-3 offload.

CUDA: the 1.03B model of ``stage_throughput`` (20 layers, hidden 2048, GQA 16/4, SwiGLU 5632, vocab
32000) at ``--batch 32,8`` x ``--seq 1024`` on random token ids (no download). Each variant runs in
its own process (``stage_fit.py variant ...``) with its own timeout, one after the other, so a crash,
an OOM or a hang of one leaves the others' figures:

* ``lazytrain``: ``Trainer(strategy=LazyTrainStrategy(hardware="measure", gpu_memory_budget_gb=CAP,
  fp32_masters=True), precision="bf16-true")``, the project's ``LlamaLM`` in a ``CausalLMModule``,
  ``HybridAdamW(eight_bit="plan")`` (the default a user gets: the plan picks the smallest 8-bit
  slice host memory needs -- none on a host that holds the 32-bit states, which then run torch's
  fused AdamW kernel on the host; the update layer-pipelined when the plan says so; the slice
  chosen is recorded as ``eight_bit_chosen``). CAP is 40% (``--cap-frac``) of the way from the
  smallest to the keep-all footprint of the workload measured on the device (``kit.footprint_range``,
  as ``stage_throughput``); ``--cap-gb`` gives it instead. Its first step is the strategy's profile
  (then the plan), not timed.
* ``auto``: ``strategy="auto"``, ``precision="bf16-mixed"``, the same ``LlamaLM`` module, torch
  ``AdamW(fused=True)`` on the GPU. An OOM is recorded as such (``status: "oom"``).
* ``fsdp2_offload``: torch FSDP2 directly, in a plain loop (world size 1, NCCL): ``fully_shard`` per
  decoder layer and the root with ``CPUOffloadPolicy(pin_memory=True)`` and
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, activation checkpointing per layer
  (Hugging Face's, non-reentrant), torch ``AdamW`` on the CPU (``fused=True``, else ``foreach``).
* ``deepspeed_offload``: ``Trainer(strategy="deepspeed_stage_3_offload", precision="bf16-mixed")``
  (ZeRO-3, optimizer and parameters offloaded to the CPU), ``DeepSpeedCPUAdam`` (JIT-built with the
  image's compilers), activation checkpointing per layer as FSDP2's. When it cannot run (DeepSpeed
  not carried, no C++ compiler, no ``Python.h``, no ninja, the build fails) it records ``skipped``
  with the exact reason. Its CPU Adam is built in the background (``nice 19``) while ``auto`` runs
  (the GPU-bound variant), and the host-bound peers start only once that build is over.

The peers train a Hugging Face ``LlamaForCausalLM`` of the same shapes (a ``LlamaConfig``, no download;
the same parameter count): both wrappers hook a module's ``forward`` (FSDP2's unshard, ZeRO-3's
parameter fetch), and ``LlamaLM``'s training loss is a method beside it that reads the LM head's weight
directly (the chunked loss), which neither gathers; the Hugging Face model is also what a user of
these tools runs, and what the first FSDP2 measurement ran. Its loss is the same next-token
cross-entropy (fp32, over full logits: the peers' only extra work).

Per variant: steady-state step seconds (median of ``--timed`` steps after ``--warmup`` steps, each
step from one batch's start to the next's, CUDA synchronised), tokens/s, the optimizer's seconds on
the step's critical path (from ``on_before_optimizer_step`` -- after the backward -- to the batch's
end, synchronised; FSDP2: ``optimizer.step`` + ``zero_grad``), GPU busy fraction (one more step under
``torch.profiler``, CUDA activity: the union of kernel intervals over that step's wall, as
``stage_throughput``; the union of H2D / D2H copies beside it), ``max_memory_allocated`` and
``max_memory_reserved`` over the timed steps. lazytrain also: the plan's predicted step seconds and
peak, measured / predicted, busy seconds per lane of the last timed step
(``strategy.last_stats.segments``) and as predicted, achieved GB/s per lane, the HybridAdamW update's
own host seconds per step (overlapped with the GPU when pipelined), the plan's schedule and re-plans, and
the plan timed against its baselines (``races``; with ``--race`` only, before the timed steps).

Ratios: lazytrain's tokens/s over each peer's. Targets (reported, never a
failure): b32 >= 0.8x auto, >= 2x FSDP2 offload, GPU busy >= 0.8; b8 >= 0.35x auto, >= 1.5x FSDP2
offload; measured / predicted within 10%. Hard failures: only lazytrain's -- an error, an OOM, a
timeout, or its ``max_memory_reserved`` over the timed steps above the cap.

Time: the variants share the stage's budget (``--budget``, else the runner's timeout for this stage,
``KIT_STAGE_TIMEOUT_S``, less a margin); a variant gets ``min(its timeout, what is left)`` and one
that cannot start is recorded ``not_started``. Progress lines carry the wall clock and the seconds
since the stage started.

CPU rehearsal: the kit's tiny model (``tiny_spec``), fp32 (``32-true``; so no ``fp32_masters``, which
needs a 16-bit precision), batch 2 x 32, no warm-up, 2 timed steps (+ lazytrain's profiled one and
the profiler's); lazytrain and auto really run, FSDP2 runs on a gloo group (FSDP2 and its CPU offload
work on the CPU), DeepSpeed checks what it can (import, ninja, compiler, ``Python.h``,
``CPUAdamBuilder().is_compatible()``) and records ``skipped`` (CUDA only). GPU figures are recorded
as skipped with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import gc
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from kit import GB, TINY_FIELDS, Stage, footprint_range, stage_main

HERE = Path(__file__).resolve().parent
VARIANTS = ("lazytrain", "auto", "fsdp2_offload", "deepspeed_offload")
PEERS = ("auto", "fsdp2_offload", "deepspeed_offload")
HOST_BOUND = ("fsdp2_offload", "deepspeed_offload")  # start once the background CPU Adam build is over
# The 1.03B model of stage_throughput (ONE_B there), as fields
ONE_B_FIELDS = dict(name="kit-1b", num_layers=20, hidden=2048, intermediate=5632, heads=16, kv_heads=4, head_dim=128,
                    vocab=32000)
# Issue 22, point 2, by (batch, seq): lazytrain's tokens/s over auto's and FSDP2 offload's, GPU busy.
TARGETS: dict[tuple[int, int], dict[str, float]] = {
    (32, 1024): {"auto": 0.8, "fsdp2_offload": 2.0, "gpu_busy": 0.8},
    (8, 1024): {"auto": 0.35, "fsdp2_offload": 1.5},
}
PREDICTION_TOL = 0.10  # measured / predicted step within 10%
CUDA_TIMEOUTS = {"lazytrain": 150, "auto": 80, "fsdp2_offload": 100, "deepspeed_offload": 150}
CPU_TIMEOUTS = {v: 120 for v in VARIANTS}
DS_BUILD_TIMEOUT = 240
MIN_START_S = 20.0  # a variant is not started with less left than this
T0 = time.perf_counter()


def say(msg: str) -> None:
    """A progress line: wall clock and seconds since this process started."""
    print(f"[{dt.datetime.now():%H:%M:%S} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def first_line(err: BaseException, n: int = 400) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0][:n] if text else type(err).__name__


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


# ------------------------------------------------------------------------------------- parent side


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batch", default=None, help="comma-separated batch sizes (default: 32,8 on CUDA, 2 on the CPU)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default: 1024 on CUDA, 32 on the CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps before the timed ones (default: 2 on "
                    "CUDA, 0 on the CPU; lazytrain's profiled first step comes before them)")
    ap.add_argument("--timed", type=int, default=None, help="timed steps, median reported (default: 5 on CUDA, 2 on "
                    "the CPU)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    ap.add_argument("--cap-frac", type=float, default=0.4, help="lazytrain's budget: this fraction of the way from "
                    "the smallest to the keep-all footprint")
    ap.add_argument("--cap-gb", type=float, default=None, help="lazytrain's budget in GB (instead of --cap-frac)")
    ap.add_argument("--timeouts", default="", help="per-variant timeouts, e.g. lazytrain=150,auto=80 (default: "
                    + ",".join(f"{k}={v}" for k, v in CUDA_TIMEOUTS.items()) + " on CUDA, 120 each on the CPU)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole stage (default: the runner's "
                    "timeout KIT_STAGE_TIMEOUT_S less 12 s, else 380)")
    ap.add_argument("--no-peer-checkpointing", action="store_true",
                    help="the peers without activation checkpointing")
    ap.add_argument("--updates-at-step", action="store_true",
                    help="lazytrain's HybridAdamW updates every layer after the backward (pipelined under the next "
                         "forward) instead of each block during the backward (updates_in_backward=True, the default: "
                         "no clip and no non-finite skip, as the peers' AdamW)")
    ap.add_argument("--race", action="store_true",
                    help="lazytrain times its plan against its baselines before the timed steps (core/plan_race.py; "
                         "on by default on CUDA in real use: off here by default, the throughput stage compares the "
                         "MILP plan with MegaTrain's schedule, and the race's 13 extra steps would take the fit's "
                         "device time)")
    ap.add_argument("--no-prebuild", action="store_true",
                    help="build DeepSpeed's CPU Adam in its own variant instead of in the background during auto")


def _parse_timeouts(text: str, cuda: bool) -> dict[str, float]:
    out = dict(CUDA_TIMEOUTS if cuda else CPU_TIMEOUTS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in out or not value:
            raise ValueError(f"--timeouts: {part!r}: give variant=seconds with a variant from {list(out)}")
        out[name] = float(value)
    return out


def _die_with_parent() -> None:
    """In a child: SIGKILL when the stage process dies (the runner kills the stage's process group on
    its timeout; a variant in a session of its own would outlive it and hold the GPU)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the child may outlive a killed stage
        pass


def _nice_and_die_with_parent() -> None:
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(19)


class Job:
    """A child process (its own session, killed with its descendants on timeout) writing ``out``."""

    def __init__(self, cmd: list[str], out: Path, timeout: float, env: dict[str, str], nice: bool = False) -> None:
        self.out, self.timeout = out, timeout
        out.unlink(missing_ok=True)
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=HERE.parents[1], env=env, start_new_session=True,
                                     preexec_fn=_nice_and_die_with_parent if nice else _die_with_parent)
        self.rc: int | None = None
        self.timed_out = False

    def left(self) -> float:
        return self.timeout - (time.perf_counter() - self.t0)

    def wait(self, limit: float | None = None) -> bool:
        """Wait until it ends, its timeout, or ``limit`` seconds; kill it at its timeout. True when ended."""
        if self.rc is not None:
            return True
        budget = self.left() if limit is None else min(limit, self.left())
        try:
            self.rc = self.proc.wait(timeout=max(0.0, budget))
            return True
        except subprocess.TimeoutExpired:
            if self.left() > 0:
                return False
            self.kill()
            return True

    def kill(self) -> None:
        if self.rc is None:
            self.timed_out = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # this job's own session, started above
            self.rc = self.proc.wait()

    @property
    def seconds(self) -> float:
        return round(time.perf_counter() - self.t0, 2)

    def result(self) -> dict:
        doc: dict = {}
        if self.out.is_file():
            with contextlib.suppress(ValueError, OSError):
                doc = json.loads(self.out.read_text())
        return doc


def _label(batch: int, seq: int) -> str:
    return f"b{batch}x{seq}"


def ratios_and_targets(batch: int, seq: int, variants: dict[str, dict]) -> tuple[dict, dict]:
    """lazytrain's tokens/s over each peer's (None where either was not measured, with the reason), and
    the speed targets for this shape as {name: {target, value, met}} (``met`` None: not measured)."""
    lt = variants.get("lazytrain", {})
    ratios: dict[str, Any] = {}
    why: dict[str, str] = {}
    for peer in PEERS:
        other = variants.get(peer, {})
        key = f"lazytrain_over_{peer}"
        if lt.get("tokens_per_s") and other.get("tokens_per_s"):
            ratios[key] = lt["tokens_per_s"] / other["tokens_per_s"]
        else:
            ratios[key] = None
            missing = [(n, v) for n, v in (("lazytrain", lt), (peer, other)) if not v.get("tokens_per_s")]
            why[key] = "; ".join(f"{n} {v.get('status', 'not run')}" + (f": {v['reason']}" if v.get("reason") else "")
                                 for n, v in missing)
    if why:
        ratios["why_none"] = why
    targets: dict[str, dict] = {}
    want = TARGETS.get((batch, seq), {})
    for peer in ("auto", "fsdp2_offload"):
        if peer in want:
            value = ratios.get(f"lazytrain_over_{peer}")
            targets[f"lazytrain_over_{peer}"] = {"target": f">= {want[peer]:g}", "value": value,
                                                 "met": None if value is None else value >= want[peer]}
    if "gpu_busy" in want:
        value = lt.get("gpu_busy_fraction")
        targets["gpu_busy_fraction"] = {"target": f">= {want['gpu_busy']:g}", "value": value,
                                        "met": None if value is None else value >= want["gpu_busy"]}
    value = lt.get("measured_over_predicted")
    targets["measured_over_predicted"] = {"target": f"within {PREDICTION_TOL:.0%} of 1", "value": value,
                                          "met": None if value is None else abs(value - 1) <= PREDICTION_TOL}
    if not want:
        targets["note"] = "the speed targets are for 8 x 1024 and 32 x 1024; here only measured / predicted"
    return ratios, targets


def _stale_locks(ext_dir: Path) -> list[str]:
    """torch's extension builds lock ``<dir>/<name>/lock``; a build killed before it let go leaves it, and the
    next build would wait on it for ever. No build runs when the stage starts: drop them."""
    gone = []
    for lock in ext_dir.glob("*/lock"):
        with contextlib.suppress(OSError):
            lock.unlink()
            gone.append(str(lock))
    return gone


def body(st: Stage, args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    batches = [int(b) for b in (args.batch or ("32,8" if cuda else "2")).split(",") if b.strip()]
    seq = args.seq or (1024 if cuda else 32)
    warmup = args.warmup if args.warmup is not None else (2 if cuda else 0)
    timed = args.timed if args.timed is not None else (5 if cuda else 2)
    if timed < 1 or warmup < 0 or not batches or min(batches) < 1:
        raise ValueError(f"need --timed >= 1, --warmup >= 0 and batch sizes >= 1 (got {timed}, {warmup}, {batches})")
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(wanted) - set(VARIANTS)
    if unknown:
        raise ValueError(f"--variants: unknown {sorted(unknown)}; from {list(VARIANTS)}")
    timeouts = _parse_timeouts(args.timeouts, cuda)
    runner_s = os.environ.get("KIT_STAGE_TIMEOUT_S")
    budget = args.budget if args.budget is not None else (float(runner_s) - 12 if runner_s else 380.0)
    deadline = T0 + budget
    spec = ONE_B_FIELDS if cuda else TINY_FIELDS
    # Order: lazytrain (the subject) at every batch, then auto, then the slow host-bound peers.
    jobs = [(v, b) for v in VARIANTS if v in wanted for b in batches]
    ext_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(tempfile.gettempdir()) / "lazytrain-kit-torch-ext")
    ext_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    st.figures.update({
        "model": spec, "peer_model": "transformers.LlamaForCausalLM(LlamaConfig(...)) of the same shapes",
        "device": args.device, "batches": [[b, seq] for b in batches], "warmup": warmup, "timed": timed,
        "order": [f"{v} {_label(b, seq)}" for v, b in jobs], "budget_s": round(budget, 1),
        "timeouts_s": timeouts, "cap_frac": args.cap_frac, "cap_gb_given": args.cap_gb,
        "peer_activation_checkpointing": not args.no_peer_checkpointing, "torch_extensions_dir": str(ext_dir),
        "runs": {}})
    dropped = _stale_locks(ext_dir)
    if dropped:
        st.note(f"removed stale torch extension build locks (a killed build's): {dropped}")
    say(f"fit: {len(jobs)} runs ({', '.join(st.figures['order'])}); warm-up {warmup}, timed {timed}; budget "
        f"{budget:.0f} s")

    def child_cmd(kind: str, out: Path, *extra: str) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), kind, "--device", args.device, "--out", str(out),
                "--workdir", str(args.workdir), *extra]

    build: Job | None = None
    build_info: dict = {"status": "not started"}
    prebuild = cuda and "deepspeed_offload" in wanted and not args.no_prebuild
    overlapped: list[str] = []

    def finish_build(limit: float | None) -> None:
        nonlocal build
        if build is None:
            return
        if not build.wait(limit):
            build_info["status"] = "still running"
            return
        doc = build.result()
        build_info.update(doc)
        build_info["seconds"] = build.seconds
        build_info["overlapped_with"] = list(overlapped)
        if build.timed_out:
            build_info.update(status="timeout", reason=f"killed after {build.timeout:.0f} s")
            _stale_locks(ext_dir)
        elif not doc:
            build_info.update(status="error", reason=f"exited with status {build.rc} without a result")
        say(f"fit: DeepSpeed CPU Adam background build {build_info.get('status')} in {build.seconds:.1f} s"
            + (f" ({build_info['reason']})" if build_info.get("reason") else ""))
        build = None

    for variant, batch in jobs:
        label = _label(batch, seq)
        run = st.figures["runs"].setdefault(label, {"batch": batch, "seq": seq, "tokens_per_step": batch * seq,
                                                    "variants": {}})
        if prebuild and build is None and build_info["status"] == "not started" and variant != "lazytrain":
            out = args.workdir / "deepspeed-build.json"
            say("fit: building DeepSpeed's CPU Adam in the background (nice 19) while the GPU-bound variants run")
            build = Job(child_cmd("ds-build", out), out, min(DS_BUILD_TIMEOUT, max(1.0, deadline - time.perf_counter())),
                        env, nice=True)
            build_info["status"] = "running"
        if variant in HOST_BOUND and build is not None:
            say("fit: waiting for the background CPU Adam build before the host-bound peers")
            finish_build(max(0.0, deadline - time.perf_counter() - MIN_START_S))
        left = deadline - time.perf_counter()
        if left < MIN_START_S:
            run["variants"][variant] = {"status": "not_started",
                                        "reason": f"the stage's {budget:.0f} s budget is spent ({left:.0f} s left)"}
            say(f"fit: {variant} {label}: not started ({left:.0f} s left)")
            continue
        timeout = min(timeouts[variant], left - 2)
        out = args.workdir / f"{variant}-{label}.json"
        extra = ["--variant", variant, "--batch", str(batch), "--seq", str(seq), "--warmup", str(warmup),
                 "--timed", str(timed), "--cap-frac", str(args.cap_frac)]
        if args.cap_gb is not None:
            extra += ["--cap-gb", str(args.cap_gb)]
        if args.no_peer_checkpointing:
            extra.append("--no-peer-checkpointing")
        if args.updates_at_step:
            extra.append("--updates-at-step")
        if getattr(args, "race", False):
            extra.append("--race")
        say(f"fit: {variant} {label} started (timeout {timeout:.0f} s)")
        job = Job(child_cmd("variant", out, *extra), out, timeout, env)
        if build is not None:
            overlapped.append(f"{variant} {label}")
        job.wait()
        res = job.result()
        res["seconds"] = job.seconds
        if job.timed_out:
            res.update(status="timeout", reason=f"timed out after {timeout:.0f} s (last phase: {res.get('phase')})")
        elif not res:
            res.update(status="error", reason=f"exited with status {job.rc} without a result (see log.txt)")
        elif res.get("status") == "running":
            res.update(status="error", reason=f"exited with status {job.rc} in phase {res.get('phase')}")
        run["variants"][variant] = res
        say(f"fit: {variant} {label}: {res.get('status')} in {job.seconds:.1f} s"
            + (f", {res['tokens_per_s']:,.0f} tokens/s, step {res['median_step_seconds']:.3f} s"
               if res.get("tokens_per_s") else "")
            + (f" ({res['reason']})" if res.get("reason") else ""))
        if build is not None and build.rc is None and build.proc.poll() is not None:
            finish_build(0)
    finish_build(0 if build is None else max(0.0, min(build.left(), deadline - time.perf_counter())))
    if build is not None:
        build.kill()
        build_info.update(status="killed", reason="the stage ended first")
        _stale_locks(ext_dir)
    if prebuild:
        st.figures["deepspeed_build"] = build_info

    # ratios, targets, the hard checks (lazytrain only)
    for label, run in st.figures["runs"].items():
        variants = run["variants"]
        run["ratios"], run["targets"] = ratios_and_targets(run["batch"], run["seq"], variants)
        lt = variants.get("lazytrain")
        if lt is not None:
            if lt.get("status") != "measured":
                st.fail(f"lazytrain {label}: {lt.get('status')}" + (f": {lt['reason']}" if lt.get("reason") else ""))
            elif cuda and lt.get("max_memory_reserved_gb") is not None and lt.get("cap_gb") is not None:
                st.check(lt["max_memory_reserved_gb"] <= lt["cap_gb"],
                         f"lazytrain {label}: max_memory_reserved {lt['max_memory_reserved_gb']:.2f} GB over the timed "
                         f"steps > cap {lt['cap_gb']:.2f} GB (allocated {lt.get('max_memory_allocated_gb', 0):.2f} GB)")
        for peer in PEERS:
            v = variants.get(peer)
            if v is not None and v.get("status") not in ("measured", "skipped"):
                st.note(f"{peer} {label}: {v.get('status')}" + (f": {v['reason']}" if v.get("reason") else ""))
        missed = [k for k, t in run["targets"].items() if isinstance(t, dict) and t.get("met") is False]
        if cuda and missed:
            st.note(f"{label}: targets missed: " + ", ".join(
                f"{k} {run['targets'][k]['value']:.3g} (want {run['targets'][k]['target']})" for k in missed))
        say(f"fit: {label} ratios " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} -"
                                                for k, v in run["ratios"].items() if k != "why_none"))


# -------------------------------------------------------------------------------------- child side


class Clock:
    """Times one run's steps. Step k's timestamps come from the training loop: ``start(k)`` at the
    batch's start, ``before_optimizer()`` once its backward is done, ``end(k)`` at its end (each after a
    CUDA synchronise). Steps: ``lead`` (lazytrain: the profiled first step and the plan), ``warmup``,
    ``timed`` (each from its start to the next step's start), then one step under ``torch.profiler``.
    Memory peaks: reset at the first timed step's start, sampled at each timed step's end."""

    def __init__(self, dev: str, lead: int, warmup: int, timed: int) -> None:
        self.dev, self.cuda = dev, dev == "cuda"
        self.first_timed = lead + warmup
        self.profiled = self.first_timed + timed
        self.total = self.profiled + 1
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self.opt_starts: dict[int, float] = {}
        # the forward / backward split of each step (Note: [phase marks]): CUDA events on the compute stream
        # (no synchronise: the host runs ahead as in training), perf_counter on the CPU
        self.marks: dict[int, dict[str, Any]] = {}
        self.k = -1
        self.reset_peak: Callable[[], None] = (lambda: torch.cuda.reset_peak_memory_stats()) if self.cuda else (
            lambda: None)
        self.peak_allocated: Callable[[], int] = (lambda: torch.cuda.max_memory_allocated()) if self.cuda else (
            lambda: 0)
        self.allocated = 0
        self.reserved = 0
        self.hooks: dict[str, list[Callable[[], None]]] = {"first_timed": [], "last_timed": [], "profiled_start": [],
                                                            "done": []}
        self.prof: Any = None
        self.prof_t0 = 0.0
        self.gpu_busy: dict | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _run(self, name: str) -> None:
        for fn in self.hooks[name]:
            fn()

    def _mark(self, name: str) -> None:
        """Note: [phase marks] A phase boundary of step ``k``: on CUDA an event on the current stream, which
        the GPU passes once the work queued before it is done -- the forward's end as the device ran it,
        its waits for host updates included -- without stopping the host; on the CPU the time now."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.setdefault(self.k, {})[name] = ev
        else:
            self.marks.setdefault(self.k, {})[name] = time.perf_counter()

    def _between(self, k: int, a: str, b: str) -> float | None:
        m = self.marks.get(k, {})
        if a not in m or b not in m:
            return None
        return m[a].elapsed_time(m[b]) / 1e3 if self.cuda else m[b] - m[a]

    def start(self, k: int) -> None:
        self.sync()
        self.k = k
        self.starts[k] = time.perf_counter()
        self._mark("start")
        if k == self.first_timed:
            self.reset_peak()
            self._run("first_timed")
        if k == self.profiled:
            self._run("profiled_start")
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU])
            self.prof.start()
            self.sync()
            self.prof_t0 = time.perf_counter()
        if k in (0, self.first_timed, self.profiled):
            say(f"step {k} of {self.total}: " + ("first" if k == 0 else "timed steps start" if k == self.first_timed
                                                 else "profiled step"))

    def before_backward(self) -> None:
        self._mark("backward")

    def before_optimizer(self) -> None:
        self.sync()
        self.opt_starts[self.k] = time.perf_counter()
        self._mark("optimizer")

    def end(self, k: int) -> None:
        self.sync()
        self.ends[k] = time.perf_counter()
        if self.first_timed <= k < self.profiled and self.cuda:
            self.allocated = max(self.allocated, int(self.peak_allocated()))
            self.reserved = max(self.reserved, int(torch.cuda.max_memory_reserved()))
        if k == self.profiled - 1:
            self._run("last_timed")
        if k == self.profiled and self.prof is not None:
            wall = self.ends[k] - self.prof_t0
            self.prof.stop()
            self.gpu_busy = parse_profile(self.prof, wall, self.cuda)
            self.prof = None
            self._run("done")

    def result(self, tokens_per_step: int) -> dict:
        timed = [self.starts[k + 1] - self.starts[k] for k in range(self.first_timed, self.profiled)
                 if k in self.starts and k + 1 in self.starts]
        first = [self.starts[k + 1] - self.starts[k] for k in range(0, self.first_timed)
                 if k in self.starts and k + 1 in self.starts]
        opt = [self.ends[k] - self.opt_starts[k] for k in range(self.first_timed, self.profiled)
               if k in self.ends and k in self.opt_starts]
        out: dict = {"steps_run": len(self.starts), "untimed_step_seconds": [round(s, 4) for s in first],
                     "step_seconds": [round(s, 4) for s in timed]}
        if timed:
            med = statistics.median(timed)
            out.update(median_step_seconds=med, tokens_per_s=tokens_per_step / med)
        if opt:
            out["optimizer_seconds"] = statistics.median(opt)
            out["optimizer_seconds_each"] = [round(s, 4) for s in opt]
        # Note: [phase marks]: the timed steps' forward (from the step's start: T's waits for the updated
        # non-block weights and block 0 included) and backward (to the optimizer step), medians
        phases = {}
        for name, (a, b) in {"forward": ("start", "backward"), "backward": ("backward", "optimizer")}.items():
            got = [x for k in range(self.first_timed, self.profiled) if (x := self._between(k, a, b)) is not None]
            if got:
                phases[name] = round(statistics.median(got), 4)
        if phases:
            out["phase_seconds"] = phases
        if self.cuda and timed:
            out["max_memory_allocated_gb"] = self.allocated / GB
            out["max_memory_reserved_gb"] = self.reserved / GB
        if self.gpu_busy is not None:
            out["gpu_busy"] = self.gpu_busy
            out["gpu_busy_fraction"] = self.gpu_busy.get("gpu_busy_fraction")
            if self.cuda and timed and self.gpu_busy.get("kernel_seconds"):
                out["gpu_busy_fraction_of_median_step"] = self.gpu_busy["kernel_seconds"] / statistics.median(timed)
        return out


def parse_profile(prof: Any, wall: float, cuda: bool) -> dict:
    """GPU busy figures of a profiled step (``stage_throughput.gpu_busy_from_events``) plus the union of
    the H2D and D2H copies (the GPU's copy lanes)."""
    from stage_throughput import gpu_busy_from_events
    from torch.autograd import DeviceType

    device_types = {DeviceType.CUDA, getattr(DeviceType, "PrivateUse1", DeviceType.CUDA)}
    events = [(e.name, e.device_type in device_types, e.time_range.start, e.time_range.end) for e in prof.events()]
    out = gpu_busy_from_events(events, wall)
    out.update(copy_lanes(events), events=len(events))
    if not cuda:
        out.update(status="skipped", reason="CUDA only: the CPU rehearsal has no GPU kernels (the profiled step ran)",
                   gpu_busy_fraction=None)
    else:
        out["status"] = "measured"
    return out


def copy_lanes(events) -> dict:
    """Seconds the profiled step's H2D and D2H copies kept each direction busy (union of intervals)."""
    from stage_throughput import interval_union

    lanes: dict[str, list] = {"h2d": [], "d2h": []}
    for name, dev, a, b in events:
        low = name.lower()
        if dev and low.startswith("memcpy"):
            if "htod" in low:
                lanes["h2d"].append((a, b))
            elif "dtoh" in low:
                lanes["d2h"].append((a, b))
    return {f"{k}_copy_seconds": round(interval_union(v) / 1e6, 6) for k, v in lanes.items()}


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


def lane_figures(stats: Any, sim: Any) -> dict:
    """Busy seconds per lane of a measured step (``StepStats.segments``, summed as ``stage_throughput``)
    and as the plan predicted, and the achieved GB/s per lane (bytes / the lane's busy union)."""
    from stage_throughput import lane_rates

    out: dict = {}
    if stats is not None:
        busy: dict[str, float] = {}
        for seg in stats.segments:
            busy[seg.lane] = busy.get(seg.lane, 0.0) + seg.end - seg.start
        out["lane_busy_seconds"] = {k: round(v, 4) for k, v in sorted(busy.items())}
        out["lane_gb_per_s"] = lane_rates(stats.segments, dict(stats.lane_bytes))
        out["lane_bytes"] = {k: int(v) for k, v in stats.lane_bytes.items()}
    if sim is not None:
        pbusy: dict[str, float] = {}
        for seg in sim.timeline:
            pbusy[seg.lane] = pbusy.get(seg.lane, 0.0) + seg.end - seg.start
        out["predicted_lane_busy_seconds"] = {k: round(v, 4) for k, v in sorted(pbusy.items())}
        out["predicted_lane_gb_per_s"] = {k: v["gb_per_s"] for k, v in lane_rates(sim.timeline).items()}
        opt = [s for s in sim.timeline if s.kind == "optimizer"]
        out["predicted_optimizer_seconds"] = round(sum(s.end - s.start for s in opt), 4)
    return out


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


def profile_lines(prof: Any, top: int = 45) -> list[str]:
    """The main thread's cProfile of the timed steps: the ``top`` functions by cumulative seconds."""
    import io
    import pstats

    lines = []
    for key, n in (("cumulative", top), ("tottime", 15)):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(n)
        text = re.sub(r"\S*/(site-packages|lightning_lazytrain)/", r"\1/", buf.getvalue())
        lines += [f"# by {key}"] + [line.rstrip()[:200] for line in text.splitlines() if line.strip()][:n + 12]
    return lines


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


def ensure_ninja() -> str | None:
    """The ``ninja`` torch's JIT builds run: on PATH, else the carried ``ninja`` wheel's (``<site>/bin`` after
    ``pip install --target``, or the package's ``BIN_DIR``), put on PATH."""
    from torch.utils.cpp_extension import is_ninja_available

    if is_ninja_available():
        return shutil.which("ninja")
    dirs = [Path(p) / "bin" for p in sys.path if p]
    with contextlib.suppress(Exception):
        import ninja

        if getattr(ninja, "BIN_DIR", ""):
            dirs.insert(0, Path(ninja.BIN_DIR))
    for d in dirs:
        exe = d / "ninja"
        if exe.is_file():
            if not os.access(exe, os.X_OK):
                with contextlib.suppress(OSError):
                    exe.chmod(0o755)
            os.environ["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
            if is_ninja_available():
                return str(exe)
    return None


def deepspeed_preflight(cuda: bool) -> dict:
    """What DeepSpeed's CPU Adam needs to be JIT-built here. Raises ``Skip`` with the exact reason when
    something is missing (or on the CPU, after checking the rest)."""
    info: dict = {}
    try:
        import deepspeed
    except Exception as err:  # noqa: BLE001 - recorded
        raise Skip(f"deepspeed is not importable ({first_line(err, 200)}): carry it (fetch_wheels.py ships it when "
                   "it is installed where the wheels are fetched: pip install deepspeed)") from None
    info["deepspeed"] = deepspeed.__version__
    problems = []
    info["ninja"] = ensure_ninja()
    if info["ninja"] is None:
        problems.append("no ninja (torch's JIT builds need it: the carried ninja wheel, or ninja on PATH)")
    cxx = os.environ.get("CXX", "c++")
    info["cxx"] = shutil.which(cxx)
    if info["cxx"] is None:
        problems.append(f"no C++ compiler: {cxx!r} is not on PATH (torch builds with $CXX, default c++)")
    else:
        with contextlib.suppress(Exception):
            info["cxx_version"] = subprocess.run([info["cxx"], "--version"], capture_output=True, text=True,
                                                 timeout=20).stdout.splitlines()[0]
    include = sysconfig.get_paths().get("include", "")
    info["python_h"] = str(Path(include) / "Python.h")
    if not (Path(include) / "Python.h").is_file():
        problems.append(f"no Python.h in {include} (the interpreter's development headers)")
    from torch.utils import cpp_extension

    info["cuda_home"] = cpp_extension.CUDA_HOME
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        builder = CPUAdamBuilder()
        info["cpu_adam_builder"] = f"{type(builder).__module__}.{type(builder).__name__}"
        info["cpu_adam_compatible"] = bool(builder.is_compatible(verbose=False))
        if not info["cpu_adam_compatible"]:
            problems.append(f"CPUAdamBuilder().is_compatible() is False: {getattr(builder, 'error_log', '')}")
    except Exception as err:  # noqa: BLE001 - recorded
        problems.append(f"CPUAdamBuilder: {first_line(err, 200)}")
    info["problems"] = problems
    if not cuda:
        raise Skip("CUDA only: Lightning's DeepSpeed strategy (ZeRO-3 offload) needs a GPU; checked here: "
                   + ("; ".join(problems) if problems else "deepspeed imports, ninja, a C++ compiler and Python.h "
                      "are there and CPUAdamBuilder().is_compatible()"), info)
    if problems:
        raise Skip("DeepSpeedCPUAdam cannot be JIT-built on this image: " + "; ".join(problems), info)
    return info


def build_cpu_adam(info: dict) -> None:
    """JIT-build (or load the built) DeepSpeed CPU Adam; raises ``Skip`` with the compiler's own error."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    t0 = time.perf_counter()
    try:
        CPUAdamBuilder().load(verbose=False)
    except Exception as err:  # noqa: BLE001 - recorded
        lines = [ln for ln in str(err).splitlines() if "error" in ln.lower()] or str(err).splitlines()[-5:]
        info["build_error"] = "\n".join(lines[:8])[:1500]
        raise Skip(f"DeepSpeedCPUAdam's JIT build failed: {' | '.join(lines[:3])[:500]}", info) from None
    info["build_or_load_seconds"] = round(time.perf_counter() - t0, 2)


def run_deepspeed(a: argparse.Namespace, res: dict, save: Callable[..., None]) -> None:
    cuda = a.device == "cuda"
    save(phase="preflight")
    try:
        res["preflight"] = deepspeed_preflight(cuda)
        save(phase="cpu_adam build")
        build_cpu_adam(res["preflight"])
    except Skip as s:
        res["preflight"] = s.info
        raise
    say(f"deepspeed_offload: CPU Adam ready in {res['preflight']['build_or_load_seconds']:.1f} s")
    import lightning as L

    spec = ONE_B_FIELDS
    ckpt = not a.no_peer_checkpointing
    clock = Clock(a.device, 0, a.warmup, a.timed)
    data = token_batches(clock.total, a.batch, a.seq, spec["vocab"])
    module = fit_module("ds_cpu_adam", model=hf_llama(spec, a.seq, a.device, ckpt))
    res["parameters"] = sum(p.numel() for p in module.parameters())
    res["settings"] = {"strategy": "deepspeed_stage_3_offload (ZeRO-3, optimizer and parameters offloaded to the CPU)",
                       "precision": "bf16-mixed",
                       "optimizer": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), lr 3e-4, weight decay 0.1",
                       "activation_checkpointing": "per decoder layer (Hugging Face, non-reentrant)" if ckpt else "off",
                       "model": "transformers.LlamaForCausalLM, fp32 cross-entropy over full logits"}
    trainer = L.Trainer(strategy="deepspeed_stage_3_offload", precision="bf16-mixed",
                        **trainer_kwargs(a.workdir / "deepspeed", clock, cuda))
    save(phase="fit")
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader(data))
    res["fit_seconds"] = round(time.perf_counter() - t0, 2)
    res.update(clock.result(a.batch * a.seq))
    res["optimizer_note"] = "the DeepSpeed engine's step (CPU Adam on the offloaded fp32 states), after the backward"


class Skip(Exception):
    """A variant that cannot run here: recorded ``skipped`` with this reason (``info``: what was found)."""

    def __init__(self, reason: str, info: dict | None = None) -> None:
        super().__init__(reason)
        self.info = info or {}


RUNNERS = {"lazytrain": run_lazytrain, "auto": run_auto, "fsdp2_offload": run_fsdp2,
           "deepspeed_offload": run_deepspeed}


def child_main(kind: str, argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=f"stage_fit.py {kind}: one run of the fit stage")
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--timed", type=int, default=2)
    ap.add_argument("--cap-frac", type=float, default=0.4)
    ap.add_argument("--cap-gb", type=float, default=None)
    ap.add_argument("--no-peer-checkpointing", action="store_true")
    ap.add_argument("--updates-at-step", action="store_true")
    ap.add_argument("--race", action="store_true")
    a = ap.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    res: dict = {"status": "running", "phase": "start", "variant": a.variant, "batch": [a.batch, a.seq]}

    def save(**kw: Any) -> None:
        res.update(kw)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
        tmp.replace(a.out)

    save()
    try:
        if a.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        if kind == "ds-build":
            res["variant"] = "deepspeed CPU Adam build"
            try:
                res["preflight"] = deepspeed_preflight(a.device == "cuda")
                build_cpu_adam(res["preflight"])
                res.update(status="built", reason=None)
            except Skip as s:
                res.update(status="skipped", reason=str(s), preflight=s.info)
        else:
            say(f"{a.variant} {_label(a.batch, a.seq)}: {a.device}, warm-up {a.warmup}, timed {a.timed}")
            RUNNERS[a.variant](a, res, save)
            res.update(status="measured" if res.get("tokens_per_s") else "error",
                       reason=None if res.get("tokens_per_s") else "no timed step completed")
    except Skip as s:
        res.update(status="skipped", reason=str(s))
        say(f"{a.variant}: skipped: {s}")
    except BaseException as err:  # noqa: BLE001 - recorded; the parent goes on with the next run
        traceback.print_exc()
        res.update(status="oom" if is_oom(err) else "error", reason=first_line(err))
    res["phase"] = "done"
    save()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("variant", "ds-build"):
        raise SystemExit(child_main(sys.argv[1], sys.argv[2:]))
    raise SystemExit(stage_main("fit", body, add_args))
