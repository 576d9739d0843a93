"""Several devices for ``LazyTrainStrategy``: one process per device, data parallel.

Note: [replicate mode]
    Today every rank streams whole blocks from its own host copy of the masters and optimizer
    states (the issue's ``replicate`` mode; sharding them across a node's ranks is the next step).
    What makes it train as DDP does:

    - the same start: rank 0's masters and buffers are broadcast when the executor is built;
    - the same plan: rank 0 profiles its first step like every rank, solves, and broadcasts the
      plan (or the reason it could not plan, so no rank waits for one that will never come);
    - the same gradients: when a step's last micro-batch has landed on the host, each group's flat
      host gradient is summed over the ranks and divided by the world size (DDP's average), a
      parameter that got a gradient on any rank gets one on all, and the per-parameter norms that
      clipping uses (and the per-layer squared norms) are taken again from the averaged gradients.

    Gradients and masters live in host memory, so these collectives run on a gloo group of their
    own (also next to NCCL on GPUs), in the launching thread, at a step boundary: they never
    interleave with Lightning's collectives on the default group (logging with ``sync_dist``,
    barriers). The all-reduce is serial after the backward; overlapping it per layer with the
    backward, and reduce-scatter on the devices in a sharded mode, are what comes next.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_lazytrain.engine.param_store import REST, ParamStore

__all__ = ["GradSync"]


class GradSync:
    """Host-side collectives of a data-parallel lazytrain run (see Note: [replicate mode])."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("GradSync needs an initialised torch.distributed default process group")
        kw: dict[str, Any] = {"backend": "gloo"}
        if timeout is not None:
            kw["timeout"] = timeout
        self.group = dist.new_group(**kw)
        self.world_size = dist.get_world_size(self.group)

    def _layers(self, params: ParamStore) -> list[int]:
        return [REST, *range(params.num_layers)]

    def broadcast_state(self, params: ParamStore, module: torch.nn.Module) -> None:
        """Every rank starts from rank 0's weights and buffers (DDP broadcasts them at wrap time)."""
        with torch.no_grad():
            for j in self._layers(params):
                master = params.master_flat(j)
                if master.numel():
                    dist.broadcast(master, src=0, group=self.group)
            for buf in module.buffers():
                host = buf.detach().cpu() if buf.device.type != "cpu" else buf.data
                dist.broadcast(host, src=0, group=self.group)
                if host is not buf.data:
                    buf.data.copy_(host)

    def average_grads(self, params: ParamStore, grad_norms: dict[int, dict[torch.nn.Parameter, torch.Tensor]],
                      sq_norms: dict[int, torch.Tensor] | None = None) -> None:
        """Average the step's host gradients over the ranks, in place; refresh the norms the executor
        took (``StepStats.grad_norms``, per parameter, and ``layer_sq_norms``) from the averages."""
        layers = self._layers(params)
        flats = {j: params.flat_host_grads(j) for j in layers}
        has = torch.tensor([p.grad is not None for j in layers for p, _ in flats[j][1]], dtype=torch.int32)
        if has.numel():
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.group)
        k = 0
        with torch.no_grad():
            for j in layers:
                flat, views = flats[j]
                if flat.numel():
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                    flat.div_(self.world_size)
                for p, view in views:
                    if has[k] and p.grad is None and p.requires_grad:
                        p.grad = view
                    k += 1
                if j in grad_norms or (sq_norms is not None and j in sq_norms):
                    norms = params.grad_norms(j)
                    if j in grad_norms:
                        grad_norms[j] = norms
                    if sq_norms is not None and j in sq_norms:
                        parts = [n.float() for n in norms.values()]
                        sq_norms[j] = torch.stack(parts).square().sum() if parts else torch.zeros(())
