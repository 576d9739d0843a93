"""Fine-tuning with frozen blocks: what a step moves and computes, against full training in the same process.

A stack of ``--layers`` MLP blocks (hidden ``--d``) under a frozen embedding, trained with
``strategy="lazytrain"`` and a named policy (``--policy``, default ``recompute_all``) for ``--steps`` steps:
fully trainable (the baseline), then with the first ``k`` blocks frozen for each ``k`` in ``--frozen`` (all:
a head-only fine-tune). Per variant, the last step's H2D and D2H bytes, its block backward and re-run
segments, and the median step seconds of the last half of the steps, each as a ratio to the baseline's.
With ``--policy milp`` also the plan's predicted step against the measured one, and the same schedule priced
as if every block ran its backward (how the plan priced a frozen prefix before Note: [layers without a
backward], planner/workload.py).
Note: [blocks no gradient reaches] (engine/block_calls.py): a frozen first part of the stack runs its forward
only, keeps no internals and is not fetched again for the backward.

    python bench/bench_frozen_blocks.py [--layers 8 --d 256 --batch 64 --steps 12 --frozen 4,8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import lightning as L
import torch
from torch import nn

from lightning_lazytrain.planner import simulate
from lightning_lazytrain.strategy import LazyTrainStrategy


class Net(L.LightningModule):
    def __init__(self, layers: int, d: int, frozen: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(d, d).requires_grad_(False)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(layers))
        self.head = nn.Linear(d, 1)
        for b in self.layers[:frozen]:
            b.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.layers:
            h = h + b(h)
        return h

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.head(self(batch)).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class Watch(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []
        self.last: dict = {}

    def on_before_optimizer_step(self, trainer, *args) -> None:
        stats = trainer.strategy.executor.stats
        kinds: dict[str, int] = {}
        for s in stats.segments:
            if s.lane == "compute":
                kinds[s.kind] = kinds.get(s.kind, 0) + 1
        self.last = {"h2d": stats.lane_bytes.get("h2d", 0.0), "d2h": stats.lane_bytes.get("d2h", 0.0),
                     "backward": kinds.get("backward", 0),
                     "reruns": kinds.get("local_recompute", 0) + kinds.get("recompute", 0)}

    def on_train_batch_end(self, trainer, *args) -> None:
        self.ends.append(time.perf_counter())
        self.plan = trainer.strategy.core.plan  # policy="milp": the plan from the profiled first step


def run(a: argparse.Namespace, frozen: int) -> dict:
    watch = Watch()
    data = [torch.randn(a.batch, a.d, generator=torch.Generator().manual_seed(k)) for k in range(a.steps)]
    trainer = L.Trainer(strategy=LazyTrainStrategy(policy=a.policy), accelerator="cpu", max_steps=a.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[watch])
    trainer.fit(Net(a.layers, a.d, frozen), torch.utils.data.DataLoader(data, batch_size=None))
    steps = [b - e for e, b in zip(watch.ends, watch.ends[1:])][len(watch.ends) // 2:]
    out = {**watch.last, "step_s": statistics.median(steps)}
    plan = getattr(watch, "plan", None)
    if plan is not None:  # the plan's step, and the same schedule priced as if every block ran its backward
        r = plan.result
        out["predicted_s"] = r.sim.iteration_seconds
        out["as_if_trained_s"] = simulate(r.schedule, replace(r.workload, no_backward=()), r.hardware,
                                          check=False).iteration_seconds
        out["policy"] = r.schedule.policy
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--policy", default="recompute_all")
    ap.add_argument("--frozen", default=None, help="comma-separated counts of frozen first blocks (default: half, all)")
    a = ap.parse_args()
    counts = [int(k) for k in a.frozen.split(",")] if a.frozen else [a.layers // 2, a.layers]
    base = run(a, 0)
    print(f"{a.layers} blocks, d={a.d}, batch {a.batch}, policy {a.policy}, torch {torch.__version__}; per step "
          "(last step's bytes and segments, median step seconds of the last half), ratio to full training")
    print(f"{'frozen':>8} {'H2D B':>12} {'D2H B':>12} {'backward':>9} {'re-runs':>8} {'step s':>9}")
    rows = [(0, base)] + [(k, run(a, k)) for k in counts]
    for k, r in rows:
        ratio = lambda key: r[key] / base[key] if base[key] else float("nan")  # noqa: E731
        print(f"{k:>8} {r['h2d']:>12.0f} {r['d2h']:>12.0f} {r['backward']:>9d} {r['reruns']:>8d} {r['step_s']:>9.4f}"
              + ("" if k == 0 else f"   x{ratio('h2d'):.2f} H2D, x{ratio('d2h'):.2f} D2H, x{ratio('step_s'):.2f} step"))
    if "predicted_s" in base:  # Note: [layers without a backward] (planner/workload.py)
        print("the plan's step (the profile's workload on the plan's hardware) against the measured median step:")
        print(f"{'frozen':>8} {'schedule':>16} {'measured s':>11} {'predicted s':>12} {'pred/meas':>10} "
              f"{'priced as trained s':>20} {'pred/meas':>10}")
        for k, r in rows:
            print(f"{k:>8} {r['policy']:>16} {r['step_s']:>11.4f} {r['predicted_s']:>12.4f} "
                  f"{r['predicted_s'] / r['step_s']:>10.2f} {r['as_if_trained_s']:>20.4f} "
                  f"{r['as_if_trained_s'] / r['step_s']:>10.2f}")


if __name__ == "__main__":
    main()
