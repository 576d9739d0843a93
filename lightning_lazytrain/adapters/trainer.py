"""``LazyTrainStrategy``: the Trainer's hooks translated into the training core (``core/``).

    import lightning_lazytrain.strategy          # registers "lazytrain" and "lazytrain_megatrain"
    Trainer(strategy="lazytrain")                # MILP plan
    Trainer(strategy="lazytrain_megatrain")      # MegaTrain's fixed policy, for A/B runs
    Trainer(strategy=LazyTrainStrategy(gpu_memory_budget_gb=20, nvme_dir="/nvme/spill"))
    Trainer(strategy="lazytrain", devices=8)     # data parallel, one process per device

The core streams the blocks, plans and re-plans, syncs gradients and shapes checkpoints; this class
is Lightning's side of it: devices and processes, setup, a training step's micro-batch, evaluation,
the checkpoint hooks (a mixin: ``trainer_checkpoints.py``) and the logged figures. The module's
parameters stay on the host as the master copy, so ``configure_optimizers``, LR schedulers and
checkpoints work unchanged; optimizer states stay on the host too. With several devices
(``devices=N``, ``num_nodes=M``; Lightning's launcher, ``torchrun`` or SLURM) every process streams
the blocks of the same plan and gradients are averaged as under DDP (``core/grad_sync.py``,
Note: [replicate mode]).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_lazytrain.adapters import lightning_internals, processes
from lightning_lazytrain.adapters.options import CoreViews, option
from lightning_lazytrain.adapters.precision import is_lazytrain_precision, lazytrain_precision
from lightning_lazytrain.adapters.trainer_checkpoints import CheckpointHooks, _trainer_of
from lightning_lazytrain.adapters.trainer_outputs import StepMetrics, artifact_dir
from lightning_lazytrain.adapters.weight_readers import gradients_read_after_step, weights_read_after_step
from lightning_lazytrain.core import CoreOptions, FitSettings, TrainingCore
from lightning_lazytrain.core.autoplan import NamedOptions, count_tokens
from lightning_lazytrain.core.batch_size import batch_elements
from lightning_lazytrain.planner import Hardware

__all__ = ["COMPUTE_DTYPES", "LazyTrainStrategy"]

# The dtype blocks are streamed and computed in, per Lightning precision. Mixed precision keeps fp32
# weights under autocast, exactly as plain Lightning does (autocast casts matmul operands itself;
# norms, softmax and losses see fp32 weights), so its streamed copies are fp32 too.
COMPUTE_DTYPES = {"32-true": torch.float32, "32": torch.float32, "bf16-mixed": torch.float32,
                  "bf16-true": torch.bfloat16, "16-mixed": torch.float32, "16-true": torch.float16}


class LazyTrainStrategy(CoreViews, CheckpointHooks, ParallelStrategy, metaclass=NamedOptions):
    """Train with weights streamed from host memory and a planned activation schedule, on one device
    or data parallel on several (one process per device; see ``core/grad_sync.py``).

    The training itself is ``TrainingCore``'s (``strategy.core``, core/training_core.py); ``plan``,
    ``replans``, ``last_stats``, ``executor``, ``grad_sync`` and ``metrics`` are the core's.

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
            checkpoints, ``core/sharded_checkpoint.py``.
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
            the backward (``core/grad_sync.py``: Note: [overlapped all-reduce]; bit-identical; the plan
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
            gradient all-reduced across them: Note: [hybrid sharding] in core/grad_sync.py). Must divide
            ``devices x num_nodes``.
        nonblock_parts: one process with a ``HybridAdamW`` whose layers split the non-block weights
            (``CausalLMModule``: ``embed``, ``head``): the step's tail moves, updates and stages them
            part by part, each part's transfers under the next part's host work (Note: [non-block
            parts] in planner/schedule_windows.py; bit-identical). False: one part (the ablation).
        replan: re-profile and re-plan when the measured step time drifts from the prediction
            (``True``, ``False`` or a dict of ``replan.ReplanOptions``: threshold, patience,
            min_gain, max_replans, backoff, profile_check); only for ``policy="milp"``. Its
            ``profile_warmup`` (steps before the profiled first one; default 1 on CUDA, 0 on the CPU)
            applies to every policy.
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
        options = CoreOptions(hardware=hardware, gpu_memory_budget_gb=gpu_memory_budget_gb, nvme_dir=nvme_dir,
                              policy=policy, blocks=blocks, emulate_link_gb_per_s=emulate_link_gb_per_s,
                              replan=replan, checkpoint_format=checkpoint_format,
                              verify_checkpoints=verify_checkpoints, overlap_grad_sync=overlap_grad_sync,
                              nonblock_parts=nonblock_parts, data_parallel=data_parallel, shard_size=shard_size,
                              fp32_masters=fp32_masters, keep_compute_copy=keep_compute_copy,
                              conversions=conversions, chunked_loss=chunked_loss)
        self.core = TrainingCore(options, info=rank_zero_info, debug=rank_zero_debug, warn=rank_zero_warn)
        self._verify_checkpoints = verify_checkpoints
        super().__init__(accelerator=accelerator, parallel_devices=None, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._given_device = torch.device(device) if device is not None else None
        # Set by Lightning from Trainer(devices=..., num_nodes=...) (it fills these attributes when a
        # strategy has them, and the cluster environment that gives each process its rank).
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._half_step = False  # a failing run gave up a step begun in the backward: no checkpoint from here

    # the options, as given (read-only; CoreOptions checked them)
    hardware = option("hardware")
    gpu_memory_budget_gb = option("gpu_memory_budget_gb")
    nvme_dir = option("nvme_dir")
    policy = option("policy")
    blocks = option("blocks")
    emulate_link_gb_per_s = option("emulate_link_gb_per_s")
    replan = option("replan")
    checkpoint_format = option("checkpoint_format")
    overlap_grad_sync = option("overlap_grad_sync")
    nonblock_parts = option("nonblock_parts")
    data_parallel = option("data_parallel")
    shard_size = option("shard_size")
    fp32_masters = option("fp32_masters")
    keep_compute_copy = option("keep_compute_copy")
    conversions = option("conversions")
    chunked_loss = option("chunked_loss")

    # what the core holds (CoreViews: executor, plan, replans, last_stats, metrics)
    @property
    def grad_sync(self) -> Any:
        return self.core.grad_sync

    # ---- devices and processes -----------------------------------------------------------------
    @property
    def checkpoint_io(self) -> Any:
        """``VerifiedCheckpointIO`` (CRCs checked before a resume, atomic writes) unless another was given, also
        inside an empty wrapper: ``AsyncCheckpointIO()`` given to the strategy or as a Trainer plugin (Lightning
        fills an empty one with its plain ``TorchCheckpointIO``: the checks were dropped without a word, reviews 24
        and 25). None is kept until asked, so ``Trainer(plugins=[AsyncCheckpointIO()])`` is not refused as given
        twice."""
        from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

        from lightning_lazytrain.adapters.checkpoint_io import VerifiedCheckpointIO

        if self._checkpoint_io is None:
            self._checkpoint_io = VerifiedCheckpointIO(verify=self._verify_checkpoints)
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO) and self._checkpoint_io.checkpoint_io is None:
            self._checkpoint_io.checkpoint_io = VerifiedCheckpointIO(verify=self._verify_checkpoints)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @property
    @override
    def root_device(self) -> torch.device:
        return processes.root_device(self.accelerator, self.parallel_devices, self.local_rank, self._given_device,
                                     hint="Trainer(accelerator='gpu') or accelerator='cpu'")

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
        processes.set_world_ranks(self.cluster_environment, node_rank=self.node_rank, local_rank=self.local_rank,
                                  per_node=self.num_processes, nodes=self.num_nodes)

    @override
    def _configure_launcher(self) -> None:
        self._launcher = None
        if self.is_distributed:
            assert self.cluster_environment is not None
            if self._given_device is not None:
                raise ValueError(f"LazyTrainStrategy(device={self._given_device}) picks one device, but the Trainer "
                                 f"asks for {self.num_processes} device(s) on {self.num_nodes} node(s): pass "
                                 "devices=N to the Trainer without device=, or devices=1")
            self._launcher = lightning_internals.TrainerSubprocessLauncher(self.cluster_environment,
                                                                           self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.is_distributed:
            self.set_world_ranks()
            assert self.cluster_environment is not None
            processes.init_processes(self.cluster_environment, self.root_device, self._process_group_backend,
                                     self._timeout)
        layout = processes.layout_of(self.global_rank, self.num_processes, self.num_nodes)
        self.core.connect_processes(layout, self.root_device, timeout=self._timeout)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.is_distributed:
            processes.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return processes.broadcast(obj, src) if self.is_distributed else obj

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return processes.reduce(tensor, group, reduce_op) if self.is_distributed else tensor

    # ---- setup ---------------------------------------------------------------------------------
    @override
    def model_to_device(self) -> None:
        """Build the core's executor instead of moving the model: only buffers and the non-block
        weights live on the device; blocks stream."""
        module = self.lightning_module
        assert module is not None
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in COMPUTE_DTYPES:
            raise ValueError(f"precision={precision!r} is not supported by strategy='lazytrain': use one of "
                             f"{sorted(COMPUTE_DTYPES)} (64-bit and plugin precisions would silently train "
                             "differently from strategy='auto')")
        if not is_lazytrain_precision(self.precision_plugin):
            raise ValueError(f"strategy='lazytrain' runs Lightning's own precision plugins (Precision, MixedPrecision, "
                             f"HalfPrecision), not {type(self.precision_plugin).__name__}: pass precision=... to "
                             "the Trainer instead of a plugin of your own")
        trainer = _trainer_of(module)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        device = self.root_device
        self.core.build(module, device, compute_dtype=COMPUTE_DTYPES[precision], precision=precision,
                        automatic=module.automatic_optimization, measure=fitting)
        lightning_internals.set_module_device(module, device)  # LightningModule.device: where it computes

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self._half_step = False
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
            self.setup_optimizers(trainer)  # on the host parameters; states stay on the host
            self.core.checkpoints.check_targets([getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks],
                                                self.optimizers)
            self.core.start_fit(self.optimizers, self._fit_settings(trainer), artifact_dir=artifact_dir(trainer))
            if not any(isinstance(cb, StepMetrics) for cb in trainer.callbacks):
                trainer.callbacks.append(StepMetrics())
        self.setup_precision_plugin()

    def _fit_settings(self, trainer: Any) -> FitSettings:
        module = self.lightning_module
        # Grads of the non-block weights and of layer 0 normally reach the host once per optimizer
        # step; a hook that looks at grads after each backward, or manual optimization, needs every
        # micro-batch's grads on the host, as plain Lightning has them. So do fp32 masters: each
        # micro-batch's 16-bit gradients join the fp32 ones (a step's would otherwise add up in 16
        # bits on the device for layer 0 and the non-block weights).
        full = self.fp32_masters or not module.automatic_optimization or is_overridden(
            "on_after_backward", module) or any(is_overridden("on_after_backward", cb, parent=Callback)
                                                for cb in trainer.callbacks)
        # Note: [stale norms] (optim/grad_norms.py): the fused clip's norms are taken as the gradients
        # land; user code that runs before the step may edit them (even through .data)
        between = ("on_after_backward", "on_before_optimizer_step")
        # a callback that declares ``reads_gradients_only = True`` (it logs or times, it edits nothing) is
        # trusted; an edit is still caught where it matters (the stale-norm and updates-in-backward checks)
        trusted = module.automatic_optimization and not any(
            is_overridden(name, module) for name in (*between, "configure_gradient_clipping")) and not any(
            is_overridden(name, cb, parent=Callback) for cb in trainer.callbacks for name in between
            if not getattr(cb, "reads_gradients_only", False))
        # 16-mixed: the grads (and so the host lane's norms) are loss-scaled, and the plugin unscales
        # them in place before the step: no norm is handed over
        scaler = getattr(self.precision_plugin, "scaler", None)
        scaled = scaler is not None and scaler.is_enabled()
        # Note: [updates in the backward pass] (core/optimizer_steps.py): why blocks may not be updated
        # during the backward (None: they may)
        # (an overridden optimizer_step may run the closure without stepping, or step with something else; an
        # overridden backward may run several backward passes, or one with create_graph)
        own_step = [n for n in ("optimizer_step", "optimizer_zero_grad", "backward") if is_overridden(n, module)]
        in_backward = ("manual optimization" if not module.automatic_optimization else
                       f"the LightningModule overrides {' and '.join(own_step)}" if own_step else
                       f"gradient_clip_val={trainer.gradient_clip_val} needs every gradient first"
                       if trainer.gradient_clip_val else "16-mixed unscales the gradients after the backward"
                       if scaled else "a hook may edit gradients between the backward and the step "
                       "(on_after_backward, on_before_optimizer_step or configure_gradient_clipping)"
                       if not trusted else None)
        return FitSettings(grad_accum=trainer.accumulate_grad_batches, full_microbatches=full, hand_over_norms=True,
                           clip=bool(trainer.gradient_clip_val), loss_scaled=scaled, norms_trusted=trusted,
                           updates_in_backward=in_backward,
                           step_waits=weights_read_after_step(module, trainer.callbacks),
                           grads_read_after_step=gradients_read_after_step(module, trainer.callbacks))

    @property
    @override
    def precision_plugin(self) -> Precision:
        """The Trainer's plugin as the strategy's subclass of it (fused clip, pipelined step: precision.py)."""
        if self._precision_plugin is None:
            self._precision_plugin = lazytrain_precision(None, self.core)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = None if precision_plugin is None else lazytrain_precision(precision_plugin,
                                                                                           self.core)

    # ---- training ------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        batch = args[0] if args else kwargs.get("batch")
        last = not module.automatic_optimization or lightning_internals.steps_after_this_batch(module.trainer)
        # Note: [the micro-batch begins at the model's call]; not where the LightningModule holds parameters of
        # its own, which training_step reads without calling a module (they are bound when the micro-batch begins)
        at_call = next(module.parameters(recurse=False), None) is None
        self.core.begin_microbatch(lambda: count_tokens(batch), last=last, elements=lambda: batch_elements(batch),
                                   at_call=at_call)
        with self.core.weight_reads_guard():  # Note: [weights read before the forward] (core/weight_reads.py)
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """As Lightning's, but the core finishes the micro-batch right after the backward, so
        ``on_after_backward`` sees the gradients on the host parameters, as under ``auto``; before it, the
        core marks the blocks whose input the loss also uses (Note: [one gradient per boundary use])."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.core.before_backward(closure_loss)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self.core.end_microbatch(step=module.trainer.global_step)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # ---- evaluation ----------------------------------------------------------------------------
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.is_distributed:  # before the first step: ranks with uneven data would wait on each other
            t = self.lightning_module.trainer
            processes.refuse_uneven_batches(t.num_training_batches, t.max_steps, t.accumulate_grad_batches)

    def on_validation_start(self) -> None:
        self.core.begin_inference()

    @override
    def on_validation_end(self) -> None:
        self.core.end_inference()

    @override
    def on_test_start(self) -> None:
        self.core.begin_inference()

    @override
    def on_test_end(self) -> None:
        self.core.end_inference()

    @override
    def on_predict_start(self) -> None:
        self.core.begin_inference()

    @override
    def on_predict_end(self) -> None:
        self.core.end_inference()

    # ---- end -----------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        self.core.teardown()
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


LazyTrainStrategy.register_strategies(StrategyRegistry)
