"""Does the plan price the host lane as the engine runs it? Measured vs predicted host-lane seconds.

    python bench/bench_host_model.py [link GB/s, default 2] [--rounds N] [--profiles K] [--sweep]   # ~45 s, 2 cores

On the CPU with an emulated link: a LlamaLM with fp32 masters and bf16 compute copies (every fetch
casts, every gradient copy widens), the host lane's rates measured as the strategy measures them
(``autoplan.measure_hardware``: the engine's host kernels, ``engine/host_ops.py``). For each
placement of the conversions (planner/placement.py: all on the host; masters cast on the device;
gradients widened on the device, a step's first copy landing in the host gradient; both) and two
schedules (keep_all: one fetch per layer; megatrain K=4: fetches again for the re-runs):

* measured: the host lane's busy seconds per step (the sum of its jobs, ``engine.records()``) and
  per kind of job (cast / accumulate); the eight variants live side by side and take one step each
  in turn (round-robin, ``--rounds`` rounds after a warm-up one), so the machine's load falls on all
  alike; per row the median over rounds and the spread (min..max);
* predicted: the simulator's host-lane seconds per iteration for the same schedule, every host-lane
  figure priced from rates (``placement.priced_from_rates``: nothing measured per layer reused),
  the rates calibrated (``placement.calibrate_host_rates``, Note: [host rates in place]) on the
  "host" variant's steps, three ways:

  - ``1 profile``: one profiled step (``workload_from_stats``), what the strategy's first plan uses;
  - ``K profiles``: the median of ``--profiles`` profiled steps (``placement.median_host_seconds``);
  - ``training``: the "host" row's own unprofiled steps (their host lane, the median over rounds):
    the lane as it runs in training, without the profile's memory measurement (on the CPU a Python
    dispatch mode in the thread that launches compute, which slows the lane's jobs: they wait for
    the interpreter lock).

  Each with the fixed cost per host-lane job measured in place (``autoplan.host_job_seconds``).

Prints measured / predicted per placement and schedule (the goal: within 10%, 1.0 +- 0.1), then per
row and kind of job, measured against predicted with the ``training`` calibration (the host row
reproduces itself there: any other row's gap is the model's, not the calibration's), and with
``--sweep`` the ratios for fixed costs per job from 0 to 1.5 ms (whether any one fits every row).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import time

import torch

from lightning_lazytrain.core.autoplan import measure_hardware
from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.profiler import workload_from_stats
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import ModelSpec, keep_all, megatrain, simulate
from lightning_lazytrain.planner.placement import Placement, calibrate_host_rates, median_host_seconds, priced_from_rates

SPEC = ModelSpec(name="bench", num_layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=4, head_dim=64,
                 vocab=4096)
BATCH, SEQ = 1, 33
PLACEMENTS = {"host": Placement(), "cast on device": Placement(cast_blocks=True, cast_rest=True),
              "widen on device": Placement(widen_blocks=True, widen_rest=True),
              "both on device": Placement(cast_blocks=True, widen_blocks=True, cast_rest=True, widen_rest=True)}
SCHEDULES = {"keep_all": keep_all(SPEC.num_layers), "megatrain K=4": megatrain(SPEC.num_layers, 4)}
KINDS = ("cast", "accumulate")


@dataclasses.dataclass
class Variant:
    """One placement x schedule: its own model copy, executor and optimizer, and what its steps measured."""

    schedule: str
    placement: str
    model: torch.nn.Module
    ex: Executor
    opt: torch.optim.Optimizer
    busy: list[dict[str, float]] = dataclasses.field(default_factory=list)  # per step: seconds per kind
    jobs: list[dict[str, int]] = dataclasses.field(default_factory=list)
    trained: list = dataclasses.field(default_factory=list)  # per step: its workload (host seconds only read)
    profiles: list = dataclasses.field(default_factory=list)

    def step(self, tokens: torch.Tensor, *, profile: bool = False, keep: bool = True) -> None:
        self.ex.profiling = profile
        self.ex.begin_microbatch()
        self.model.loss(tokens).backward()
        stats = self.ex.end_microbatch()
        self.ex.profiling = False
        if keep:
            if profile:
                self.profiles.append(workload_from_stats(self.ex, stats, tokens=tokens.numel()))
            else:
                busy: dict[str, float] = {}
                jobs: dict[str, int] = {}
                for s in stats.segments:
                    if s.lane == "host":
                        busy[s.kind] = busy.get(s.kind, 0.0) + s.end - s.start
                        jobs[s.kind] = jobs.get(s.kind, 0) + 1
                self.busy.append(busy)
                self.jobs.append(jobs)
                if self.placement == "host":  # the lane as it runs in training calibrates too
                    self.trained.append(workload_from_stats(self.ex, stats, tokens=tokens.numel()))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def predicted(wl, schedule, placement: Placement, hw) -> dict[str, float]:
    """The simulator's host-lane seconds per kind, ``wl`` placed as ``placement`` and priced from ``hw``."""
    sim = simulate(schedule, priced_from_rates(wl, placement, hw), hw, check=False)
    out = dict.fromkeys(KINDS, 0.0)
    for s in sim.timeline:
        if s.lane == "host":
            out[s.kind] = out.get(s.kind, 0.0) + s.end - s.start
    return out


def _arg(name: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main() -> None:
    args = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--") and not sys.argv[i - 1].startswith("--")]
    link = float(args[0]) if args else 2.0
    rounds, n_profiles = _arg("--rounds", 12), _arg("--profiles", 5)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # compute on one core; the host lane's kernels use their own pool
    base = LlamaLM(SPEC)
    tokens = torch.randint(0, SPEC.vocab, (BATCH, SEQ))
    links = {"h2d": LinkSpec(link * 1e9), "d2h": LinkSpec(link * 1e9)}
    t0 = time.perf_counter()
    hw = measure_hardware(torch.device("cpu"), link_gb_per_s=link)
    print(f"# bench_host_model: {SPEC.num_layers} layers, hidden {SPEC.hidden}, {SPEC.total_params / 1e6:.1f}M params, "
          f"fp32 masters, bf16 compute, link {link} GB/s, torch {torch.__version__}; {rounds} rounds, "
          f"{n_profiles} profiles")
    print(f"# measured host rates: like-to-like {hw.host_bytes_per_s / 1e9:.1f} GB/s, widening add "
          f"{hw.host_widen_bytes_per_s / 1e9:.1f} GB/s, norms {hw.host_norm_bytes_per_s / 1e9:.1f} GB/s; fixed cost "
          f"per job (in place) {hw.host_job_seconds * 1e3:.3f} ms ({time.perf_counter() - t0:.1f} s)")
    variants: list[Variant] = []
    for sname, schedule in SCHEDULES.items():
        for pname, p in PLACEMENTS.items():
            m = copy.deepcopy(base)
            ex = Executor(m, schedule, compute_dtype=torch.bfloat16, links=links)
            ex.set_placement(**p.groups(SPEC.num_layers))
            variants.append(Variant(sname, pname, m, ex, torch.optim.SGD(m.parameters(), lr=1e-3)))
    try:
        for v in variants:  # warm-up
            v.step(tokens, keep=False)
        for r in range(rounds):
            for v in variants:
                v.step(tokens)
                if v.placement == "host" and r < n_profiles:  # the profile runs on the host, as the strategy's
                    v.step(tokens, profile=True)
    finally:
        for v in variants:
            v.ex.close()
    print(f"# {rounds} rounds of {len(variants)} variants in {time.perf_counter() - t0:.1f} s")
    report(variants, hw)


def report(variants: list[Variant], hw) -> None:
    cals: dict[str, dict[str, object]] = {}
    for sname, schedule in SCHEDULES.items():
        host = next(v for v in variants if v.schedule == sname and v.placement == "host")
        cals[sname] = {"1 profile": calibrate_host_rates(host.profiles[0], schedule, hw),
                       "K profiles": calibrate_host_rates(median_host_seconds(host.profiles), schedule, hw),
                       "training": calibrate_host_rates(median_host_seconds(host.trained), schedule, hw)}
    names = list(next(iter(cals.values())))
    print(f"{'schedule':<14} {'placement':<16} {'measured s (min..max)':>24} "
          + " ".join(f"{n + ' pred':>16} {'ratio':>6}" for n in names))
    ratios: dict[str, list[float]] = {n: [] for n in names}
    per_kind: list[str] = []
    for v in variants:
        schedule, p = SCHEDULES[v.schedule], PLACEMENTS[v.placement]
        totals = [sum(b.values()) for b in v.busy]
        meas = statistics.median(totals)
        line = f"{v.schedule:<14} {v.placement:<16} {meas:>8.4f} ({min(totals):.4f}..{max(totals):.4f})"
        for n in names:
            pred = predicted(host_of(variants, v).profiles[0], schedule, p, cals[v.schedule][n])
            total = sum(pred.values())
            ratios[n].append(meas / total)
            line += f" {total:>16.4f} {meas / total:>6.3f}"
            if n == "training":
                for kind in KINDS:
                    mk = statistics.median(b.get(kind, 0.0) for b in v.busy)
                    jobs = statistics.median(j.get(kind, 0) for j in v.jobs)
                    if mk or pred[kind]:
                        per_kind.append(f"{v.schedule:<14} {v.placement:<16} {kind:<10} {jobs:>4.0f} {mk:>9.4f} "
                                        f"{pred[kind]:>9.4f} {mk / pred[kind] if pred[kind] else float('nan'):>6.3f} "
                                        f"{(mk - pred[kind]) / jobs * 1e3 if jobs else float('nan'):>8.3f}")
        print(line, flush=True)
    print(f"\n{'schedule':<14} {'placement':<16} {'kind':<10} {'jobs':>4} {'measured':>9} {'predicted':>9} {'ratio':>6} "
          f"{'ms/job off':>8}   (calibrated: training)")
    print("\n".join(per_kind))
    print()
    for n in names:
        r = ratios[n]
        print(f"measured / predicted host lane, calibrated by {n}: median {statistics.median(r):.3f}, range "
              f"{min(r):.3f} .. {max(r):.3f}; rows within 10%: {sum(abs(x - 1) <= 0.1 for x in r)}/{len(r)}")
    if "--sweep" in sys.argv:  # which fixed cost per job would fit every row (the model, not its estimate)
        for job_ms in (0.0, 0.25, 0.5, 0.75, 1.0, 1.5):
            h = hw.replace(host_job_seconds=job_ms / 1e3)
            line = f"fixed cost {job_ms:.2f} ms:"
            for n, src in (("K profiles", "profiles"), ("training", "trained")):
                r = []
                for v in variants:
                    host = host_of(variants, v)
                    schedule = SCHEDULES[v.schedule]
                    cal = calibrate_host_rates(median_host_seconds(getattr(host, src)), schedule, h)
                    pred = sum(predicted(host.profiles[0], schedule, PLACEMENTS[v.placement], cal).values())
                    r.append(statistics.median(sum(b.values()) for b in v.busy) / pred)
                line += f"  {n}: {min(r):.3f}..{max(r):.3f} ({sum(abs(x - 1) <= 0.1 for x in r)}/8) " + " ".join(
                    f"{x:.2f}" for x in r)
            print(line)


def host_of(variants: list[Variant], v: Variant) -> Variant:
    return next(u for u in variants if u.schedule == v.schedule and u.placement == "host")


if __name__ == "__main__":
    main()
