"""Gradient norms over sharded blocks (``data_parallel="shard"``, engine/shard_store.py): a rank holds
its rows of every sharded parameter's gradient, so a norm over its own tensors would be a shard's.
Both functions take the norm of the whole gradients over the ranks of the shard group."""

from __future__ import annotations

from typing import Any

import torch

from lightning_lazytrain.engine.param_store import REST
from lightning_lazytrain.engine.shard_store import ShardedParamStore

__all__ = ["clip_sharded", "whole_grad_norms"]


def clip_sharded(store: ShardedParamStore, sync: Any, optimizer: Any, max_norm: float) -> None:
    """``clip_grad_norm_`` over ``optimizer``'s parameters: the squared norms of this rank's shards are
    summed over the ranks (one all-reduce), the whole non-block parameters' counted once; then every
    gradient (shard or whole) is scaled as torch does."""
    sharded = {id(p) for j in (REST, *range(store.num_layers)) if store.sharded(j)
               for p in store.group_parameters(j)}
    grads = [(id(p) in sharded, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    with torch.no_grad():
        sq = torch.zeros(2, dtype=torch.float64)
        for is_shard, g in grads:
            sq[0 if is_shard else 1] += g.detach().double().square().sum()
        part = sq[:1].clone()
        torch.distributed.all_reduce(part, group=sync.shard_host_group)  # each shard once
        total = float((part[0] + sq[1]).sqrt())
        coef = min(max_norm / (total + 1e-6), 1.0)
        for _, g in grads:
            g.mul_(coef)


def whole_grad_norms(store: ShardedParamStore, sync: Any, stale: list) -> dict:
    """Each parameter's norm over its whole gradient, taken again from every rank's current shards,
    when any rank has a stale norm (every rank calls this at every step, so the collectives match).
    Note: [stale norms] in optim/grad_norms.py."""
    flag = torch.tensor([int(bool(stale))], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=sync.group)
    if not flag.item():
        return {}
    norms = {j: store.grad_norms(j) for j in (REST, *range(store.num_layers))}
    sync.combine_shard_norms(store, norms)
    return {p: n for per_group in norms.values() for p, n in per_group.items()}
