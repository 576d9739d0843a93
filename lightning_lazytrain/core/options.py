"""The training core's options, checked once at construction and named as the user wrote them, and
the layout of the processes it trains in.

Both strategies build a ``CoreOptions`` from their constructor's arguments; every problem is a
``ValueError`` that names the option (``autoplan.validate_options`` for the machine, budget, NVMe
directory, policy and link; the rest here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_lazytrain.core.autoplan import validate_options
from lightning_lazytrain.core.replan import ReplanOptions
from lightning_lazytrain.planner import Hardware, Schedule

__all__ = ["CoreOptions", "FitSettings", "ProcessLayout"]


@dataclass(frozen=True)
class CoreOptions:
    """What ``LazyTrainStrategy`` documents (its docstring has every option's meaning); the Fabric
    strategy uses a subset. ``replan`` may be given as ``True``/``False``/a dict and ``chunked_loss``
    as a bool: both are normalised here. ``fixed_schedule`` is the schedule of a plan.json
    ``policy`` (None otherwise)."""

    hardware: str | Hardware = "measure"
    gpu_memory_budget_gb: float | None = None
    nvme_dir: str | None = None
    policy: str = "milp"
    blocks: str | None = None
    emulate_link_gb_per_s: float | None = None
    replan: Any = True
    checkpoint_format: str = "sharded"
    verify_checkpoints: bool = True
    overlap_grad_sync: bool = True
    nonblock_parts: bool = True
    data_parallel: str = "replicate"
    shard_size: int | None = None
    fp32_masters: bool = False
    keep_compute_copy: bool | str = "auto"
    conversions: str = "plan"
    chunked_loss: Any = False
    fixed_schedule: Schedule | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fixed = validate_options(self.hardware, self.gpu_memory_budget_gb, self.nvme_dir, self.policy,
                                 self.emulate_link_gb_per_s)
        object.__setattr__(self, "fixed_schedule", fixed)
        if self.checkpoint_format not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format={self.checkpoint_format!r}: use 'sharded' (several processes write a "
                             "directory, each a share) or 'full' (one file from rank 0)")
        if self.data_parallel not in ("replicate", "shard"):
            raise ValueError(f"data_parallel={self.data_parallel!r}: use 'replicate' (every process holds all host "
                             "state) or 'shard' (each holds 1/N of every block's; experimental, no checkpoints)")
        for name in ("verify_checkpoints", "overlap_grad_sync", "nonblock_parts", "fp32_masters"):
            if not isinstance(getattr(self, name), bool):  # a string such as "no" would read as True
                raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")
        if self.blocks is not None and (not isinstance(self.blocks, str) or not self.blocks.strip()):
            raise ValueError(f"blocks={self.blocks!r}: must be the dotted path of the block stack, e.g. "
                             "'model.layers' (or None: found by itself)")
        if self.shard_size is not None and (isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int)
                                            or self.shard_size < 1):
            raise ValueError(f"shard_size={self.shard_size!r}: must be a number of processes >= 1 (default: the "
                             "devices per node)")
        if self.keep_compute_copy not in (True, False, "auto"):
            raise ValueError(f"keep_compute_copy={self.keep_compute_copy!r}: use True, False or 'auto'")
        if self.conversions not in ("plan", "host", "device"):
            raise ValueError(f"conversions={self.conversions!r}: use 'plan' (the plan chooses), 'host' or 'device'")
        chunked = self.chunked_loss
        if isinstance(chunked, bool):
            chunked = 4096 if chunked else 0
        if not isinstance(chunked, int) or chunked < 0:
            raise ValueError(f"chunked_loss={self.chunked_loss!r}: use True, False or a number of tokens per chunk")
        object.__setattr__(self, "chunked_loss", chunked)
        object.__setattr__(self, "replan", ReplanOptions.parse(self.replan))


@dataclass(frozen=True)
class ProcessLayout:
    """The processes of a run: this one's global ``rank``, the ``world_size`` and the processes per
    node (``per_node``: each holds its own masters and optimizer states, so a process plans with its
    share of the node's host memory)."""

    rank: int = 0
    world_size: int = 1
    per_node: int = 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.per_node))


@dataclass(frozen=True)
class FitSettings:
    """How a fit drives the core (``TrainingCore.start_fit``).

    ``grad_accum``: micro-batches per optimizer step (the plan's accumulation). ``full_microbatches``:
    every micro-batch writes all of its gradients back to the host (a hook that reads gradients after
    each backward, manual optimization, fp32 masters; Fabric's every backward), so the executor's step
    is the micro-batch. ``hand_over_norms``: give ``HybridAdamW`` the gradient norms the host lane took,
    for its fused clip (Note: [exact clip] in optim/clip.py); ``clip``: a clip value is set;
    ``loss_scaled``: the gradients are loss-scaled until the plugin unscales them (16-mixed: no norm is
    handed over); ``norms_trusted``: no user code can edit the gradients between the hand-over and the
    step (Note: [stale norms] in optim/grad_norms.py). ``updates_in_backward``: None when a
    ``HybridAdamW(updates_in_backward=True)`` may update blocks during the backward (the adapter knows
    the step's last micro-batch and that nothing runs between the backward and the step), else why not
    (Note: [updates in the backward pass] in core/optimizer_steps.py). ``step_waits``: None when user code
    cannot read weights between an optimizer step and the next forward, else why it may: the plan's step
    is then serial and a pipelined one is waited for (Note: [weights read after the step] in
    adapters/weight_readers.py). ``grads_read_after_step``: None when no code trusted to read no weights
    reads gradients between a step and the next forward, else who may: a pipelined step then scales the
    gradients by the clip factor before it returns (Note: [gradients read after a clipped step] in
    optim/hybrid_adamw.py)."""

    grad_accum: int = 1
    full_microbatches: bool = False
    hand_over_norms: bool = False
    clip: bool = False
    loss_scaled: bool = False
    norms_trusted: bool = True
    updates_in_backward: str | None = "the loop does not say which micro-batch ends the optimizer step"
    step_waits: str | None = None
    grads_read_after_step: str | None = None
