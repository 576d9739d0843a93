"""A node whose backward refuses: where a gradient would be lost, the backward that reaches it stops with a
message naming the pattern and the fix (``UnsupportedBlockPattern``) instead."""

from __future__ import annotations

from typing import Any

import torch

from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern

__all__ = ["refusing_views"]


class RefuseBackward(torch.autograd.Function):
    """Views of the first ``n`` inputs; the other inputs only put their tensors into the graph (so a gradient
    asked of them reaches this node). Its backward raises ``UnsupportedBlockPattern(message)``."""

    @staticmethod
    def forward(ctx: Any, message: str, n: int, copy: bool, *tensors: torch.Tensor) -> Any:
        ctx.message = message
        return tuple(t.clone() if copy else t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise UnsupportedBlockPattern(ctx.message)


def refusing_views(message: str, tensors: list[torch.Tensor], sources: list[torch.Tensor], *,
                   copy: bool = False) -> tuple:
    """``tensors`` as views that require grad through ``RefuseBackward`` over ``sources`` (at least one of
    which must require grad). ``copy``: copies instead, which user code may edit in place under grad (a
    custom Function's view output may not be: review 25, ``h = block(h); h.mul_(0.5)`` in evaluation)."""
    out = RefuseBackward.apply(message, len(tensors), copy, *tensors, *sources)
    return out if isinstance(out, tuple) else (out,)
