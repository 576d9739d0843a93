"""The backward side of the executor's block node (a mixin of ``Executor``, executor.py: it reads the
executor's schedule, stores and per-micro-batch state, and calls its helpers).

``backward_window`` runs window B{t}, block ``t``'s planned backward: the window's transfers
(``_issue_transfers``: grads of layer t+1 to the host, the prefetch of layer t-1, reloads of
boundaries and internals, NVMe reads), the re-run of a recompute block that ends here
(``_recompute_block``, Note: [recompute double buffer]), the re-run of block ``t`` unless it kept its
internals, and the backprop. ``_pass_backward_window`` runs a window the backward skips or never
reaches (Note: [unreached blocks]); ``adhoc_backward`` the backward of an ad-hoc pass
(``ForwardWindows.adhoc_forward``, forward_windows.py). Each first checks that its node belongs to the
running micro-batch (``_check_live``) and counts the block's backprops (``_count_backprop``).
``_retire_residents`` gives back the slots of resident layers whose gradients went to the host.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import CheckpointError

from lightning_lazytrain.engine.block_fn import BlockContext, CountingHooks, Grads, backprop
from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern
from lightning_lazytrain.engine.boundary_uses import SplitUses
from lightning_lazytrain.engine.forward_windows import RECOMPUTE_SLOT, _most
from lightning_lazytrain.engine.partial_keep import MatmulOutputs, OverlapHooks
from lightning_lazytrain.engine.user_grad_hooks import tensor_hook_names

if TYPE_CHECKING:
    from lightning_lazytrain.engine.activation_store import ActivationStore
    from lightning_lazytrain.engine.adhoc_grads import AdhocGrads
    from lightning_lazytrain.engine.block_fn import SharedInputs
    from lightning_lazytrain.engine.block_io import ForwardState
    from lightning_lazytrain.engine.blocks import BlockStack
    from lightning_lazytrain.engine.internals import OffloadedInternals
    from lightning_lazytrain.engine.param_store import ParamStore, PendingGrads
    from lightning_lazytrain.engine.partial_keep import PartialForward
    from lightning_lazytrain.engine.step_stats import StepStats
    from lightning_lazytrain.engine.trace import DeviceTracker, StepTrace
    from lightning_lazytrain.planner.schedule import Schedule

__all__ = ["BackwardWindows"]


class BackwardWindows:
    """The backward windows of ``Executor`` (see the module doc); the attributes are the executor's."""

    schedule: Schedule
    stack: BlockStack
    device: torch.device
    params: ParamStore | None
    acts: ActivationStore | None
    stats: StepStats
    tracker: DeviceTracker
    trace: StepTrace
    profiling: bool
    resident_slot: dict[int, int]
    _micro: tuple[bool, bool] | None
    _serial: int
    _adhoc_used: bool
    _windows: dict
    _b_next: int
    _backprops: dict[int, int]
    _ctxs: dict[int, BlockContext]
    _shared: SharedInputs
    _forwarded: set[int]
    _unreachable: set[int]
    _recomputed: dict[int, torch.Tensor]
    _calls: dict[int, tuple]
    _states: dict[int, ForwardState]
    _internals: dict[int, OffloadedInternals]
    _partial: dict[int, PartialForward]
    _adhoc_grads: AdhocGrads
    _pending_grads: list[PendingGrads]
    _retiring: list[int]

    # ---- the block node's runner, backward (block_fn.BlockRunner; Note: [the block node]) -------
    def backward_window(self, ctx: BlockContext, grads: Grads) -> tuple[torch.Tensor | None, list]:
        """Window B{t} for block ``t = ctx.j``'s planned pass; returns the gradients of its input
        and routed inputs."""
        assert self.params is not None
        t = ctx.j
        self._check_live(ctx)
        if t > self._b_next:
            raise UnsupportedBlockPattern(
                f"block {t}'s backward came after the backward of block {self._b_next + 1}, below it, in the "
                "same micro-batch: strategy='lazytrain' runs a micro-batch's block backwards once, from the top "
                "block down. Add the losses and call backward once per micro-batch.")
        for u in range(self._b_next, t, -1):  # Note: [unreached blocks]: the backward entered below u
            self._pass_backward_window(u, rerun=True)
        self._b_next = t - 1
        self._ctxs.pop(t, None)
        self._count_backprop(t)
        s = self.schedule
        name = f"B{t}"
        self._retire_residents()  # before the mark: their grads left in the previous window
        self._reap_offloads()
        # The incoming output gradient is part of the backward's working set.
        self._window(name, carried=sum(self._nbytes(g) for g in grads if isinstance(g, torch.Tensor)))
        self._transfers_and_rerun(name, t, s.block_ending_at(t + 1))
        slot = self.slot_of(t)
        self._finish_grads(slot=slot)  # the slot's grad buffer is zeroed by bind
        # ad-hoc gradients of earlier backward calls reach the host gradient before this call's (Note: [ad-hoc
        # gradients per backward call])
        self._add_adhoc_grads([(t, g, touched) for g, touched in self._adhoc_grads.planned(t)])
        with self.params.bind(t, slot, grads=True):
            if ctx.kept is not None:
                xg, rin = ctx.kept.x, ctx.kept.routed
                self._calls.pop(t)
                roots, all_grads = self._shared.with_running(ctx, rin, list(ctx.kept.roots), list(grads))
                partial = self._partial.pop(t, None)
                if partial is not None:  # Note: [partial keep]: the backprop re-runs the elementwise ops
                    partial.recomputing = True
                with self.trace.timed(name, "backward", t), _partial_rerun_named(t if partial is not None else None), \
                        _input_uses(ctx, xg, rin, roots, all_grads) as uses:
                    backprop(roots, all_grads)
                if t in self._internals:
                    self._internals.pop(t).free(self.acts)
                self.tracker.drop(f"internals{t}")
                self.tracker.drop(f"partial{t}")
            else:
                x = self._boundary(t)
                call, routed = self._calls.pop(t)
                xg = x.detach().requires_grad_()
                rin = [r.detach().requires_grad_() for r in routed]
                # a profiled step also measures what a partial keep of the layer would store (Note: [partial keep])
                mode = MatmulOutputs(self.device) if self.profiling else None
                hooks = (CountingHooks if mode is None else functools.partial(OverlapHooks, mode))(
                    lambda: self.params.slot_weights(t, slot), self._not_internals(x))
                with self.trace.timed(name, "local_recompute", t), self._states[t].replay(), torch.enable_grad(), \
                        torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack), \
                        (mode if mode is not None else contextlib.nullcontext()):
                    _, outs = self._run_block(t, xg, call, rin, first=False)
                ctx.check_outputs(outs)
                if mode is not None:
                    if mode.mutated or self.stats.partial_bytes.get(t, -1) == 0:
                        self.stats.partial_bytes[t] = 0  # never partially kept
                    else:
                        _most(self.stats.partial_bytes, t, mode.nbytes)
                    _most(self.stats.partial_recompute_bytes, t, hooks.bytes - hooks.overlap)
                    _most(self.stats.partial_seconds, t, mode.elementwise_seconds)
                self.tracker.add(f"internals{t}", hooks.bytes)
                _most(self.stats.internal_bytes, t, hooks.bytes + self._nbytes(x))
                self.stats.recomputed_forwards[t] = self.stats.recomputed_forwards.get(t, 0) + 1
                outs, all_grads = self._shared.with_running(ctx, rin, outs, list(grads))
                with self.trace.timed(name, "backward", t), _input_uses(ctx, xg, rin, outs, all_grads) as uses:
                    backprop(outs, all_grads)
                del outs, all_grads
                self.tracker.drop(f"internals{t}")
        self._free_boundary(t)
        if t in self.resident_slot and (t > 0 or self._micro[1]):
            # Its weights are done (layer 0's serve the next micro-batch's F0); its gradients leave
            # in the next window.
            self.params.evict(slot, keep_grads=True)
            self.tracker.drop(f"resident{t}")
            self.tracker.add(f"resident{t}", self.params.slot_bytes(t, slot))
        return _node_grads(xg, uses, self._shared.input_grads(ctx, rin))

    # Note: [unreached blocks] A forward with grad enabled whose output is never backpropagated (a
    # detached result: a GAN's fake batch for its critic, a target computed with grad on; or an output
    # simply dropped) gets no backward under plain autograd: its graph is freed and its weights get no
    # gradient. Here its blocks' backward windows never come, and the plan's later windows expect the
    # slots and boundaries those windows leave. So a window the backward skips (the gradient entered
    # the stack below it) or never reaches (by the micro-batch's end) runs its transfers as planned
    # and computes nothing (``_pass_backward_window``): the weights go where the next window expects
    # them, the grads of the blocks whose backward ran go to the host, the pass's boundaries, kept
    # internals and its node's saved graph are released. It costs the transfers, not compute, and it
    # trains exactly as plain autograd. A node of such a pass that is backpropagated later (after its
    # micro-batch ended) is refused with a clear error (``_check_live``): its state is gone.
    def _pass_backward_window(self, t: int, *, rerun: bool) -> None:
        """Window B{t} for a block whose planned pass gets no gradient (Note: [unreached blocks]).
        ``rerun``: a recompute block ending here is still re-run (a lower block's backward, still to
        come, needs its boundaries); at the micro-batch's end none is."""
        assert self.params is not None and self.acts is not None
        s = self.schedule
        name = f"B{t}"
        self._retire_residents()
        self._reap_offloads()
        self._window(name)
        self._transfers_and_rerun(name, t, s.block_ending_at(t + 1) if rerun else None)
        self._finish_grads(slot=self.slot_of(t))  # as a real window's bind: the slot's next send waits for it
        ctx = self._ctxs.pop(t, None)
        self._shared.passed(t)  # Note: [one gradient per shared input] (block_fn.py)
        if ctx is not None:
            ctx.kept = None  # its saved graph (kept internals) goes now, not when the user drops the output
        self._calls.pop(t, None)
        self._states.pop(t, None)
        if t in self._internals:
            self._internals.pop(t).free(self.acts)
        self._partial.pop(t, None)
        self.tracker.drop(f"internals{t}")
        self.tracker.drop(f"partial{t}")
        self._free_boundary(t)
        if t in self.resident_slot and (t > 0 or self._micro[1]):
            slot = self.slot_of(t)
            self.params.evict(slot, keep_grads=True)
            self.tracker.drop(f"resident{t}")
            self.tracker.add(f"resident{t}", self.params.slot_bytes(t, slot))
        self._b_next = t - 1
        if t in self._forwarded and t not in self._unreachable:
            self.stats.unreached.add(t)

    def _check_live(self, ctx: BlockContext) -> None:
        """A block's node may run its backward once, in the micro-batch of its forward."""
        if ctx.backpropagated:
            raise UnsupportedBlockPattern(
                f"a second backward through block {ctx.j}'s forward: either a backward with retain_graph=True, then "
                "another through the same forward, or a double backward (torch.autograd.grad(..., create_graph=True) "
                "through the blocks -- a gradient penalty, as WGAN-GP's -- then a backward of a loss that uses it). "
                "With strategy='lazytrain' each forward is backpropagated once; the backward releases its saved "
                "state as it goes (its blocks' activations and weights are streamed, not retained), and a gradient "
                "of a gradient through the blocks is not supported. Fix: add the losses and call backward once "
                "(e.g. manual_backward(loss1 + loss2): the same gradients, summed before they reach the weights), "
                "or run the forward again for the second loss; for a gradient penalty through the blocks, train "
                "with strategy='auto'.")
        ctx.backpropagated = True
        if ctx.stepped:  # Note: [a step inside a micro-batch] (core/microbatches.py)
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"an optimizer step changed block {ctx.j}'s weights after its forward and before this backward "
                "(strategy='auto' refuses this backward too: the forward saved them). Step that optimizer after the "
                "backward (manual_backward), or run the forward again after the step.")
        if self._micro is None or ctx.serial != self._serial:
            raise RuntimeError(
                f"backward through block {ctx.j}'s forward of an earlier micro-batch: with strategy='lazytrain' a "
                "forward's saved state is released when its micro-batch ends (at the backward that ends it: any "
                "backward that reached the model, e.g. a discriminator's on fake.detach() when the discriminator is "
                "part of the streamed model). Backpropagate a forward in the micro-batch that ran it, or run it "
                "again; with manual optimization, call manual_backward after each forward, or add the losses and "
                "call it once (manual_backward(loss1 + loss2)); in a GAN, compute the generator's loss before the "
                "discriminator's backward, or call the generator again for it.")

    def _count_backprop(self, t: int) -> None:
        """A block backpropagated twice in one micro-batch (its planned pass and an ad-hoc one) runs
        two backwards where autograd runs one on the summed gradient: a gradient hook on its weights
        would fire twice on partial sums, so that is refused (Note: [gradient hooks on streamed
        parameters], engine/user_grad_hooks.py)."""
        assert self.params is not None
        n = self._backprops[t] = self._backprops.get(t, 0) + 1
        if n < 2:
            return
        hooked = tensor_hook_names(zip(self.params.param_names(t), self.params.group_parameters(t)))
        if hooked:
            names = ", ".join(f"{self.stack.block_path(t)}.{name}" for name in hooked)
            raise UnsupportedBlockPattern(
                f"a gradient hook (register_hook) on {names}: block {t} ran two forwards with grad that both "
                "reach this backward (e.g. the model called twice before one backward); strategy='lazytrain' "
                "backpropagates the two passes separately, so the hook would fire twice on partial gradients "
                "where plain autograd fires it once on their sum. Use register_post_accumulate_grad_hook, "
                "call the model once per backward, or train with strategy='auto'.")

    def adhoc_backward(self, ctx: BlockContext, grads: Grads) -> tuple[torch.Tensor | None, list]:
        """The backward of an ad-hoc pass: re-run with grad through the recompute slot, backprop,
        its weight gradients kept to join the planned ones (``_adhoc_grads``)."""
        assert self.params is not None and ctx.adhoc is not None
        j = ctx.j
        self._check_live(ctx)
        self._count_backprop(j)
        x, call, routed, state = ctx.adhoc.x, ctx.adhoc.call, ctx.adhoc.routed, ctx.adhoc.state
        ctx.adhoc = None
        self.params.stage(j, RECOMPUTE_SLOT)
        xg = x.detach().requires_grad_()
        rin = [t.detach().requires_grad_() for t in routed]
        with self.params.bind(j, RECOMPUTE_SLOT, grads=True):
            with state.replay(), torch.enable_grad():
                _, outs = self._run_block(j, xg, call, rin, first=False)
            ctx.check_outputs(outs)
            with _input_uses(ctx, xg, rin, outs, grads) as uses:
                backprop(outs, grads)
        grads_j = self.params.take_grads(self.params.send_grads(j, RECOMPUTE_SLOT, direct=False))
        self.params.evict(RECOMPUTE_SLOT)
        self._adhoc_grads.add(j, grads_j)  # Note: [ad-hoc gradients per backward call]
        self._adhoc_used = True
        return _node_grads(xg, uses, [t.grad for t in rin])

    # Note: [recompute double buffer] During a block recompute the slot of layer t-1 is idle (its
    # last user, B{t+1}, is done; only its grad buffer is still being read), so the recompute
    # streams through it and the recompute slot alternately, and layer t-1's prefetch is issued
    # once the recompute is done: three weight buffers, as the plan counts, and the recompute's
    # fetches overlap its compute.
    def _transfers_and_rerun(self, name: str, t: int, block: tuple[int, int] | None) -> None:
        """Window B{t}'s transfers, then the re-run of ``block`` (the recompute block ending at t + 1, or None)
        through the spare slot of layer t-1, whose prefetch is issued after it (Note: [recompute double
        buffer]); a planned backward window and a passed one alike."""
        spare = t - 1 if block is not None and t >= 1 and (t - 1) not in self.resident_slot else None
        self._issue_transfers(name, defer_weights=spare)
        if block is not None:
            self._recompute_block(name, block[0], t, spare=None if spare is None else self.slot_of(spare))
            if spare is not None and self._fetched_for_backward(spare) and any(
                    op.kind == "weights" and op.index == spare for op in self._windows[name].ops):
                self._stage(spare)

    def _recompute_block(self, window: str, s: int, t: int, spare: int | None = None) -> None:
        """Re-run layers s..t-1 without grad from boundary s; keep boundaries s+1..t."""
        assert self.params is not None
        x = self._boundary(s)
        bufs = [RECOMPUTE_SLOT] if spare is None else [RECOMPUTE_SLOT, spare]
        self.params.stage(s, bufs[0])
        self.tracker.add("recompute_slot", self.params.slot_bytes(s, RECOMPUTE_SLOT))
        for k, j in enumerate(range(s, t)):
            slot = bufs[k % len(bufs)]
            if j + 1 < t and len(bufs) == 2:
                self.params.stage(j + 1, bufs[(k + 1) % 2])  # fetch the next while this one computes
            call, routed = self._calls[j]
            with self.params.bind(j, slot, grads=False), self.trace.timed(window, "recompute", j), \
                    self._states[j].replay(), torch.no_grad():
                _, outs = self._run_block(j, x, call, routed, first=False)
            x = outs[0]
            if j + 1 < t and len(bufs) == 1:
                self.params.stage(j + 1, slot)
            self._recomputed[j + 1] = x
            self.tracker.add(f"recomputed{j + 1}", self._nbytes(x))
            self.stats.recomputed_forwards[j] = self.stats.recomputed_forwards.get(j, 0) + 1
        self.params.evict(RECOMPUTE_SLOT)
        self.tracker.drop("recompute_slot")

    # ---- transfers ---------------------------------------------------------------------------
    def _issue_transfers(self, name: str, defer_weights: int | None = None) -> None:
        """Start a backward-side window's transfers (grads, prefetch, reloads, NVMe reads), in order;
        the weight fetch of layer ``defer_weights`` is left to the caller."""
        assert self.params is not None and self.acts is not None
        for op in self._windows[name].ops:
            if op.lane == "d2h" and op.kind == "grads":
                if not self._fetched_for_backward(op.index) and op.index not in self.resident_slot:
                    continue  # no gradient, and its slot holds another layer now (not fetched again)
                self._pending_grads.append(self.params.send_grads(op.index, self.slot_of(op.index)))
                if op.index in self.resident_slot:
                    self._retiring.append(op.index)
            elif op.lane == "h2d" and op.kind == "weights":
                if op.index != defer_weights and self._fetched_for_backward(op.index):
                    self._stage(op.index)
            elif op.lane == "h2d" and op.kind == "reload":
                self.acts.prefetch(op.index)
                self.tracker.add(f"reload{op.index}", self.acts.nbytes(op.index))
            elif op.lane == "h2d" and op.kind == "reload_internals":
                if op.index in self._unreachable:  # it kept none (Note: [blocks no gradient reaches])
                    continue
                moving = self._internals[op.index]
                moving.reload(self.acts)
                self.tracker.add(f"internals{op.index}", moving.nbytes)
            elif op.lane == "nvme_read":
                with self._host_side():
                    self.acts.read_to_host(op.index)

    def _retire_residents(self, *layers: int) -> None:
        """Give back the slots of resident layers whose gradients went to the host (those sent in
        an earlier window, and ``layers``): the plan counts a resident layer's slot from its fetch
        to the window that sends its gradients."""
        assert self.params is not None
        for j in [*self._retiring, *(j for j in layers if j in self.resident_slot)]:
            slot = self.slot_of(j)
            self._finish_grads(slot=slot)
            self.params.evict(slot)
            self.tracker.drop(f"resident{j}")
        self._retiring = []


@contextlib.contextmanager
def _partial_rerun_named(t: int | None):
    """Around a partial keep's backprop (Note: [partial keep]): torch's checkpoint raises ``CheckpointError``
    when the re-run of the elementwise ops does not reproduce the forward's tensors -- a block whose forward
    depends on state it changes outside its buffers (module attributes: RecurrentGemma's ``conv1d_state``)
    -- which says nothing of the block or the way out: name both."""
    if t is None:
        yield
        return
    try:
        yield
    except CheckpointError as err:
        raise UnsupportedBlockPattern(
            f"block {t}'s re-run under a partial keep did not reproduce its forward ({' '.join(str(err).split())[:300]}"
            "): the block changes state its re-run reads outside its buffers (module attributes, e.g. a recurrent "
            "state kept on the module). Plan without a partial keep (plan.partial_keep=false / "
            "MilpOptions(partial_keep=False)) or turn the model's cache off (use_cache=False)") from err


def _input_uses(ctx: BlockContext, xg: torch.Tensor, rin: list[torch.Tensor], roots: list,
                grads) -> SplitUses | contextlib.nullcontext:
    """Around a block's backprop of ``grads`` from ``roots``: each use's gradient of its input (and of routed
    tensors), where the node returns them apart (Note: [one gradient per boundary use] in boundary_uses.py)."""
    return SplitUses(ctx, xg, rin, roots, grads) if ctx.split else contextlib.nullcontext()


def _node_grads(xg: torch.Tensor, uses: SplitUses | None, grad_routed: list) -> tuple[torch.Tensor | None, list]:
    """The gradients the node returns for its input and routed tensors: the sums (``xg.grad``; ``grad_routed``),
    or each use's in a slot of its own, the extra slots' in ``ctx.extra_grads`` (Note: [one gradient per boundary
    use])."""
    if not isinstance(uses, SplitUses):
        return xg.grad, grad_routed
    return uses.returned(grad_routed)
