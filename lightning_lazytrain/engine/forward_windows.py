"""The forward side of the executor's block node (a mixin of ``Executor``, executor.py: it reads the
executor's schedule, stores and per-micro-batch state, and calls its helpers).

``forward_window`` runs window F{j}, block ``j``'s planned pass: the window's transfers (offloads of
boundaries and kept internals, weight prefetches, the grads of the previous micro-batch's layer 0), the
input boundary stored per its home, and the block with no grad, or keeping its internals (whole,
offloaded: Note: [offloaded internals] in internals.py; or its matmul outputs only: Note: [partial keep]
in partial_keep.py, ``_partial_forward``); after the last block it issues window H's transfers.
``adhoc_forward`` runs a further forward of a block the planned pass already ran in this micro-batch
(exact, unplanned; its backward is ``BackwardWindows.adhoc_backward``, backward_windows.py).

``RECOMPUTE_SLOT`` (the recompute buffer's slot, which an ad-hoc pass borrows) and ``_most`` (a step's
figure: its largest micro-batch's) are used on both sides: the backward side and the executor import
them from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_lazytrain.engine.block_fn import AdhocPass, BlockContext, KeptGraph, WeightTokenHooks
from lightning_lazytrain.engine.block_io import BlockCall, BlockOutput, ForwardState, rerun_call
from lightning_lazytrain.engine.internals import OffloadedInternals
from lightning_lazytrain.engine.partial_keep import PartialForward

if TYPE_CHECKING:
    from lightning_lazytrain.engine.activation_store import ActivationStore
    from lightning_lazytrain.engine.block_fn import SharedInputs, TrainableReads
    from lightning_lazytrain.engine.blocks import BlockStack
    from lightning_lazytrain.engine.param_store import ParamStore, PendingGrads
    from lightning_lazytrain.engine.step_stats import StepStats
    from lightning_lazytrain.engine.trace import DeviceTracker, StepTrace
    from lightning_lazytrain.planner.schedule import Schedule

__all__ = ["RECOMPUTE_SLOT", "ForwardWindows"]

RECOMPUTE_SLOT = 2


class ForwardWindows:
    """The forward windows of ``Executor`` (see the module doc); the attributes are the executor's."""

    schedule: Schedule
    stack: BlockStack
    device: torch.device
    params: ParamStore | None
    acts: ActivationStore | None
    stats: StepStats
    tracker: DeviceTracker
    trace: StepTrace
    resident_slot: dict[int, int]
    wait_updated: Callable[[int], None] | None
    _micro: tuple[bool, bool] | None
    _serial: int
    _adhoc_used: bool
    _reads: TrainableReads | None
    _signatures: dict
    _mutable_buffers: dict[int, dict]
    _windows: dict
    _ctxs: dict[int, BlockContext]
    _shared: SharedInputs
    _unreachable: set[int]
    _saved: dict[int, torch.Tensor]
    _calls: dict[int, tuple]
    _states: dict[int, ForwardState]
    _pending_offload: dict[int, torch.Tensor]
    _internals: dict[int, OffloadedInternals]
    _partial: dict[int, PartialForward]

    # ---- the block node's runner, forward (block_fn.BlockRunner; Note: [the block node]) --------
    def forward_window(self, ctx: BlockContext, call: BlockCall, x: torch.Tensor,
                       routed: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Window F{j} for block ``ctx.j``'s planned pass; returns the node's outputs."""
        assert self.params is not None and self.acts is not None
        s, L, j = self.schedule, len(self.stack), ctx.j
        name = f"F{j}"
        ctx.serial = self._serial
        self._ctxs[j] = ctx
        self._settle_offloads(j)  # before the mark: the plan frees boundaries offloaded before F{j}
        self._window(name)
        sent: list[PendingGrads] = []
        self._store_call(j, call, routed)
        ctx.routed_keys = self._shared.share(j, routed)
        _most(self.stats.boundary_bytes, j, self._nbytes(x))
        for op in self._windows[name].ops:
            if op.lane == "d2h" and op.kind == "offload":
                src = x if op.index == j else self._pending_offload.pop(op.index)
                with self._host_side():
                    self.acts.offload(op.index, src.detach(), s.homes[op.index])
                self.tracker.add(f"offload{op.index}", self._nbytes(src))
            elif op.lane == "d2h" and op.kind == "offload_internals":
                if op.index in self._unreachable:  # it kept none (Note: [blocks no gradient reaches])
                    continue
                with self._host_side():
                    self._internals[op.index].offload(self.acts)
            elif op.lane == "h2d" and op.kind == "weights":
                if s.optimizer == "pipelined" and self._micro[0] and self.wait_updated is not None:
                    self._wait_for_update(op.index)
                self._stage(op.index)
                if op.index in self.resident_slot:
                    self.tracker.add(f"resident{op.index}", self.params.slot_bytes(op.index, self.slot_of(op.index)))
            elif op.lane == "d2h" and op.kind == "grads":
                sent.append(self.params.send_grads(op.index, self.slot_of(op.index)))
        # their host-lane accumulation queues after the window's casts; layer 0's grads of the previous
        # micro-batch are not the step's last ones (its last leave in T)
        self._finish_grads(sent, final=False)
        home = s.homes[j]
        if home == "gpu":
            self._saved[j] = x.detach()
            self.tracker.add(f"boundary{j}", self._nbytes(x))
        elif home in ("cpu", "nvme") and s.offload_window[j] > j:
            self._pending_offload[j] = x.detach()
        slot = self.slot_of(j)
        # a block no gradient reaches keeps no internals: no backward will read them (Note: [blocks no
        # gradient reaches]); the profile then measures none for it
        partial = s.partial_keep[j] and j not in self._unreachable
        keep = (s.keep_internals[j] or partial) and j not in self._unreachable
        if keep:
            self._finish_grads(slot=slot)  # bind with grads zeroes the slot's grad buffer
        state = self._states[j] = ForwardState.capture(self.device)
        # bind first: a wait for the weights is a stall on the timeline, not forward compute
        with self.params.bind(j, slot, grads=keep), self.trace.timed(name, "forward", j), \
                state.watch_buffers(self.stack[j], self._mutable_buffers.setdefault(j, {})):
            if keep:
                xg = x.detach().requires_grad_()
                rin = [t.detach().requires_grad_() for t in routed]
            if partial:  # Note: [partial keep]
                spec, outs = self._partial_forward(j, call, x, xg, rin)
            elif keep:
                weights, count = (lambda: self.params.slot_weights(j, slot)), \
                    (lambda n: self.tracker.add(f"internals{j}", n))
                if s.internals_offload_window[j] is not None:
                    moving = self._internals[j] = OffloadedInternals(j, self.device, weights, count,
                                                                     self._not_internals(x))
                    pack, unpack = moving.pack, moving.unpack_with(self.acts)
                else:
                    hooks = WeightTokenHooks(weights, count, skip=self._not_internals(x))
                    pack, unpack = hooks.pack, hooks.unpack
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    spec, outs = self._run_block(j, xg, call, rin, first=True,
                                                 rerun=s.homes[j + 1] == "recompute")
            if keep:
                # Roots of the kept graph: the hidden state and routed outputs are returned detached;
                # hook-captured tensors must be returned as the very objects the hooks stored, so an
                # alias keeps their graph (the node's apply re-points the objects' history).
                n_struct = 1 + len(spec.routed)
                with torch.enable_grad():
                    roots = outs[:n_struct] + [torch.ops.aten.alias(t) for t in outs[n_struct:]]
                ctx.kept = KeptGraph.of(xg, rin, roots)  # Note: [kept roots hold no data]
                del roots
                outs = [t.detach() for t in outs[:n_struct]] + outs[n_struct:]
            else:
                with self._reads if self._reads is not None else contextlib.nullcontext():
                    spec, outs = self._run_block(j, x, call, routed, first=True)
        ctx.output, ctx.n_outputs = spec, len(outs)
        out = outs[0]
        if partial:
            _most(self.stats.partial_bytes, j, self._partial[j].nbytes)
        elif keep:
            _most(self.stats.internal_bytes, j, self.tracker.by_owner.get(f"internals{j}", 0) + self._nbytes(x))
        if j == L - 1:
            _most(self.stats.boundary_bytes, L, self._nbytes(out))
            self._settle_offloads(L)
            self._window("H")
            self._issue_transfers("H")
        return tuple(outs)

    def _partial_forward(self, j: int, call: BlockCall, x: torch.Tensor, xg: torch.Tensor,
                         rin: list) -> tuple[BlockOutput, list[torch.Tensor]]:
        """Block j's forward under selective checkpointing (Note: [partial keep]): its matmul outputs
        are kept (counted as ``partial{j}``); ``B{j}``'s backprop re-runs the rest with the stored
        re-run call, hooks silenced, the forward's state replayed."""
        rcall = self._calls[j][0]  # the re-run call (KV caches as the block found them)
        pf = self._partial[j] = PartialForward(j, self.device, lambda n: self.tracker.add(f"partial{j}", n),
                                               self._not_internals(x))
        spec: list[BlockOutput] = []

        def forward(xx: torch.Tensor, rr: list) -> list[torch.Tensor]:
            out_spec, outs = self._run_block(j, xx, call, rr, first=True, rerun=True)
            spec.append(out_spec)
            return outs

        def rerun(xx: torch.Tensor, rr: list) -> list[torch.Tensor]:
            with self._states[j].replay():
                return self._run_block(j, xx, rcall, rr, first=False)[1]

        outs = pf.run(forward, rerun, xg, rin)
        return spec[0], outs

    def adhoc_forward(self, ctx: BlockContext, call: BlockCall, x: torch.Tensor,
                      routed: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """A further forward pass of block ``ctx.j`` in the same micro-batch: weights through the
        recompute slot, input kept on the device, re-run and gradients to the host in its own
        backward. Exact, synchronous and not part of the plan (its memory and time are not predicted)."""
        assert self.params is not None
        j = ctx.j
        self._adhoc_used = True  # from here on (core/grad_sync.py: Note: [overlapped all-reduce])
        ctx.serial = self._serial
        state = ForwardState.capture(self.device)
        args, kwargs = rerun_call(self._signatures.get(j), *call.build(routed), j=j)  # before the cache grows
        rcall, rrouted = BlockCall.pack(args, kwargs)
        self.params.stage(j, RECOMPUTE_SLOT)
        try:
            with self.params.bind(j, RECOMPUTE_SLOT, grads=False), \
                    state.watch_buffers(self.stack[j], self._mutable_buffers.setdefault(j, {})):
                spec, outs = self._run_block(j, x, call, routed, first=True)
        finally:
            self.params.evict(RECOMPUTE_SLOT)
        ctx.adhoc = AdhocPass(x.detach(), rcall, [t.detach() for t in rrouted], state)
        ctx.output, ctx.n_outputs = spec, len(outs)
        return tuple(outs)


def _most(figures: dict, key: Any, value: float) -> None:
    """A step's figure of ``key``: the largest of its micro-batches' (a profiled step with accumulation
    plans for its largest micro-batch, whichever comes first: Note: [batches larger than the plan] in
    core/batch_size.py)."""
    figures[key] = max(figures.get(key, value), value)
