"""Does the plan price the host lane as the engine runs it? Measured vs predicted host-lane seconds.

    python bench/bench_host_model.py [link GB/s, default 2] [--steps N] [--profile-step 0|1]   # ~1 minute, 2 cores

On the CPU with an emulated link: a LlamaLM with fp32 masters and bf16 compute copies (every fetch
casts, every gradient copy widens), the host lane's rates measured as the strategy measures them
(``autoplan.measure_hardware``: the engine's host kernels, ``engine/host_ops.py``). For each
placement of the conversions (planner/placement.py: all on the host; masters cast on the device;
gradients widened on the device, a step's first copy landing in the host gradient; both) and two
schedules (keep_all: one fetch per layer; megatrain K=4: fetches again for the re-runs):

* measured: the host lane's busy seconds per step (the sum of its jobs, ``engine.records()``),
  median of the steps after a warm-up step;
* predicted: the simulator's host-lane seconds per iteration for the same schedule, on the
  workload of a step profiled on the host (as the strategy's first step), every host-lane figure
  priced from rates (``placement.priced_from_rates``: nothing measured per layer reused), once
  with the rates measured alone, once with them calibrated by the profiled step per byte only (the
  fixed cost per job left out: ``host_job_seconds`` = 0, the model before it) and once calibrated
  with the fixed cost per host-lane job measured in place (``autoplan.host_job_seconds``;
  ``placement.calibrate_host_rates``, Note: [host rates in place]: what the plan uses).

Prints measured / predicted per placement and schedule; the goal is within 10% (1.0 +- 0.1).
"""

from __future__ import annotations

import copy
import statistics
import sys

import torch

from lightning_lazytrain.core.autoplan import measure_hardware
from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.profiler import workload_from_stats
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import ModelSpec, keep_all, megatrain, simulate
from lightning_lazytrain.planner.placement import Placement, calibrate_host_rates, priced_from_rates

SPEC = ModelSpec(name="bench", num_layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=4, head_dim=64,
                 vocab=4096)
BATCH, SEQ = 1, 33
PLACEMENTS = {"host": Placement(), "cast on device": Placement(cast_blocks=True, cast_rest=True),
              "widen on device": Placement(widen_blocks=True, widen_rest=True),
              "both on device": Placement(cast_blocks=True, widen_blocks=True, cast_rest=True, widen_rest=True)}


def run(base, tokens, schedule, placement: Placement, links, steps: int, profile_step: int):
    """The host lane's median busy seconds over ``steps`` steps after a warm-up one, and the
    workload of step ``profile_step`` profiled (0: the first, as the strategy's first step)."""
    m = copy.deepcopy(base)
    ex = Executor(m, schedule, compute_dtype=torch.bfloat16, links=links)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    busy, profile = [], None
    try:
        ex.set_placement(**placement.groups(SPEC.num_layers))
        for k in range(steps + 1):
            ex.profiling = k == profile_step
            ex.begin_microbatch()
            m.loss(tokens).backward()
            stats = ex.end_microbatch()
            if k == profile_step:
                profile = workload_from_stats(ex, stats, tokens=tokens.numel())
            elif k:
                busy.append(sum(r.duration for r in ex.engine.records() if r.lane == "host"))
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        ex.close()
    return (statistics.median(busy) if busy else float("nan")), profile


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    link = float(args[0]) if args else 2.0
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 5
    # the step that calibrates: 0 = the first (the strategy's profile: on the CPU its memory measurement,
    # a Python dispatch mode, holds the GIL and slows the host lane's jobs), 1 = after a warm-up step
    # (a re-plan's profile)
    profile_step = int(sys.argv[sys.argv.index("--profile-step") + 1]) if "--profile-step" in sys.argv else 1
    torch.manual_seed(0)
    torch.set_num_threads(1)  # compute on one core; the host lane's kernels use their own pool
    base = LlamaLM(SPEC)
    tokens = torch.randint(0, SPEC.vocab, (BATCH, SEQ))
    links = {"h2d": LinkSpec(link * 1e9), "d2h": LinkSpec(link * 1e9)}
    hw = measure_hardware(torch.device("cpu"), link_gb_per_s=link)
    print(f"# bench_host_model: {SPEC.num_layers} layers, hidden {SPEC.hidden}, {SPEC.total_params / 1e6:.1f}M params, "
          f"fp32 masters, bf16 compute, link {link} GB/s, torch {torch.__version__}")
    print(f"# measured host rates: like-to-like {hw.host_bytes_per_s / 1e9:.1f} GB/s, widening add "
          f"{hw.host_widen_bytes_per_s / 1e9:.1f} GB/s, norms {hw.host_norm_bytes_per_s / 1e9:.1f} GB/s; fixed cost "
          f"per job (in place) {hw.host_job_seconds * 1e3:.3f} ms")
    print(f"{'schedule':<14} {'placement':<16} {'measured s':>11} {'rates alone':>12} {'ratio':>7} "
          f"{'per byte':>9} {'ratio':>7} {'calibrated':>11} {'ratio':>7}")
    ratios, raw, per_byte = [], [], []
    bytes_only = hw.replace(host_job_seconds=0.0)
    for sname, schedule in (("keep_all", keep_all(SPEC.num_layers)), ("megatrain K=4", megatrain(SPEC.num_layers, 4))):
        # the profile runs on the host (as the strategy's first step does): it calibrates the rates
        # (placement.calibrate_host_rates), then every placement is predicted from them
        _, profile = run(base, tokens, schedule, PLACEMENTS["host"], links, 1, profile_step)
        cal = calibrate_host_rates(profile, schedule, hw)
        cal_bytes = calibrate_host_rates(profile, schedule, bytes_only)
        for pname, p in PLACEMENTS.items():
            measured, _ = run(base, tokens, schedule, p, links, steps, -1)
            row = [measured]
            for rates in (hw, cal_bytes, cal):
                sim = simulate(schedule, priced_from_rates(profile, p, rates), rates, check=False)
                row.append(sum(s.end - s.start for s in sim.timeline if s.lane == "host"))
            raw.append(measured / row[1])
            per_byte.append(measured / row[2])
            ratios.append(measured / row[3])
            print(f"{sname:<14} {pname:<16} {measured:>11.4f} {row[1]:>12.4f} {raw[-1]:>7.3f} {row[2]:>9.4f} "
                  f"{per_byte[-1]:>7.3f} {row[3]:>11.4f} {ratios[-1]:>7.3f}", flush=True)
    print(f"measured / predicted host lane, rates alone: median {statistics.median(raw):.3f}; calibrated, per byte "
          f"only (host_job_seconds = 0): median {statistics.median(per_byte):.3f}, range {min(per_byte):.3f} .. "
          f"{max(per_byte):.3f}; calibrated with the fixed cost per job: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f} .. {max(ratios):.3f}")


if __name__ == "__main__":
    main()
