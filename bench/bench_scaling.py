"""Several GPUs, simulated: 27B, batch 72 per GPU, seq 1024 on 1/2/4/8 H800 SXM in one node
and on 2 nodes x 8, for each data-parallel mode of ``planner/multi.py``.

    python bench/bench_scaling.py          # ~1 minute on a 2-core machine (MILP solves of one rank)

Per row: tokens/s of the whole job, scaling efficiency (tokens/s at N / (N x the same mode's tokens/s
at 1 GPU); for fsdp also against the single-GPU plan), host memory per node and its ratio to the
single-GPU plan's, the rank's iteration time, optimizer mode and boundary homes (gpu/cpu/nvme/recompute).
Hardware: conf/hardware/h800x8.yaml and h800x8x2.yaml (the H800 profile of the paper's node plus the
interconnect; see the source comment on each field: the interconnect figures are estimates).
"""

from __future__ import annotations

import sys
import time

from lightning_lazytrain.config import load_hardware, load_model
from lightning_lazytrain.planner import InfeasibleSchedule, TrainSpec, Workload, simulate
from lightning_lazytrain.planner.multi import fsdp_schedules, plan_cluster, rank_hardware, rank_workload

GB = 1e9
CONFIGS = ((1, 1), (2, 1), (4, 1), (8, 1), (8, 2))  # (GPUs per node, nodes)
MODES = ("shard", "shard<=1.1x", "replicate", "replicate_overlap", "fsdp")


def hardware(n: int, nodes: int):
    return load_hardware("h800x8x2" if nodes > 1 else "h800x8").replace(gpus_per_node=n, nodes=nodes)


def fsdp_largest_batch(model, train, hw, upper: int = 72) -> int:
    """Largest per-GPU micro-batch at which an FSDP policy (keep all / full recompute) fits one rank."""
    def ok(b: int) -> bool:
        t = train.replace(micro_batch_size=b)
        wl = rank_workload(Workload.analytic(model, t, hw), hw, "fsdp")
        rhw = rank_hardware(hw)
        for s in fsdp_schedules(wl):
            try:
                simulate(s, wl, rhw)
                return True
            except InfeasibleSchedule:
                pass
        return False

    lo, hi = 0, upper + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def main() -> int:
    t0 = time.perf_counter()
    model = load_model("qwen3.6-27b")
    train = TrainSpec(micro_batch_size=72, seq_len=1024)
    single = plan_cluster(model, train, hardware(1, 1), "shard")
    single_host = single.host_bytes_per_node
    print(f"# bench_scaling  27B ({model.name}), batch 72 per GPU x seq 1024, H800 SXM (conf/hardware/h800x8*.yaml)")
    print(f"single-GPU plan: {single.tokens_per_second:.0f} tokens/s, iteration {single.sim.iteration_seconds:.2f} s, "
          f"host {single_host / GB:.0f} GB")
    fsdp_batch = fsdp_largest_batch(model, train, hardware(1, 1))
    print(f"fsdp: batch 72 does not fit an H800 without activation offload; largest fitting batch per GPU: "
          f"{fsdp_batch} (its rows use it)")
    print()
    print("| mode | GPUs | batch/GPU | tokens/s | efficiency | host GB/node | x single | iteration s | optimizer | "
          "homes g/c/n/r | host fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for mode in MODES:
        for n, nodes in CONFIGS:
            hw = hardware(n, nodes)
            kw = {}
            real = mode
            t = train
            if mode == "shard<=1.1x":
                real, kw = "shard", {"host_bytes_per_node": 1.1 * single_host}
            if mode == "fsdp":
                t = train.replace(micro_batch_size=fsdp_batch)
            r = plan_cluster(model, t, hw, real, **kw)
            tps = r.tokens_per_second
            base.setdefault(mode, tps)
            eff = tps / (r.world_size * base[mode])
            if mode == "fsdp":
                eff_text = f"{eff:.3f} ({tps / (r.world_size * single.tokens_per_second):.3f} vs plan)"
            else:
                eff_text = f"{eff:.3f}"
            c = r.schedule.count_homes()
            homes = "/".join(str(c[h]) for h in ("gpu", "cpu", "nvme", "recompute"))
            gpus = f"{n}" if nodes == 1 else f"{nodes}x{n}"
            fits = "yes" if r.host_fits else f"no (> {hw.cpu_memory_bytes / GB:.0f} GB)"
            print(f"| {mode} | {gpus} | {t.micro_batch_size} | {tps:.0f} | {eff_text} | {r.host_bytes_per_node / GB:.0f} | "
                  f"{r.host_bytes_per_node / single_host:.2f} | {r.sim.iteration_seconds:.2f} | {r.schedule.optimizer} | "
                  f"{homes} | {fits} |")
            sys.stdout.flush()
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
