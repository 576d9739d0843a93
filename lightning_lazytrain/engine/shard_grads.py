"""The gradient collectives of a sharded store (engine/shard_store.py), off the launching thread.

Note: [overlapped reduce-scatter]
    A sharded block's gradients are summed over the ranks by a reduce-scatter (and, with hybrid
    sharding, an all-reduce of the shard over the replica group), divided by the world size, and the
    ranks' "a gradient reached this parameter" flags are OR-ed; only then can the shard's D2H start.
    The plan prices these on the collective lane beside compute, so handing a block's gradients over
    must not wait for them. ``ShardGradLane.submit`` starts them and returns a handle the shard's D2H
    takes as ``after=`` and a function that reads the flags (called on the host lane, once the D2H is
    in). The slot's next gradient use waits for that D2H (``bind`` with grads, as for any group), so
    at most one reduction per slot is in flight: the slots bound what the lane holds.

    Every rank must issue the collectives of one group in the same order, and NCCL asks the same of
    operations on different communicators (they may deadlock otherwise). Hence, per backend:

    - gloo (CPU devices): a collective blocks its caller, so a FIFO thread of the lane's own runs
      the jobs in submission order -- the schedule's order, the same on every rank -- on a gloo group
      of their own (``grad_group``: the launching thread's all-gathers on the store's group never
      interleave with them) and on the replica group, which only this thread uses then. The thread
      is a ``worker.Worker``: a failed job fails every later one at once (no rank waits out a
      timeout per layer) until the lane closes, and its error reaches the D2H, the accumulation and
      ``wait_host`` (Note: [one worker, one error rule]).
    - NCCL (CUDA): collectives do not block the host, so they are issued from the launching thread,
      in program order, like the all-gathers: the reduce-scatter while compute is the current stream
      (NCCL orders it after the layer's backward), the rest on a side stream that waits for it (so
      compute never waits for a collective); the flags come back through a pinned buffer and an
      event. Not yet run on a GPU (the device kit's ``distributed`` stage runs it at world size 1).

    Per element the arithmetic is the in-line path's (the same collectives on the same buffers, one
    division), so an overlapped step is bit-identical to an in-line one (tested).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_lazytrain.engine.worker import CopyHandle, Worker

__all__ = ["ShardGradLane"]

log = logging.getLogger(__name__)


class ShardGradLane:
    """Issues a sharded store's gradient collectives so the launching thread never waits for them."""

    def __init__(self, device: torch.device, group: Any, grad_group: Any, replica_group: Any, divisor: int) -> None:
        self.device, self.group, self.grad_group, self.replica_group = device, group, grad_group, replica_group
        self.divisor = divisor  # every rank (shard group x replicas): DDP's average
        self._worker: Worker | None = None  # gloo: the jobs' FIFO thread, started by the first job
        self._side: Any = None  # CUDA: the stream the replica all-reduce, division and flags run on

    def submit(self, rank_major: torch.Tensor, mine: torch.Tensor, flags: torch.Tensor
               ) -> tuple[CopyHandle, Callable[[], list[int]]]:
        """Reduce-scatter ``rank_major`` into ``mine`` (summed over every rank, divided by their
        number) and OR ``flags`` (int32, one per parameter) over the ranks. Returns the handle the
        D2H of ``mine`` waits for, and a function giving the combined flags once that handle is done."""
        if self.device.type == "cuda":
            return self._issue_cuda(rank_major, mine, flags)
        if self.grad_group is None:
            raise RuntimeError("an overlapped reduce-scatter on gloo needs a process group of its own (grad_group)")
        out: list[list[int]] = []

        def job() -> None:
            with torch.no_grad():
                self.reduce(rank_major, mine, flags, self.grad_group)
            out.append(flags.tolist())

        if self._worker is None:
            self._worker = Worker("lazytrain-reduce")
        return self._worker.submit(job, lane="d2h", nbytes=mine.nbytes), lambda: out[0]

    def reduce(self, rank_major: torch.Tensor, mine: torch.Tensor, flags: torch.Tensor, group: Any,
               timed: Any = None) -> None:
        """The collectives of one block's gradients, run to completion on the calling thread (gloo),
        on ``group``: the reduce-scatter and the same shard's sum over the other shard groups (inside
        ``timed``, a context manager, if given), the flags' OR, the division. The gloo thread's job,
        and the in-line path of a profiled step (``ShardedParamStore._reduce_in_line``)."""
        with timed if timed is not None else contextlib.nullcontext():
            dist.reduce_scatter_tensor(mine, rank_major, group=group)
            if self.replica_group is not None:  # the same shard's sum over the other shard groups
                dist.all_reduce(mine, group=self.replica_group)
        dist.all_reduce(flags, group=group)
        if self.replica_group is not None:
            dist.all_reduce(flags, group=self.replica_group)
        mine.div_(self.divisor)  # DDP's average over every rank

    def _issue_cuda(self, rank_major: torch.Tensor, mine: torch.Tensor, flags: torch.Tensor
                    ) -> tuple[CopyHandle, Callable[[], list[int]]]:
        from lightning_lazytrain.engine.copy_cuda import CudaHandle

        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        flags_dev = flags.to(self.device, non_blocking=True)
        # issued with compute current: NCCL orders the reduce-scatter after this layer's backward
        work = dist.reduce_scatter_tensor(mine, rank_major, group=self.group, async_op=True)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        self._side.wait_stream(torch.cuda.current_stream(self.device))  # the flags' copy above
        with torch.cuda.stream(self._side):
            work.wait()  # the side stream (not compute) waits for the reduce-scatter
            flag_work = dist.all_reduce(flags_dev, group=self.group, async_op=True)
            if self.replica_group is not None:
                dist.all_reduce(mine, group=self.replica_group, async_op=True).wait()
            flag_work.wait()
            if self.replica_group is not None:
                dist.all_reduce(flags_dev, group=self.replica_group, async_op=True).wait()
            mine.div_(self.divisor)
            host.copy_(flags_dev, non_blocking=True)
            for t in (mine, rank_major, flags_dev):
                t.record_stream(self._side)
            done = torch.cuda.Event()
            done.record(self._side)
        handle = CudaHandle.after_event("d2h", mine.nbytes, done, tag="reduce")

        def read() -> list[int]:
            done.synchronize()
            return host.tolist()

        return handle, read

    # ---- the gloo thread ------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the queued jobs and stop the thread (a daemon: a failed rank never waits for it)."""
        if self._worker is not None and not self._worker.close(timeout=60):
            # still inside a collective: never start a second thread beside it
            log.warning("the reduce-scatter thread did not finish within 60 s; leaving it")
            return
        self._worker = None  # (a stopped worker goes with it: a new one runs the next jobs)
