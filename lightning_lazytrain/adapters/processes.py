"""Devices and processes as both strategies see them (the Trainer's and Fabric's): the device this
process computes on, its place among the processes, the default process group and the collectives
Lightning asks a strategy for (barrier, broadcast, reduce)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
from lightning.fabric.accelerators import CUDAAccelerator as FabricCUDA
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.accelerators import CPUAccelerator as TrainerCPU
from lightning.pytorch.accelerators import CUDAAccelerator as TrainerCUDA

from lightning_lazytrain.adapters import lightning_internals
from lightning_lazytrain.core.options import ProcessLayout
from lightning_lazytrain.core.processes import broadcast_object, distributed_ready, gather_objects

__all__ = ["barrier", "broadcast", "init_processes", "layout_of", "reduce", "refuse_uneven_batches", "root_device",
           "set_world_ranks"]


def root_device(accelerator: Any, parallel_devices: list | None, local_rank: int, given: torch.device | None, *,
                hint: str) -> torch.device:
    """The device this process computes on: ``given`` (the strategy's ``device=``), else the
    accelerator's (on CUDA the device of this process's local rank; ``devices=[1]``: cuda:1).
    ``hint``: how to choose another, for the error on any other accelerator."""
    if given is not None:
        return given
    if isinstance(accelerator, (TrainerCUDA, FabricCUDA)):
        if parallel_devices:
            return torch.device(parallel_devices[min(local_rank, len(parallel_devices) - 1)])
        return torch.device("cuda", torch.cuda.current_device())
    if accelerator is None or isinstance(accelerator, (TrainerCPU, FabricCPU)):
        return torch.device("cpu")
    raise RuntimeError(f"strategy='lazytrain' runs on a CUDA GPU or the CPU, not on {type(accelerator).__name__}; "
                       f"use {hint}")


def set_world_ranks(cluster_environment: Any, *, node_rank: int, local_rank: int, per_node: int, nodes: int) -> int:
    """Give the cluster environment this process's global rank and the world size (as Lightning's DDP
    does); rank-zero-only logging follows it. Returns the global rank."""
    rank = 0
    if cluster_environment is not None:
        cluster_environment.set_global_rank(node_rank * per_node + local_rank)
        cluster_environment.set_world_size(nodes * per_node)
        rank = cluster_environment.global_rank()
    rank_zero_only.rank = rank  # type: ignore[attr-defined]
    return rank


def layout_of(rank: int, per_node: int, nodes: int) -> ProcessLayout:
    return ProcessLayout(rank=rank, world_size=per_node * nodes, per_node=per_node)


def init_processes(cluster_environment: Any, device: torch.device, backend: str | None, timeout: Any) -> None:
    """The default process group (``backend``, default: nccl on GPUs, gloo on the CPU)."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    lightning_internals.init_process_group(cluster_environment,
                                           backend or lightning_internals.default_backend(device), **kwargs)


def barrier(device: torch.device) -> None:
    if not distributed_ready():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[device.index])
    else:
        torch.distributed.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    return broadcast_object(obj, src)


def reduce(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    if isinstance(tensor, torch.Tensor) and distributed_ready():
        return lightning_internals.reduce(tensor, group, reduce_op)
    return tensor


def refuse_uneven_batches(batches: float, max_steps: int, accumulate: int) -> None:
    """Before the first step of several processes: ranks whose training loaders hold different numbers of batches
    per epoch (their own data, ``use_distributed_sampler=False``) would step until each one's data ends, and the
    others wait in a gradient all-reduce the finished rank never joins (review 23: gloo's "Connection closed by
    peer" on two ranks and a success on the third, or the process group's timeout; DDP fails the same way).
    Refused on every rank, naming each rank's count, unless the run ends (``max_steps``) before the smallest
    epoch does. A loader without a length is not checked."""
    counts = gather_objects(float(batches))
    if len(set(counts)) <= 1 or any(c == float("inf") for c in counts):
        return
    if max_steps > 0 and max_steps * accumulate <= min(counts):
        return
    raise RuntimeError(
        "strategy='lazytrain': the processes' training loaders hold different numbers of batches per epoch ("
        + ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(counts)) + "): the rank that runs out first would "
        "end its epoch while the others wait for it in the gradient all-reduce (DDP fails the same way). Fix: give "
        "every process the same number of batches (Trainer(use_distributed_sampler=True) with Lightning's "
        "DistributedSampler, or an equal split of your own data with drop_last), or Trainer(limit_train_batches="
        f"{int(min(counts))})")
