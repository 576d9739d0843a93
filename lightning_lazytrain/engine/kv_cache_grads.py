"""Gradients through a Hugging Face KV cache: refused by name, never dropped.

Note: [gradients through a KV cache]
    A block appends its keys and values to the cache it is given (``past_key_values`` and its older names,
    ``block_io._CACHE_KWARGS``). Under autograd those tensors carry the block's graph: a later forward that
    is given the cache (a long sequence trained in chunks, a prefix computed with grad) backpropagates into
    the forward that filled it, and a loss on ``out.past_key_values`` reaches the blocks. A streamed block
    runs its forward inside its node, which returns only the hidden state (and routed tensors), so the cache
    held constants: the continuation trained as if the prefix ran under ``no_grad`` (review 22: Llama's
    losses 4.612351 vs auto's 4.594738 at step 2, no error), and a loss on the cache's keys lost its gradient
    (step 1) or failed with torch's bare "backward through the graph a second time" (later steps).
    Now, in a training forward with grad enabled:
    - after block ``j``'s pass, the keys and values of the cache's layer ``j`` are replaced by views that
      require grad where autograd's would (the block's output does) through ``RefuseBackward``, a node whose
      backward refuses by name: a loss on them is refused as the backward reaches them;
    - before block ``j``'s pass, a cache whose layer ``j`` holds keys or values that require grad (so marked
      by an earlier forward, or a learned prefix the user made) is refused, naming the fixes: compute the
      prefix under ``torch.no_grad()`` (it is then a constant -- what lazytrain trained before, now
      explicit), run prefix and continuation as one forward, or ``strategy="auto"``.
    A cache that is filled and never read again (every Hugging Face training forward with ``use_cache``)
    costs one view per tensor and block. Recurrent states (Mamba's ``conv_states``) are not covered.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from lightning_lazytrain.engine.block_io import _CACHE_KWARGS, UnsupportedBlockPattern
from lightning_lazytrain.engine.refuse_backward import refusing_views

__all__ = ["cache_arguments", "mark_cache_layer", "refuse_cache_with_grad"]

_FIX = ("compute the prefix under torch.no_grad() (its keys and values are then constants), run prefix and "
        "continuation as one forward, or train this pattern with strategy='auto'")


def cache_arguments(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> list[Any]:
    """The KV caches of a block call (by keyword, by position through the block's signature, or inside its
    ``**kwargs``)."""
    found = [v for k, v in kwargs.items() if k in _CACHE_KWARGS and v is not None]
    if signature is None or not args:
        return found
    try:
        bound = signature.bind_partial(None, *args, **kwargs)
    except TypeError:
        return found
    ids = {id(v) for v in found}
    for name, value in bound.arguments.items():
        if name in _CACHE_KWARGS and value is not None and id(value) not in ids:
            found.append(value)
    return found


def _layer_tensors(cache: Any, j: int) -> list[tuple[Any, str]]:
    """(layer object, attribute) of the keys and values the cache holds for layer ``j``."""
    out: list[tuple[Any, str]] = []
    for part in ("self_attention_cache", "cross_attention_cache"):
        if hasattr(cache, part):
            out += _layer_tensors(getattr(cache, part), j)
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list) and j < len(layers):
        out += [(layers[j], a) for a in ("keys", "values") if isinstance(getattr(layers[j], a, None), torch.Tensor)]
    return out


def refuse_cache_with_grad(caches: list[Any], j: int, where: str) -> None:
    """Before block ``j``'s pass in a training forward: refuse a cache whose layer ``j`` requires grad."""
    for cache in caches:
        if any(getattr(lay, a).requires_grad for lay, a in _layer_tensors(cache, j)):
            raise UnsupportedBlockPattern(
                f"strategy='lazytrain': {where} was given a KV cache ({type(cache).__name__}) whose layer {j} holds "
                "keys or values that require grad (a prefix computed by an earlier forward with grad enabled, or "
                "learned prefix keys): a streamed block carries no gradient through a KV cache from one forward "
                f"into another, so the prefix would train as a constant. Fix: {_FIX}")


def _refusal(where: str) -> str:
    return (f"strategy='lazytrain': a gradient reached the keys or values {where} wrote into its KV cache "
            "(past_key_values): a streamed block returns only its hidden state to autograd, so no gradient flows "
            "through what it cached. Fix: use the cache's tensors detached (.detach()) or under torch.no_grad(), "
            "or train this pattern with strategy='auto'")


def mark_cache_layer(caches: list[Any], j: int, where: str, output: torch.Tensor) -> None:
    """After block ``j``'s pass in a training forward whose ``output`` requires grad: its cached keys and
    values require grad too, through ``RefuseBackward`` over that output."""
    for cache in caches:
        # (never marked yet: a cache whose layer j required grad was refused before the pass; an inner graph of
        # the block's own forward is detached)
        slots = [(lay, a) for lay, a in _layer_tensors(cache, j) if getattr(lay, a).is_floating_point()]
        if not slots:
            continue
        marked = refusing_views(_refusal(where), [getattr(lay, a).detach() for lay, a in slots], [output])
        for (lay, a), t in zip(slots, marked):
            setattr(lay, a, t)
