"""The per-layer optimizer mode: what it gains, and does the MILP find it?

    python bench/bench_optimizer_mix.py      # ~1 minute on a 2-core machine

``serial`` updates every layer in T, ``pipelined`` updates layer 0 in T and layer j+1 in the first
micro-batch's F{j}; ``Schedule.serial_layers`` (the per-layer mode) updates a chosen set S in T under
a pipelined step. For each instance: the MILP forced to each pure mode
(``MilpOptions(serial_layers=False)``), a brute-force search over S with each pure solution's other
decisions (every set for up to 6 layers; for more, every prefix and suffix and the greedy set), and
the MILP with the per-layer decision (the default), which must be at least as good as both. Instances: the eight small ones of ``tests/test_planner_optimizer_mode.py``
(accumulation, slow links: where serial wins 2.5-4.2%), the audit's 27B / H800 / batch 72 with a
3 GB/s link, and the shipped 27B / H800 profile.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
import time
from pathlib import Path

from lightning_lazytrain.planner import simulate, solve
from lightning_lazytrain.planner.schedule import Schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def mixed(s: Schedule, serial: set[int]) -> Schedule:
    """``s``'s decisions with a pipelined optimizer that updates ``serial`` in T."""
    return dataclasses.replace(s, optimizer="pipelined", serial_layers=tuple(sorted(serial)))


def best_mix(s: Schedule, wl, hw) -> tuple[float, set[int]]:
    L = s.num_layers
    t = lambda S: simulate(mixed(s, S), wl, hw).iteration_seconds  # noqa: E731
    layers = range(1, L)
    if L <= 6:
        candidates = [set(c) for r in range(L) for c in itertools.combinations(layers, r)]
    else:
        candidates = [set(range(1, k)) for k in range(1, L + 1)] + [set(range(k, L)) for k in range(1, L)]
        S, best = set(), t(set())
        improved = True
        while improved:  # greedy: add the layer whose move to T helps most
            improved = False
            for j in layers:
                if j not in S and (v := t(S | {j})) < best - 1e-9:
                    best, S, improved = v, S | {j}, True
        candidates.append(S)
    return min(((t(S), S) for S in candidates), key=lambda x: x[0])


def instances():
    from test_planner_optimizer_mode import small_instance

    for seed in range(8):
        wl, hw = small_instance(random.Random(1200 + seed), 3 + seed % 3, slow=seed < 6)
        yield f"small seed {seed} (L={wl.num_layers}, accum {wl.grad_accum})", wl, hw
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_planner import load
    from lightning_lazytrain.planner import Workload

    hw, m, t = load("h800", "qwen3.6-27b")
    wl = Workload.analytic(m, t, hw)
    yield "27B / H800 / b72, 3 GB/s link", wl, hw.replace(h2d_bytes_per_s=3e9, d2h_bytes_per_s=3e9)
    yield "27B / H800 / b72, profile", wl, hw


def main() -> None:
    t0 = time.time()
    print("instance | serial s | pipelined s | best pure | brute-force mix s (layers in T) | MILP s (layers in T; "
          "solve s) | MILP / best pure")
    worst = 1.0
    for name, wl, hw in instances():
        gap = 1e-9 if wl.num_layers < 10 else 1e-3
        pure = {mode: solve(wl, hw, mip_gap=gap, time_limit=60, optimizer_mode=mode, serial_layers=False)
                for mode in ("serial", "pipelined")}
        best_pure = min(r.simulated.iteration_seconds for r in pure.values())
        for mode, r in pure.items():  # the mix's two ends are the pure modes, to the last bit
            ends = set(range(1, wl.num_layers)) if mode == "serial" else set()
            assert simulate(mixed(r.schedule, ends), wl, hw).iteration_seconds == r.simulated.iteration_seconds
        t_mix, S = min((best_mix(r.schedule, wl, hw) for r in pure.values()), key=lambda x: x[0])
        t1 = time.time()
        milp = solve(wl, hw, mip_gap=gap, time_limit=60, serial_layers=True)
        solve_s = time.time() - t1
        t_milp = milp.simulated.iteration_seconds
        worst = min(worst, t_milp / best_pure)
        show = lambda x: sorted(x) if len(x) < 12 else f"{len(x)} layers"  # noqa: E731
        print(f"{name} | {pure['serial'].simulated.iteration_seconds:.4f} | "
              f"{pure['pipelined'].simulated.iteration_seconds:.4f} | "
              f"{min(pure, key=lambda k: pure[k].simulated.iteration_seconds)} | {t_mix:.4f} ({show(S)}) | "
              f"{t_milp:.4f} ({milp.schedule.optimizer}, {show(milp.schedule.serial_layers)}; {solve_s:.2f}) | "
              f"{t_milp / best_pure:.4f}")
    print(f"\nMILP with the per-layer mode / best pure mode, lowest over the instances: {worst:.4f}  "
          f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
