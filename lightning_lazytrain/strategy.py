"""``LazyTrainStrategy``: layer-streaming training as a Lightning strategy.

    Trainer(strategy="lazytrain")              # MILP plan (registered name)
    Trainer(strategy="lazytrain_megatrain")    # MegaTrain's fixed policy, for A/B runs
    Trainer(strategy=LazyTrainStrategy(gpu_memory_budget_gb=20, nvme_dir="/nvme/spill"))
    Trainer(strategy="lazytrain", devices=8)     # data parallel, one process per device


The strategy is glue: the engine (``engine.Executor``) streams the blocks and places activations;
the plan comes from ``autoplan`` (profile the first batch on the real device, then solve). The
module's parameters stay on the host as the master copy, so ``configure_optimizers``, LR
schedulers and checkpoints work unchanged; optimizer states stay on the host too. With several
devices (``devices=N``, ``num_nodes=M``; Lightning's launcher, ``torchrun`` or SLURM) every process
streams the blocks of the same plan and gradients are averaged as under DDP
(``distributed.py``, Note: [replicate mode]).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.pytorch.strategies import ParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero as _rank_zero
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_lazytrain.allocator import MemoryWatch, configure_allocator
from lightning_lazytrain.autoplan import AutoPlan, NamedOptions, count_tokens, measure_hardware, validate_options
from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.executor import Executor, StepStats
from lightning_lazytrain.engine.nvme import check_nvme_dir, remove_stale_spill_dirs
from lightning_lazytrain.engine.param_store import REST as REST_GROUP
from lightning_lazytrain.engine.param_store import upcast_parameters
from lightning_lazytrain.engine.user_grad_hooks import has_post_accumulate_hooks
from lightning_lazytrain.planner import Hardware, min_memory, recompute_all
from lightning_lazytrain.precision import LazyTrainPrecision, with_lazytrain_precision
from lightning_lazytrain.strategy_checkpoints import StrategyCheckpoints
from lightning_lazytrain.strategy_planning import StrategyPlanning, artifact_dir

log = logging.getLogger(__name__)

# The dtype blocks are streamed and computed in, per Lightning precision. Mixed precision keeps fp32
# weights under autocast, exactly as plain Lightning does (autocast casts matmul operands itself;
# norms, softmax and losses see fp32 weights), so its streamed copies are fp32 too.
_COMPUTE_DTYPE = {"32-true": torch.float32, "32": torch.float32, "bf16-mixed": torch.float32,
                  "bf16-true": torch.bfloat16, "16-mixed": torch.float32, "16-true": torch.float16}


class LazyTrainStrategy(StrategyCheckpoints, StrategyPlanning, ParallelStrategy, metaclass=NamedOptions):
    """Train with weights streamed from host memory and a planned activation schedule, on one device
    or data parallel on several (one process per device; see ``distributed.py``).

    Args:
        hardware: "measure" (measure this machine's links and memory), a profile name from
            ``conf/hardware/`` (e.g. "h800"), or a ``planner.Hardware``.
        gpu_memory_budget_gb: device memory the plan may use (default: 90% of what is free).
        nvme_dir: a directory on an NVMe drive for activation spill files (enables the NVMe tier).
        policy: "milp", "megatrain", "keep_all", "recompute_all", or the path of a ``plan.json``.
        blocks: dotted path of the block stack (default: found automatically).
        emulate_link_gb_per_s: on CPU, make host<->"device" copies take the time of a link of this
            speed (to study overlap without a GPU).
        verify_checkpoints: check a checkpoint's CRCs before resuming from it (checkpoints are
            always written atomically); see ``checkpoint_io.VerifiedCheckpointIO`` and, for sharded
            checkpoints, ``sharded_checkpoint.py``.
        checkpoint_format: with several processes, ``"sharded"`` (the default) saves a checkpoint
            as a directory through ``torch.distributed.checkpoint``: each rank writes a share of the
            (replicated) weights and optimizer states, no rank gathers the model, and the directory
            appears atomically once every rank has written (Note: [sharded checkpoint]);
            ``"full"`` writes one plain ``torch.save`` file from rank 0 (what ``torch.load`` and
            ``strategy="auto"`` read directly). With one process both are that single verified
            file; remote paths and ``storage_options`` are always saved full. Loading reads either
            kind on any number of processes (a sharded checkpoint resumes on 1 rank, a single file
            on several). ``checkpoint_io=`` applies to full checkpoints only.
        process_group_backend: of the default process group with several devices (default: nccl on
            GPUs, gloo on CPU); gradients and masters are exchanged on a gloo group of their own.
        timeout: of the collectives (default: torch's); a rank that fails makes the others fail
            when they next exchange data, at the latest after this long.
        overlap_grad_sync: with several processes, average each group's host gradients as soon as
            the step's backward has finished it, on a thread of its own, instead of all of them after
            the backward (``distributed.py``: Note: [overlapped all-reduce]; bit-identical; the plan
            is made for the planner's ``replicate_overlap`` mode, else ``replicate``). Only with
            automatic optimization. With ``data_parallel="shard"``: each block's all-gather overlaps
            the previous block's compute (engine/shard_store.py, Note: [overlapped all-gather]);
            False runs it in line (the ablation).
        data_parallel: with several processes, ``"replicate"`` (each holds all host state; every
            group's host gradients all-reduced) or ``"shard"`` (experimental: each holds 1/N of every
            group's host masters, gradients and optimizer state within a group of ``shard_size``
            processes, replicated across the groups; engine/shard_store.py; a sharded
            checkpoint holds each rank's rows as written, nothing gathered, and resumes on any number
            of processes (8-bit states: on the same number only); a ``"full"`` one gathers every
            tensor to rank 0 and cannot hold 8-bit states; automatic and manual optimization).
        shard_size: ``data_parallel="shard"``: the processes that share one copy of the host state
            (default: the devices per node; the state is replicated across nodes, and each shard's
            gradient all-reduced across them: Note: [hybrid sharding] in distributed.py). Must divide
            ``devices x num_nodes``.
        nonblock_parts: one process with a ``HybridAdamW`` whose layers split the non-block weights
            (``CausalLMModule``: ``embed``, ``head``): the step's tail moves, updates and stages them
            part by part, each part's transfers under the next part's host work (Note: [non-block
            parts] in planner/schedule.py; bit-identical). False: one part (the ablation).
        replan: re-profile and re-plan when the measured step time drifts from the prediction
            (``True``, ``False`` or a dict of ``replan.ReplanOptions``: threshold, patience,
            min_gain, max_replans); only for ``policy="milp"``.
        fp32_masters: with ``precision="bf16-true"`` (or ``"16-true"``): keep fp32 master weights
            on the host (the optimizer and its states, gradient accumulation across micro-batches
            and clipping in fp32) and stream 16-bit compute copies (the papers' setup: half the
            bytes of ``bf16-mixed``, which streams the fp32 weights autocast reads). The same
            training as plain PyTorch with fp32 master weights and a 16-bit model copy; not the
            same as ``strategy="auto"`` with bf16-true, whose optimizer updates bf16 weights.
            The masters are cast per weight fetch on the host lane, or once per micro-batch and
            kept (``keep_compute_copy``), or cast by the device (``conversions``).
        conversions: with ``fp32_masters``, where the fp32 masters are cast into the 16-bit copies
            and the 16-bit gradients widened into the fp32 ones: ``"plan"`` (default: the plan
            decides, per parameter group class, from the measured host and link rates), ``"host"``
            (the host lane does both: half the link bytes) or ``"device"`` (the device does both: the
            fp32 bytes cross the links, the host adds like to like, and a step's first gradient copy
            of a group lands in the host gradient with no host work). Bit-identical either way
            (planner/placement.py, Note: [conversion placement]).
        chunked_loss: a Hugging Face causal LM in the module computes its loss with the project's
            chunked linear + cross-entropy (``True``: 4096 tokens at a time, or that many tokens)
            instead of its own, so the head window never holds the whole micro-batch's logits
            (models/hf_loss.py, Note: [chunked loss for Hugging Face models]: its ``logits`` then
            hold the last position only; the same loss up to summation order).
        keep_compute_copy: with ``fp32_masters``: keep each group's 16-bit copy in host memory
            (2 bytes per parameter, pinned on CUDA), cast from the masters at its first fetch of a
            micro-batch and reused by that micro-batch's later fetches (backward, re-runs), instead
            of a cast per fetch. Re-cast at every micro-batch, so a master changed in between (by
            the optimizer or by user code, even through ``.data``) is never stale. ``"auto"``
            (default): when the host has room for them.
    """

    strategy_name = "lazytrain"

    def __init__(self, hardware: str | Hardware = "measure", gpu_memory_budget_gb: float | None = None,
                 nvme_dir: str | None = None, policy: str = "milp", blocks: str | None = None,
                 emulate_link_gb_per_s: float | None = None, verify_checkpoints: bool = True,
                 device: str | torch.device | None = None, accelerator: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = None, replan: Any = True, checkpoint_format: str = "sharded",
                 overlap_grad_sync: bool = True, nonblock_parts: bool = True,
                 data_parallel: str = "replicate", shard_size: int | None = None, fp32_masters: bool = False,
                 keep_compute_copy: bool | str = "auto", conversions: str = "plan",
                 chunked_loss: bool | int = False) -> None:
        # imported here: checkpoint_io imports Lightning, whose import registers this module (a
        # module-level import would be circular when checkpoint_io is imported first)
        from lightning_lazytrain.checkpoint_io import VerifiedCheckpointIO

        super().__init__(accelerator=accelerator, parallel_devices=None, cluster_environment=None,
                         checkpoint_io=checkpoint_io or VerifiedCheckpointIO(verify=verify_checkpoints),
                         precision_plugin=precision_plugin)
        self._fixed_schedule = validate_options(hardware, gpu_memory_budget_gb, nvme_dir, policy,
                                                emulate_link_gb_per_s)
        if checkpoint_format not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format={checkpoint_format!r}: use 'sharded' (several processes write a "
                             "directory, each a share) or 'full' (one file from rank 0)")
        self.checkpoint_format = checkpoint_format
        self._verify_checkpoints = verify_checkpoints
        self._device_given = device is not None
        self._root_device = torch.device(device or "cpu")
        # Set by Lightning from Trainer(devices=..., num_nodes=...) (it fills these attributes when a
        # strategy has them, and the cluster environment that gives each process its rank).
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.grad_sync: Any = None  # distributed.GradSync with several processes
        self.overlap_grad_sync = bool(overlap_grad_sync)
        self.nonblock_parts = bool(nonblock_parts)
        if data_parallel not in ("replicate", "shard"):
            raise ValueError(f"data_parallel={data_parallel!r}: use 'replicate' (every process holds all host "
                             "state) or 'shard' (each holds 1/N of every block's; experimental, no checkpoints)")
        self.data_parallel = data_parallel
        if shard_size is not None and (not isinstance(shard_size, int) or shard_size < 1):
            raise ValueError(f"shard_size={shard_size!r}: must be a number of processes >= 1 (default: the devices "
                             "per node)")
        self.shard_size = shard_size
        if not isinstance(fp32_masters, bool):
            raise ValueError(f"fp32_masters={fp32_masters!r}: must be True or False")
        if keep_compute_copy not in (True, False, "auto"):
            raise ValueError(f"keep_compute_copy={keep_compute_copy!r}: use True, False or 'auto'")
        self.fp32_masters = fp32_masters
        self.keep_compute_copy = keep_compute_copy
        if conversions not in ("plan", "host", "device"):
            raise ValueError(f"conversions={conversions!r}: use 'plan' (the plan chooses), 'host' or 'device'")
        self.conversions = conversions
        if isinstance(chunked_loss, bool):
            chunked_loss = 4096 if chunked_loss else 0
        if not isinstance(chunked_loss, int) or chunked_loss < 0:
            raise ValueError(f"chunked_loss={chunked_loss!r}: use True, False or a number of tokens per chunk")
        self.chunked_loss = chunked_loss
        self._loss_hooks: list = []
        from lightning_lazytrain.replan import DriftMonitor, ReplanOptions

        self.replan = ReplanOptions.parse(replan)
        self._drift = DriftMonitor(self.replan)
        self._replan_reason: str | None = None  # set: the next step is re-profiled
        self._predicted: float | None = None  # the current schedule's prediction after a kept re-plan
        self.replans: list[dict[str, Any]] = []  # what each re-plan found and did
        self._hardware_measured: Hardware | None = None
        self.hardware = hardware
        self.gpu_memory_budget_gb = gpu_memory_budget_gb
        self.nvme_dir = nvme_dir
        self.policy = policy
        self.blocks = blocks
        self.emulate_link_gb_per_s = emulate_link_gb_per_s
        self.executor: Executor | None = None
        self.plan: AutoPlan | None = None
        self.last_stats: StepStats | None = None
        self._micro_index = 0
        self._t_step = 0.0
        self._tokens: int | None = None  # of the first batch, which is profiled
        self._full_microbatches = False  # every micro-batch writes all grads back (see _begin_microbatch)
        self._full_always = False  # ... for every step (setup: manual optimization, fp32 masters, hooks)
        self._norms_trusted = True  # no user code runs between the hand-over of norms and the step (setup)
        self._incomplete_profiles = 0  # steps meant as the profile whose backward skipped blocks
        # the allocator's reserve against the budget (allocator.py, Note: [the budget is what the allocator reserves])
        self._memory = MemoryWatch()
        self._budget_bytes: float | None = None
        self._pending_metrics: dict[str, float] = {}
        self._inference = contextlib.ExitStack()

    # ---- device and processes ------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        if self._device_given:
            return self._root_device
        if isinstance(self.accelerator, CUDAAccelerator):
            if self.parallel_devices:  # Trainer(devices=[1]) -> cuda:1; with several, this process's
                return torch.device(self.parallel_devices[min(self.local_rank, len(self.parallel_devices) - 1)])
            return torch.device("cuda", torch.cuda.current_device())
        if self.accelerator is None or isinstance(self.accelerator, CPUAccelerator):
            return torch.device("cpu")
        raise RuntimeError(f"strategy='lazytrain' runs on a CUDA GPU or the CPU, not on {type(self.accelerator).__name__}; "
                           "use Trainer(accelerator='gpu') or accelerator='cpu'")

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
        """Several processes (Lightning reads this to give each its share of the data)."""
        return self.num_processes * self.num_nodes > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_processes * self.num_nodes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        _rank_zero.rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def _configure_launcher(self) -> None:
        self._launcher = None
        if self.is_distributed:
            assert self.cluster_environment is not None
            if self._device_given:
                raise ValueError(f"LazyTrainStrategy(device={self._root_device}) picks one device, but the Trainer "
                                 f"asks for {self.num_processes} device(s) on {self.num_nodes} node(s): pass "
                                 "devices=N to the Trainer without device=, or devices=1")
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.is_distributed:
            self.set_world_ranks()
            backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
            kwargs: dict[str, Any] = {"timeout": self._timeout}
            if self.root_device.type == "cuda":
                kwargs["device_id"] = self.root_device
            assert self.cluster_environment is not None
            _init_dist_connection(self.cluster_environment, backend, **kwargs)
            from lightning_lazytrain.distributed import GradSync

            self.grad_sync = GradSync(self._timeout)
            if self.data_parallel == "shard":  # Note: [hybrid sharding]: within a node by default
                self.grad_sync.make_shard_groups(self.shard_size or self.num_processes,
                                                 gloo_reduce=self.root_device.type != "cuda")

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized() and self.is_distributed:
            if torch.distributed.get_backend() == "nccl":
                torch.distributed.barrier(device_ids=[self.root_device.index])
            else:
                torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (_distributed_is_initialized() and self.is_distributed):
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and self.is_distributed:
            from lightning.fabric.utilities.distributed import _sync_ddp_if_available

            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        """Build the executor instead of moving the model: only buffers and the non-block weights
        live on the device; blocks stream."""
        assert self.model is not None
        device = self.root_device
        if self.nvme_dir is not None:
            check_nvme_dir(self.nvme_dir)
            remove_stale_spill_dirs(self.nvme_dir)  # crashed runs' leftovers, whatever this plan uses
        links = None
        if self.emulate_link_gb_per_s is not None and device.type == "cpu":
            bw = self.emulate_link_gb_per_s * 1e9
            links = {"h2d": LinkSpec(bw, 0.0), "d2h": LinkSpec(bw, 0.0)}
        trainer = getattr(self.lightning_module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # expandable segments before the executor's buffers exist (Note: [the budget is what the allocator reserves])
        self._memory = MemoryWatch.for_device(device, configure_allocator(device))
        if self.hardware == "measure" and fitting:  # free device memory before the executor's slots exist
            self._hardware_measured = measure_hardware(device, gpu_memory_budget_gb=self.gpu_memory_budget_gb,
                                                       nvme_dir=self.nvme_dir, link_gb_per_s=self.emulate_link_gb_per_s)
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in _COMPUTE_DTYPE:
            raise ValueError(f"precision={precision!r} is not supported by strategy='lazytrain': use one of "
                             f"{sorted(_COMPUTE_DTYPE)} (64-bit and plugin precisions would silently train "
                             "differently from strategy='auto')")
        compute_dtype = _COMPUTE_DTYPE[precision]
        if self.fp32_masters:
            if compute_dtype == torch.float32:
                raise ValueError(f"LazyTrainStrategy(fp32_masters=True) streams 16-bit copies of fp32 masters: use "
                                 f"precision='bf16-true' (or '16-true'), not {precision!r} (under '32-true' and "
                                 "the mixed precisions the weights are fp32 already)")
            upcast_parameters(self.lightning_module)
        t0 = time.perf_counter()
        module = self.lightning_module
        from lightning_lazytrain.blocks import find_blocks

        stack = find_blocks(module, self.blocks)
        L_provisional = len(stack)
        self._install_chunked_loss(module)
        if self._fixed_schedule is not None and self._fixed_schedule.num_layers != L_provisional:
            raise ValueError(f"plan file {self.policy} is for {self._fixed_schedule.num_layers} layers, but the "
                             f"block stack {stack.path!r} has {L_provisional}: plan for this model")
        provisional = min_memory(L_provisional) if device.type == "cuda" else recompute_all(L_provisional)
        shard = self.grad_sync is not None and self.data_parallel == "shard"
        if shard:  # rank 0's start (as DDP), before each rank keeps its shard of it
            self.grad_sync.broadcast_module(module)
            self.precision_plugin._sharded_clip = self  # non-HybridAdamW norm clipping (precision.py)
        self.executor = Executor(module, provisional, blocks=stack, device=device,
                                 compute_dtype=compute_dtype, nvme_dir=self.nvme_dir,
                                 links=links, shard_group=self.grad_sync.shard_device_group if shard else None,
                                 replica_group=self.grad_sync.replica_device_group if shard else None,
                                 grad_group=self.grad_sync.shard_grad_group if shard else None)
        if hasattr(module, "_device"):  # LightningModule.device: where its computation runs
            module._device = device
        if self.grad_sync is not None:
            assert self.executor.params is not None
            self.grad_sync.broadcast_state(self.executor.params, module)  # rank 0's start, as DDP
            if self.overlap_grad_sync and getattr(module, "automatic_optimization", True):
                ex = self.executor
                self.grad_sync.attach(ex.params)
                self.grad_sync.adhoc_probe = lambda: ex.late_grads
        rank_zero_info(f"lazytrain: {L_provisional} blocks at {stack.path!r}, executor on {device} "
                       f"({precision}) built in {time.perf_counter() - t0:.2f} s")

    def _install_chunked_loss(self, module: Any) -> None:
        """``chunked_loss``: hooks on the module's Hugging Face causal LMs (models/hf_loss.py)."""
        for hooks in self._loss_hooks:
            hooks.remove()
        self._loss_hooks = []
        if not self.chunked_loss:
            return
        from lightning_lazytrain.models.hf_loss import ChunkedLoss, chunked_loss_modules

        found = chunked_loss_modules(module)
        if not found:
            raise ValueError("LazyTrainStrategy(chunked_loss=...) found no Hugging Face causal LM (a ...ForCausalLM) "
                             f"in {type(module).__name__}: compute a chunked loss yourself "
                             "(lightning_lazytrain.models.loss.chunked_lm_loss) or drop the option")
        self._loss_hooks = [ChunkedLoss(m, self.chunked_loss) for m in found]

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self.fp32_masters and trainer.ckpt_path is not None and not self.restore_checkpoint_after_setup:
            raise ValueError("LazyTrainStrategy(fp32_masters=True) cannot resume a checkpoint while an on_fit_start "
                             "hook (of the module or of a callback) is overridden: the checkpoint's fp32 masters "
                             "would be loaded before setup and rounded by the bf16 conversion. Move that hook's "
                             "work to on_train_start, or resume without fp32_masters")
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._setup_model(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            shard = self.is_distributed and self.data_parallel == "shard"
            self.setup_optimizers(trainer)  # on the host parameters; states stay on the host
            if shard and self._eight_bit_states() and any(  # saved full: "full", or a remote directory
                    not self._sharded_checkpoint(getattr(cb, "dirpath", None), None, warn=False)
                    for cb in trainer.checkpoint_callbacks):
                raise ValueError(self._SHARD_NO_CHECKPOINTS)
            self._set_rest_parts()
            self._choose_compute_copy()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            from lightning.pytorch.utilities.model_helpers import is_overridden

            module = self.lightning_module
            # Grads of the non-block weights and of layer 0 normally reach the host once per optimizer
            # step; a hook that looks at grads after each backward, or manual optimization, needs
            # every micro-batch's grads on the host, as plain Lightning has them. So do fp32 masters:
            # each micro-batch's 16-bit gradients join the fp32 ones (a step's would otherwise add up
            # in 16 bits on the device for layer 0 and the non-block weights).
            self._full_always = self.fp32_masters or not module.automatic_optimization or is_overridden(
                "on_after_backward", module) or any(is_overridden("on_after_backward", cb, parent=Callback)
                                                    for cb in trainer.callbacks)
            # Note: [stale norms] (optim/hybrid_adamw.py): the fused clip's norms are taken as the
            # gradients land; user code that runs before the step may edit them (even through .data)
            between = ("on_after_backward", "on_before_optimizer_step")
            self._norms_trusted = module.automatic_optimization and not any(
                is_overridden(name, module) for name in (*between, "configure_gradient_clipping")) and not any(
                is_overridden(name, cb, parent=Callback) for cb in trainer.callbacks for name in between)
            if not any(isinstance(cb, _StepMetrics) for cb in trainer.callbacks):
                trainer.callbacks.append(_StepMetrics())

    @property
    @override
    def precision_plugin(self) -> Precision:
        """The Trainer's plugin as a ``LazyTrainPrecision`` subclass (fused clip, pipelined step)."""
        plugin = self._precision_plugin if self._precision_plugin is not None else Precision()
        if not isinstance(plugin, LazyTrainPrecision):
            plugin = self._precision_plugin = with_lazytrain_precision(plugin)
        return plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = precision_plugin

    def clip_sharded(self, optimizer: Any, max_norm: float) -> None:
        """``clip_grad_norm_`` over ``optimizer``'s parameters when blocks are sharded: the squared
        norms of this rank's shards are summed over the ranks (one all-reduce), the whole non-block
        parameters' counted once; then every gradient (shard or whole) is scaled as torch does."""
        assert self.executor is not None and self.executor.params is not None and self.grad_sync is not None
        store = self.executor.params
        sharded = {id(p) for j in (REST_GROUP, *range(store.num_layers)) if store.sharded(j)
                   for p in store.group_parameters(j)}
        grads = [(id(p) in sharded, p.grad) for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        with torch.no_grad():
            sq = torch.zeros(2, dtype=torch.float64)
            for is_shard, g in grads:
                sq[0 if is_shard else 1] += g.detach().double().square().sum()
            part = sq[:1].clone()
            torch.distributed.all_reduce(part, group=self.grad_sync.shard_host_group)  # each shard once
            total = float((part[0] + sq[1]).sqrt())
            coef = min(max_norm / (total + 1e-6), 1.0)
            for _, g in grads:
                g.mul_(coef)

    def _plan_pipelined_steps(self) -> None:
        """With a HybridAdamW whose layers follow the blocks, the plan's ``pipelined`` optimizer runs
        as a layer-pipelined update in forward order (``precision.LazyTrainPrecision.optimizer_step``);
        otherwise steps stay serial."""
        from lightning_lazytrain.optim import HybridAdamW

        self._pending_steps: list[Any] = []
        self._pipelined: dict[int, tuple[list, dict, list]] = {}
        ex = self.executor
        if ex is None or ex.params is None or ex.schedule.optimizer != "pipelined":
            return
        for opt in self.optimizers:
            inner = getattr(opt, "optimizer", opt)
            if not isinstance(inner, HybridAdamW):
                continue
            layer_of = {id(p): g["layer"] for g in inner.param_groups for p in g["params"]}
            groups: dict[int, set] = {}
            for j in [REST_GROUP, *range(len(ex.stack))]:
                groups[j] = {layer_of.get(id(p)) for p in ex.params.group_parameters(j)} - {None}
            blocks = [groups[j] for j in range(len(ex.stack))]
            if any(len(g) != 1 for g in blocks) or len({next(iter(g)) for g in blocks}) != len(blocks):
                continue  # the optimizer's layers do not follow the blocks: keep the serial step
            block_layer = {j: next(iter(groups[j])) for j in range(len(ex.stack))}
            first = [layer for layer in inner.layers if layer in groups[REST_GROUP]]
            rest = [layer for layer in inner.layers if layer not in first and layer not in block_layer.values()]
            # the optimizer layers holding each part of the non-block weights (one part: all of them)
            parts = len(ex.params.rest_parts)
            part_layers = [first] if parts == 1 else [
                [layer for layer in first
                 if layer in {layer_of.get(id(p)) for p in ex.params.rest_part_parameters(k)}]
                for k in range(parts)]
            # T updates the non-block layers, layer 0, then the schedule's serial layers (the per-layer
            # mode: the executor waits for them before F0); the forward pipelines the others in order
            serial = [j for j in ex.schedule.serial_layers if j < len(ex.stack)]
            blocks_order = [0, *serial] + [j for j in range(1, len(ex.stack)) if j not in serial]
            self._pipelined[id(inner)] = (first + [block_layer[j] for j in blocks_order] + rest,
                                          block_layer, part_layers)
        if self._pipelined:
            ex.wait_updated = self._wait_updated

    def _choose_compute_copy(self) -> None:
        """``fp32_masters``: keep the 16-bit copies on the host (engine/param_store.py, Note: [kept
        compute copy]) when asked, or with ``"auto"`` when the host holds them beside the masters,
        their gradients and AdamW-sized optimizer states (8 bytes per parameter)."""
        ex = self.executor
        if not self.fp32_masters or ex is None or ex.params is None:
            return
        want = self.keep_compute_copy
        store = ex.params
        numel = sum(p.numel() for p in self.lightning_module.parameters())
        if want == "auto":
            need = store.host_pinned_bytes + store.host_grad_bytes + 8 * numel + 2 * numel
            want = need <= self._hardware().cpu_memory_bytes
            rank_zero_info(f"lazytrain: 16-bit weight copies {'kept on the host' if want else 'cast per fetch'} "
                           f"(keep_compute_copy='auto': the host needs ~{need / 1e9:.3g} GB with them)")
        ex.set_keep_compute_copy(bool(want))

    def _set_rest_parts(self) -> None:
        """One process: T moves, updates and stages the non-block weights in the parts of the
        first ``HybridAdamW``'s layers (e.g. ``embed``, ``head``; Note: [non-block parts] in
        planner/schedule.py), in that optimizer's layer order, when they are runs of the packed
        buffer; otherwise in one part. Several processes average the group whole: one part."""
        from lightning_lazytrain.optim import HybridAdamW

        ex = self.executor
        if ex is None or ex.params is None or self.is_distributed or not self.nonblock_parts:
            return
        rest = {id(p) for p in ex.params.group_parameters(REST_GROUP)}
        for opt in self.optimizers:
            inner = getattr(opt, "optimizer", opt)
            if isinstance(inner, HybridAdamW):
                by_layer: dict[Any, list] = {}
                for g in inner.param_groups:
                    by_layer.setdefault(g["layer"], []).extend(p for p in g["params"] if id(p) in rest)
                ex.set_rest_parts([ps for ps in by_layer.values() if ps])
                return

    def pipelined_order(self, optimizer: Any) -> list | None:
        """The layer order of ``optimizer``'s pipelined step, or None (serial step)."""
        entry = getattr(self, "_pipelined", {}).get(id(optimizer))
        return None if entry is None else entry[0]

    def start_pipelined_step(self, optimizer: Any) -> None:
        order, block_layer, part_layers = self._pipelined[id(optimizer)]
        self._pending_steps.append((optimizer.step_pipelined(order), block_layer, part_layers))

    def _wait_updated(self, j: int) -> None:
        """The executor is about to stage block j (or, for j = -1 - p, part p of the non-block
        weights; one part: REST_GROUP)."""
        for pipe, block_layer, part_layers in self._pending_steps:
            for layer in (part_layers[-1 - j] if j < 0 else [block_layer[j]]):
                pipe.wait_updated(layer)

    def _finish_optimizer_steps(self) -> None:
        """Wait for pipelined updates still running (before evaluation, checkpoints, teardown)."""
        for pipe, _, _ in getattr(self, "_pending_steps", []):
            pipe.wait_all()
        self._pending_steps = []

    # ---- training -----------------------------------------------------------------------------
    def _last_microbatch(self) -> bool:
        module = self.lightning_module
        if module is None or not module.automatic_optimization:
            return True
        return not module.trainer.fit_loop.epoch_loop._should_accumulate()

    def _begin_microbatch(self) -> None:
        """Automatic optimization: begin now. Manual optimization: arm the executor, so the
        micro-batch begins when the model is called (optimizer steps and parameter reads before
        that see the host masters, as under ``auto``)."""
        ex = self.executor
        assert ex is not None
        if self._micro_index == 0:  # post-accumulate-grad hooks see every micro-batch's host grads
            # (engine/user_grad_hooks.py, Note: [gradient hooks on streamed parameters])
            self._full_microbatches = self._full_always or has_post_accumulate_hooks(self.lightning_module.parameters())
        first = self._micro_index == 0 or self._full_microbatches
        last = self._full_microbatches or self._last_microbatch()
        if first:
            self._micro_index = 0
            self._t_step = time.perf_counter()
            self._pending_steps = [p for p in getattr(self, "_pending_steps", []) if not p[0].done]
            store = self._shard_store()
            if store is not None:  # a profiled step's collectives run in line: their times price the plan
                store.overlap = self.overlap_grad_sync and not ex.profiling  # Note: [overlapped all-gather]
            if self.grad_sync is not None:  # distributed.py, Note: [one sync per step]
                self.grad_sync.hold = (self._full_microbatches and self.data_parallel != "shard"
                                       and not self._last_microbatch())
        if self.lightning_module.automatic_optimization:
            ex.begin_microbatch(first=first, last=last)
        else:
            ex.arm(first=first, last=last)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        ex = self.executor
        assert ex is not None
        ex.disarm()
        if ex.in_microbatch:  # the previous training_step returned None, or ran a forward without backward
            ex.abort_microbatch()
            self._micro_index = 0
        if self.plan is None and self._tokens is None:
            # The first real step is the profile: it runs under the provisional schedule with timing
            # on, the plan is made from it before its optimizer step (no extra call of user code).
            batch = args[0] if args else kwargs.get("batch")
            self._tokens = count_tokens(batch)
            ex.profiling = True
        elif self._replan_reason is not None and self._micro_index == 0 and not ex.profiling:
            ex.profiling = True  # this step is the new profile (see replan.py)
        self._begin_microbatch()
        return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """As Lightning's, but the executor finishes the micro-batch right after the backward, so
        ``on_after_backward`` sees the gradients on the host parameters, as under ``auto``."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self._end_microbatch()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _end_microbatch(self) -> None:
        ex = self.executor
        if ex is None or not ex.in_microbatch:
            return
        stats = ex.end_microbatch()
        self._micro_index += 1
        if stats is None:
            return
        micro_batches, self._micro_index = self._micro_index, 0
        self.last_stats = stats
        if self.grad_sync is not None and self.grad_sync.hold and ex.profiling:
            assert ex.params is not None  # the plan prices the all-reduces this micro-batch does not run
            self.grad_sync.time_all_reduce(ex.params)  # (distributed.py, Note: [one sync per step])
        if self.grad_sync is not None and not self.grad_sync.hold:  # before the plan, clipping and the
            # optimizer see them (held: averaged after the step's last micro-batch, Note: [one sync per step])
            assert ex.params is not None
            # the collective lane's bytes, in the planner's unit (distributed.py, Note: [collective bytes])
            stats.lane_bytes["collective"] = self.grad_sync.average_grads(ex.params, stats.grad_norms,
                                                                           stats.layer_sq_norms)
            # sharded groups (their average came with the reduce-scatter): per-parameter norms of the
            # whole gradients from every rank's shard norms; their all-gathers and reduce-scatters
            # are the step's collective lane
            self.grad_sync.combine_shard_norms(ex.params, stats.grad_norms, stats.layer_sq_norms)
            store = self._shard_store()
            if store is not None:
                nbytes, seconds = store.take_collective()
                stats.lane_bytes["collective"] = stats.lane_bytes.get("collective", 0.0) + nbytes
                if nbytes and seconds > 0 and not store.overlap:  # in line: the collectives' own time
                    self._shard_bytes_per_s = nbytes / seconds
        # (a backward whose forward ran no block with grad, e.g. a critic step, profiles nothing; nor
        # does one that left blocks of its planned pass without a gradient: Note: [unreached blocks])
        profiled = ex.profiling and len(stats.boundary_bytes) == len(ex.stack) + 1 and not stats.unreached
        if ex.profiling and stats.unreached:
            self._incomplete_profile(stats)
        if profiled:
            ex.profiling = False
            self._incomplete_profiles = 0
            reason, self._replan_reason = self._replan_reason, None
            self._make_plan(stats, micro_batches, replan=reason)
        self._hand_over_norms(stats)
        self._pending_metrics = stats.metrics(time.perf_counter() - self._t_step, self._predicted_seconds())
        if not profiled:  # a profiled step ran another schedule, with timing on
            self._watch_drift()
            self._watch_memory(stats)
        if not self.lightning_module.automatic_optimization:
            self._begin_microbatch()  # later forwards of this training_step are passes with grad

    def _incomplete_profile(self, stats: StepStats) -> None:
        """The step meant as the profile left blocks without a backward (Note: [unreached blocks]):
        the next step profiles; after three such steps the run stays on the provisional schedule."""
        ex = self.executor
        assert ex is not None
        self._incomplete_profiles += 1
        blocks = ", ".join(map(str, sorted(stats.unreached)))
        if self._incomplete_profiles < 3:
            rank_zero_info(f"lazytrain: the profiled step's backward did not reach block(s) {blocks} of its "
                           "planned pass (a forward with grad whose output was detached or not backpropagated); "
                           "the next step is profiled instead")
            return
        ex.profiling = False
        self._replan_reason = None
        log.warning("lazytrain: %d steps in a row left block(s) %s of the planned pass without a backward, so no "
                    "step could be profiled: training goes on exactly, on the current schedule (%s), without a "
                    "new plan. Run forwards whose output is not backpropagated under torch.no_grad() to let the "
                    "strategy plan.", self._incomplete_profiles, blocks, ex.schedule.policy)

    def _hand_over_norms(self, stats: StepStats) -> None:
        """Give HybridAdamW each parameter's gradient norm, taken by the executor's host lane as the
        gradients arrived, so its clip needs no pass over the gradients and equals Lightning's
        ``clip_grad_norm_`` bit for bit (Note: [exact clip] in optim/clip.py). The step runs after
        this, inside the closure. A norm whose gradient changed since (a hook or callback edited
        it) is taken again at the step (Note: [stale norms] in optim/hybrid_adamw.py); with user
        code that could edit gradients unseen (through ``.data``) between here and the step, or
        without norms (an ad-hoc backward, post-accumulate-grad hooks), every norm is. Sharded
        gradients' norms are taken again over the ranks."""
        from lightning_lazytrain.optim import HybridAdamW

        clip = self.lightning_module.trainer.gradient_clip_val
        shard = self._shard_store() is not None
        recompute = self._whole_grad_norms if shard else None
        norms: dict[torch.nn.Parameter, torch.Tensor] | None = None
        for opt in self.optimizers:
            inner = getattr(opt, "optimizer", opt)
            if not isinstance(inner, HybridAdamW):
                continue
            if not (clip or inner.max_grad_norm is not None or shard):
                inner.set_grad_norms(None)  # never a stale step's norms
                continue
            if norms is None:
                # 16-mixed: the grads (and so these norms) are loss-scaled here, and the plugin unscales
                # them in place before the step, which makes every norm stale: none is handed over
                scaler = getattr(self.precision_plugin, "scaler", None)
                scaled = scaler is not None and scaler.is_enabled()
                trusted = self._norms_trusted and bool(stats.grad_norms) and not scaled
                norms = {p: n for per_layer in stats.grad_norms.values() for p, n in per_layer.items()} \
                    if trusted else {}
            inner.set_grad_norms(norms, recompute=recompute)

    def _whole_grad_norms(self, stale: list) -> dict:
        """Sharded mode: each parameter's norm over its whole gradient, taken again from every rank's
        current shards, when any rank has a stale norm (every rank calls this at every step, so the
        collectives match). Note: [stale norms] in optim/hybrid_adamw.py."""
        ex, sync = self.executor, self.grad_sync
        assert ex is not None and ex.params is not None and sync is not None
        flag = torch.tensor([int(bool(stale))], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=sync.group)
        if not flag.item():
            return {}
        store = ex.params
        norms = {j: store.grad_norms(j) for j in (REST_GROUP, *range(store.num_layers))}
        sync.combine_shard_norms(store, norms)
        return {p: n for per_group in norms.values() for p, n in per_group.items()}

    # ---- evaluation ---------------------------------------------------------------------------
    def _begin_inference(self) -> None:
        self._finish_optimizer_steps()
        if self.executor is not None:
            self.executor.disarm()
            if self.executor.in_microbatch:  # a forward without backward (manual optimization)
                self.executor.abort_microbatch()
                self._micro_index = 0
            self._inference.enter_context(self.executor.inference())

    def _end_inference(self) -> None:
        self._inference.close()

    @override
    def on_validation_start(self) -> None:
        self._begin_inference()

    @override
    def on_validation_end(self) -> None:
        self._end_inference()

    @override
    def on_test_start(self) -> None:
        self._begin_inference()

    @override
    def on_test_end(self) -> None:
        self._end_inference()

    @override
    def on_predict_start(self) -> None:
        self._begin_inference()

    @override
    def on_predict_end(self) -> None:
        self._end_inference()

    # ---- end ----------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        self._finish_optimizer_steps()
        self._pipelined = {}
        self._end_inference()
        if self.executor is not None:
            module = self.lightning_module
            if (self.last_stats is not None and module is not None and getattr(module, "_trainer", None) is not None
                    and self.is_global_zero):
                _write_measured_timeline(self.last_stats, artifact_dir(module.trainer))
            self.executor.close()
            self.executor = None
        for hooks in self._loss_hooks:
            hooks.remove()
        self._loss_hooks = []
        self.plan = None
        self._hardware_measured = None
        self._tokens = None
        self._pending_metrics = {}
        self._replan_reason, self._predicted = None, None
        self._drift.reset()
        if self.grad_sync is not None:
            self.grad_sync.close()
        self.grad_sync = None
        if self.cluster_environment is None:  # torn down before Lightning connected it
            Strategy.teardown(self)
        else:
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        strategy_registry.register("lazytrain", cls, description="layer streaming with a MILP plan",
                                   override=True)
        strategy_registry.register("lazytrain_megatrain", cls, description="layer streaming, MegaTrain's policy",
                                   policy="megatrain", override=True)


def _write_measured_timeline(stats: StepStats, directory: str | None) -> None:
    if not directory or not stats.segments:
        return
    try:
        from lightning_lazytrain.report import plot_timeline

        os.makedirs(directory, exist_ok=True)
        plot_timeline(stats.segments, os.path.join(directory, "timeline_measured.png"), title="measured: last step")
    except Exception as err:  # a plot must never fail a run
        log.warning("could not draw the measured timeline: %s", err)


class _StepMetrics(Callback):
    """Logs the strategy's per-step figures (``lazytrain/*``) through ``LightningModule.log``, so
    they follow ``log_every_n_steps`` and reach every logger like the user's own metrics."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        metrics = getattr(strategy, "_pending_metrics", None)
        if isinstance(strategy, LazyTrainStrategy) and metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
            strategy._pending_metrics = {}


LazyTrainStrategy.register_strategies(StrategyRegistry)
