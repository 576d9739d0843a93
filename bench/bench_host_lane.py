"""Host lane benchmark on CPU: host-side copy work (fp32 -> bf16 casts before each weight fetch,
gradient accumulation and norms after each gradient copy) on the host lane's worker thread vs
done inline on the thread that launches compute (how the engine worked before the host lane).

    python bench/bench_host_lane.py [torch threads, default 1]   # ~1 minute on a 2-core machine
    python bench/bench_host_lane.py [threads] --copies            # kept compute copies vs a cast per fetch

Same process, same model and data, fp32 masters with bf16 compute copies (so every fetch casts),
for keep_all (one fetch per layer per step) and megatrain K=4 (two fetches, re-runs). Reports the
median step time of each (after a warm-up step) in 3 alternating rounds, the ratio inline / host
lane per round and its median, and the host lane's busy seconds per step (the work moved off the
launching thread). The simulator's host lane
(``planner``: ``Op("host", ...)``) is what a plan counts for the same work.

``--copies``: the host lane either way, a cast per fetch vs kept compute copies (engine/param_store.py,
Note: [kept compute copy]: one cast per group and micro-batch), in the same alternating rounds; reports
the host lane's busy seconds and casts per step and the step time ratio.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

import lightning_lazytrain.engine.executor as executor_module
from lightning_lazytrain.engine.copy_cpu import ThreadCopyEngine
from lightning_lazytrain.engine.copy_engine import CopyRecord, DoneHandle
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import ModelSpec, keep_all, megatrain

SPEC = ModelSpec(name="bench", num_layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=4, head_dim=64,
                 vocab=4096)
BATCH, SEQ = 1, 33  # few tokens: compute is cheap next to the weights, as on a GPU
STEPS = 5
ROUNDS = 3


class InlineHostEngine(ThreadCopyEngine):
    """The baseline: host work runs in the caller, before the call returns."""

    def host(self, fn, *, after=(), tag=None, nbytes=0):
        for h in after:
            h.wait()
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        self._add_record(CopyRecord("host", nbytes, start, time.perf_counter(), tag))
        return self._track(DoneHandle("host"))


def run(base, tokens, schedule, inline: bool, keep: bool = False) -> tuple[list[float], float, int]:
    """Step times (after a warm-up step), the host lane's median busy seconds per step and the casts
    of the last step."""
    make = executor_module.make_copy_engine
    if inline:
        executor_module.make_copy_engine = lambda device, links=None: InlineHostEngine(links)
    try:
        m = copy.deepcopy(base)
        ex = Executor(m, schedule, compute_dtype=torch.bfloat16, keep_compute_copy=keep)
    finally:
        executor_module.make_copy_engine = make
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    times, busy, casts = [], [], 0
    try:
        for _ in range(STEPS + 1):
            t0 = time.perf_counter()
            ex.begin_microbatch()
            m.loss(tokens).backward()
            ex.end_microbatch()
            times.append(time.perf_counter() - t0)
            busy.append(sum(r.duration for r in ex.engine.records() if r.lane == "host"))
            casts = sum(1 for r in ex.engine.records() if (r.tag or "").startswith("cast"))
            opt.step()
            opt.zero_grad()
    finally:
        ex.close()
    return times[1:], statistics.median(busy[1:]), casts


def compare(name: str, base, tokens, schedule, sides: dict[str, dict], describe) -> None:
    """Alternating rounds (a drifting machine speed hits both sides alike) of two ``run`` settings
    (``sides``: label -> keyword arguments, the first the numerator of the ratio)."""
    (num, num_kw), (den, den_kw) = sides.items()
    ratios = []
    for rnd in range(ROUNDS):
        a = run(base, tokens, schedule, **num_kw)
        b = run(base, tokens, schedule, **den_kw)
        ratio = statistics.median(a[0]) / statistics.median(b[0])
        ratios.append(ratio)
        print(f"{name} round {rnd + 1}: {describe(num, a)}, {describe(den, b)}: {num} / {den} = {ratio:.3f}",
              flush=True)
    print(f"{name}: median {num} / {den} = {statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


def main() -> None:
    torch.manual_seed(0)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    torch.set_num_threads(int(args[0]) if args else 1)  # 1: the host lane needs the other core
    base = LlamaLM(SPEC)
    tokens = torch.randint(0, SPEC.vocab, (BATCH, SEQ))
    print(f"# bench_host_lane: {SPEC.num_layers} layers, hidden {SPEC.hidden}, batch {BATCH}x{SEQ - 1}, "
          f"{SPEC.total_params / 1e6:.1f}M params, fp32 masters, bf16 compute, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    schedules = (("keep_all", keep_all(SPEC.num_layers)), ("megatrain K=4", megatrain(SPEC.num_layers, 4)))
    for name, schedule in schedules:
        if "--copies" in sys.argv:
            compare(name, base, tokens, schedule, {"cast per fetch": dict(inline=False),
                                                   "kept copies": dict(inline=False, keep=True)},
                    lambda label, r: f"{label} {statistics.median(r[0]):.3f} s/step (host lane {r[1]:.3f} s, "
                                     f"{r[2]} casts)")
        else:
            compare(name, base, tokens, schedule, {"inline": dict(inline=True), "host lane": dict(inline=False)},
                    lambda label, r: f"{label} {statistics.median(r[0]):.3f} s/step (host work {r[1]:.3f} s)")

if __name__ == "__main__":
    main()
