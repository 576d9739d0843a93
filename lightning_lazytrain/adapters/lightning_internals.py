"""The parts of Lightning 2.6.x the strategies use without a public API: every import or use of a
private name of Lightning is here, and nowhere else in the package -- but for two methods the precision
plugins inherit, named below.

Lightning 2.6.x (checked on 2.6.6) has no public counterpart for these; its own strategies
(``DDPStrategy``, ``FSDPStrategy``) use the same names:

- the launcher that starts one process per device by running the script again
  (``_SubprocessScriptLauncher``; ``lightning.pytorch.strategies.launchers`` lists it in its
  ``__all__``, Fabric's lives in ``lightning.fabric.strategies.launchers.subprocess_script``);
- the process-group set-up from a cluster environment (``_init_dist_connection``, which also sets
  ``MASTER_ADDR``/``MASTER_PORT``), the default backend for a device, the
  reduction behind ``Strategy.reduce``/``all_reduce`` (``_sync_ddp_if_available``: ``"mean"`` on gloo,
  barriers) and the gather behind ``all_gather``;
- whether the Trainer steps the optimizer after the current batch (``_TrainingEpochLoop
  ._should_accumulate``: accumulation, the epoch's last batch): no hook tells a strategy, which needs
  it before the batch's forward (the executor keeps the gradients of layer 0 and the non-block
  weights on the device between the micro-batches of one step);
- the precision plugins' closure steps (adapters/precision.py, subclasses of Lightning's three plugins, calls
  ``_wrap_closure`` and overrides ``_after_closure``: methods of the base class, not imports; the hooks run there,
  inside ``optimizer.step()`` before the update);
- the device a ``LightningModule`` reports (``LightningModule.device`` reads ``_device``, which only
  ``.to()`` sets): the strategy keeps the parameters on the host, yet the module computes on the
  device, and a module's ``self.device`` must say so, as under ``strategy="auto"``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher as FabricSubprocessLauncher,
)
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as TrainerSubprocessLauncher

__all__ = ["FabricSubprocessLauncher", "TrainerSubprocessLauncher", "all_gather",
           "default_backend", "init_process_group", "reduce", "set_module_device", "steps_after_this_batch"]


def default_backend(device: torch.device) -> str:
    """nccl on a CUDA device, gloo elsewhere (as Lightning's DDP chooses)."""
    return _get_default_process_group_backend_for_device(device)


def init_process_group(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """The default process group of this process, from the cluster environment's ranks and address."""
    _init_dist_connection(cluster_environment, backend, **kwargs)


def reduce(tensor: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
    """``tensor`` reduced over the processes, in place (``"mean"``, ``"sum"`` or a ``ReduceOp``)."""
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def all_gather(tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
    """Every process's ``tensor``, stacked (a new leading dimension)."""
    return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)


def steps_after_this_batch(trainer: Any) -> bool:
    """The Trainer steps the optimizer after the batch now running (not accumulating)."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def set_module_device(module: Any, device: torch.device) -> None:
    """What ``module.device`` reports (a LightningModule; other modules have no such record)."""
    if hasattr(module, "_device"):
        module._device = device
