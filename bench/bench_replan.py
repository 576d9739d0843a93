"""Online re-planning on CPU: the emulated host<->device link slows down mid-run.

Two runs in this process, the same model, data and slowdown: re-planning on (the default) and off.
Prints per-step measured and predicted step seconds, when the re-plan fired and what it decided,
and the figures for bench/RESULTS.md: measured/predicted before the slowdown, and after the re-plan
(the prediction tracks the run again), and the measured step time after the slowdown with the
re-plan over without it (same process, median of the last steps).

    python bench/bench_replan.py [--steps 16] [--at 4] [--factor 40] [--link-gb 0.2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_replan import Net, SlowsDown  # noqa: E402  (the test's model and the slowdown callback)

from lightning_lazytrain.strategy import LazyTrainStrategy  # noqa: E402


def run(steps: int, at: int, factor: float, link_gb: float, replan: bool):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (8, 64), generator=g) for _ in range(steps)]
    strategy = LazyTrainStrategy(emulate_link_gb_per_s=link_gb, replan={"threshold": 0.5, "patience": 2}
                                 if replan else False)
    slow = SlowsDown(at=at, factor=factor)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0, callbacks=[slow]).fit(
        Net(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return strategy, slow


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--at", type=int, default=4)
    ap.add_argument("--factor", type=float, default=40.0)
    ap.add_argument("--link-gb", type=float, default=0.2)
    a = ap.parse_args()
    results = {}
    for replan in (False, True):
        strategy, slow = run(a.steps, a.at, a.factor, a.link_gb, replan)
        results[replan] = (strategy, slow)
        print(f"\n## replan={'on' if replan else 'off'}: measured/predicted per step (from step 1)")
        print(" ".join(f"{x:.2f}" for x in slow.ratios))
        for r in strategy.replans:
            print(f"re-plan at step {r['step']}: {r['reason']}; current {r['current_predicted_s']:.3f} s, "
                  f"new {r['new_predicted_s']:.3f} s ({r['gain']:+.1%}), switched={r['switched']}")
    on, off = results[True][1], results[False][1]
    tail = 4
    before = statistics.median(on.ratios[1:a.at - 1])
    after = statistics.median(on.ratios[-tail:])
    stale = statistics.median(off.ratios[-tail:])
    steps_on = [x * p for x, p in zip(on.ratios, on.predicted)][-tail:]
    steps_off = [x * p for x, p in zip(off.ratios, off.predicted)][-tail:]
    print("\n## figures")
    print(f"measured/predicted before the slowdown: {before:.2f}; after the re-plan: {after:.2f} "
          f"(without re-planning the stale prediction gives {stale:.2f})")
    print(f"measured step after the slowdown, last {tail} steps (median): with re-plan "
          f"{statistics.median(steps_on):.3f} s, without {statistics.median(steps_off):.3f} s: "
          f"{statistics.median(steps_off) / statistics.median(steps_on):.2f}x")


if __name__ == "__main__":
    main()
