"""What the training core exchanges between processes besides gradients: Python objects from rank 0
(a plan, a re-plan decision) and from every rank (a step's allocator peaks), on the default process group."""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["broadcast_object", "distributed_ready", "gather_objects"]

T = TypeVar("T")


def distributed_ready() -> bool:
    """torch.distributed is there and its default group initialised."""
    return dist.is_available() and dist.is_initialized()


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (picklable; the default group). Without a process group:
    ``obj``."""
    if not distributed_ready():
        return obj
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def gather_objects(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank (picklable; the default group). Without a process
    group: ``[obj]``."""
    if not distributed_ready():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
