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

Note: [collective bytes]
    ``GradSync.average_grads`` returns (and keeps in ``step_bytes``) what the step's collectives
    moved, per rank, in the planner's unit (``planner.multi.host_allreduce_bytes``): an all-reduce
    of a buffer of ``N`` bytes over ``W`` ranks counts ``2 (W-1)/W x N`` -- what each rank sends
    (and receives) in a bandwidth-optimal ring all-reduce, gloo's algorithm for these buffers, and
    the "bus bandwidth" convention of nccl-tests. ``N`` is the group's flat host gradient as it is
    all-reduced: ``ParamStore.group_numel`` elements (every parameter padded to 64 elements) in the
    master dtype. A measured ``Workload`` counts the same elements (``LayerWork.params`` is the
    group's numel), so ``step_bytes["collective"]`` -- one all-reduce per group, the schedule's
    ``collective allreduce`` ops in T -- equals the simulator's ``lane_bytes["collective"]`` for the
    rank's workload (``multi.rank_workload(wl, hw, "replicate")``) exactly, with fp32 masters
    (``32-true`` and the mixed precisions). With 16-bit masters (``bf16-true``) the gradient is
    16-bit and the planner, which prices host gradients in fp32 (``HOST_GRAD_BYTES``), counts twice
    the bytes. Not counted on the collective lane (``step_bytes["flags"]``): the one exchange of
    "has a gradient" flags per step (one int32 per parameter tensor, MAX), control data of
    O(tensors), not O(parameters), which the planner does not model.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_lazytrain.engine.param_store import REST, ParamStore
from lightning_lazytrain.planner.multi import host_allreduce_bytes

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
        # what the last average_grads moved, per rank (Note: [collective bytes])
        self.step_bytes: dict[str, float] = {"collective": 0.0, "flags": 0.0}

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
                      sq_norms: dict[int, torch.Tensor] | None = None) -> float:
        """Average the step's host gradients over the ranks, in place; refresh the norms the executor
        took (``StepStats.grad_norms``, per parameter, and ``layer_sq_norms``) from the averages.
        Returns the bytes this rank's gradient all-reduces moved (the ``collective`` lane; Note:
        [collective bytes]); ``step_bytes`` has them and the flag exchange's."""
        layers = self._layers(params)
        flats = {j: params.flat_host_grads(j) for j in layers}
        has = torch.tensor([p.grad is not None for j in layers for p, _ in flats[j][1]], dtype=torch.int32)
        moved, flags = 0.0, 0.0
        if has.numel():
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.group)
            flags = host_allreduce_bytes(has.numel() * has.element_size(), self.world_size)
        k = 0
        with torch.no_grad():
            for j in layers:
                flat, views = flats[j]
                if flat.numel():
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                    flat.div_(self.world_size)
                    moved += host_allreduce_bytes(flat.numel() * flat.element_size(), self.world_size)
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
        self.step_bytes = {"collective": moved, "flags": flags}
        return moved
