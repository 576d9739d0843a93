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

The child side lives beside this file: ``fit_clock.py`` (the step clock, the profile figures, the
progress lines), ``fit_variants.py`` (lazytrain, auto, FSDP2 and their model / data helpers),
``fit_deepspeed.py`` (DeepSpeed's preflight, CPU Adam build and run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kit import TINY_FIELDS, Stage, stage_main
from fit_clock import T0, first_line, is_oom, say
from fit_deepspeed import Skip, build_cpu_adam, deepspeed_preflight, run_deepspeed
from fit_variants import ONE_B_FIELDS, run_auto, run_fsdp2, run_lazytrain

HERE = Path(__file__).resolve().parent
VARIANTS = ("lazytrain", "auto", "fsdp2_offload", "deepspeed_offload")
PEERS = ("auto", "fsdp2_offload", "deepspeed_offload")
HOST_BOUND = ("fsdp2_offload", "deepspeed_offload")  # start once the background CPU Adam build is over
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
