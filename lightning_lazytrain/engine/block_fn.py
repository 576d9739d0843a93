"""One autograd node per block, and the saved-tensor hooks that keep a block's internals.

``BlockFunction.apply(executor, j, call, adhoc, x, anchor, *routed)`` runs block ``j``'s forward
window under the executor (or, for a further forward pass in the same micro-batch, an ad-hoc
self-contained forward) and returns the node's outputs; its ``backward`` runs the block's backward
window.
``anchor`` is a 0-dim tensor that requires grad, so the node gets a backward even when ``x``
does not (frozen embeddings): the block's own weights still need gradients.

Note: [kept internals and streamed weights] When a layer keeps its internals, its forward runs
with grad under ``saved_tensors_hooks``. Saved tensors that live in the layer's weight slot are
packed as (offset, size, stride) tokens, not kept: the slot is reused by other layers before
the backward. At ``B{j}`` the executor has re-staged layer j into the same slot, and unpacking
re-views it. The leaf wrappers created at ``F{j}`` still own the gradient views of that slot,
so the weight gradients land in the slot's gradient buffer as for any other layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class BlockFunction(torch.autograd.Function):
    """Inputs: the hidden state ``x``, ``anchor`` and the call's routed tensors (those that require
    grad, ``block_io.BlockCall``). Outputs: the hidden state, the routed output tensors and the
    tensors forward hooks saw (``block_io``); the backward returns gradients for every input."""

    @staticmethod
    def forward(ctx: Any, executor: Any, j: int, call: Any, adhoc: bool, x: torch.Tensor, anchor: torch.Tensor,
                *routed: torch.Tensor) -> tuple:
        ctx.executor, ctx.j, ctx.kept, ctx.adhoc = executor, j, None, None
        ctx.routed_keys = [None] * len(routed)  # the planned pass sets them (Note: [one gradient per shared input])
        ctx.set_materialize_grads(False)  # outputs nobody used get None, not zeros
        if adhoc:
            return executor._adhoc_forward(ctx, j, call, x, list(routed))
        return executor._forward_window(ctx, j, call, x, list(routed))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        if ctx.adhoc is not None:
            grad_in, grad_routed = ctx.executor._adhoc_backward(ctx, ctx.j, grads)
        else:
            grad_in, grad_routed = ctx.executor._backward_window(ctx, ctx.j, grads)
        ctx.kept = None
        return (None, None, None, None, grad_in, None, *grad_routed)


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
