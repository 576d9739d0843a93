"""The executor: runs a planner ``Schedule`` on a module's block stack.

Each block of the stack becomes one autograd node (``block_fn.BlockFunction``); everything else
(embedding, final norm, head, loss) runs with normal autograd on device-resident weights. The
executor follows ``Schedule.windows()`` literally, so it moves exactly the bytes and re-runs
exactly the layers that the simulator counts:

    F{j}   issue the window's transfers (offload boundaries and kept internals, prefetch layer
           j+1 into its slot),
           store the input boundary per its home, run block j (no grad, or with grad keeping its
           internals), and after the last block issue window H's transfers
    B{t}   issue the window's transfers (grads of layer t+1 to the host, prefetch layer t-1,
           reloads of boundaries and internals, NVMe reads), re-run a recompute block if one ends here, re-run layer t with
           grad unless it kept its internals, backpropagate, free its input
    T      (``end_microbatch(last)``) last grads to the host; the caller's optimizer then runs;
           ``begin_microbatch(first)`` of the next step fetches layer 0 again

Protocol for one optimizer step of ``g`` micro-batches::

    for k in range(g):
        ex.begin_microbatch(first=k == 0, last=k == g - 1)
        loss = model(...); ex.mark_boundary_uses(loss); loss.backward()  # (Note: [one gradient per boundary use])
        ex.end_microbatch()
    optimizer.step(); optimizer.zero_grad()

Slots: layer j uses slot ``j % 2`` in forward and backward (so kept internals can re-view their
weights), slot 2 is the recompute buffer (weights only), resident layers get slots 3, 4, ...
Outside a training micro-batch (``torch.no_grad()`` evaluation) blocks simply stream through the
two slots.

The block node's windows run in two mixins of ``Executor``: ``ForwardWindows`` (forward_windows.py:
F{j}, H's transfers, ad-hoc forwards) and ``BackwardWindows`` (backward_windows.py: B{t}, the windows
the backward skips or never reaches, ad-hoc backwards, block recomputes, the backward-side
transfers); a block's call becomes its pass in a third, ``BlockCalls`` (block_calls.py: ``_block_call``,
Note: [blocks no gradient reaches], evaluation's streaming). The micro-batch protocol (``arm``,
``begin_microbatch``, ``end_microbatch``, ``abort_microbatch``, ``inference``) is the mixin
``MicroBatchProtocol`` (microbatch_protocol.py); the device memory and boundaries are ``StepMemory``
(step_memory.py). This module holds the setup (schedule, placement, the blocks' installed forwards,
``close``) and the grads' completion.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_lazytrain.engine import layer_checkpointing
from lightning_lazytrain.engine.activation_store import ActivationStore
from lightning_lazytrain.engine.backward_windows import BackwardWindows
from lightning_lazytrain.engine.block_calls import BlockCalls
from lightning_lazytrain.engine.block_fn import TrainableReads
from lightning_lazytrain.engine.blocks import BlockStack, find_blocks
from lightning_lazytrain.engine.boundary_uses import mark_boundary_uses
from lightning_lazytrain.engine.copy_engine import CopyError, LinkSpec
from lightning_lazytrain.engine.copy_factory import make_copy_engine
from lightning_lazytrain.engine.early_parts import EarlyParts, EarlyPartsWatch
from lightning_lazytrain.engine.forward_windows import ForwardWindows
from lightning_lazytrain.engine.microbatch_protocol import MicroBatchProtocol
from lightning_lazytrain.engine.param_store import REST, ParamStore, PendingGrads
from lightning_lazytrain.engine.step_memory import StepMemory
from lightning_lazytrain.engine.step_stats import StepStats
from lightning_lazytrain.engine.streamed_forward import StreamedForward
from lightning_lazytrain.engine.trace import DeviceTracker
from lightning_lazytrain.engine.window_memory import WindowMemory
from lightning_lazytrain.engine.worker import CopyHandle
from lightning_lazytrain.planner.schedule import Schedule

__all__ = ["Executor", "StepStats"]

log = logging.getLogger(__name__)


class Executor(MicroBatchProtocol, ForwardWindows, BackwardWindows, BlockCalls, StepMemory, EarlyPartsWatch):
    def __init__(self, module: nn.Module, schedule: Schedule, *, blocks: BlockStack | str | None = None,
                 device: torch.device | str = "cpu", compute_dtype: torch.dtype = torch.float32,
                 nvme_dir: str | os.PathLike[str] | None = None, links: Mapping[str, LinkSpec] | None = None,
                 wait_updated: Callable[[int], None] | None = None, nvme_required_bytes: int = 0,
                 shard_group: Any = None, replica_group: Any = None, grad_group: Any = None,
                 keep_compute_copy: bool = False) -> None:
        self.module = module
        # 16-bit compute copies of fp32 masters cast once per micro-batch and kept on the host
        # (param_staging's Note: [kept compute copy]); kept across set_schedule
        self.keep_compute_copy = keep_compute_copy
        self.stack = blocks if isinstance(blocks, BlockStack) else find_blocks(module, blocks)
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.engine = make_copy_engine(self.device, links)
        self.wait_updated = wait_updated
        # Note: [norms only when wanted] The host lane takes every parameter's gradient norm at a step's
        # last accumulation (the fused clip's, the non-finite skip's, several processes' averaging) -- one
        # more read of every fp32 host gradient per step. A run that uses none of them (no clip, no skip,
        # one process) sets this False (core/optimizer_steps.py ``norms_wanted``): the step's stats then
        # hold no norms, and the plan prices none (``Workload.host_norms``).
        self.take_norms = True
        # ids of the weights an optimizer holds (the training core sets them each step): Note: [blocks no
        # gradient reaches]
        self.optimized_ids: frozenset[int] = frozenset()
        self._reads_trainable: set[int] = set()  # blocks seen reading a trainable tensor they do not own
        self._shared_checked = False  # a micro-batch's blocks shared a container and none read it (shared_args.py)
        # Note: [the tracker's own time] (live_bytes.py): take the CPU memory tracker's time out of a profiled
        # step's compute. Off by default: the CPU tests' plan and drift decisions at their margins were set
        # under the profile as it was (its compute ~2x a step's); on, two of them (a plan's choice of updates in
        # the backward, a drift re-profile of a 16x batch) flipped in one of two full runs. On in
        # bench/bench_profile_overhead.py and tests/test_tracker_time.py. CUDA has no tracker either way.
        self.tracker_time_out = False
        self._reads: TrainableReads | None = None  # watching the forward of a block run without its node
        self.tracker = DeviceTracker()
        self.stats = StepStats()
        self._orig: dict[int, Callable] = {}
        self._micro: tuple[bool, bool] | None = None
        self._between_microbatches = False  # evaluation between an accumulated step's micro-batches
        self._exit = contextlib.ExitStack()
        self.params: ParamStore | None = None
        self.acts: ActivationStore | None = None
        self._nvme_dir = nvme_dir
        self._nvme_required = nvme_required_bytes
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        self._armed: tuple[bool, bool] | None = None
        self._arm_handles: list = []
        self._adhoc_used = False
        self._post_hooks = False  # the module's masters carry post-accumulate-grad hooks (this step)
        self._serial = 0  # counts micro-batches: a node of an earlier one cannot run its backward
        self.profiling = False  # True: the trace synchronises the device at every mark (exact CUDA times)
        self.measure_memory = False  # True: measure real device bytes per window (always while profiling)
        self._mem: WindowMemory | None = None  # while a step measures its device bytes
        self.rest_parts: list[list[nn.Parameter]] = []  # see set_rest_parts
        # Note: [early non-block parts] (early_parts.py): the parts that may be written back and handed over
        # during the backward, the optimizer's hand-over (both set by core/optimizer_steps.PipelinedSteps),
        # whether this micro-batch is armed for it (the training core), and the micro-batch's watch
        self.early_part_set: frozenset[int] = frozenset()
        self.on_part_final: Callable[[int, CopyHandle], None] | None = None
        self.early_parts_armed = False
        self._early: EarlyParts | None = None
        self.placement: dict[str, list[int]] = {}  # see set_placement
        # sharded data parallel (engine/shard_store.py): the process group whose ranks share every
        # block's host state ("world": the default group); None: this process holds all of it
        self.shard_group = shard_group
        self.replica_group = replica_group  # Note: [hybrid sharding] (core/grad_sync.py)
        # gloo, over the shard group's ranks: the overlapped reduce-scatters' (shard_grads.py); with
        # the "world" group on CPU devices made here, once, by every rank, when not given
        self.grad_group = grad_group
        if shard_group == "world" and grad_group is None and self.device.type != "cuda":
            import torch.distributed as dist

            self.grad_group = dist.new_group(backend="gloo")
        self.set_schedule(schedule)
        self._install()

    # ---- setup ---------------------------------------------------------------------------
    def set_schedule(self, schedule: Schedule) -> None:
        """(Re)configure for ``schedule`` (between steps)."""
        L = len(self.stack)
        if schedule.num_layers != L:
            raise ValueError(f"schedule has {schedule.num_layers} layers, the block stack {self.stack.path!r} has {L}")
        if self._micro is not None:
            raise RuntimeError("set_schedule() inside a micro-batch")
        self.schedule = schedule
        residents = [j for j in range(L) if schedule.resident_weights[j]]
        self.resident_slot = {j: 3 + r for r, j in enumerate(residents)}
        slots = 3 + len(residents)
        if self.params is None or self.params.num_slots != slots:
            hook = None
            if self.params is not None:
                hook = self.params.final_grads_hook  # (core/grad_sync.GradSync's, if any) carries over
                self.params.close()
            # The recompute slot and the resident slots hold device memory only while the plan counts
            # them (lazy slots: allocated by stage, given back by evict).
            if self.shard_group is None:
                self.params = ParamStore(self.module, self.stack, self.device, self.compute_dtype, self.engine,
                                         num_slots=slots, lazy_slots=range(2, slots),
                                         keep_copies=self.keep_compute_copy)
            else:
                from lightning_lazytrain.engine.shard_store import ShardedParamStore

                group = None if self.shard_group == "world" else self.shard_group
                self.params = ShardedParamStore(self.module, self.stack, self.device, self.compute_dtype,
                                                self.engine, num_slots=slots, lazy_slots=range(2, slots),
                                                group=group, replica_group=self.replica_group,
                                                grad_group=self.grad_group,
                                                keep_copies=self.keep_compute_copy)
            self.params.set_final_grads_hook(hook)
            if self.rest_parts:
                self.params.set_rest_parts(self.rest_parts)
            if self.placement:
                self.params.set_placement(**self.placement)
        uses_nvme = "nvme" in schedule.homes
        if uses_nvme and self._nvme_dir is None:
            raise ValueError("the schedule puts activations on NVMe: pass nvme_dir= (a directory on the NVMe drive)")
        if self.acts is None or (uses_nvme and self.acts.spill is None):
            if self.acts is not None:
                self.acts.close()
            self.acts = ActivationStore(self.device, self.engine, self._nvme_dir if uses_nvme else None,
                                        nvme_required_bytes=self._nvme_required)
        self.tracker = DeviceTracker()
        self._static_bytes()

    @property
    def nvme_required_bytes(self) -> int:
        """The NVMe bytes the plan needs: the spill directory checks them for free space when the
        activation store opens it (the next ``set_schedule`` whose schedule puts boundaries on NVMe).
        Settable (a strategy sets it from a new plan before ``set_schedule``)."""
        return self._nvme_required

    @nvme_required_bytes.setter
    def nvme_required_bytes(self, nbytes: int) -> None:
        self._nvme_required = int(nbytes)

    def _wait_for_update(self, j: int) -> None:
        """``wait_updated(j)``, the seconds this thread is blocked on it counted in the step's
        ``optimizer_wait_seconds``."""
        assert self.wait_updated is not None
        t0 = time.perf_counter()
        self.wait_updated(j)
        self.stats.optimizer_wait_seconds += time.perf_counter() - t0

    def set_wait_updated(self, fn: Callable[[int], None] | None) -> None:
        """Wait for the pipelined optimizer: ``fn(j)`` returns once layer ``j``'s masters are
        updated (``-1 - p``: the non-block group's part ``p``); None: nothing to wait for. Called
        before a master is cast or fetched in a step's first micro-batch (the attribute
        ``wait_updated`` holds it)."""
        self.wait_updated = fn

    def set_keep_compute_copy(self, on: bool) -> bool:
        """Keep (or drop) the host compute-dtype copies (between micro-batches); returns whether
        they are kept (only where masters need a cast)."""
        if self._micro is not None:
            raise RuntimeError("set_keep_compute_copy() inside a micro-batch")
        assert self.params is not None
        self.keep_compute_copy = on
        return self.params.keep_copies(on)

    def set_rest_parts(self, parts: list[list[nn.Parameter]]) -> bool:
        """Run T's non-block work in these parts (Note: [non-block parts] in planner/schedule_windows.py;
        ``ParamStore.set_rest_parts``); kept across ``set_schedule``. False: one part (the parts
        are not runs of the packed non-block buffer)."""
        if self._micro is not None:
            raise RuntimeError("set_rest_parts() inside a micro-batch")
        assert self.params is not None
        ok = self.params.set_rest_parts(parts)
        self.rest_parts = [list(p) for p in parts] if ok else []
        return ok

    def set_placement(self, *, cast_on_device: Iterable[int] = (), widen_on_device: Iterable[int] = ()) -> dict:
        """Where each parameter group's dtype conversions run (``ParamStore.set_placement``; the plan's
        ``planner.placement.Placement``); kept across ``set_schedule``. Between micro-batches."""
        if self._micro is not None:
            raise RuntimeError("set_placement() inside a micro-batch")
        assert self.params is not None
        self.placement = self.params.set_placement(cast_on_device=cast_on_device, widen_on_device=widen_on_device)
        self.tracker = DeviceTracker()
        self._static_bytes()
        return self.placement

    def _static_bytes(self) -> None:
        """Device bytes present all step: two block slots (weights + grads), the rest's buffers and
        the copy lanes' conversion buffers (Note: [conversion on the device] in copy_engine.py)."""
        assert self.params is not None
        e = torch.empty((), dtype=self.compute_dtype).element_size()
        largest = max(self.params.group_numel(j) for j in range(len(self.stack)))
        self.tracker.add("slots", 2 * 2 * largest * e)
        self.tracker.add("rest", 2 * self.params.group_numel(REST) * e)
        if self.params.conversion_device_bytes:
            self.tracker.add("conversion", self.params.conversion_device_bytes)

    def _install(self) -> None:
        self._signatures: dict[int, inspect.Signature | None] = {}
        self._own_forward = {j: "forward" in vars(block) for j, block in enumerate(self.stack)}
        self._mutable_buffers: dict[int, dict] = {}  # block -> {train/eval key: buffers its forward changes}
        for j, block in enumerate(self.stack):
            self._orig[j] = block.forward
            try:
                self._signatures[j] = inspect.signature(block.forward)
            except (TypeError, ValueError):
                self._signatures[j] = None
            block.forward = self._make_forward(j)
        self._layer_ckpt: dict[int, Any] = {}
        layer_checkpointing.quiet(self.stack, self._layer_ckpt)  # Note: [a block's own checkpointing]

    def _make_forward(self, j: int) -> Callable:
        # The hidden state is the block's first parameter; callers may pass it by keyword
        # (``block(hidden_states=h, ...)``), the original forward then gets it positionally. A copy of the
        # block is a plain block (Note: [a copy of a streamed block] in streamed_forward.py).
        sig = self._signatures[j]
        first = next(iter(sig.parameters), None) if sig is not None else None
        block = self.stack[j]
        return StreamedForward(self._block_call, j, first, block, vars(block).get("forward"))

    def close(self) -> None:
        """Restore the blocks, free device buffers, worker threads and spill files.

        Every step runs even if an earlier one fails (a failed copy must not leave threads, spill
        files or patched blocks behind); copy failures were reported where they were waited for and
        are only logged here; any other error is raised once everything is closed."""
        errors: list[BaseException] = []

        def run(step: Callable[[], Any]) -> None:
            try:
                step()
            except CopyError as err:
                log.warning("lazytrain: closing after a failed copy: %s", err)
            except Exception as err:  # noqa: BLE001 - re-raised below, after the other steps
                errors.append(err)

        run(self.disarm)
        run(self._stop_memory)
        # inside a micro-batch, or between an accumulated step's micro-batches (the non-block bind held): the user's
        # edits of the bound copies reach the masters first (Note: [an edit of a bound copy] in bound_edits.py)
        run(self._sync_edits_quietly)
        self._micro = None
        run(self._exit.close)
        run(self._restore_blocks)
        for part in (self.acts, self.params):
            if part is not None:
                run(part.close)
        run(self.engine.close)
        if errors:
            raise errors[0]

    def _sync_edits_quietly(self) -> None:
        try:
            self.sync_edits()
        except Exception as err:  # noqa: BLE001 - closing after a failure: the failure is what is reported
            log.warning("lazytrain: closing: the non-block copies' edits could not be taken into the masters: %s", err)

    def _restore_blocks(self) -> None:
        layer_checkpointing.restore(self.stack, self._layer_ckpt)
        for j, block in enumerate(self.stack):
            if j in self._orig:
                original = self._orig.pop(j)
                if self._own_forward.get(j):
                    block.forward = original  # the block had an instance-level forward of its own
                else:
                    del block.forward  # the class's forward again (a later class-level patch is seen)

    def mark_boundary_uses(self, loss: torch.Tensor) -> int:
        """Before the backward of ``loss`` in a training micro-batch: mark the block nodes whose input is also used
        elsewhere, so each use's gradient is added as plain autograd adds it (Note: [one gradient per boundary
        use] in boundary_uses.py; the strategies call it; an engine user calls it before ``loss.backward()``).
        Returns how many were marked."""
        if self._micro is None or not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            return 0
        reached: list = []
        marked = mark_boundary_uses(loss, reached)
        # the planned passes this backward reaches (Note: [one gradient per shared input] in block_fn.py)
        self._shared.reached({ctx.j for ctx in reached if self._ctxs.get(ctx.j) is ctx})
        return marked

    def slot_of(self, j: int) -> int:
        return self.resident_slot.get(j, j % 2)

    # ---- transfers ---------------------------------------------------------------------------
    def _evict_lazy_slots(self) -> None:
        assert self.params is not None
        for slot in range(2, self.params.num_slots):
            if self.params.allocated(slot):
                self.params.evict(slot)

    def _finish_grads(self, pending: list[PendingGrads] | None = None, *, slot: int | None = None,
                      final: bool = True) -> None:
        """Complete grad D2Hs: the given ones, those from ``slot``, or all pending ones."""
        assert self.params is not None
        if pending is None:
            target = None if slot is None else self.params.slot(slot)
            pending = [p for p in self._pending_grads if target is None or p.slot is target]
        last = self._micro is not None and self._micro[1]
        for p in pending:
            # Note: [norms only when wanted]; and only of a group's step's last accumulation (layer 0's grads
            # of the previous micro-batch, sent in the last one's F0, are not: its last leave in T)
            norms = last and final and self.take_norms
            param_norms: dict[nn.Parameter, torch.Tensor] | None = {} if norms else None
            norm = self.params.finish_grads(p, norm=norms, final=last and final,
                                            extra=self._adhoc_grads.joined(p.layer), wait=False,
                                            param_norms=param_norms)
            if norm is not None:
                self.stats.layer_sq_norms[p.layer] = norm
                self.stats.grad_norms[p.layer] = param_norms  # filled by the host lane
            if p in self._pending_grads:
                self._pending_grads.remove(p)

    def _flush_adhoc_grads(self) -> None:
        """Ad-hoc gradients that met no planned ones (layer 0 between micro-batches of a step, a
        layer whose planned grads went first, a later backward call's: Note: [ad-hoc gradients per backward
        call]) go straight to the host grads."""
        self._add_adhoc_grads(list(self._adhoc_grads.remaining()))

    def _add_adhoc_grads(self, taken: list[tuple[int, torch.Tensor, frozenset]]) -> None:
        """Add ad-hoc gradients (layer, flat gradients, parameters touched) to the host grads, in order."""
        assert self.params is not None
        if taken:
            self.params.wait_host()  # after the host lane's accumulations, in order
        for j, grads, touched in taken:
            self.params.renew_aliased_host_grads(j)  # Note: [a kept gradient] (kept_grads.py)
            self.params.accumulate_host(j, grads, touched)
            self.stats.late_groups.add(j)
