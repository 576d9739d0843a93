"""Run the device kit's stages, each in its own process with its own timeout.

    python bench/device/run_checks.py OUTDIR              # on a CUDA machine
    python bench/device/run_checks.py --rehearse OUTDIR   # here: every stage that can run on the CPU

Normally started by ``check.sh`` (which first installs the carried wheels). Every stage runs with
the interpreter that runs this script (``sys.executable``, recorded as ``environment.executable``),
never a ``python3`` looked up on ``PATH``. Writes
``OUTDIR/results.json`` after every stage (so a run cut short still leaves what it did) and
``OUTDIR/log.txt`` (every stage's output). Exit status: 0 when no stage failed, 1 otherwise,
2 when the run could not start (no CUDA device without ``--rehearse``).

``results.json``: ``{"mode", "ok", "seconds", "environment", "stages": [...]}``; one entry per stage
with ``name``, ``status`` (pass / fail / skipped), ``seconds`` (wall, including the process's
imports), ``reason`` (when skipped or failed), ``figures``, ``failures`` and ``notes``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@dataclass(frozen=True)
class StageSpec:
    """``args`` (``--out``/``--device``/``--name`` are added); ``cpu_args`` replace ``args`` in a
    rehearsal; ``cuda_only``: recorded as skipped in a rehearsal without starting it; ``opt_in``: on the
    device, run only when ``KIT_ONLY`` names it (a stage that needs minutes of its own), else recorded
    as skipped with the command that runs it (a rehearsal always runs it)."""

    name: str
    script: str
    timeout_s: int
    what: str
    args: tuple[str, ...] = ()
    cpu_args: tuple[str, ...] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cuda_only: bool = False
    opt_in: bool = False


# In order of importance when the GPU machine is lent for a short time; timeouts are for one H200
# (the whole run must stay under 8 minutes: the budget below also stops stages from starting once it
# is spent).
STAGES: tuple[StageSpec, ...] = (
    StageSpec("equivalence", "stage_equivalence.py", 150,
              "executor == plain autograd, every schedule + MILP plan, accumulation, 3 steps + eval: fp32, "
              "bf16-mixed vs plain autocast, GPT-2 with dropout under re-runs, kept bf16 copies vs a cast per "
              "fetch (CPU: bitwise)",
              env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    StageSpec("delays", "stage_delays.py", 120,
              "delay injection on copy streams and at each bind: bitwise equal to undelayed",
              cpu_args=("--schedules", "cpu_homes,nvme_homes,kept_internals_resident",
                        "--patterns", "copies,compute,jitter0", "--delay-ms", "1"),
              env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    StageSpec("sanitizer", "stage_equivalence.py", 180,
              "the fp32 and GPT-2 equivalence runs under TORCH_CUDA_SANITIZER=1 (no race reported)",
              args=("--steps", "1", "--parts", "fp32,gpt2"),
              env={"TORCH_CUDA_SANITIZER": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, cuda_only=True),
    StageSpec("sync_debug", "stage_sync_debug.py", 60,
              "implicit syncs per step under torch.cuda.set_sync_debug_mode('warn') (reported)", cuda_only=True),
    StageSpec("lightning", "stage_lightning.py", 150,
              "Trainer + LazyTrainStrategy + HybridAdamW 8-bit, clip, accumulation, validation vs strategy='auto'",
              cpu_args=("--steps", "4")),
    StageSpec("throughput", "stage_throughput.py", 200,
              "~1B LlamaLM: MILP plan vs megatrain vs plain bf16, tokens/s and memory vs the cap"),
    # ~5 minutes on one H200 (8 Lightning fits and a DeepSpeed CPU Adam build): more than a full run
    # leaves, so the device runs it when asked: KIT_ONLY=throughput,fit
    StageSpec("fit", "stage_fit.py", 400,
              "end to end, Lightning fit of the ~1B Llama with the optimizer, b32 and b8 x 1024: lazytrain vs auto vs "
              "FSDP2 CPU offload vs DeepSpeed ZeRO-3 offload (tokens/s, GPU busy, optimizer seconds, memory)",
              opt_in=True),
    StageSpec("distributed", "stage_distributed.py", 60,
              "NCCL default group of world size 1 + GradSync's overlapped all-reduce next to the CUDA executor: "
              "bitwise equal to no sync"),
    StageSpec("nvme", "stage_nvme.py", 60, "O_DIRECT probe and spill write/read GB/s"),
    StageSpec("pytest_gpu", "stage_pytest_gpu.py", 150, "pytest -m gpu"),
)


class Runner:
    def __init__(self, out: Path, rehearse: bool, budget_s: float, only: list[str]) -> None:
        self.out, self.rehearse, self.budget_s, self.only = out, rehearse, budget_s, only
        self.t0 = time.perf_counter()
        self.results: list[dict] = []
        self.log_path = out / "log.txt"
        self.env_info: dict = {}
        self.error: str | None = None

    def log(self, text: str) -> None:
        with self.log_path.open("a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log(text)

    def write(self, finished: bool = False) -> None:
        failed = [r["name"] for r in self.results if r["status"] == "fail"]
        doc = {"kit": "lightning_lazytrain device validation kit", "mode": "rehearse" if self.rehearse else "device",
               "started": self.started, "finished": dt.datetime.now().isoformat(timespec="seconds") if finished else None,
               "seconds": round(time.perf_counter() - self.t0, 1), "ok": finished and not failed and not self.error,
               "failed": failed, "error": self.error, "environment": self.env_info, "stages": self.results}
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(self.out / "results.json")

    def environment(self) -> dict:
        code = ("import json, sys, torch\n"
                "from importlib import metadata, util\n"
                "d = {'python': sys.version.split()[0], 'executable': sys.executable, 'torch': torch.__version__,\n"
                "     'cuda_runtime': torch.version.cuda, 'cuda_available': torch.cuda.is_available()}\n"
                "if torch.cuda.is_available():\n"
                "    p = torch.cuda.get_device_properties(0)\n"
                "    d.update(gpu=p.name, gpu_memory_gb=round(p.total_memory / 1e9, 1), capability=f'{p.major}.{p.minor}')\n"
                "for mod, dist in (('lightning', 'lightning'), ('transformers', 'transformers'), ('pyomo', 'pyomo'),\n"
                "                  ('highspy', 'highspy'), ('hydra', 'hydra-core'), ('omegaconf', 'omegaconf'),\n"
                "                  ('bitsandbytes', 'bitsandbytes'), ('jsonargparse', 'jsonargparse')):\n"
                "    try:\n"
                "        d[dist] = metadata.version(dist) if util.find_spec(mod) else 'missing'\n"
                "    except Exception as e:\n"
                "        d[dist] = f'present, no metadata ({type(e).__name__})'\n"
                "print(json.dumps(d))\n")
        info: dict = {"host": platform.node(), "cpus": os.cpu_count()}
        try:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
            info.update(json.loads(r.stdout.strip().splitlines()[-1]))
            if r.returncode:
                info["error"] = r.stderr[-2000:]
        except Exception as e:  # noqa: BLE001 - recorded
            info["error"] = f"{type(e).__name__}: {e}"
        try:
            info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                         cwd=ROOT, timeout=10).stdout.strip() or None
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, cwd=ROOT, timeout=10).stdout.strip()
            info["git_dirty"] = bool(dirty)
        except Exception:  # noqa: BLE001 - no git on the device is fine
            pass
        return info

    def run(self) -> int:
        self.started = dt.datetime.now().isoformat(timespec="seconds")
        self.say(f"# device kit, {'rehearsal (CPU)' if self.rehearse else 'device run'}, {self.started}; "
                 f"budget {self.budget_s:.0f} s; results in {self.out}")
        self.env_info = self.environment()
        self.say("environment: " + json.dumps(self.env_info))
        if not self.rehearse and not self.env_info.get("cuda_available"):
            self.error = "no CUDA device (torch.cuda.is_available() is False); use --rehearse on a CPU machine"
            self.say(f"ERROR: {self.error}")
            self.write(finished=True)
            return 2
        device = "cpu" if self.rehearse else "cuda"
        for spec in STAGES:
            if self.only and spec.name not in self.only:
                continue
            self.results.append(self.run_stage(spec, device))
            self.write()
        self.write(finished=True)
        self.say("\n# summary")
        for r in self.results:
            self.say(f"{r['name']:<12} {r['status']:<8} {r['seconds']:7.1f} s  {r.get('reason') or ''}")
        failed = [r["name"] for r in self.results if r["status"] == "fail"]
        self.say(f"total {time.perf_counter() - self.t0:.1f} s; " + (f"FAILED: {', '.join(failed)}" if failed else "OK"))
        return 1 if failed else 0

    def run_stage(self, spec: StageSpec, device: str) -> dict:
        base = {"name": spec.name, "what": spec.what, "timeout_s": spec.timeout_s}
        self.say(f"\n## {spec.name}: {spec.what}")
        if self.rehearse and spec.cuda_only:
            self.say("skipped: needs CUDA (the rehearsal runs on the CPU)")
            return {**base, "status": "skipped", "seconds": 0.0, "reason": "needs CUDA (rehearsal runs on the CPU)",
                    "figures": {}}
        if spec.opt_in and not self.rehearse and spec.name not in self.only:
            why = (f"opt-in on the device (about {spec.timeout_s} s of its own): run it with KIT_ONLY=throughput,"
                   f"{spec.name} bash bench/device/check.sh OUTDIR")
            self.say(f"skipped: {why}")
            return {**base, "status": "skipped", "seconds": 0.0, "reason": why, "figures": {}}
        left = self.budget_s - (time.perf_counter() - self.t0)
        if left < 15:
            self.say(f"not started: the kit's {self.budget_s:.0f} s budget is spent")
            return {**base, "status": "fail", "seconds": 0.0, "figures": {},
                    "reason": f"not started: the kit's {self.budget_s:.0f} s budget was spent by earlier stages"}
        timeout = min(spec.timeout_s, left)
        result_path = self.out / "stages" / f"{spec.name}.json"
        result_path.parent.mkdir(parents=True, exist_ok=True)
        result_path.unlink(missing_ok=True)
        args = spec.cpu_args if (self.rehearse and spec.cpu_args is not None) else spec.args
        cmd = [sys.executable, str(HERE / spec.script), "--out", str(result_path), "--device", device,
               "--name", spec.name, "--workdir", str(self.out / "work" / spec.name), *args]
        # KIT_STAGE_TIMEOUT_S: the stage's own time limit here, for a stage that budgets its parts
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1", "KIT_STAGE_TIMEOUT_S": str(int(timeout))}
        self.log("$ " + " ".join(cmd) + "".join(f"  [{k}={v}]" for k, v in spec.env.items()))
        t0 = time.perf_counter()
        timed_out = False
        with self.log_path.open("a") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # the stage's own process group, started above
                rc = proc.wait()
        seconds = round(time.perf_counter() - t0, 2)
        if timed_out:
            r = {**base, "status": "fail", "seconds": seconds, "figures": {},
                 "reason": f"timed out after {timeout:.0f} s"}
        elif result_path.is_file():
            r = {**base, **json.loads(result_path.read_text()), "seconds": seconds}
        else:
            r = {**base, "status": "fail", "seconds": seconds, "figures": {},
                 "reason": f"exited with status {rc} without writing a result (see log.txt)"}
        if r["status"] == "fail" and not r.get("reason"):
            r["reason"] = f"exited with status {rc}"
        self.say(f"{spec.name}: {r['status']} in {seconds:.1f} s" + (f" ({r['reason']})" if r.get("reason") else ""))
        return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="output directory (results.json, log.txt)")
    ap.add_argument("--rehearse", action="store_true", help="CPU rehearsal: CUDA-only stages are skipped")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("KIT_BUDGET_S", 450)),
                    help="seconds for all stages together (default 450; env KIT_BUDGET_S)")
    ap.add_argument("--only", default=os.environ.get("KIT_ONLY", ""), help="comma-separated stage names")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "log.txt").unlink(missing_ok=True)
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - {s.name for s in STAGES}
    if unknown:
        ap.error(f"unknown stage(s) {sorted(unknown)}; stages: {[s.name for s in STAGES]}")
    return Runner(args.out.resolve(), args.rehearse, args.budget, only).run()


if __name__ == "__main__":
    raise SystemExit(main())
