"""A Fabric training script for the data-parallel Fabric tests (``tests/test_fabric.py``): run as
``python tests/dist_fabric.py '<json options>'`` (or a JSON list of options: the runs one after another in
the same processes); ``fabric.launch()`` starts the other ranks by running this same command. Each rank writes its per-step losses; rank 0 writes the final weights and
what its strategy planned.

Options: out (directory), devices, batch (per rank), steps, accum (backward calls per optimizer
step), clip (``fabric.clip_gradients`` max norm), strategy ("lazytrain" or "ddp"), policy,
union_of (one process whose every micro-batch is the union of what union_of ranks see), overlap
(``overlap_grad_sync``), same_init (every rank builds the same initial weights).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import lightning as L
import torch
from dist_runs import run_each
from models import tiny_llama

LAYERS = 4
SEQ = 32


def make_model(seed: int) -> torch.nn.Module:
    return tiny_llama(seed, layers=LAYERS)


def data(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (n, SEQ), generator=g)


def micro_batches(opts: dict, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's micro-batches, in order: rank r takes rows r, r + W, ... of each global batch of
    W x batch rows (``union_of``: one process takes the whole global batch)."""
    b, steps, accum = opts["batch"], opts.get("steps", 3), opts.get("accum", 1)
    w = opts.get("union_of", world)
    rows = data(w * b * steps * accum)
    out = []
    for k in range(steps * accum):
        glob = rows[k * w * b:(k + 1) * w * b]
        out.append(glob if "union_of" in opts else glob[rank::world])
    return out


def train(opts: dict) -> dict:
    torch.set_num_threads(1)
    if opts.get("strategy", "lazytrain") == "lazytrain":
        from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy

        strategy = LazyTrainFabricStrategy(policy=opts.get("policy", "milp"), timeout=timedelta(seconds=60),
                                           overlap_grad_sync=opts.get("overlap", True), replan=opts.get("replan", True))
    else:
        strategy = opts["strategy"]
    devices = 1 if "union_of" in opts else opts.get("devices", 2)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    model = make_model(0 if opts.get("same_init", True) else 1000 + rank)  # rank 0's weights are broadcast
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    accum = opts.get("accum", 1)
    losses = []
    for k, b in enumerate(micro_batches(opts, rank, fabric.world_size)):
        loss = model(input_ids=b, labels=b).loss
        fabric.backward(loss / accum)
        losses.append(loss.item())
        if (k + 1) % accum == 0:
            if opts.get("clip"):
                fabric.clip_gradients(model, opt, max_norm=opts["clip"])
            opt.step()
            opt.zero_grad()
    out = {"losses": losses, "rank": rank, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if opts.get("strategy", "lazytrain") == "lazytrain":
        s = fabric.strategy
        out["policy"] = s.plan.schedule.policy if s.plan is not None else None
        out["collective"] = float(s.last_stats.lane_bytes.get("collective", 0.0)) if s.last_stats else 0.0
        out["replans"] = list(s.replans)
        s.teardown()
    return out


def main() -> None:
    run_each("dist_fabric", run)  # tests/dist_runs.py, Note: [shared runs]


def run(opts: dict) -> None:
    result = train(opts)
    out, rank = opts["out"], result["rank"]
    with open(os.path.join(out, f"losses_rank{rank}.json"), "w") as f:
        json.dump({k: v for k, v in result.items() if k != "weights"}, f)
    if rank == 0:
        torch.save(result["weights"], os.path.join(out, "weights.pt"))
    with open(os.path.join(out, f"done_rank{rank}"), "w"):
        pass


if __name__ == "__main__":
    main()
