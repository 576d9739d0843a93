"""The streamed block's autograd contract: one autograd node per block, its typed context, the
interface the executor gives it, and the saved-tensor hooks that keep a block's internals.

Note: [the block node]
    The executor patches each block's ``forward``; a call with grad inside a training micro-batch
    becomes one ``BlockFunction`` node (the only path between the block's inside and the rest of
    the graph: block_io.py). Inputs: the hidden state ``x``, the grad anchor, the call's routed
    tensors (``block_io.BlockCall``), then ``x`` and each routed tensor again, 7 times each (Note: [one gradient
    per boundary use] in boundary_uses.py). Outputs: the hidden state, the routed output tensors and the
    tensors the block's forward hooks stored (``run_block``). The caller makes the node's
    ``BlockContext`` and passes it in; everything the backward needs is in it, typed.

    Forward (``BlockFunction.forward``): the runner (the executor, a ``BlockRunner``) runs the
    block's planned pass, window ``F{j}`` (``forward_window``), or, for a block the planned pass
    has already run in this micro-batch, an ad-hoc pass (``adhoc_forward``). Either records in the
    context: ``serial`` (its micro-batch), ``n_outputs``, ``output`` (the return value's structure,
    taken by the caller at once); the planned pass ``routed_keys`` (Note: [one gradient per shared
    input]) and, when the layer keeps its internals, ``kept`` (a ``KeptGraph``); the ad-hoc pass
    ``adhoc`` (an ``AdhocPass``: what its re-run needs).

    Backward (``BlockFunction.backward``): ``adhoc_backward`` while the context holds an ad-hoc pass,
    else ``backward_window`` (window ``B{j}``). Each first checks that the node belongs to the
    running micro-batch and counts the block's backprops, runs the window (transfers, re-runs,
    backprop of the kept graph or of the re-run), and returns the gradient of ``x`` and of each routed
    input (a shared input's only from the last block that uses it; a marked node: each use's in a slot of
    its own, for ``x`` and for routed inputs used elsewhere). The anchor gets None; the kept graph is
    released after the backward.

    The anchor is a 0-dim tensor that requires grad, so the node gets a backward even when ``x``
    does not (frozen embeddings): the block's own weights still need gradients.

Note: [kept internals and streamed weights] When a layer keeps its internals, its forward runs
with grad under ``saved_tensors_hooks``. Saved tensors that live in the layer's weight slot are
packed as (offset, size, stride) tokens, not kept: the slot is reused by other layers before
the backward. At ``B{j}`` the executor has re-staged layer j into the same slot, and unpacking
re-views it. The leaf wrappers created at ``F{j}`` still own the gradient views of that slot,
so the weight gradients land in the slot's gradient buffer as for any other layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from lightning_lazytrain.engine.block_io import (BlockCall, BlockOutput, ForwardState, HookCapture,
                                                 UnsupportedBlockPattern)

__all__ = ["AdhocPass", "BlockContext", "BlockFunction", "BlockRunner", "CountingHooks", "KeptGraph",
           "SharedInputs", "WeightTokenHooks", "backprop", "run_block"]

Grads = tuple[torch.Tensor | None, ...]


@dataclass(eq=False)
class KeptGraph:
    """The graph of a layer that kept its internals, from ``F{j}`` to its backward.

    Note: [kept roots hold no data] The backward needs the roots' graph, not their values: keeping
    the tensors would keep the block's output (the next boundary) on the device after its planned
    offload. Their gradient edges keep only the graph."""

    x: torch.Tensor  # the leaf the forward ran on (its ``.grad`` is the input's gradient)
    routed: list[torch.Tensor]  # the routed inputs' leaves
    roots: list[GradientEdge | None]  # one per node output (None: an output without grad)

    @classmethod
    def of(cls, x: torch.Tensor, routed: list[torch.Tensor], roots: Sequence[torch.Tensor]) -> KeptGraph:
        return cls(x, routed, [get_gradient_edge(r) if r.requires_grad else None for r in roots])


@dataclass(eq=False)
class AdhocPass:
    """What an ad-hoc pass's backward re-runs the block from (its weights come through the
    recompute slot again)."""

    x: torch.Tensor  # the input, detached, kept on the device
    call: BlockCall  # the re-run call (KV caches as the block found them)
    routed: list[torch.Tensor]  # its routed tensors, detached
    state: ForwardState  # the RNG/autocast state and buffers the forward started from


@dataclass(eq=False)
class BlockContext:
    """One block node's state, from its forward to its backward (Note: [the block node])."""

    j: int  # the block
    serial: int = 0  # the micro-batch whose forward made the node (Executor: a backward must be in it)
    n_outputs: int = 0  # the node's outputs (a re-run must produce as many)
    # per routed input, its key among the micro-batch's shared inputs (None: returned by this node
    # alone); the planned pass sets them (Note: [one gradient per shared input])
    routed_keys: list[int | None] = field(default_factory=list)
    kept: KeptGraph | None = None  # a planned pass that kept its internals
    adhoc: AdhocPass | None = None  # an ad-hoc pass not yet backpropagated
    # the block's return structure, for the caller to rebuild the return value (taken at once:
    # it may reference the block's non-tensor outputs, e.g. a KV cache)
    output: BlockOutput | None = None
    backpropagated: bool = False  # its backward ran (a second one: retain_graph, refused by name)
    stepped: bool = False  # an optimizer changed its weights after its forward (Note: [a step inside a micro-batch])
    # outputs of a forward window that already ran, for the node to return instead of running it (Note:
    # [blocks no gradient reaches] in block_calls.py: a block that read a trainable tensor it does not own)
    precomputed: list[torch.Tensor] | None = None
    # Note: [one gradient per boundary use] (boundary_uses.py): after its routed inputs (``n_routed``) the
    # node takes ``x`` ``extra_inputs`` more times, then each routed input ``routed_extra`` more times;
    # ``split``: groups of its tensors (-1: ``x``, i: routed input i) that share one producer, each use's
    # gradient returned in a slot of its own (set before the backward), the extra slots' in ``extra_grads``
    extra_inputs: int = 0
    n_routed: int = 0
    routed_extra: int = 0
    split: list[tuple[int, ...]] = field(default_factory=list)
    extra_grads: list[torch.Tensor | None] | None = None

    @property
    def split_input(self) -> bool:
        """Are the uses of ``x`` returned apart?"""
        return any(-1 in group for group in self.split)

    def split_routed(self) -> set[int]:
        """The routed inputs whose uses are returned apart (not chained: Note: [one gradient per shared input])."""
        return {k for group in self.split for k in group if k >= 0}

    def positions_of(self, k: int) -> list[int]:
        """The positions of tensor ``k`` (-1: ``x``, i: routed input i) among the node's tensor inputs (x,
        anchor, routed..., ``x``'s extra slots, each routed input's extra slots); its own position first."""
        first = 2 + self.n_routed
        if k < 0:
            return [0, *range(first, first + self.extra_inputs)]
        start = first + self.extra_inputs + k * self.routed_extra
        return [2 + k, *range(start, start + self.routed_extra)]

    def tensor_at(self) -> dict[int, int]:
        """Position among the node's tensor inputs -> its tensor (-1: ``x``, i: routed input i); not the anchor."""
        return {pos: k for k in range(-1, self.n_routed) for pos in self.positions_of(k)}

    def n_extra(self) -> int:
        """The extra slots after the routed inputs (``x``'s, then each routed input's)."""
        return self.extra_inputs + self.n_routed * self.routed_extra

    def check_outputs(self, outs: Sequence[torch.Tensor]) -> None:
        """A re-run must produce the node's outputs again, as many as the forward did."""
        if len(outs) != self.n_outputs:
            raise UnsupportedBlockPattern(
                f"block {self.j}'s re-run produced {len(outs)} tensors where its forward produced {self.n_outputs} "
                "(outputs plus tensors seen by forward hooks): the block's forward is not repeatable. Use "
                "policy='keep_all' (no re-runs) or make the block's outputs independent of call history.")

    def take_output(self) -> BlockOutput:
        out, self.output = self.output, None
        assert out is not None
        return out


class BlockRunner(Protocol):
    """What a block node calls (the executor implements it; Note: [the block node])."""

    def forward_window(self, ctx: BlockContext, call: BlockCall, x: torch.Tensor,
                       routed: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Window F{j}: the planned pass of block ``ctx.j``; returns the node's outputs."""
        ...

    def adhoc_forward(self, ctx: BlockContext, call: BlockCall, x: torch.Tensor,
                      routed: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """A further pass of a block the planned pass already ran; returns the node's outputs."""
        ...

    def backward_window(self, ctx: BlockContext, grads: Grads) -> tuple[torch.Tensor | None, list]:
        """Window B{j}; returns the gradients of ``x`` and of the routed inputs."""
        ...

    def adhoc_backward(self, ctx: BlockContext, grads: Grads) -> tuple[torch.Tensor | None, list]:
        """An ad-hoc pass's backward; returns the gradients of ``x`` and of the routed inputs."""
        ...


class BlockFunction(torch.autograd.Function):
    """``BlockFunction.apply(runner, ctx, call, adhoc, x, anchor, *routed, *extra)``: block
    ``ctx.j`` as one autograd node (Note: [the block node]; ``extra``: ``x`` and the routed tensors again, Note:
    [one gradient per boundary
    use] in boundary_uses.py). Outputs: the hidden state, the routed output tensors and
    the tensors forward hooks saw; the backward returns gradients for every input."""

    @staticmethod
    def forward(fctx: Any, runner: BlockRunner, ctx: BlockContext, call: BlockCall, adhoc: bool, x: torch.Tensor,
                anchor: torch.Tensor, *inputs: torch.Tensor) -> tuple:
        fctx.runner, fctx.block = runner, ctx
        routed = inputs[:ctx.n_routed]  # then ``x`` and each routed input again (Note: [one gradient per
        # boundary use])
        fctx.set_materialize_grads(False)  # outputs nobody used get None, not zeros
        if ctx.precomputed is not None:  # the window ran already (Note: [blocks no gradient reaches])
            outs, ctx.precomputed = ctx.precomputed, None
            return tuple(outs)
        ctx.routed_keys = [None] * len(routed)  # the planned pass sets them (Note: [one gradient per shared input])
        if adhoc:
            return runner.adhoc_forward(ctx, call, x, list(routed))
        return runner.forward_window(ctx, call, x, list(routed))

    @staticmethod
    def backward(fctx: Any, *grads: torch.Tensor | None) -> tuple:
        ctx: BlockContext = fctx.block
        if ctx.adhoc is not None:
            grad_in, grad_routed = fctx.runner.adhoc_backward(ctx, grads)
        else:
            grad_in, grad_routed = fctx.runner.backward_window(ctx, grads)
        ctx.kept = None
        extra, ctx.extra_grads = ctx.extra_grads or [None] * ctx.n_extra(), None
        return (None, None, None, None, grad_in, None, *grad_routed, *extra)


class TrainableReads(torch.overrides.TorchFunctionMode):
    """Inside a block's forward run without its node (Note: [blocks no gradient reaches] in block_calls.py):
    the first tensor that requires grad an operation reads (``seen``). There the block's input, routed
    tensors and bound weights require none, so such a tensor is one the block does not own: a parameter of
    another module captured by the block's code."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: torch.Tensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: Sequence = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.seen is None:
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    self.seen = t
                    break
        return func(*args, **kwargs)


def run_block(forward: Callable[..., Any], block: nn.Module, where: str, x: torch.Tensor, call: BlockCall,
              routed: list, *, first: bool, rerun: bool = True) -> tuple[BlockOutput, list[torch.Tensor]]:
    """Run a block's own ``forward`` on ``x``; returns its output structure and the node's outputs:
    hidden state, routed output tensors, tensors captured by hooks (deduplicated). ``where``: the
    block's path (messages). ``first``: the block's forward (hooks fire), else a re-run (hooks
    silenced); ``rerun``: the forward will be re-run later (so hooks that change values are refused)."""
    args, kwargs = call.build(routed)
    capture = HookCapture(block, where, first=first, refuse_changes=rerun)
    with capture():
        result = forward(x, *args, **kwargs)
    spec, hidden, outs = BlockOutput.split(result)
    seen = {id(t) for t in (x, hidden, *outs, *routed)}
    captured = []
    for t in capture.captured:
        if id(t) not in seen:
            seen.add(id(t))
            captured.append(t)
    return spec, [hidden, *outs, *captured]


def backprop(roots: Sequence[torch.Tensor | GradientEdge | None], grads: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate the node's output gradients (None: that output was not used) from the roots
    (tensors, or gradient edges of kept roots; None: a root without grad)."""
    pairs = [(r, g) for r, g in zip(roots, grads, strict=True)
             if g is not None and r is not None and (isinstance(r, GradientEdge) or r.requires_grad)]
    if pairs:
        torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])


class SharedInputs:
    """Note: [one gradient per shared input] A tensor passed to several blocks (the encoder's output
    to every cross-attention, a shared position bias) gets, under plain autograd, one addition per
    use into its gradient, in backward order. If each node returned its own sum, autograd would add
    per-block sums: the same value up to rounding. So the blocks that share such an input chain
    its gradient: each re-run backpropagates the running total into the input's leaf first (an
    alias made after the re-run is the newest node, so autograd runs it first), and only the last
    block to run its backward returns the total; the others return None. One per micro-batch.
    The blocks still to come are the planned passes that took the input (``share``) less those whose
    backward ran or whose window passed without one (``passed``: Note: [unreached blocks]), and, once the
    walk before the backward has seen the graph (``reached``), less those the backward will not reach: a loss
    on a middle boundary reaches neither the blocks above it nor, with a detached boundary, those below."""

    def __init__(self) -> None:
        self._refs: dict[int, torch.Tensor] = {}  # keeps each key's id unique for the micro-batch
        self._pending: dict[int, set[int]] = {}  # key -> planned blocks whose backward is still to come
        self._running: dict[int, torch.Tensor] = {}  # key -> the gradient summed so far

    def share(self, j: int, routed: list[torch.Tensor]) -> list[int | None]:
        """Count block ``j``'s planned pass for its routed inputs; returns their keys (all None when the same
        tensor is passed twice in one call: each position on its own)."""
        keys = [id(t) for t in routed]
        if len(set(keys)) != len(keys):
            return [None] * len(keys)
        for key, t in zip(keys, routed):
            self._refs[key] = t
            self._pending.setdefault(key, set()).add(j)
        return list(keys)

    def passed(self, j: int) -> None:
        """Block ``j``'s planned pass gets no backward (its window passed)."""
        for blocks in self._pending.values():
            blocks.discard(j)

    def reached(self, blocks: set[int]) -> None:
        """The planned passes the coming backward reaches (the walk before it); the others get none."""
        for pending in self._pending.values():
            pending &= blocks

    def check_delivered(self) -> None:
        """At the micro-batch's end: a running total no block returned is a gradient the routed tensor lost."""
        if self._running:
            raise UnsupportedBlockPattern(
                "a tensor routed into several blocks got gradient from the upper ones, but the backward did not "
                "reach the lowest block that takes it (its input was detached), so its gradient could not be "
                "returned. The strategies see this coming (they walk the graph before the backward); an Executor "
                "user calls executor.mark_boundary_uses(loss) before loss.backward().")

    def with_running(self, ctx: BlockContext, rin: list[torch.Tensor], roots: list, grads: list) -> tuple[list, list]:
        """``roots``/``grads`` plus, per shared input, its leaf's alias and the running total (none for an input
        whose uses the node returns apart: Note: [one gradient per boundary use])."""
        split = ctx.split_routed()
        with torch.enable_grad():
            for k, (leaf, key) in enumerate(zip(rin, ctx.routed_keys)):
                running = self._running.pop(key, None) if key is not None and k not in split else None
                if running is not None:
                    roots.append(leaf.view_as(leaf))
                    grads.append(running)
        return roots, grads

    def input_grads(self, ctx: BlockContext, rin: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The routed inputs' gradients this node returns (a shared one only from its last block; the sum where
        the node returns the uses apart, which replace it)."""
        out: list[torch.Tensor | None] = []
        split = ctx.split_routed()
        for k, (leaf, key) in enumerate(zip(rin, ctx.routed_keys)):
            if key is None or k in split:
                out.append(leaf.grad)
                continue
            pending = self._pending.get(key, set())
            pending.discard(ctx.j)
            if not pending:
                self._pending.pop(key, None)
                out.append(leaf.grad)
            else:
                if leaf.grad is not None:
                    self._running[key] = leaf.grad
                out.append(None)
        return out


class WeightTokenHooks:
    """Pack hooks for a kept forward: weights of ``slot_buffer()`` become tokens, the rest is kept
    and its bytes are reported once per storage through ``count``, except storages in ``skip``
    (the input boundary and the call's other tensors, counted where they live: see
    ``Executor._not_internals``)."""

    def __init__(self, slot_buffer: Callable[[], torch.Tensor], count: Callable[[int], None],
                 skip: Iterable[int] = ()) -> None:
        self.slot_buffer = slot_buffer
        self.count = count
        self.seen: set[int] = set(skip)

    def slot_token(self, t: torch.Tensor) -> tuple | None:
        """``("slot", offset, size, stride)`` if ``t`` views the layer's weight slot, else None."""
        buf = self.slot_buffer()
        if t.device == buf.device and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            return ("slot", t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        return None

    def slot_view(self, token: tuple) -> torch.Tensor:
        _, offset, size, stride = token
        return torch.as_strided(self.slot_buffer(), size, stride, offset)

    def pack(self, t: torch.Tensor) -> Any:
        token = self.slot_token(t)
        if token is not None:
            return token
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.seen:
            self.seen.add(ptr)
            self.count(t.untyped_storage().nbytes())
        return t

    def unpack(self, obj: Any) -> torch.Tensor:
        return self.slot_view(obj) if isinstance(obj, tuple) else obj


class CountingHooks:
    """Pack hooks that only measure saved bytes (weights in ``slot_buffer()`` excluded)."""

    def __init__(self, slot_buffer: Callable[[], torch.Tensor] | None, skip: Iterable[int] = ()) -> None:
        self.slot_buffer = slot_buffer
        self.bytes = 0
        self.seen: set[int] = set(skip)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if self.slot_buffer is not None and ptr == self.slot_buffer().untyped_storage().data_ptr():
            return t
        if ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t
