"""``LazyTrainFabricStrategy``: Fabric's hooks translated into the training core (``core/``).

    import lightning_lazytrain.fabric_strategy                       # registers the names with Fabric
    fabric = L.Fabric(accelerator="cuda", strategy="lazytrain")     # MILP plan
    fabric = L.Fabric(strategy="lazytrain_megatrain")                # MegaTrain's fixed policy
    fabric = L.Fabric(strategy=LazyTrainFabricStrategy(gpu_memory_budget_gb=20, nvme_dir="/nvme/spill"))
    fabric = L.Fabric(strategy="lazytrain", devices=2); fabric.launch()   # data parallel, one process per device
    model, opt = fabric.setup(model, opt)        # optimizer created on model.parameters() beforehand
    for batch in data:
        loss = model(batch).loss                 # any forward, several per step allowed
        fabric.backward(loss)                    # (several backward calls = gradient accumulation)
        opt.step(); opt.zero_grad()
    fabric.strategy.teardown()                   # restore the blocks, free device buffers

``setup_module`` builds the core's executor on a provisional schedule and returns a thin wrapper
whose forward opens a micro-batch (a forward with grad while none is open); ``backward`` runs the
backward and closes it. Each forward ... ``fabric.backward`` is therefore one executor micro-batch
with ``first=last=True``: exact, and accumulation is several backward calls adding into the host
``.grad``. A further forward before the backward runs ad hoc (the executor's second-pass path). The
first micro-batch is the profile (on CUDA the second: the first warms up, ``replan={"profile_warmup": n}``): after its backward the workload is measured from its trace, the
plan solved and the executor switched to it, before the optimizer step (an impossible budget raises
there); later backward calls re-plan when the run drifts from the plan or the allocator outgrows it,
as under the Trainer. The module's parameters stay on the host as the fp32 masters; the user's
optimizer updates them in place and the next forward stages the updated weights.

Several processes (``devices=N``; ``fabric.launch()`` starts them, as for Fabric's DDP): every
process streams the same plan (rank 0 profiles, solves and broadcasts it), starts from rank 0's
weights, and every backward averages the host gradients over the processes, as DDP does without
``no_sync`` (``core/grad_sync.py``, Note: [replicate mode]).

The class derives from Fabric's ``SingleDeviceStrategy``: one process needs no ``fabric.launch()``
(Lightning 2.6.x asks every ``ParallelStrategy`` for one), and ``fabric.no_backward_sync`` does
nothing (every backward syncs).
"""

from __future__ import annotations

import contextlib
import copy
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_lazytrain.adapters import lightning_internals, processes
from lightning_lazytrain.adapters.options import CoreViews, option
from lightning_lazytrain.core import CoreOptions, FitSettings, TrainingCore
from lightning_lazytrain.core.autoplan import NamedOptions, count_tokens
from lightning_lazytrain.core.batch_size import batch_elements
from lightning_lazytrain.core.processes import distributed_ready
from lightning_lazytrain.engine.blocks import BlockDiscoveryError, find_blocks
from lightning_lazytrain.planner import Hardware

__all__ = ["LazyTrainFabricStrategy", "SUPPORTED_PRECISIONS"]

# Fabric precisions the streamed engine reproduces: fp32 masters computed in fp32, or in fp32 slots
# under Fabric's bf16 autocast (the executor's re-runs replay the autocast state).
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed")


class _StreamedModule(nn.Module):
    """What ``fabric.setup`` wraps in its ``_FabricModule`` (the place DDP's wrapper takes): the
    user's module, whose forward goes through the strategy (micro-batch or inference)."""

    def __init__(self, module: nn.Module, strategy: LazyTrainFabricStrategy) -> None:
        super().__init__()
        self.module = module
        self.strategy = strategy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.strategy.streamed_forward(self.module, args, kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """A copy of the set-up model (``AveragedModel``, an EMA or teacher copy) is a plain copy of the user's
        module, not streamed (Note: [a copy of a streamed block] in engine/streamed_forward.py)."""
        return copy.deepcopy(self.module, memo)


class LazyTrainFabricStrategy(CoreViews, SingleDeviceStrategy, metaclass=NamedOptions):
    """Fabric strategy: block weights streamed from the host, a planned activation schedule, one device
    per process (one process, or data parallel on several).

    Args (as ``LazyTrainStrategy``'s):
        hardware: "measure" (measure this machine), a profile name from ``conf/hardware/``, or a
            ``planner.Hardware``.
        gpu_memory_budget_gb: device memory the plan may use (default: 90% of what is free).
        nvme_dir: a directory on an NVMe drive for activation spill files (enables the NVMe tier).
        policy: "milp", "megatrain", "keep_all", "recompute_all", or the path of a ``plan.json``.
        blocks: dotted path of the block stack (default: found automatically).
        emulate_link_gb_per_s: on CPU, make host<->"device" copies take the time of a link of this speed.
        verify_checkpoints: ``fabric.save`` writes atomically and ``fabric.load`` checks the file's CRCs
            first (``checkpoint_io.VerifiedCheckpointIO``; a ``checkpoint_io=`` of your own replaces it).
        replan: re-profile and re-plan when the measured step time drifts from the prediction, or the
            allocator's peaks outgrow the plan (``True``, ``False`` or a dict of ``ReplanOptions``; its
            ``profile_warmup``: backward passes before the profiled one, default 1 on CUDA, 0 on the CPU).
        process_group_backend: of the default process group with several devices (default: nccl on
            GPUs, gloo on CPU); gradients and masters are exchanged on a gloo group of their own.
        timeout: of the collectives (default: torch's).
        overlap_grad_sync: with several processes, average each group's host gradients as soon as the
            backward has finished it, on a thread of its own (bit-identical).

    Bad options fail at construction, named as written (``core/options.py``, as the Trainer's).

    The training itself is ``TrainingCore``'s (``strategy.core``). After the first backward, ``plan``
    holds the ``AutoPlan`` (``plan.write(dir)`` writes plan.json and the predicted timeline);
    ``last_stats`` holds the last micro-batch's ``StepStats`` and ``metrics`` its ``lazytrain/*``
    figures, the ones the Trainer's strategy logs (Fabric logs nothing by itself:
    ``fabric.log_dict(fabric.strategy.metrics)``); ``replans`` what each re-plan found and did.
    """

    strategy_name = "lazytrain"

    def __init__(self, hardware: str | Hardware = "measure", gpu_memory_budget_gb: float | None = None,
                 nvme_dir: str | None = None, policy: str = "milp", blocks: str | None = None,
                 emulate_link_gb_per_s: float | None = None, device: str | torch.device | None = None,
                 accelerator: Any = None, checkpoint_io: Any = None, precision: Precision | None = None,
                 verify_checkpoints: bool = True, replan: Any = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = None, overlap_grad_sync: bool = True) -> None:
        from lightning_lazytrain.adapters.checkpoint_io import VerifiedCheckpointIO

        options = CoreOptions(hardware=hardware, gpu_memory_budget_gb=gpu_memory_budget_gb, nvme_dir=nvme_dir,
                              policy=policy, blocks=blocks, emulate_link_gb_per_s=emulate_link_gb_per_s,
                              replan=replan, verify_checkpoints=verify_checkpoints,
                              overlap_grad_sync=overlap_grad_sync)
        self.core = TrainingCore(options, info=rank_zero_info, debug=rank_zero_debug, warn=rank_zero_warn)
        super().__init__(device=device or "cpu", accelerator=accelerator,
                         checkpoint_io=checkpoint_io or VerifiedCheckpointIO(verify=verify_checkpoints),
                         precision=precision)
        self._given_device = torch.device(device) if device is not None else None
        # filled in by Fabric's connector: the devices= selection, the cluster environment (ranks), num_nodes=
        self.parallel_devices: list | None = None
        self.cluster_environment: Any = None
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._module: nn.Module | None = None

    hardware = option("hardware")
    gpu_memory_budget_gb = option("gpu_memory_budget_gb")
    nvme_dir = option("nvme_dir")
    policy = option("policy")
    blocks = option("blocks")
    emulate_link_gb_per_s = option("emulate_link_gb_per_s")
    replan = option("replan")
    overlap_grad_sync = option("overlap_grad_sync")

    # ---- precision -----------------------------------------------------------------------------
    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        name = getattr(precision, "precision", None)
        if precision is not None and name not in SUPPORTED_PRECISIONS:
            raise ValueError(f"strategy='lazytrain' supports precision={' or '.join(map(repr, SUPPORTED_PRECISIONS))}, "
                             f"not {name!r} ({type(precision).__name__}): the host masters are fp32")
        self._precision = precision

    # ---- devices and processes -----------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        return processes.root_device(self.accelerator, self.parallel_devices, self.local_rank, self._given_device,
                                     hint="Fabric(accelerator='cuda') or accelerator='cpu'")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes (devices) per node."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self) -> bool:
        return self.num_processes * self.num_nodes > 1

    # the ranks come from the cluster environment (SingleDeviceStrategy.__init__ assigns one process's:
    # 0, 0 and 1, which the setters take as they are)
    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.cluster_environment is not None else 0

    @global_rank.setter
    def global_rank(self, rank: int) -> None:
        assert rank == 0

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self.cluster_environment is not None else 0

    @local_rank.setter
    def local_rank(self, rank: int) -> None:
        assert rank == 0

    @property
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self.cluster_environment is not None else 0

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes

    @world_size.setter
    def world_size(self, size: int) -> None:
        assert size == 1

    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Several processes: each gets its share of the data (``fabric.setup_dataloaders``)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank} if self.is_distributed else None

    def _set_world_ranks(self) -> None:
        processes.set_world_ranks(self.cluster_environment, node_rank=self.node_rank, local_rank=self.local_rank,
                                  per_node=self.num_processes, nodes=self.num_nodes)

    @override
    def _configure_launcher(self) -> None:
        self._launcher = None
        if self.is_distributed:
            assert self.cluster_environment is not None
            self._launcher = lightning_internals.FabricSubprocessLauncher(self.cluster_environment,
                                                                          self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.is_distributed:
            self._set_world_ranks()
            processes.init_processes(self.cluster_environment, self.root_device, self._process_group_backend,
                                     self._timeout)
        layout = processes.layout_of(self.global_rank, self.num_processes, self.num_nodes)
        self.core.connect_processes(layout, self.root_device, timeout=self._timeout)

    @override
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return processes.reduce(tensor, group, reduce_op) if self.is_distributed else tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if not self.is_distributed:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        return lightning_internals.all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.is_distributed:
            processes.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return processes.broadcast(obj, src) if self.is_distributed else obj

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not self.is_distributed:
            return decision
        votes = int(self.all_reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum"))
        return votes == self.world_size if all else votes > 0

    @override
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``fabric.init_module()``: parameters are created on the host (they are the masters)."""
        stack = contextlib.ExitStack()
        stack.enter_context(super().module_init_context(empty_init))
        stack.enter_context(torch.device("cpu"))  # innermost: wins over the root device
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """A module with a block stack stays on the host (``setup_module`` streams it; the engine
        moves its buffers); any other module moves to the device as usual."""
        if module is self._module or isinstance(module, _StreamedModule):
            return
        if not self._has_blocks(module):
            module.to(self.root_device)

    def _has_blocks(self, module: nn.Module) -> bool:
        try:
            find_blocks(module, self.blocks)
        except BlockDiscoveryError:
            return False
        return True

    def __deepcopy__(self, memo: dict) -> LazyTrainFabricStrategy:
        """A copy of the set-up model (Fabric's wrapper holds the strategy) shares the strategy: one per process,
        with its executor and threads, which no copy could hold."""
        return self

    # ---- setup ---------------------------------------------------------------------------------
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Build the executor on a provisional schedule; the plan replaces it after the first backward."""
        if self.core.executor is not None:
            if not self._has_blocks(module):  # beside the streamed one (a value head, a discriminator): set up
                module.to(self.root_device)  # as Fabric's one-device strategy does
                return module
            raise NotImplementedError("strategy='lazytrain' streams one model per Fabric; set up the others with "
                                      "a second Fabric or keep them outside fabric.setup")
        if self.is_distributed and not distributed_ready():
            raise RuntimeError(f"Fabric(strategy='lazytrain') on {self.world_size} devices runs one process per "
                               "device: call fabric.launch() before fabric.setup(...) (or use `fabric run`)")
        self.core.build(module, self.root_device, compute_dtype=torch.float32,  # bf16-mixed: autocast over fp32
                        precision=str(self.precision.precision), measure=True)
        self.core.start_fit([], FitSettings(full_microbatches=True))
        self._module = module
        return _StreamedModule(module, self)

    @override
    def setup_optimizer(self, optimizer: Any) -> Any:
        streamed = {id(p) for p in self._module.parameters()} if self._module is not None else None
        if streamed is None or any(id(p) in streamed for group in optimizer.param_groups for p in group["params"]):
            self.core.add_optimizer(optimizer)  # priced in the plan (HybridAdamW), its 8-bit slice planned
        return super().setup_optimizer(optimizer)

    # ---- training ------------------------------------------------------------------------------
    def streamed_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The wrapped module's forward: a micro-batch (with grad), its ad-hoc pass, or inference."""
        core = self.core
        if core.executor is None:  # torn down: the plain module (host weights)
            return module(*args, **kwargs)
        if torch.is_grad_enabled():
            if not core.in_microbatch:
                core.begin_microbatch(lambda: count_tokens(*args, **kwargs), last=True,
                                      elements=lambda: batch_elements(*args, **kwargs))
            return module(*args, **kwargs)  # a forward with one open already: the executor's ad-hoc pass
        if core.in_microbatch:  # no-grad forward between a forward and its backward: non-block weights are bound
            return module(*args, **kwargs)
        with core.inference():  # evaluation: non-block weights staged on the device, blocks stream
            return module(*args, **kwargs)

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.core.before_backward(tensor)  # Note: [one gradient per boundary use] (engine/boundary_uses.py)
        mark = self.core.reach_mark()
        super().backward(tensor, module, *args, **kwargs)
        self.core.end_microbatch_if_reached(mark)  # Note: [a backward that reaches nothing] (core/microbatches.py)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        # an open micro-batch stays open: its backward may follow (a GAN's critic stepped between the generator's
        # forward and the loss that uses the critic: Note: [a step inside a micro-batch] in core/microbatches.py);
        # a forward without backward is dropped when the next begins
        with self.core.stepping(optimizer):
            return super().optimizer_step(optimizer, **kwargs)

    # ---- checkpoints: plain state dicts of the host masters --------------------------------------
    def _unwrap(self, module: nn.Module, *, loading: bool = False) -> nn.Module:
        if isinstance(module, _StreamedModule):
            if loading and self.core.in_microbatch:
                raise RuntimeError("strategy='lazytrain': load the model after fabric.backward(), not between a "
                                   "forward and its backward (its non-block weights are staged on the device)")
            return module.module
        return module

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        module = self._unwrap(module)
        # Note: [a state dict mid-bind]: between accumulated micro-batches, or between a forward and its backward
        with self.core.masters_in_modules():
            return super().get_module_state_dict(module)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
        # refused before anything loads (review 20: the optimizer and scheduler earlier in the dict were loaded)
        objs = state.values() if isinstance(state, dict) else [state]
        if any(isinstance(o, _StreamedModule) or o is self._module for o in objs):
            for o in objs:
                if isinstance(o, nn.Module):
                    self._unwrap(o, loading=True)
        return super().load_checkpoint(path, state, strict=strict, **kwargs)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(self._unwrap(module, loading=True), state_dict, strict=strict)

    # ---- end -----------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Restore the blocks' forward, free device buffers and copy threads (Fabric does not call
        this itself: call ``fabric.strategy.teardown()`` when done). The module keeps its trained
        host parameters."""
        self.core.teardown()
        self._module = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("lazytrain", cls, description="layer streaming with a MILP plan", override=True)
        strategy_registry.register("lazytrain_megatrain", cls, description="layer streaming, MegaTrain's policy",
                                   policy="megatrain", override=True)


LazyTrainFabricStrategy.register_strategies(STRATEGY_REGISTRY)
