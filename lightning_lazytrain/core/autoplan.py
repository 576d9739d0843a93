"""Plan for the model in hand: measure the link and memory of this machine, profile the blocks on
the real device, solve (or apply a fixed policy), and describe what was done.

Used by the training core (``core/``); imports the engine and the planner, never Lightning. A named
hardware profile is read with ``config.load_hardware`` (the top-level module: Hydra's YAML, the planner's
types, no torch).
"""

from __future__ import annotations

import abc
import json
import logging
import math
import numbers
import os
import shutil
import time
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_lazytrain.planner import Hardware, ModelSpec, Schedule, Workload, baseline
from lightning_lazytrain.planner.hardware import available_host_bytes
from lightning_lazytrain.planner.milp import MilpOptions
from lightning_lazytrain.planner.placement import calibrate_host_rates
from lightning_lazytrain.planner.plan import PlanResult, diagnose, plan_workload, with_update_timing

log = logging.getLogger(__name__)
GB = 1e9
POLICIES = ("milp", "megatrain", "keep_all", "recompute_all")


def _host_memory_bytes() -> float:
    available = available_host_bytes()
    return 16 * GB if available is None else float(available)


def _copy_rate(device: torch.device, nbytes: int = 64 << 20) -> tuple[float, float]:
    """Measured (H2D, D2H) bytes/s: pinned copies on CUDA, memcpy on CPU."""
    n = nbytes // 4
    if device.type == "cuda":
        host = torch.empty(n, dtype=torch.float32, pin_memory=True)
        dev = torch.empty(n, dtype=torch.float32, device=device)
        rates = []
        for src, dst in ((host, dev), (dev, host)):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(3):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            rates.append(3 * nbytes / (time.perf_counter() - t0))
        return rates[0], rates[1]
    a, b = torch.empty(n), torch.empty(n)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    rate = 3 * nbytes / (time.perf_counter() - t0)
    return rate, rate


# the model host_job_seconds streams: its host jobs' bytes are a sliver of their time
JOB_PROBE = ModelSpec(name="host-job-probe", num_layers=8, hidden=64, intermediate=176, heads=1, kv_heads=1,
                      head_dim=64, vocab=256)

_HOST_RATES: dict[tuple[str, int], tuple[float, float, float, float, float]] = {}


def host_rates(device: torch.device) -> tuple[float, float, float, float, float]:
    """The engine's host kernels as this machine runs them (engine/host_ops.py, its default thread
    count): bytes/s of the fp32 -> 16-bit cast, of the widening add of 16-bit gradients into fp32
    ones, of the fp32 add, of the per-tensor gradient norms; fused AdamW parameters/s with 32-bit
    states, as HybridAdamW runs them. Bytes counted as ``Hardware.host_bytes_per_s``,
    ``host_widen_bytes_per_s``, ``host_add_bytes_per_s`` and ``host_norm_bytes_per_s`` price them
    (planner/workload.py). Measured once per process: 256 MiB
    tensors next to a GPU (out of the caches of a server's sockets), 16 MiB on a CPU-only run."""
    from lightning_lazytrain.engine.host_ops import BYTES_PER_ELEM, default_host_threads, measure_host_rates

    threads = default_host_threads()
    key = (device.type, threads)
    if key not in _HOST_RATES:
        nbytes = (256 if device.type == "cuda" else 16) << 20
        rates = measure_host_rates(nbytes, (threads,), repeats=2,
                                   ops=("cast_fp32_bf16", "add_fp32_fp32", "add_bf16_fp32", "norm_fp32", "adamw_fp32"))
        r = {op: v["host_ops"] if op != "adamw_fp32" else v["torch"] for op, v in rates["rates"][threads].items()}
        _HOST_RATES[key] = (r["cast_fp32_bf16"] * GB, r["add_bf16_fp32"] * GB, r["add_fp32_fp32"] * GB,
                            r["norm_fp32"] * GB, r["adamw_fp32"] * GB / BYTES_PER_ELEM["adamw_fp32"])
    return _HOST_RATES[key]


_HOST_JOB: dict[tuple[str, int, float | None], float] = {}


def host_job_seconds(device: torch.device, *, link_gb_per_s: float | None = None, steps: int = 6) -> float:
    """Seconds a host-lane job takes besides its bytes (``Hardware.host_job_seconds``), measured in
    place: the engine streams a small ``LlamaLM`` (``JOB_PROBE``: 8 layers, hidden 64, 50k parameters
    a block) with fp32 masters, bf16 compute copies and both conversions on the device, so the host
    lane's only jobs are the gradient copies' (direct landing, each parameter's norm: ~0.2 MB), run
    beside the thread that launches compute as in training. The mean of those jobs over ``steps``
    steps after a warm-up one (a step's jobs add up; their durations are bimodal, so a median is
    unstable), less their bytes at the norm rate measured alone (``host_rates``). Alone the same job
    takes ~0.03 ms on the 2-core machine; beside compute ~0.5-1 ms, the waits for the interpreter
    lock and the cores the lane shares: what a small job costs in a step. Once
    per process (device, torch threads, link); 0.0 when the probe cannot run (logged)."""
    key = (device.type, torch.get_num_threads(), link_gb_per_s)
    if key in _HOST_JOB:
        return _HOST_JOB[key]
    import copy as _copy
    import statistics

    from lightning_lazytrain.engine.copy_engine import LinkSpec
    from lightning_lazytrain.engine.executor import Executor
    from lightning_lazytrain.models import LlamaLM
    from lightning_lazytrain.planner import keep_all
    from lightning_lazytrain.planner.placement import Placement

    spec = JOB_PROBE
    links = None
    if link_gb_per_s is not None and device.type != "cuda":
        links = {"h2d": LinkSpec(link_gb_per_s * GB), "d2h": LinkSpec(link_gb_per_s * GB)}
    ex = None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaLM(spec)
            tokens = torch.randint(0, spec.vocab, (1, 33))
        model = _copy.deepcopy(model)
        ex = Executor(model, keep_all(spec.num_layers), device=device, compute_dtype=torch.bfloat16, links=links)
        both = Placement(cast_blocks=True, widen_blocks=True, cast_rest=True, widen_rest=True)
        ex.set_placement(**both.groups(spec.num_layers))
        tokens = tokens.to(device)
        jobs: list[float] = []
        nbytes: list[int] = []
        for k in range(steps + 1):
            ex.engine.reset_stats()
            ex.begin_microbatch()
            model.loss(tokens).backward()
            ex.end_microbatch()
            if k:
                for r in ex.engine.records():
                    if r.lane == "host" and (r.tag or "").startswith("accum"):
                        jobs.append(r.duration)
                        nbytes.append(r.nbytes)
            for param in model.parameters():
                param.grad = None
        norm_rate = host_rates(device)[3]
        # the mean, not the median: a step's jobs cost their sum, and the durations are bimodal (~1 ms
        # beside compute, ~0.1 ms for the step's last jobs, after it), so a median lands anywhere in
        # the gap between the modes. Across processes the mean still varies (0.26-0.68 ms over 12 on
        # the 2-core machine, in two levels): the lane's cost per job does (bench/RESULTS.md)
        seconds = max(0.0, statistics.fmean(jobs) - statistics.fmean(nbytes) / norm_rate) if jobs else 0.0
    except Exception as err:  # a measurement must never stop training: per-byte pricing only
        log.warning("could not measure the host lane's fixed cost per job (priced as 0): %s", err)
        seconds = 0.0
    finally:
        if ex is not None:
            ex.close()
    _HOST_JOB[key] = seconds
    return seconds


def measure_hardware(device: torch.device, *, gpu_memory_budget_gb: float | None = None,
                     nvme_dir: str | os.PathLike[str] | None = None, link_gb_per_s: float | None = None,
                     nvme_gb_per_s: float = 2.0, opt_params_per_s: float | None = None,
                     host_job: bool = True) -> Hardware:
    """A ``Hardware`` for this machine. Compute speed is not needed here: the profile measures it.

    ``link_gb_per_s`` (CPU link emulation) overrides the measured copy rate; NVMe bandwidth is a
    stated assumption (``nvme_gb_per_s``), its capacity the free space of ``nvme_dir``. The host
    lane's rates and the 32-bit AdamW rate are measured (``host_rates``; ``opt_params_per_s``
    overrides the latter); the 8-bit one is taken as equal until an 8-bit optimizer is priced
    (the strategy measures it then). The host lane's fixed cost per job is measured in place
    (``host_job_seconds``, ~0.7 s once per process on the CPU), unless ``host_job=False`` (0: the
    strategy measures it when a workload has conversions to place, the only pricing that uses it)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cap = min(free, total) * 0.9
    else:
        total = cap = _host_memory_bytes() / 2
    if gpu_memory_budget_gb is not None:
        cap = min(gpu_memory_budget_gb * GB, total)
    h2d, d2h = _copy_rate(device)
    if link_gb_per_s is not None:
        h2d = d2h = link_gb_per_s * GB
    nvme_cap = shutil.disk_usage(nvme_dir).free if nvme_dir is not None and Path(nvme_dir).exists() else 0.0
    nvme_bw = nvme_gb_per_s * GB if nvme_cap else 0.0
    cast, widen, add, norm, adam = host_rates(device)
    adam = opt_params_per_s or adam
    job = host_job_seconds(device, link_gb_per_s=link_gb_per_s) if host_job else 0.0
    return Hardware(name=f"measured-{device.type}", gpu_memory_bytes=float(total), gpu_memory_cap_bytes=float(cap),
                    peak_tflops=1.0, efficiency=1.0, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
                    nvme_read_bytes_per_s=nvme_bw, nvme_write_bytes_per_s=nvme_bw, nvme_capacity_bytes=float(nvme_cap),
                    cpu_memory_bytes=_host_memory_bytes(), cpu_adam_params_per_s=adam,
                    cpu_adam8_params_per_s=adam, host_bytes_per_s=cast,
                    host_widen_bytes_per_s=widen, host_add_bytes_per_s=add, host_norm_bytes_per_s=norm,
                    host_job_seconds=job).validate()


@dataclass
class AutoPlan:
    """What the strategy planned at setup, and how long each part took."""

    result: PlanResult
    timings: dict[str, float] = field(default_factory=dict)
    # the 8-bit fraction the plan gave HybridAdamW(eight_bit="plan") optimizers (optim/plan_states.py;
    # every process applies it), None when none was pending
    state_fraction: float | None = None

    @property
    def schedule(self) -> Schedule:
        return self.result.schedule

    def write(self, directory: str | os.PathLike[str]) -> list[Path]:
        """plan.json and timeline.png (predicted) into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        data = self.result.to_json()
        data["setup_seconds"] = self.timings
        data["workload"] = self.result.workload.to_json()
        (out / "plan.json").write_text(json.dumps(data, indent=1, default=str))
        paths = [out / "plan.json"]
        try:
            from lightning_lazytrain.planner.report import plot_timeline

            plot_timeline(self.result.sim, out / "timeline.png", title=f"predicted: {self.schedule.policy}",
                          cap_bytes=self.result.hardware.gpu_memory_cap_bytes)
            paths.append(out / "timeline.png")
        except Exception as err:  # a plot must never stop training
            log.warning("could not draw the predicted timeline: %s", err)
        return paths


def plan_from_workload(wl: Workload, hardware: Hardware, *, policy: str = "milp", options: MilpOptions | None = None,
                       K: int = 4, start: Schedule | None = None, profiled: Schedule | None = None) -> AutoPlan:
    """Diagnose, evaluate the baselines and solve (or apply ``policy``) for a measured workload;
    ``start``: the schedule a re-plan warm-starts from (``solve``); ``profiled``: the schedule the
    workload was measured on, whose host lane calibrates the host rates (planner/placement.py, Note:
    [host rates in place])."""
    t0 = time.perf_counter()
    if profiled is not None:
        hardware = calibrate_host_rates(wl, profiled.in_mode(wl.data_parallel), hardware)
    diagnose(wl, hardware)  # an impossible budget: which tier is short, by how much
    fixed = None
    if policy != "milp":
        fixed = baseline(policy, wl.num_layers, K) if policy in POLICIES else load_schedule(policy)
        fixed = fixed.in_mode(wl.data_parallel)  # several ranks: the job's collectives
        if policy in POLICIES:  # Note: [updates in the backward pass]: the faster way where the run allows it
            fixed = with_update_timing(fixed, wl, hardware)
    result = plan_workload(wl, hardware, fixed=fixed, options=options, K=K, start=start)
    return AutoPlan(result=result, timings={"solve": time.perf_counter() - t0})


def load_schedule(path: str | os.PathLike[str]) -> Schedule:
    """The ``Schedule`` of a plan.json (the file ``lazytrain-plan`` or a run writes, or a bare
    schedule); every problem is a ValueError that names the file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"policy {str(path)!r} is neither one of {POLICIES} nor an existing plan.json file")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"plan file {p} is not readable JSON ({err}); write it with lazytrain-plan or a "
                         "previous run's plan.json") from err
    if not isinstance(data, dict):
        raise ValueError(f"plan file {p} holds a {type(data).__name__}, not a plan (an object with a 'schedule')")
    body = data.get("schedule", data)
    if not isinstance(body, dict) or "homes" not in body:
        raise ValueError(f"plan file {p} has no schedule (expected a 'schedule' object with 'homes', "
                         f"'keep_internals', ...; found keys {sorted(data)})")
    try:
        return Schedule.from_json(body)
    except Exception as err:  # the planner's own validation: version, lengths, homes
        raise ValueError(f"plan file {p} holds an invalid schedule: {err}") from err


def _check_positive_number(name: str, value: object, unit: str, example: str, none_means: str) -> None:
    """``value`` must be None or a finite int/float > 0 (not a bool: ``True`` is 1 to Python, never meant as 1 GB);
    the ValueError names the option, what is wrong and the fix."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        why = f"got {type(value).__name__} {value!r}"
    elif not math.isfinite(value):
        why = f"{value} is not a finite size"
    elif value <= 0:
        why = f"got {value!r}"
    else:
        return
    raise ValueError(f"{name}={value!r}: must be a number of {unit} > 0 ({why}). Fix: pass e.g. {name}={example}, "
                     f"or {name}=None ({none_means})")


def _check_nvme_dir_option(nvme_dir: object) -> None:
    """``nvme_dir`` must be None or a path (str / os.PathLike), not an existing file; the ValueError names it."""
    if nvme_dir is None:
        return
    fix = ("Fix: pass nvme_dir='/path/on/an/nvme/drive' (a directory, created if missing), or nvme_dir=None (no NVMe "
           "tier)")
    if isinstance(nvme_dir, bytes) or not isinstance(nvme_dir, (str, os.PathLike)):
        raise ValueError(f"nvme_dir={nvme_dir!r}: must be a path (str or os.PathLike) to a directory on a local NVMe "
                         f"drive, not {type(nvme_dir).__name__}. {fix}")
    text = os.fspath(nvme_dir)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"nvme_dir={nvme_dir!r}: an empty path. {fix}")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"nvme_dir={text!r}: {path} exists and is not a directory (spill files go into a "
                         f"directory). {fix}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"nvme_dir={text!r}: cannot be created, {parent} is a file. {fix}")
            break


def validate_options(hardware: object, budget: object, nvme_dir: object, policy: object,
                     link: object) -> Schedule | None:
    """The strategies' (Trainer and Fabric) options, checked at construction and named as the user
    wrote them (not later, in bytes). Returns the schedule of a plan.json ``policy`` (else None).

    ``gpu_memory_budget_gb`` / ``emulate_link_gb_per_s``: None or a finite number > 0 (``True``, nan, inf, 0 and
    negatives are refused); ``nvme_dir``: None or a path (str / os.PathLike) that is not an existing file;
    ``hardware``: ``"measure"``, a profile name or a ``planner.Hardware``; ``policy``: one of ``POLICIES`` or a
    plan.json."""
    _check_positive_number("gpu_memory_budget_gb", budget, "GB", "70",
                           "the hardware profile's cap, or 90% of the free device memory with hardware='measure'")
    _check_positive_number("emulate_link_gb_per_s", link, "GB/s", "16", "no link emulation")
    _check_nvme_dir_option(nvme_dir)
    if not isinstance(hardware, Hardware):
        if not isinstance(hardware, str):
            raise ValueError(f"hardware={hardware!r}: use 'measure', a profile name or a planner.Hardware")
        if hardware != "measure":
            from lightning_lazytrain.config import load_hardware
            from lightning_lazytrain.planner import InvalidInput

            try:
                load_hardware(hardware)
            except InvalidInput as err:
                raise ValueError(f"hardware={hardware!r}: {err}") from err
    if policy in POLICIES:
        return None
    schedule = load_schedule(str(policy))  # names the file in every error
    if "nvme" in schedule.homes and nvme_dir is None:
        raise ValueError(f"plan file {policy} puts activations on NVMe: pass nvme_dir= (a directory on an "
                         "NVMe drive), or use a plan without NVMe homes")
    return schedule


TOKEN_KEYS = ("input_ids", "tokens", "idx")


def count_tokens(*items: Any, **named: Any) -> int:
    """Tokens of a profiled micro-batch, for the plan's tokens/s (1: none, the report then leaves
    tokens/s out): a ``TOKEN_KEYS`` entry of ``named`` or of a dict, else the first integer tensor
    (token ids; float inputs such as images carry no tokens), looking one level into dicts, lists
    and tuples."""
    def ids(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()

    for key in TOKEN_KEYS:
        if ids(named.get(key)):
            return int(named[key].numel())
    for item in (*items, *named.values()):
        if isinstance(item, dict):
            item = [item[k] for k in TOKEN_KEYS if k in item] + list(item.values())
        for sub in item if isinstance(item, (list, tuple)) else (item,):
            if ids(sub):
                return int(sub.numel())
    return 1


class NamedOptions(abc.ABCMeta):
    """The metaclass of the strategies: ``cls(typo=...)`` is refused by ``check_option_names`` before
    ``__init__`` (the class's own signature stays what LightningCLI and ``help()`` read)."""

    def __init__(cls, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        import inspect

        # inspect.signature(cls) would otherwise read this metaclass's __call__ (*args, **kwargs)
        init = inspect.signature(cls.__init__)
        cls.__signature__ = init.replace(parameters=list(init.parameters.values())[1:])

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        check_option_names(cls, kwargs)
        return super().__call__(*args, **kwargs)


def check_option_names(cls: type, kwargs: dict) -> None:
    """A keyword ``cls(...)`` does not take is a TypeError that names it, the closest option and
    where the options are listed (Python's own says only "unexpected keyword argument")."""
    import difflib
    import inspect

    known = [n for n, p in inspect.signature(cls.__init__).parameters.items()
             if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in known]
    if not unknown:
        return
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(k, known, n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(f"{cls.__name__} has no option {', '.join(hints)}; its options are {', '.join(known)} "
                    f"(see help({cls.__name__}))")


def given_hardware(hardware: str | Hardware, budget_gb: float | None, nvme_dir: object) -> Hardware:
    """The machine a named profile or a ``Hardware`` describes, as the options shape it: the budget
    applies on every path, and without ``nvme_dir`` the plan gets no NVMe tier (nowhere to spill).
    (``hardware="measure"`` is ``measure_hardware``'s, which applies both itself.)"""
    if isinstance(hardware, Hardware):
        hw = hardware
    else:
        from lightning_lazytrain.config import load_hardware

        hw = load_hardware(hardware)
    if budget_gb is not None:
        hw = hw.replace(gpu_memory_cap_bytes=min(budget_gb * GB, hw.gpu_memory_bytes))
    if nvme_dir is None and hw.nvme_capacity_bytes:
        hw = hw.replace(nvme_capacity_bytes=0.0, nvme_read_bytes_per_s=0.0, nvme_write_bytes_per_s=0.0)
    return hw
