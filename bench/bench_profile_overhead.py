"""The CPU profile's compute times against a step without the memory tracker (Note: [the tracker's own time]).

On the CPU a profiled step measures its device bytes with ``LiveBytes``, a ``TorchDispatchMode`` that sees every
op -- and slows every op. The plan is made from that step's compute times, so before this note every compute
figure it priced on the CPU carried the tracker's cost. This bench streams a ``LlamaLM`` through the
``Executor`` (``--schedule``, default keep_all) and alternates, ``--rounds`` times after a warm-up, a profiled
micro-batch (``profiling=True``: the tracker on) and a plain one; per micro-batch it sums the compute segments
(forward, backward, re-runs) and the head's span (window H to B{L-1}). Printed: the medians, and the profiled
step's figures over the plain step's, raw (what the clock saw) and with the tracker's own time taken out (what
the profile now hands the plan). 1.0 is a profile that prices the step as it runs.

    python bench/bench_profile_overhead.py [--hidden 64 --layers 4 --batch 8 --seq 128 --rounds 9]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.live_bytes import dispatch_cost
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import ModelSpec
from lightning_lazytrain.planner.policies import BASELINES, baseline


def figures(ex: Executor, layers: int) -> dict[str, float]:
    """One micro-batch's compute seconds (raw and without the tracker) and head span."""
    tr = ex.trace
    raw = sum(tr.resolve(b) - tr.resolve(a) for _, _, _, a, b, _ in tr._compute)
    net = sum(s.end - s.start for s in tr.compute)
    starts = dict(tr.windows[::-1])
    head_raw = max(0.0, starts.get(f"B{layers - 1}", 0.0) - starts.get("H", 0.0))
    return {"compute_raw": raw, "compute": net, "head_raw": head_raw, "head": tr.span("H", f"B{layers - 1}")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--schedule", default="keep_all", choices=sorted(BASELINES))
    a = ap.parse_args()
    torch.manual_seed(0)
    heads = max(1, a.hidden // 16)
    spec = ModelSpec(name="bench", num_layers=a.layers, hidden=a.hidden, intermediate=4 * a.hidden, heads=heads,
                     kv_heads=heads, head_dim=a.hidden // heads, vocab=256)
    model = LlamaLM(spec)
    tokens = torch.randint(0, 256, (a.batch, a.seq))
    ex = Executor(model, baseline(a.schedule, a.layers))
    ex.tracker_time_out = True  # off by default (executor.py, Note: [the tracker's own time])
    rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        for r in range(a.rounds + 1):
            for profiled in (True, False):
                ex.profiling = profiled
                ex.begin_microbatch(first=True, last=True)
                model.loss(tokens).backward()
                ex.end_microbatch()
                ex.profiling = False
                model.zero_grad(set_to_none=True)
                if r:
                    rows[profiled].append(figures(ex, a.layers))
    finally:
        ex.close()
    med = {p: {k: statistics.median(x[k] for x in rows[p]) for k in rows[p][0]} for p in rows}
    print(f"LlamaLM hidden {a.hidden}, {a.layers} blocks, batch {a.batch} x {a.seq}, schedule {a.schedule}, "
          f"{a.rounds} rounds, torch {torch.__version__} ({torch.get_num_threads()} threads); dispatch cost "
          f"{dispatch_cost() * 1e6:.1f} us/op")
    print(f"{'figure':>14} {'plain s':>9} {'profiled raw s':>15} {'ratio':>6} {'profiled s':>11} {'ratio':>6}")
    for what in ("compute", "head"):
        plain = med[False][what]
        raw, net = med[True][f"{what}_raw"], med[True][what]
        print(f"{what:>14} {plain:>9.4f} {raw:>15.4f} {raw / plain:>6.2f} {net:>11.4f} {net / plain:>6.2f}")


if __name__ == "__main__":
    main()
