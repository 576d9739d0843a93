"""The micro-batch protocol of the executor (a mixin of ``Executor``, executor.py: it reads the executor's
schedule, stores and per-micro-batch state, and calls its helpers).

One training micro-batch's life: ``arm`` (begin it at the model's next call, ``_armed_call``) or
``begin_microbatch`` (reset the per-micro-batch state; in a step's first micro-batch also the step's
stats, trace and memory measurement, and window T's last ops: stage the updated non-block weights and
layer 0, bind the non-block weights for the step), then ``end_microbatch`` (the windows the backward did
not reach, the grads' completion, and after the step's last micro-batch window T's transfers and the
step's ``StepStats``) or ``abort_microbatch`` (a micro-batch whose backward never ran). ``inference``
is evaluation outside a micro-batch (also between an accumulated step's micro-batches);
``late_grads`` says whether a group's gradients may change after its final accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_lazytrain.engine import layer_checkpointing
from lightning_lazytrain.engine.adhoc_grads import AdhocGrads
from lightning_lazytrain.engine.armed_hook import ArmedHook
from lightning_lazytrain.engine.block_fn import SharedInputs
from lightning_lazytrain.engine.live_bytes import reset_cuda_peak
from lightning_lazytrain.engine.param_store import REST
from lightning_lazytrain.engine.shared_args import SharedWrites
from lightning_lazytrain.engine.step_stats import StepStats
from lightning_lazytrain.engine.trace import DeviceTracker, StepTrace
from lightning_lazytrain.engine.user_grad_hooks import has_post_accumulate_hooks

if TYPE_CHECKING:
    from torch import nn

    from lightning_lazytrain.engine.activation_store import ActivationStore
    from lightning_lazytrain.engine.block_fn import BlockContext
    from lightning_lazytrain.engine.block_io import ForwardState
    from lightning_lazytrain.engine.blocks import BlockStack
    from lightning_lazytrain.engine.copy_engine import CopyEngine
    from lightning_lazytrain.engine.early_parts import EarlyParts
    from lightning_lazytrain.engine.internals import OffloadedInternals
    from lightning_lazytrain.engine.param_store import ParamStore, PendingGrads
    from lightning_lazytrain.engine.partial_keep import PartialForward
    from lightning_lazytrain.engine.window_memory import WindowMemory
    from lightning_lazytrain.planner.schedule import Schedule

__all__ = ["MicroBatchProtocol"]


class MicroBatchProtocol:
    """The micro-batch protocol of ``Executor`` (see the module doc); the attributes are the executor's."""

    module: nn.Module
    schedule: Schedule
    stack: BlockStack
    device: torch.device
    engine: CopyEngine
    params: ParamStore | None
    acts: ActivationStore | None
    stats: StepStats
    tracker: DeviceTracker
    trace: StepTrace
    profiling: bool
    tracker_time_out: bool
    take_norms: bool
    wait_updated: Callable[[int], None] | None
    _micro: tuple[bool, bool] | None
    _armed: tuple[bool, bool] | None
    _arm_handles: list
    _between_microbatches: bool
    _exit: contextlib.ExitStack
    _shared_checked: bool
    _layer_ckpt: dict[int, Any]
    _adhoc_used: bool
    _post_hooks: bool
    _serial: int
    _early: EarlyParts | None
    _mem: WindowMemory | None

    @property
    def in_microbatch(self) -> bool:
        return self._micro is not None

    @property
    def evaluating_mid_step(self) -> bool:
        """An evaluation between an accumulated step's micro-batches is running (``inference``)."""
        return self._between_microbatches

    def arm(self, *, first: bool = True, last: bool = True) -> None:
        """Begin the next micro-batch when the model is next called (a non-block module or a block).

        Manual optimization: between a backward and the next forward the user may step optimizers
        and read parameters, which must then be the host masters with their host grads; staging
        waits for the call that needs the weights."""
        if self._micro is not None:
            raise RuntimeError("arm() inside a micro-batch")
        assert self.params is not None
        self.disarm()
        self._armed = (first, last)
        hook = ArmedHook(self._armed_call)
        self._arm_handles = [m.register_forward_pre_hook(hook) for m in self.params.site_modules(REST)]

    def disarm(self) -> None:
        for h in self._arm_handles:
            h.remove()
        self._arm_handles, self._armed = [], None

    def _armed_call(self, module: Any = None, args: Any = None) -> None:
        first, last = self._armed  # type: ignore[misc]
        self.begin_microbatch(first=first, last=last)

    @property
    def armed(self) -> bool:
        """A micro-batch is armed (``arm``) and has not begun: the model was not called since."""
        return self._armed is not None

    def begin_armed(self) -> None:
        """Begin the armed micro-batch now (a step's last micro-batch whose training_step never called the
        model: it ends as one no gradient reached)."""
        self._armed_call()

    def sync_edits(self) -> int:
        """Note: [an edit of a bound copy] (bound_edits.py): user edits of the bound non-block copies into their
        masters now (in a micro-batch, between an accumulated step's, in evaluation); how many."""
        return self.params.sync_edits() if self.params is not None else 0

    def reach_mark(self) -> tuple[int, int]:
        """What backwards have reached of the model so far (block backwards, gradients into bound copies): a
        backward that leaves it unchanged reached nothing of the model (Note: [a backward that reaches nothing])."""
        assert self.params is not None
        return sum(self._backprops.values()) if self._micro is not None else 0, self.params.arrivals

    @property
    def backward_ran(self) -> bool:
        """A micro-batch is open and a backward reached its blocks (it was not ended yet)."""
        return self._micro is not None and bool(self._backprops)

    @contextlib.contextmanager
    def step_inside(self, params: Any) -> Any:
        """Note: [a step inside a micro-batch] (core/microbatches.py): an optimizer updates these masters while
        the micro-batch is open. Before, the queued copies finish (none still reads a master the step writes);
        after, the non-block copies bound for the micro-batch take their new values, and a block staged again
        from here casts the masters again."""
        assert self.params is not None
        if self._micro is None:
            yield
            return
        self.engine.synchronize()
        self.params.sync_edits()  # Note: [an edit of a bound copy]: an edit before the step, then the step
        self._note_stepped_blocks(params)
        yield
        self.params.invalidate_copies()
        self.params.refresh_bound(params)

    def _note_stepped_blocks(self, params: Any) -> None:
        """Note: [a step inside a micro-batch]: blocks whose forward ran in this micro-batch and whose weights the
        step will change (a gradient is there) refuse their backward, as ``auto`` refuses it."""
        assert self.params is not None
        ids = {id(p) for p in params if p.grad is not None}
        for j, ctx in self._ctxs.items():
            if any(id(p) in ids for p in self.params.group_parameters(j)):
                ctx.stepped = True

    def abort_microbatch(self) -> None:
        """Drop a micro-batch whose backward never ran (e.g. a skipped training step)."""
        if self._micro is None:
            return
        self._stop_memory()
        assert self.acts is not None
        self._watch_early_parts(False)
        self._finish_grads()
        self.params.sync_edits()  # Note: [an edit of a bound copy] (bound_edits.py)
        self._exit.close()
        self._evict_lazy_slots()
        self._internals = {}
        self._partial = {}
        self.acts.end_step()
        self.engine.synchronize()
        self._micro = None
        self.tracker = DeviceTracker()
        self._static_bytes()

    @contextlib.contextmanager
    def inference(self):
        """Evaluation outside training: the non-block weights are staged and bound (no grads);
        blocks stream through the slots (``torch.no_grad``/``inference_mode`` forwards). Between the
        micro-batches of an accumulated step (validation after a micro-batch that is not the step's
        last) the non-block weights stay bound as the step bound them -- the masters they were staged
        from do not change within a step -- and their device gradients keep what the step accumulated."""
        assert self.params is not None
        if self._micro is not None:
            raise RuntimeError("inference() inside a training micro-batch")
        self.params.invalidate_copies()  # the masters may have changed since the last micro-batch
        if self.params.is_bound(REST):
            # the blocks stream through the re-run slot (_stream_only): slot 0 still holds layer 0's
            # gradients, which the next micro-batch's F0 sends
            self._between_microbatches = True
            self.stats.evaluated_mid_step = True
            try:
                with self.engine.paused_stats():  # not the step's copies
                    yield
            finally:
                self._between_microbatches = False
            return
        self.params.stage(REST).wait()
        with self.params.bind(REST, grads=False, watch_edits=True):
            try:
                yield
            finally:  # Note: [an edit of a bound copy]: an edit in evaluation (Embedding's max_norm renorm) too
                self.params.sync_edits()

    def begin_microbatch(self, *, first: bool = True, last: bool = True) -> None:
        assert self.params is not None
        if self._micro is not None:
            raise RuntimeError("begin_microbatch() twice without end_microbatch()")
        self.disarm()
        layer_checkpointing.quiet(self.stack, self._layer_ckpt)  # Note: [a block's own checkpointing]
        self.params.invalidate_copies()  # Note: [kept compute copy]: valid for one micro-batch
        self._micro = (first, last)
        self._windows = {w.name: w for w in self.schedule.windows(first_microbatch=first, last_microbatch=last)}
        self._saved: dict[int, torch.Tensor] = {}
        self._recomputed: dict[int, torch.Tensor] = {}
        self._calls: dict[int, tuple] = {}
        self._forwarded: set[int] = set()  # blocks the planned pass has run (a second pass is ad hoc)
        self._shared_writes = SharedWrites(active=not self._shared_checked)  # Note: [containers the blocks share]
        self._unreachable: set[int] = set()  # ... of which no gradient can reach (Note: [blocks no gradient reaches])
        self._serial += 1
        self._b_next = len(self.stack) - 1  # the next backward window (Note: [unreached blocks])
        self._backprops: dict[int, int] = {}  # block -> backwards run in this micro-batch (planned, ad hoc)
        self._ctxs: dict[int, BlockContext] = {}  # block -> its planned pass's node, until its backward window
        self.params.post_hooks.reset()
        self._watch_early_parts(last)
        self._adhoc_grads = AdhocGrads()  # Note: [ad-hoc gradients per backward call]
        self._shared = SharedInputs()  # Note: [one gradient per shared input] (block_fn.py)
        if first:
            self._adhoc_used = False
            self._post_hooks = has_post_accumulate_hooks(self.module.parameters())
        self._pending_offload: dict[int, torch.Tensor] = {}
        self._internals: dict[int, OffloadedInternals] = {}  # Note: [offloaded internals] in engine/internals.py
        self._partial: dict[int, PartialForward] = {}  # Note: [partial keep] in engine/partial_keep.py
        self._pending_grads: list[PendingGrads] = []
        self._retiring: list[int] = []  # resident layers whose gradient D2H was issued
        self._call_storages: dict[int, int] = {}  # see StepStats.call_bytes
        self._states: dict[int, ForwardState] = {}
        if first:
            self.engine.synchronize()
            self.engine.reset_stats()
            self.stats = StepStats()
            self.tracker.reset_peak()
            sync = torch.cuda.synchronize if self.device.type == "cuda" and self.profiling else None
            self.trace = StepTrace(stamp=self.engine.stamp, resolve=self.engine.stamp_seconds, sync=sync,
                                   overhead=self._tracker_seconds if self.tracker_time_out else None)
            if self.device.type == "cuda":  # a new peak per step, the run's kept (Note: [peaks across resets])
                reset_cuda_peak(self.device)
            self._start_memory()
            self._window("T")
            # T's last ops: the updated non-block weights (part by part, each as soon as its update is
            # done: Note: [non-block parts]) and layer 0's; the rest stays bound for the step
            parts = len(self.params.rest_parts)
            for p in range(parts):
                if self.wait_updated is not None:
                    self._wait_for_update(-1 - p)  # REST, or its part p
                # first: the embedding needs it first; bind makes compute wait for it
                self.params.stage(REST, part=p if parts > 1 else None)
            if self.wait_updated is not None:
                self._wait_for_update(0)
            self._stage(0)
            if self.wait_updated is not None and self.schedule.optimizer == "pipelined":
                for j in self.schedule.serial_layers:  # the per-layer mode: T ends when their updates do
                    self._wait_for_update(j)
            self._exit.enter_context(self.params.bind(REST, grads=True, follow_requires_grad=True, watch_edits=True))
        self._memory_window("F0")

    def end_microbatch(self) -> StepStats | None:
        """Finish the micro-batch; on the last one, run T's transfers and return the step's stats."""
        assert self.params is not None and self.acts is not None
        if self._micro is None:
            raise RuntimeError("end_microbatch() without begin_microbatch()")
        first, last = self._micro
        self._shared_checked = self._shared_checked or bool(self._shared_writes.written)  # none was read: done
        if self._forwarded:  # Note: [unreached blocks]: windows the backward did not reach
            for t in range(self._b_next, -1, -1):
                self._pass_backward_window(t, rerun=False)
        self._shared.check_delivered()  # Note: [one gradient per shared input] (block_fn.py)
        # the step's blocks no gradient reached in any of its micro-batches (the profile's no_backward)
        self.stats.no_backward = set(self._unreachable) if first else self.stats.no_backward & self._unreachable
        self._finish_grads()
        self._retire_residents()
        if not last:
            self._flush_adhoc_grads()
            self.params.sync_edits()  # Note: [an edit of a bound copy] (bound_edits.py); the bind lasts the step
            self.params.wait_host()  # the host grads hold this micro-batch's gradients when it ends
            self.params.reconcile_outside_grads()  # Note: [a master used outside its block]
            self.params.post_hooks.fire()  # Note: [gradient hooks on streamed parameters]
            self._micro = None
            return None
        self._window("T")
        self._finish_grads([self.params.send_grads(0, self.slot_of(0))])
        self._retire_residents(0)  # layer 0's slot lives on between the micro-batches of a step
        self._flush_adhoc_grads()
        self.params.run_shared_tensor_hooks()  # Note: [gradient hooks on streamed parameters]
        early = self._early.sent if self._early is not None else set()  # Note: [early non-block parts]
        if self.take_norms:
            self.stats.grad_norms[REST] = {}
            self.stats.layer_sq_norms[REST] = self.params.write_back_grads(REST, param_norms=self.stats.grad_norms[REST],
                                                                           skip=early)
        else:  # Note: [norms only when wanted]
            self.params.write_back_grads(REST, norm=False, final=True, skip=early)
        if self._early is not None and self._early.late:
            self.stats.late_groups.add(REST)
        self._watch_early_parts(False)
        self.params.sync_edits()  # Note: [an edit of a bound copy] (bound_edits.py)
        self._exit.close()
        self.acts.end_step()
        self.engine.synchronize()
        self.params.reconcile_outside_grads()  # Note: [a master used outside its block]
        self._micro = None
        self.stats.lane_bytes = self.engine.bytes_moved
        self.stats.peak_tracked_bytes = self.tracker.peak
        if self._mem is not None:  # Note: [untracked device bytes] in window_memory.py
            self._mem.finish(self.tracker, self.stats)
        self._stop_memory()
        if self.device.type == "cuda":
            self.stats.max_memory_allocated = max(self.stats.real_peak_bytes,
                                                  torch.cuda.max_memory_allocated(self.device))
            self.stats.max_memory_reserved = int(torch.cuda.max_memory_reserved(self.device))
        self.stats.segments = self.trace.segments(self.engine.records())
        # the user's post-accumulate-grad hooks see the step's host grads (Note: [gradient hooks on
        # streamed parameters]); what they do to them comes after the norms were taken
        hooks_ran = self.params.post_hooks.fire() > 0
        if self._adhoc_used or hooks_ran:  # (so did ad-hoc backwards' additions)
            self.stats.layer_sq_norms, self.stats.grad_norms = {}, {}
        if hooks_ran:  # any group's gradients may have changed
            self.stats.late_groups.update([REST, *range(len(self.stack))])
        return self.stats

    @property
    def late_grads(self) -> bool:
        """In this step, a group's gradients may change after its final accumulation: an ad-hoc
        pass added to them, or the user's post-accumulate-grad hooks run when the micro-batch ends.
        Several processes then average the gradients after the micro-batch, not group by group as
        they complete (core/grad_sync.py, Note: [overlapped all-reduce])."""
        return self._adhoc_used or self._post_hooks
