"""How a call of a block becomes its pass (a mixin of ``Executor``, executor.py: it reads the executor's
schedule, stores and per-micro-batch state).

``_block_call`` is what a block's ``forward`` runs once the executor installed it: outside a training
micro-batch (evaluation, a no-grad forward) the weights only stream through the slots (``_stream_only``);
inside one, the block's planned pass through its node (``block_fn.BlockFunction``, Note: [the block node]),
an ad-hoc pass for a block the planned pass already ran, or, for a block no gradient reaches, the planned
forward window without the node (Note: [blocks no gradient reaches]). The helpers the window mixins share
are here too: ``_run_block`` (the block's own forward), ``_store_call`` (the call kept for re-runs),
``_not_internals`` and ``_stage``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_lazytrain.engine.block_fn import BlockContext, BlockFunction, TrainableReads, run_block
from lightning_lazytrain.engine.boundary_uses import EXTRA_INPUT_SLOTS
from lightning_lazytrain.engine.block_io import BlockCall, BlockOutput, rerun_call
from lightning_lazytrain.engine.eval_grads import guard_outputs
from lightning_lazytrain.engine.kv_cache_grads import cache_arguments, mark_cache_layer, refuse_cache_with_grad
from lightning_lazytrain.engine.forward_windows import RECOMPUTE_SLOT

if TYPE_CHECKING:
    from lightning_lazytrain.engine.blocks import BlockStack
    from lightning_lazytrain.engine.param_store import ParamStore
    from lightning_lazytrain.engine.shared_args import SharedWrites
    from lightning_lazytrain.engine.step_stats import StepStats
    from lightning_lazytrain.planner.schedule import Schedule

__all__ = ["BlockCalls"]


class BlockCalls:
    """The block calls of ``Executor`` (see the module doc); the attributes are the executor's."""

    schedule: Schedule
    stack: BlockStack
    device: torch.device
    params: ParamStore | None
    stats: StepStats
    optimized_ids: frozenset[int]
    wait_updated: Callable[[int], None] | None
    _armed: tuple[bool, bool] | None
    _micro: tuple[bool, bool] | None
    _between_microbatches: bool
    _forwarded: set[int]
    _unreachable: set[int]
    _reads: TrainableReads | None
    _reads_trainable: set[int]
    _anchor: torch.Tensor
    _orig: dict[int, Callable]
    _signatures: dict
    _calls: dict[int, tuple]
    _call_storages: dict[int, int]
    _shared_writes: SharedWrites

    def _block_call(self, j: int, x: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        if self._armed is not None:
            self._armed_call()
        if self._micro is None or not torch.is_grad_enabled():
            return self._stream_only(j, x, args, kwargs)
        call, routed = BlockCall.pack(args, kwargs)
        # A block the planned pass already ran in this micro-batch (a second forward before the
        # backward: manual optimization, several losses) runs ad hoc: self-contained, exact, unplanned.
        adhoc = j in self._forwarded
        if not adhoc and len(self._forwarded) != j:  # the planned pass streams the blocks in the stack's order
            skipped = [i for i in range(j) if i not in self._forwarded]
            raise RuntimeError(
                f"strategy='lazytrain': block {j} of {self.stack.path!r} was called in a training forward after "
                f"block(s) {sorted(self._forwarded)}, without {skipped or 'them in order'} (the model skips or "
                "reorders blocks: LayerDrop, early exit, a custom order). "
                "The plan streams every block in the stack's order once per forward. Fix: turn the skipping off "
                "for training (e.g. the config's layerdrop=0), call every block in order, or train this model "
                "with another strategy")
        caches = cache_arguments(self._signatures.get(j), args, kwargs)  # Note: [gradients through a KV cache]
        where = f"block {j} of {self.stack.path!r}"
        refuse_cache_with_grad(caches, j, where)
        self._forwarded.add(j)
        watch = self._shared_writes.watch(call, kwargs)  # Note: [containers the blocks share] (shared_args.py)
        node = BlockContext(j)  # Note: [the block node] (block_fn.py)
        with self._shared_writes.reads(j, self.stack.path):
            outs = self._pass(j, node, call, adhoc, x, routed)
        self._shared_writes.after(j, watch)
        if caches and outs[0].requires_grad:
            mark_cache_layer(caches, j, where, outs[0])
        spec = node.take_output()
        return spec.build(outs[0], outs[1:1 + len(spec.routed)])

    def _pass(self, j: int, node: BlockContext, call: BlockCall, adhoc: bool, x: torch.Tensor, routed: list) -> Any:
        """Block ``j``'s planned (or ad-hoc) pass through its node, or without it where no gradient reaches it."""
        node.n_routed = len(routed)
        node.extra_inputs = EXTRA_INPUT_SLOTS if x.requires_grad else 0  # Note: [one gradient per boundary use]
        node.routed_extra = EXTRA_INPUT_SLOTS  # routed tensors all require grad (BlockCall.pack)
        extra = [x] * node.extra_inputs + [r for r in routed for _ in range(node.routed_extra)]
        if not adhoc and not self._reachable(j, x, routed):  # Note: [blocks no gradient reaches]
            self._unreachable.add(j)
            reads = self._reads = TrainableReads()  # around the block's own forward (forward_window)
            try:
                with torch.no_grad():  # as inside the node's forward; its output requires no grad, as under autograd
                    outs = self.forward_window(node, call, x, routed)
            finally:
                self._reads = None
            if reads.seen is not None:  # it read a trainable tensor it does not own: the node over what ran
                self._unreachable.discard(j)
                self._reads_trainable.add(j)
                node.precomputed = list(outs)
                outs = BlockFunction.apply(self, node, call, adhoc, x, self._anchor, *routed, *extra)
            return outs
        return BlockFunction.apply(self, node, call, adhoc, x, self._anchor, *routed, *extra)

    # Note: [blocks no gradient reaches] A block whose input requires no grad (nor any tensor routed into it:
    # BlockCall.pack routes those) and none of whose weights does -- a frozen first part of the stack, a
    # frozen embedding below it; every block of a head-only fine-tune -- gets no backward under plain
    # autograd: its output requires no grad, and the backward stops above it. Its planned pass then runs
    # without the node (the anchor would make autograd call the node's backward): the forward window as
    # planned, under no_grad, and at the micro-batch's end its backward window passes as an unreached
    # one's does (``_pass_backward_window``: the planned transfers, no compute), without counting it as
    # unreached. A frozen block's backward and re-runs cost nothing, its weights are not fetched again
    # for the backward (but layer 0's, which the next micro-batch's F0 reads from its slot), and the
    # profiled step records it (``StepStats.no_backward``): the plan prices its B windows as they run,
    # no compute, no re-run and no second fetch (Note: [layers without a backward] in planner/workload.py).
    # A weight shared by blocks keeps every block on the node,
    # and so does a frozen weight an optimizer holds (``optimized_ids``, set by the training core): it is
    # frozen for this pass only (``toggle_optimizer``: a GAN's generator during its critic's step), and a
    # profile of such a pass would price no backward for blocks that run one in the other passes. A block
    # whose code reads a trainable tensor it does not own (a parameter of the model captured by the block)
    # is caught as it runs (``TrainableReads``): the node is then made over the window that ran (its
    # outputs, ``BlockContext.precomputed``), so its backward re-runs the block as for any block that kept
    # no internals and the tensor gets its gradient; the block keeps its node for the rest of the run.
    def _reachable(self, j: int, x: torch.Tensor, routed: list) -> bool:
        """Can a gradient reach block ``j``'s forward on ``x`` (Note: [blocks no gradient reaches])?"""
        assert self.params is not None
        if x.requires_grad or routed or self.params.shared_across_blocks or j in self._reads_trainable:
            return True
        return any(p.requires_grad or id(p) in self.optimized_ids for p in self.params.group_parameters(j))

    def _fetched_for_backward(self, u: int) -> bool:
        """Does a backward window fetch layer ``u``'s weights? Not for a block no gradient reaches (Note:
        [blocks no gradient reaches]: its backward window passes without compute), except layer 0, whose
        slot serves the next micro-batch's F0."""
        return u == 0 or u not in self._unreachable

    def _run_block(self, j: int, x: torch.Tensor, call: BlockCall, routed: list, *, first: bool,
                   rerun: bool = True) -> tuple[BlockOutput, list[torch.Tensor]]:
        """Block j's own forward on ``x`` (``block_fn.run_block``): its output structure and the
        node's outputs."""
        return run_block(self._orig[j], self.stack[j], self.stack.block_path(j), x, call, routed,
                         first=first, rerun=rerun)

    def _store_call(self, j: int, call: BlockCall, routed: list) -> None:
        """Keep the call for re-runs: KV caches dropped, routed tensors detached."""
        args, kwargs = rerun_call(self._signatures.get(j), *call.build(routed), j=j)
        rcall, rrouted = BlockCall.pack(args, kwargs)
        self._calls[j] = (rcall, [t.detach() for t in rrouted])
        for t in (*rrouted, *rcall.leaves):
            if isinstance(t, torch.Tensor) and t.device == self.device:
                storage = t.untyped_storage()
                self._call_storages[storage.data_ptr()] = storage.nbytes()
        self.stats.call_bytes = max(self.stats.call_bytes, sum(self._call_storages.values()))

    def _not_internals(self, x: torch.Tensor) -> set[int]:
        """Storages a block's saved tensors may view that are not its internals: its input (a
        boundary, with a home of its own) and the tensors of the micro-batch's block calls (rotary
        tables, masks, encoder states: ``StepStats.call_bytes``, static in the plan)."""
        return {x.untyped_storage().data_ptr(), *self._call_storages}

    def _stream_only(self, j: int, x: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """Evaluation: stream the weights through the two slots, keep nothing. Inside a training
        micro-batch (a no-grad forward in ``training_step``), or between an accumulated step's
        micro-batches, the slots belong to the planned pass: stream through the recompute slot instead."""
        assert self.params is not None
        if self._micro is not None or self._between_microbatches:
            if (self._micro is not None and self.schedule.optimizer == "pipelined" and self._micro[0]
                    and self.wait_updated is not None):
                self._wait_for_update(j)  # the pipelined step may still be updating layer j's masters
            self.params.stage(j, RECOMPUTE_SLOT)
            try:
                with self.params.bind(j, RECOMPUTE_SLOT, grads=False), torch.no_grad():
                    out = self._orig[j](x, *args, **kwargs)
            finally:
                self.params.evict(RECOMPUTE_SLOT)
            return self._guard_evaluation(j, out, x, args, kwargs)
        if j == 0 or not self.params.staged(j, j % 2):
            self.params.stage(j, j % 2)
        if j + 1 < len(self.stack):
            self.params.stage(j + 1, (j + 1) % 2)
        with self.params.bind(j, j % 2, grads=False), torch.no_grad():
            out = self._orig[j](x, *args, **kwargs)
        return self._guard_evaluation(j, out, x, args, kwargs)

    def _guard_evaluation(self, j: int, out: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """Note: [weights in evaluation] (eval_grads.py): with grad enabled, the outputs of a block streamed
        outside a training step require grad where autograd's would, and a gradient that reaches them is refused
        by name (Note: [gradients through streamed evaluation])."""
        if not torch.is_grad_enabled():
            return out
        assert self.params is not None
        inputs = [t for t in (x, *args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        return guard_outputs(out, f"block {j} of {self.stack.path!r}", [*inputs, *self.params.group_parameters(j)])

    def _stage(self, j: int, slot: int | None = None) -> None:
        # Staging writes the slot's weights only; a gradient D2H still reading the slot's grad
        # buffer may continue (it is finished before the next bind with grads zeroes that buffer).
        assert self.params is not None
        self.params.stage(j, self.slot_of(j) if slot is None else slot)
