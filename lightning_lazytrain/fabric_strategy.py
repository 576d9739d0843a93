"""``LazyTrainFabricStrategy``: layer-streaming training under Lightning Fabric.

    fabric = L.Fabric(accelerator="cuda", strategy="lazytrain")     # MILP plan (registered name)
    fabric = L.Fabric(strategy="lazytrain_megatrain")                # MegaTrain's fixed policy
    fabric = L.Fabric(strategy=LazyTrainFabricStrategy(gpu_memory_budget_gb=20, nvme_dir="/nvme/spill"))
    model, opt = fabric.setup(model, opt)        # optimizer created on model.parameters() beforehand
    for batch in data:
        loss = model(batch).loss                 # any forward, several per step allowed
        fabric.backward(loss)                    # (several backward calls = gradient accumulation)
        opt.step(); opt.zero_grad()
    fabric.strategy.teardown()                   # restore the blocks, free device buffers

Glue only, on the same engine as the Trainer strategy: ``setup_module`` builds the ``Executor``
on a provisional schedule and returns a thin wrapper whose forward opens a micro-batch (a forward
with grad while none is open); ``backward`` runs the backward and closes it. Each
forward ... ``fabric.backward`` is therefore one executor micro-batch with ``first=last=True``:
exact, and accumulation is several backward calls adding into the host ``.grad``. A further
forward before the backward runs ad hoc (the executor's second-pass path). The first micro-batch
is the profile: after its backward the workload is measured from its trace, the plan solved and
the executor switched to it, before the optimizer step (an impossible budget raises there). The
module's parameters stay on the host as the fp32 masters; the user's optimizer updates them in
place and the next forward stages the updated weights.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
from lightning.fabric.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, SingleDeviceStrategy
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_lazytrain.autoplan import (AutoPlan, NamedOptions, count_tokens, given_hardware, measure_hardware,
                                          plan_from_workload, validate_options)
from lightning_lazytrain.blocks import BlockDiscoveryError, find_blocks
from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.executor import Executor, StepStats
from lightning_lazytrain.engine.nvme import check_nvme_dir
from lightning_lazytrain.engine.profiler import workload_from_stats
from lightning_lazytrain.planner import Hardware, InfeasibleBudget, min_memory, recompute_all
from lightning_lazytrain.planner.placement import conversions_note

__all__ = ["LazyTrainFabricStrategy"]

log = logging.getLogger(__name__)

# Fabric precisions the streamed engine reproduces: fp32 masters computed in fp32, or in fp32 slots
# under Fabric's bf16 autocast (the executor's re-runs replay the autocast state).
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed")


class _StreamedModule(nn.Module):
    """What ``fabric.setup`` wraps in its ``_FabricModule`` (the place DDP's wrapper takes): the
    user's module, whose forward goes through the strategy (micro-batch or inference)."""

    def __init__(self, module: nn.Module, strategy: LazyTrainFabricStrategy) -> None:
        super().__init__()
        self.module = module
        self._strategy = strategy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._strategy._forward(self.module, args, kwargs)


class LazyTrainFabricStrategy(SingleDeviceStrategy, metaclass=NamedOptions):
    """Fabric strategy: one device, block weights streamed from the host, a planned activation schedule.

    Args (as ``LazyTrainStrategy``):
        hardware: "measure" (measure this machine), a profile name from ``conf/hardware/``, or a
            ``planner.Hardware``.
        gpu_memory_budget_gb: device memory the plan may use (default: 90% of what is free).
        nvme_dir: a directory on an NVMe drive for activation spill files (enables the NVMe tier).
        policy: "milp", "megatrain", "keep_all", "recompute_all", or the path of a ``plan.json``.
        blocks: dotted path of the block stack (default: found automatically).
        emulate_link_gb_per_s: on CPU, make host<->"device" copies take the time of a link of this speed.
        verify_checkpoints: ``fabric.save`` writes atomically and ``fabric.load`` checks the file's CRCs
            first (``checkpoint_io.VerifiedCheckpointIO``; a ``checkpoint_io=`` of your own replaces it).

    Bad options fail at construction, named as written (``autoplan.validate_options``, as the Trainer's).

    After the first backward, ``plan`` holds the ``AutoPlan`` (``plan.write(dir)`` writes plan.json
    and the predicted timeline); ``last_stats`` holds the last micro-batch's ``StepStats`` and
    ``metrics`` its ``lazytrain/*`` figures, the ones the Trainer's strategy logs (Fabric logs nothing
    by itself: ``fabric.log_dict(fabric.strategy.metrics)``).
    """

    strategy_name = "lazytrain"

    def __init__(self, hardware: str | Hardware = "measure", gpu_memory_budget_gb: float | None = None,
                 nvme_dir: str | None = None, policy: str = "milp", blocks: str | None = None,
                 emulate_link_gb_per_s: float | None = None, device: str | torch.device | None = None,
                 accelerator: Any = None, checkpoint_io: Any = None, precision: Precision | None = None,
                 verify_checkpoints: bool = True) -> None:
        from lightning_lazytrain.checkpoint_io import VerifiedCheckpointIO

        super().__init__(device=device or "cpu", accelerator=accelerator,
                         checkpoint_io=checkpoint_io or VerifiedCheckpointIO(verify=verify_checkpoints),
                         precision=precision)
        validate_options(hardware, gpu_memory_budget_gb, nvme_dir, policy, emulate_link_gb_per_s)
        self._device_given = device is not None
        self.parallel_devices: list | None = None  # Fabric's connector fills in the devices= selection
        self.hardware = hardware
        self.gpu_memory_budget_gb = gpu_memory_budget_gb
        self.nvme_dir = nvme_dir
        self.policy = policy
        self.blocks = blocks
        self.emulate_link_gb_per_s = emulate_link_gb_per_s
        self.executor: Executor | None = None
        self.plan: AutoPlan | None = None
        self.last_stats: StepStats | None = None
        self.metrics: dict[str, float] = {}
        self._hardware_measured: Hardware | None = None
        self._t_step = 0.0
        self._module: nn.Module | None = None
        self._tokens = 1
        self._t_profile = 0.0

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

    # ---- device --------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        if self._device_given:
            return self._root_device
        if isinstance(self.accelerator, CUDAAccelerator):
            if self.parallel_devices:
                return torch.device(self.parallel_devices[0])
            return torch.device("cuda", torch.cuda.current_device())
        if self.accelerator is None or isinstance(self.accelerator, CPUAccelerator):
            return torch.device("cpu")
        raise RuntimeError(f"strategy='lazytrain' runs on a CUDA GPU or the CPU, not on "
                           f"{type(self.accelerator).__name__}; use Fabric(accelerator='cuda') or accelerator='cpu'")

    @override
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``fabric.init_module()``: parameters are created on the host (they are the masters)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("cpu"))
        stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """A module with a block stack stays on the host (``setup_module`` streams it; the engine
        moves its buffers); any other module moves to the device as usual."""
        if module is self._module or isinstance(module, _StreamedModule):
            return
        try:
            find_blocks(module, self.blocks)
        except BlockDiscoveryError:
            module.to(self.root_device)

    # ---- setup ---------------------------------------------------------------------------------
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Build the executor on a provisional schedule; the plan replaces it after the first backward."""
        if self.executor is not None:
            raise NotImplementedError("strategy='lazytrain' streams one model per Fabric; set up the others with "
                                      "a second Fabric or keep them outside fabric.setup")
        if self.parallel_devices and len(self.parallel_devices) > 1:
            raise ValueError(
                f"Fabric(strategy='lazytrain') trains on one device, and devices= selected "
                f"{len(self.parallel_devices)} ({', '.join(map(str, self.parallel_devices))}): pass devices=1 (or "
                "devices=[i] for device i); for several devices use the Trainer's strategy='lazytrain', which "
                "runs data parallel")
        device = self.root_device
        if self.nvme_dir is not None:
            check_nvme_dir(self.nvme_dir)
        if self.hardware == "measure":  # free device memory before the executor's slots exist
            self._hardware_measured = measure_hardware(device, gpu_memory_budget_gb=self.gpu_memory_budget_gb,
                                                       nvme_dir=self.nvme_dir, link_gb_per_s=self.emulate_link_gb_per_s)
        links = None
        if self.emulate_link_gb_per_s is not None and device.type == "cpu":
            bw = self.emulate_link_gb_per_s * 1e9
            links = {"h2d": LinkSpec(bw, 0.0), "d2h": LinkSpec(bw, 0.0)}
        t0 = time.perf_counter()
        stack = find_blocks(module, self.blocks)
        n = len(stack)
        provisional = min_memory(n) if device.type == "cuda" else recompute_all(n)
        # compute_dtype fp32 for both supported precisions: bf16-mixed is Fabric's autocast over it
        self.executor = Executor(module, provisional, blocks=stack, device=device, compute_dtype=torch.float32,
                                 nvme_dir=self.nvme_dir, links=links)
        self._module = module
        rank_zero_info(f"lazytrain: {n} blocks at {stack.path!r}, executor on {device} "
                       f"({self.precision.precision}) built in {time.perf_counter() - t0:.2f} s")
        return _StreamedModule(module, self)

    # ---- training ------------------------------------------------------------------------------
    def _forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        ex = self.executor
        if ex is None:  # torn down: the plain module (host weights)
            return module(*args, **kwargs)
        if torch.is_grad_enabled():
            if not ex.in_microbatch:
                self._begin_microbatch(args, kwargs)
            return module(*args, **kwargs)  # a forward with one open already: the executor's ad-hoc pass
        if ex.in_microbatch:  # no-grad forward between a forward and its backward: non-block weights are bound
            return module(*args, **kwargs)
        with ex.inference():  # evaluation: non-block weights staged on the device, blocks stream
            return module(*args, **kwargs)

    def _begin_microbatch(self, args: tuple, kwargs: dict) -> None:
        ex = self.executor
        assert ex is not None
        self._t_step = time.perf_counter()
        if self.plan is None:  # this micro-batch is the profile
            ex.profiling = True
            self._tokens = count_tokens(*args, **kwargs)
            self._t_profile = self._t_step
        ex.begin_microbatch(first=True, last=True)

    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)
        ex = self.executor
        if ex is None or not ex.in_microbatch:
            return
        stats = ex.end_microbatch()
        self.last_stats = stats
        assert stats is not None
        seconds = time.perf_counter() - self._t_step
        # a backward that left blocks of the forward's pass without a gradient (a forward with grad
        # whose output was detached or dropped: engine/executor.py, Note: [unreached blocks]) is
        # exact but no profile: the next backward is
        if self.plan is None and not stats.unreached:
            ex.profiling = False
            self._make_plan(stats, seconds)
        predicted = self.plan.result.sim.iteration_seconds if self.plan is not None else float("nan")
        self.metrics = stats.metrics(seconds, predicted)

    def _make_plan(self, stats: StepStats, t_profile: float) -> None:
        """Measure the workload from the profiled micro-batch, solve, switch the executor to the plan."""
        ex = self.executor
        assert ex is not None
        t0 = time.perf_counter()
        hardware = self._hardware()
        t_hw = time.perf_counter() - t0
        wl = workload_from_stats(ex, stats, tokens=self._tokens, opt_params_per_s=hardware.cpu_adam_params_per_s)
        try:  # an impossible budget raises here, said first in the log
            plan = plan_from_workload(wl, hardware, policy=self.policy, profiled=ex.schedule)
        except InfeasibleBudget as err:
            log.error("lazytrain cannot train this within its budget: %s", err)
            raise
        plan.timings.update(profile=t_profile, hardware=t_hw)
        nvme = int(plan.result.sim.nvme_bytes)
        if nvme:
            check_nvme_dir(self.nvme_dir, nvme)
            ex._nvme_required = nvme  # no public setter; the Trainer strategy does the same
        t0 = time.perf_counter()
        ex.set_schedule(plan.schedule)
        ex.set_placement(**plan.result.placement.groups(len(ex.stack)))  # Note: [conversion placement]
        plan.timings["executor"] = time.perf_counter() - t0
        self.plan = plan
        from lightning_lazytrain.report import format_table

        rank_zero_info(f"lazytrain plan ({plan.result.status}; profile {t_profile:.2f} s, "
                       f"solve {plan.timings['solve']:.2f} s){conversions_note(plan.result.workload, plan.result.placement)}:\n"
                       f"{format_table(plan.result.rows())}")

    def _hardware(self) -> Hardware:
        """As the Trainer's: the budget applies on every path, no NVMe tier without ``nvme_dir``."""
        if self.hardware == "measure":
            assert self._hardware_measured is not None  # setup_module measured it
            return self._hardware_measured
        return given_hardware(self.hardware, self.gpu_memory_budget_gb, self.nvme_dir)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        ex = self.executor
        if ex is not None and ex.in_microbatch:  # a forward with grad whose backward never ran: drop it
            ex.abort_microbatch()
        return super().optimizer_step(optimizer, **kwargs)

    # ---- checkpoints: plain state dicts of the host masters --------------------------------------
    def _unwrap(self, module: nn.Module) -> nn.Module:
        if isinstance(module, _StreamedModule):
            if self.executor is not None and self.executor.in_microbatch:
                raise RuntimeError("strategy='lazytrain': save or load the model after fabric.backward(), not between "
                                   "a forward and its backward (the non-block weights are swapped for device copies)")
            return module.module
        return module

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return super().get_module_state_dict(self._unwrap(module))

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(self._unwrap(module), state_dict, strict=strict)

    # ---- end -----------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Restore the blocks' forward, free device buffers and copy threads (Fabric does not call
        this itself: call ``fabric.strategy.teardown()`` when done). The module keeps its trained
        host parameters."""
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        self._module = None
        self.plan = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("lazytrain", cls, description="layer streaming with a MILP plan", override=True)
        strategy_registry.register("lazytrain_megatrain", cls, description="layer streaming, MegaTrain's policy",
                                   policy="megatrain", override=True)


LazyTrainFabricStrategy.register_strategies(STRATEGY_REGISTRY)
