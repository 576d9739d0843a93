"""Several devices for ``LazyTrainStrategy``: one process per device, data parallel.

Note: [replicate mode]
    By default every rank streams whole blocks from its own host copy of the masters and optimizer
    states (the ``replicate`` mode; ``LazyTrainStrategy(data_parallel="shard")`` shards every
    group's host state instead, engine/shard_store.py, whose reduce-scatters average the gradients;
    this class then averages only groups a rank holds whole (none), and combines the shards' clip
    norms).
    What makes it train as DDP does:

    - the same start: rank 0's masters and buffers are broadcast when the executor is built;
    - the same plan: rank 0 profiles its first step like every rank, solves, and broadcasts the
      plan (or the reason it could not plan, so no rank waits for one that will never come);
    - the same gradients: when a step's last micro-batch has landed on the host, each group's flat
      host gradient is summed over the ranks and divided by the world size (DDP's average), a
      parameter that got a gradient on any rank gets one on all, and the per-parameter norms that
      clipping uses (and the per-layer squared norms) are taken again from the averaged gradients.

    Gradients and masters live in host memory, so these collectives run on a gloo group of their
    own (also next to NCCL on GPUs): they never interleave with Lightning's collectives on the
    default group (logging with ``sync_dist``, barriers). By default each group's all-reduce runs
    on a collective thread during the backward (Note: [overlapped all-reduce]); without it, in the
    launching thread at the step boundary. Reduce-scatter on the devices in a sharded mode is what
    comes next.

Note: [overlapped all-reduce]
    With ``overlap`` (``LazyTrainStrategy(overlap_grad_sync=True)``, the default with automatic
    optimization; the planner's ``replicate_overlap`` mode) a group's all-reduce does not wait for
    the step to end: the executor's last accumulation of a group in a step
    (``ParamStore.set_final_grads_hook``, in the last micro-batch's backward windows) hands the group to
    a collective thread of its own (a ``Worker``, engine/worker.py: FIFO, a daemon, so a rank that
    fails never waits on it at exit; a failed job fails the step's later ones at once),
    which waits for that accumulation on the host lane, exchanges the group's "has a gradient"
    flags, sums and divides the flat gradient, and takes the group's norms again in place (the
    step's ``grad_norms``/``layer_sq_norms`` entries are the very objects the executor handed over).
    The groups finished in ``T`` (layer 0's, handed over the same way, and the non-block group,
    written back at the end) and any group not handed over are averaged at the step's end, after
    the thread has drained, as before. Every rank hands the groups over in the schedule's order,
    so the collectives on the group match across ranks. Per element the arithmetic is the serial
    path's (one sum over the ranks, one division), so results are bit-identical to it, and to DDP at two
    ranks; at three or more the all-reduce's own summation order over buffers laid out unlike DDP's
    buckets differs in the last bit (review 23: 3.7e-9 after one SGD step, equal losses).
    A gradient added to a group after its final accumulation would be missed: that happens only
    when a block ran a second, ad-hoc pass in the step (``Executor.late_grads``; e.g. two
    forwards before one backward); the first job of a step therefore agrees over the ranks whether
    any rank did, and if so every group of that step is averaged at the end instead.

Note: [one sync per step]
    When every micro-batch writes all of its gradients back to the host (``fp32_masters``, or an
    ``on_after_backward`` hook: the strategy's full micro-batches), the executor ends a "step" per
    micro-batch, but with gradient accumulation the replicas' gradients are still averaged once per
    optimizer step, after its last micro-batch: the strategy sets ``hold`` for the others (no group
    is handed to the collective thread, ``average_grads`` is not called). That is DDP's ``no_sync``
    accumulation, as Lightning runs it: each rank sums its micro-batches, then one all-reduce, so
    a hook sees the rank's own gradients until the last micro-batch and the average after it, as under
    DDP, and the collective lane moves a step's bytes once, not once per micro-batch. (The sharded
    mode reduce-scatters every micro-batch, as FSDP does: a rank holds only its shard of the sum.)
    Such micro-batches are planned one by one (the executor's step), each with its group's all-reduce:
    the plan over-counts the collective lane of the held ones (hidden under the backward with
    ``overlap_grad_sync``). A held micro-batch that is a profile times a scratch all-reduce of the
    gradients (``time_all_reduce``), so the plan prices the all-reduces at this run's bandwidth.

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
    (``32-true``, the mixed precisions, ``fp32_masters``). With 16-bit masters (``bf16-true``) the host
    gradient is 16-bit: the analytic planner prices host gradients in fp32 (``HOST_GRAD_BYTES``), the
    running job's plan (``multi.measured_rank_workload(grad_element_bytes=)``) in the host
    gradients' own dtype. Not counted on the collective lane (``step_bytes["flags"]``): the exchange of
    "has a gradient" flags before each group's all-reduce (one int32 per parameter tensor, MAX), control data of
    O(tensors), not O(parameters), which the planner does not model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_lazytrain.engine.param_store import REST, ParamStore, sq_sum
from lightning_lazytrain.engine.worker import CopyError, ThreadHandle, Worker
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
        self._timeout = timeout
        # Note: [hybrid sharding] (set by ``make_shard_groups``): the groups of a sharded run
        self.shard_size = self.world_size
        self.shard_rank = dist.get_rank(self.group)
        self.shard_host_group: Any = self.group  # gloo: shard norms, over the ranks of one shard group
        self.shard_device_group: Any = "world"  # the store's all-gathers and reduce-scatters
        self.replica_device_group: Any = None  # the all-reduce of a shard across the shard groups
        self.shard_grad_group: Any = None  # gloo: the store's overlapped reduce-scatters (engine/shard_grads.py)
        # what the last average_grads moved, per rank (Note: [collective bytes])
        self.step_bytes: dict[str, float] = {"collective": 0.0, "flags": 0.0}
        self.step_seconds = 0.0
        # Note: [overlapped all-reduce]
        self.overlap = False
        self._late_grads_probe: Callable[[], bool] = lambda: False  # see set_late_grads_probe
        self.overlapped: list[int] = []  # groups the last step averaged during its backward
        self.hold = False  # Note: [one sync per step]: a micro-batch whose gradients are not averaged
        self._worker: Worker | None = None  # the collective thread (attach starts it)
        self._step_reset()

    def make_shard_groups(self, shard_size: int, gloo_reduce: bool = True) -> None:
        """Note: [hybrid sharding]
            ``data_parallel="shard"`` shards the host state over groups of ``shard_size`` consecutive
            ranks (by default one node's ranks: Lightning numbers them ``node * devices + local``)
            and replicates it across the groups ("shard within a node, replicate
            across nodes"): a block's all-gather and reduce-scatter run inside the shard group (on the
            devices' backend: NVLink / PCIe peer), and the reduce-scattered shard is then summed over
            the ranks that own the same shard in the other groups (one all-reduce of 1/S of the block
            per replica group: the network), before the division by the world size. Each node's host
            holds one copy of the state; the clip norms' squares are summed inside the shard group
            only (the replicas hold the same shard). ``shard_size`` equal to the world: one shard
            group (the default group), no replica all-reduce. ``gloo_reduce`` (CPU devices): also a
            gloo group per shard group for the store's gradient collectives (engine/shard_grads.py;
            NCCL needs none). Every rank creates every subgroup, in the same order, as
            torch.distributed requires."""
        world = self.world_size
        if shard_size < 1 or world % shard_size:
            raise ValueError(f"shard_size={shard_size} must divide the number of processes ({world}): use the "
                             "devices per node (the default), or a divisor of devices x num_nodes")
        rank = dist.get_rank()
        self.shard_size, self.shard_rank = shard_size, rank % shard_size
        kw: dict[str, Any] = {} if self._timeout is None else {"timeout": self._timeout}
        if shard_size == world:
            if gloo_reduce:
                self.shard_grad_group = dist.new_group(backend="gloo", **kw)
            return
        for start in range(0, world, shard_size):  # shard groups: consecutive ranks
            ranks = list(range(start, start + shard_size))
            device_group = dist.new_group(ranks, **kw)
            host_group = dist.new_group(ranks, backend="gloo", **kw)
            grad_group = dist.new_group(ranks, backend="gloo", **kw) if gloo_reduce else None
            if rank in ranks:
                self.shard_device_group, self.shard_host_group = device_group, host_group
                self.shard_grad_group = grad_group
        for r in range(shard_size):  # replica groups: the ranks that own shard r
            ranks = list(range(r, world, shard_size))
            group = dist.new_group(ranks, **kw)
            if rank in ranks:
                self.replica_device_group = group

    # ---- overlapped all-reduce (Note: [overlapped all-reduce]) ---------------------------------
    def _step_reset(self) -> None:
        self._done: list[int] = []
        self._handles: list[ThreadHandle] = []  # the step's jobs on the collective thread
        self._fallback: bool | None = None  # decided by the step's first job, the same on every rank
        self._bytes = {"collective": 0.0, "flags": 0.0}
        self._seconds = 0.0  # in the gradient all-reduces

    def attach(self, params: ParamStore) -> None:
        """Average each group as soon as its step's gradient is complete (a thread of its own)."""
        self.overlap = True
        if self._worker is None:
            self._worker = Worker("lazytrain-gradsync")
        params.set_final_grads_hook(self._submit)  # carried over when the executor rebuilds its ParamStore

    def set_late_grads_probe(self, probe: Callable[[], bool]) -> None:
        """``probe()``: may a group's gradients change after its final accumulation in this step
        (``Executor.late_grads``)? The first job of a step asks it, and if any rank says yes, every
        group of that step is averaged at the end instead (Note: [overlapped all-reduce])."""
        self._late_grads_probe = probe

    def detach(self, params: ParamStore) -> None:
        params.set_final_grads_hook(None)
        self.overlap = False

    def close(self) -> None:
        """Stop the collective thread (after its jobs); the process group lives on, as DDP leaves it."""
        if self._worker is not None:
            self._worker.close(timeout=60)
            self._worker = None

    def _submit(self, params: ParamStore, layer: int, done: Any, norms: dict | None, sq: torch.Tensor) -> None:
        assert self._worker is not None
        if params.sharded(layer) or self.hold:  # averaged by its reduce-scatter (engine/shard_store.py),
            return  # or later in the step (Note: [one sync per step])
        # FIFO, one error rule (engine/worker.py): after a failed job the step's later jobs fail at
        # once; the error is raised in the launching thread at the step's end (_drain)
        self._handles.append(self._worker.submit(lambda: self._reduce_one(params, layer, done, norms, sq),
                                                 lane="collective"))

    def _reduce_one(self, params: ParamStore, layer: int, done: Any, norms: dict | None, sq: torch.Tensor) -> None:
        done.wait()  # the group's last accumulation on the host lane
        if self._fallback is None:
            flag = torch.tensor([int(bool(self._late_grads_probe()))], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            self._fallback = bool(flag.item())
        if self._fallback:
            return
        if layer in self._done:  # the executor hands each group over once per step
            raise RuntimeError(f"group {layer} was handed over twice in one step")
        self._average_group(params, layer, norms, sq, wait=False)
        self._done.append(layer)

    def _drain(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            with contextlib.suppress(CopyError):  # the worker's error, raised below with its cause
                h.wait()
        err = self._worker.clear() if self._worker is not None else None
        if err is not None:
            raise RuntimeError(f"the overlapped gradient all-reduce failed: {type(err).__name__}: {err}") from err

    def _average_group(self, params: ParamStore, j: int, norms: dict | None, sq: torch.Tensor | None, *,
                       wait: bool = True) -> None:
        """Average one group in place: its flags (MAX), then its flat gradient (SUM, / W); a
        parameter that got a gradient on any rank gets one here. Then take the group's norms again,
        into the executor's own objects (``norms``: per parameter, ``sq``: squared group norm; None:
        not taken). Adds the bytes and all-reduce seconds to the step's (Note: [collective bytes])."""
        flat, views = params.flat_host_grads(j, wait=wait)
        has = torch.tensor([p.grad is not None for p, _ in views], dtype=torch.int32)
        if has.numel():
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.group)
            self._bytes["flags"] += host_allreduce_bytes(has.numel() * has.element_size(), self.world_size)
        with torch.no_grad():
            if flat.numel():
                t0 = time.perf_counter()
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                self._seconds += time.perf_counter() - t0
                flat.div_(self.world_size)
                self._bytes["collective"] += host_allreduce_bytes(flat.numel() * flat.element_size(),
                                                                  self.world_size)
            for k, (p, view) in enumerate(views):
                if has[k] and p.grad is None and p.requires_grad:
                    p.grad = view
        if norms is not None or sq is not None:
            fresh = params.grad_norms(j)
            if norms is not None:
                norms.clear()
                norms.update(fresh)
            if sq is not None:
                sq.copy_(sq_sum(fresh.values()))

    def _layers(self, params: ParamStore) -> list[int]:
        """The groups whose host state every rank holds whole (a sharded block's is averaged by its
        reduce-scatter and was broadcast before it was sharded: ``broadcast_module``)."""
        return [j for j in (REST, *range(params.num_layers)) if not params.sharded(j)]

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters to every rank, before a sharded store keeps each rank's shard of them."""
        with torch.no_grad():
            for p in module.parameters():
                self._broadcast_from_zero(p)

    def _broadcast_from_zero(self, t: torch.Tensor) -> None:
        """Rank 0's value of ``t`` on every rank, through host memory (the gloo group)."""
        host = t.detach().cpu() if t.device.type != "cpu" else t.data
        dist.broadcast(host, src=0, group=self.group)
        if host is not t.data:
            t.data.copy_(host)

    def combine_shard_norms(self, params: ParamStore, grad_norms: dict[int, dict[torch.nn.Parameter, torch.Tensor]],
                            sq_norms: dict[int, torch.Tensor] | None = None) -> None:
        """Sharded groups: each parameter's gradient norm over the whole parameter, from every rank's
        norm of its shard (the square root of the sum of their squares: one all-reduce per step), into
        the executor's objects, as clipping needs them. Groups no rank has norms for are left alone."""
        groups = [j for j in (REST, *range(params.num_layers)) if params.sharded(j) and j in grad_norms]
        if not groups:
            return
        plist = [(j, p) for j in groups for p in params.group_parameters(j)]
        sq = torch.tensor([float(grad_norms[j][p]) ** 2 if p in grad_norms[j] else 0.0 for j, p in plist],
                          dtype=torch.float64)
        has = torch.tensor([p.grad is not None for _, p in plist], dtype=torch.int32)
        dist.all_reduce(sq, group=self.shard_host_group)  # each shard once (Note: [hybrid sharding])
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.shard_host_group)
        for j in groups:
            grad_norms[j].clear()
        for (j, p), v, h in zip(plist, sq.tolist(), has.tolist()):
            if h:
                grad_norms[j][p] = torch.tensor(v ** 0.5, dtype=torch.float32)
        if sq_norms is not None:
            for j in groups:
                fresh = sq_sum(grad_norms[j].values())
                if j in sq_norms:
                    sq_norms[j].copy_(fresh)  # the executor's own object, as _average_group refreshes it
                else:
                    sq_norms[j] = fresh

    def broadcast_state(self, params: ParamStore, module: torch.nn.Module) -> None:
        """Every rank starts from rank 0's weights and buffers (DDP broadcasts them at wrap time)."""
        with torch.no_grad():
            for j in self._layers(params):
                master = params.master_flat(j)
                if master.numel():
                    dist.broadcast(master, src=0, group=self.group)
            for buf in module.buffers():
                self._broadcast_from_zero(buf)

    def average_grads(self, params: ParamStore, grad_norms: dict[int, dict[torch.nn.Parameter, torch.Tensor]],
                      sq_norms: dict[int, torch.Tensor] | None = None) -> float:
        """Average the step's host gradients over the ranks, in place; refresh the norms the executor
        took (``StepStats.grad_norms``, per parameter, and ``layer_sq_norms``) from the averages.
        Returns the bytes this rank's gradient all-reduces moved (the ``collective`` lane; Note:
        [collective bytes]); ``step_bytes`` has them and the flag exchange's. With ``overlap``, the
        groups already averaged during the backward are skipped (Note: [overlapped all-reduce])."""
        done: list[int] = []
        if self.overlap:
            self._drain()
            done = [] if self._fallback else list(self._done)
        self.overlapped = done
        params.wait_host()
        for j in self._layers(params):
            if j not in done:
                self._average_group(params, j, grad_norms.get(j),
                                    sq_norms.get(j) if sq_norms is not None else None, wait=False)
        self.step_bytes = dict(self._bytes)
        self.step_seconds = self._seconds
        self._step_reset()
        return self.step_bytes["collective"]

    def time_all_reduce(self, params: ParamStore) -> None:
        """Note: [one sync per step]: a held micro-batch that is a profile averages nothing, yet the plan
        prices every group's all-reduce at the bandwidth this run achieves: all-reduce a copy of each
        group's flat host gradient (the bytes of the step's average; the gradients are untouched) and
        keep the bytes and seconds for ``bytes_per_s``. Every rank profiles the same micro-batch."""
        params.wait_host()
        nbytes = seconds = 0.0
        with torch.no_grad():
            for j in self._layers(params):
                scratch = params.grad_flat(j).clone()
                if scratch.numel():
                    t0 = time.perf_counter()
                    dist.all_reduce(scratch, op=dist.ReduceOp.SUM, group=self.group)
                    seconds += time.perf_counter() - t0
                    nbytes += host_allreduce_bytes(scratch.numel() * scratch.element_size(), self.world_size)
        self.step_bytes, self.step_seconds = {"collective": nbytes, "flags": 0.0}, seconds

    def bytes_per_s(self) -> float | None:
        """The host all-reduce bandwidth the last step saw (planner unit, per rank: bytes over the
        seconds the gradient all-reduces took, waits for slower ranks included), or None."""
        if self.step_bytes["collective"] <= 0 or self.step_seconds <= 0:
            return None
        return self.step_bytes["collective"] / self.step_seconds
