"""What Note: [one gradient per boundary use] costs (engine/boundary_uses.py): the graph walk from the loss before
every backward (``mark_boundary_uses``), and a marked step (a loss on every ``hidden_states[i]``, each block's input
uses returned apart) against the same step summing them as before (the marking switched off).

A Fabric loop on a Hugging Face Llama built from a config (no download), fp32 on the CPU, policy keep_all; its steps
cycle through the three variants (interleaved), ``--steps`` of each after ``--warmup``; prints the medians of the
step time and of the walk, and the ratios walk / step and marked / unmarked step, measured in this process. The walk only reads the graph outside the blocks
(a few nodes per block), so its share shrinks as the blocks grow.

    python bench/bench_boundary_uses.py                      # ~1 minute on 2 cores
    python bench/bench_boundary_uses.py --layers 16 --hidden 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
import transformers

import lightning_lazytrain.engine.executor as executor_module
from lightning_lazytrain.engine import boundary_uses
from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy


def model(layers: int, hidden: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                   num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


VARIANTS = [("plain loss", False, True), ("hidden-state loss, marked", True, True),
            ("hidden-state loss, unmarked (as before)", True, False)]


def run(args) -> dict[str, tuple[list[float], list[float], int]]:
    """One Fabric session; the steps cycle through ``VARIANTS`` (interleaved, so load on the machine hits them
    alike). Returns per variant: step seconds, walk seconds, most blocks marked."""
    state = {"mark": True}
    walks: list[float] = []
    marked: list[int] = []

    def timed_walk(loss, *rest):
        t = time.perf_counter()
        n = boundary_uses.mark_boundary_uses(loss, *rest) if state["mark"] else 0
        walks.append(time.perf_counter() - t)
        marked.append(n)
        return n

    executor_module.mark_boundary_uses = timed_walk
    out: dict[str, tuple[list[float], list[float], int]] = {name: ([], [], 0) for name, _, _ in VARIANTS}
    try:
        m = model(args.layers, args.hidden)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LazyTrainFabricStrategy(policy="keep_all"))
        m, opt = fabric.setup(m, opt)
        g = torch.Generator().manual_seed(1)
        for s in range(len(VARIANTS) * (args.warmup + args.steps)):
            name, hidden_loss, mark = VARIANTS[s % len(VARIANTS)]
            state["mark"] = mark
            batch = torch.randint(0, 1024, (args.batch, args.seq), generator=g)
            walks.clear()
            marked.clear()
            t = time.perf_counter()
            o = m(input_ids=batch, labels=batch, output_hidden_states=hidden_loss)
            loss = o.loss
            if hidden_loss:
                loss = loss + 0.01 * sum(h.pow(2).mean() for h in o.hidden_states[:-1])
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            took = time.perf_counter() - t
            if s >= len(VARIANTS) * args.warmup:
                steps_, walks_, n = out[name]
                steps_.append(took)
                walks_.extend(walks)
                out[name] = (steps_, walks_, max([n, *marked]))
        fabric.strategy.teardown()
    finally:
        executor_module.mark_boundary_uses = boundary_uses.mark_boundary_uses
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"Llama {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq}, fp32 CPU, keep_all, "
          f"{args.steps} steps after {args.warmup}")
    out = run(args)
    med = {}
    for name, (steps, walks, n) in out.items():
        step, walk = statistics.median(steps), statistics.median(walks) if walks else 0.0
        med[name] = step
        print(f"  {name:42s} step {step * 1e3:8.1f} ms   walk {walk * 1e6:7.0f} us ({walk / step:.2%} of the step)"
              f"   blocks marked {n}")
    print(f"  marked / unmarked step (hidden-state loss): {med[VARIANTS[1][0]] / med[VARIANTS[2][0]]:.3f}x")


if __name__ == "__main__":
    main()
