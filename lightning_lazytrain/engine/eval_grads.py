"""Weight gradients outside a training step: what evaluation with grad enabled shows and refuses.

Note: [weights in evaluation]
    Outside a training micro-batch (validation, test, predict, a forward after ``fit``) the non-block
    weights are device copies bound for the whole evaluation (``MicrobatchProtocol.inference``) and each
    block's weights stream through two slots (``BlockCalls._stream_only``); no gradient leaves either.
    Plain autograd shows the module's own parameters there, which require grad as the user set them:
    code that counts trainable parameters, or a kernel that takes another path for a weight that requires
    grad (``F.linear`` of a strided slice folds differently: ``generate``'s logits were 1 ulp off, review 22),
    saw the copies' ``requires_grad=False``. Now:
    - each non-block copy requires grad as its master does. A gradient taken *of* it
      (``torch.autograd.grad(val_loss, model.lm_head.weight)``) is exact with the Trainer (Fabric's own check
      that a backward goes through ``fabric.backward`` refuses it: open, review 25). A backward that would
      *accumulate* into it (``loss.backward()`` in ``validation_step``) is refused as it lands
      (``refuse_accumulation``): the value would stay on the copy, never reaching the master.
    - with grad enabled and a block weight that requires grad, the block's floating outputs pass a node
      (``refuse_backward.RefuseBackward``) whose inputs include the block's masters, so that a gradient of an
      evaluation loss that reaches a block (``autograd.grad(val_loss, block_weight)``, ``backward``) is
      refused naming the pattern, where torch said only "does not require grad" or "not used in the graph".
      Under ``no_grad`` (Lightning's evaluation loops, ``generate``) nothing is added.

Note: [gradients through streamed evaluation]
    The same node stands for an *input* gradient through a block outside a training step (saliency in
    evaluation, ``Trainer(inference_mode=False)`` + ``torch.enable_grad()``; with Fabric, a block reached
    without the model ``fabric.setup`` returned): the slots' weights are overwritten by the next blocks, so no
    graph through them can be kept. The node takes the block's inputs that require grad among its inputs, so
    such a gradient is refused by name as the backward reaches it -- a forward under grad that nothing
    differentiates (a loss only logged) runs as before. (Before, the call itself was refused when an input
    required grad, which the embedding's output now does in evaluation, as under autograd.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern
from lightning_lazytrain.engine.refuse_backward import refusing_views

__all__ = ["guard_outputs", "refuse_accumulation"]

_FIX = ("compute gradients in a training step (training_step, manual_backward), or evaluate this way with "
        "strategy='auto'")


def refuse_accumulation(name: str) -> Any:
    """A post-accumulate-grad hook for a non-block copy bound in evaluation (Note: [weights in evaluation])."""
    def hook(_: torch.Tensor) -> None:
        raise UnsupportedBlockPattern(
            f"strategy='lazytrain': a backward outside a training step reached the non-block weight {name!r}: "
            "outside a training step the module holds a device copy of it, and a gradient accumulated there "
            "would never reach the weight the optimizer updates. torch.autograd.grad(loss, weight) of the "
            f"non-block weights is exact; otherwise {_FIX}")
    return hook


def _refusal(where: str) -> str:
    return (f"strategy='lazytrain': a gradient outside a training step reached {where}: there the block's weights "
            "stream through two slots and keep no graph, so neither its weights' nor its inputs' gradients exist. "
            "With the Trainer (weight or input gradients in evaluation: Trainer(inference_mode=False) with "
            f"torch.enable_grad()): {_FIX}. With Fabric, a block reached without the model fabric.setup returned "
            "(model.model(...), or a method not marked with fabric.mark_forward_method): call the set-up model, or "
            "mark the method")


def guard_outputs(out: Any, where: str, sources: list[torch.Tensor]) -> Any:
    """With grad enabled (the caller's check): ``out`` with its floating tensors passed through ``RefuseBackward``
    when one of ``sources`` (the block's inputs and weights) requires grad; else ``out`` unchanged."""
    trainable = [p for p in sources if p.requires_grad]
    if not trainable:
        return out
    leaves, spec = pytree.tree_flatten(out)
    idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not idx:
        return out
    guarded = refusing_views(_refusal(where), [leaves[i] for i in idx], trainable, copy=True)  # (edited in place)
    for i, t in zip(idx, guarded):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)
