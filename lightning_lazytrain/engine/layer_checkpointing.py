"""A model's own per-layer activation checkpointing, off on the streamed blocks while they stream.

Note: [a block's own checkpointing] Hugging Face's ``gradient_checkpointing_enable()`` sets
``gradient_checkpointing = True`` on each ``GradientCheckpointingLayer`` (the decoder layers: our blocks). Up to
transformers 5.17 the layer's ``__call__`` then runs ``torch.utils.checkpoint`` around ``Module.__call__``, outside
the block's ``forward`` the executor installs: the block runs first inside the checkpoint's forward (reentrant:
under ``no_grad``, so it only streams; non-reentrant: a planned pass whose saved tensors the checkpoint takes), and
again in the backward, where the checkpoint re-runs it with grad -- a second, out-of-order forward the plan refuses
("block 2 ... called after block(s) []"). Later versions checkpoint inside ``forward``, so the block's inside runs
a third time in the backward (our re-run, then the checkpoint's). Either way the plan's re-runs (recompute
boundaries, local re-runs, partial keep) already are the activation checkpointing: so while the executor streams
the blocks, their own flag is off (``quiet``, at install and at each micro-batch: a flag set later is caught too)
and the value the user set is back at ``close`` (``restore``) -- unless the user changed the block's checkpointing
since (``gradient_checkpointing_disable()`` mid-run: transformers binds ``_gradient_checkpointing_func`` afresh on
each enable or disable, so a block whose function is no longer the one seen when the flag went off keeps what the
user last set). Exact either way: a checkpoint's re-run gives the same values.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["quiet", "restore"]

log = logging.getLogger("lightning_lazytrain")


def quiet(blocks: Sequence[nn.Module], saved: dict[int, Any]) -> None:
    """Turn off the per-layer checkpointing flag of each block that has it on; ``saved``: block -> its checkpoint
    function when the flag went off (the latest time)."""
    turned = []
    for j, block in enumerate(blocks):
        if getattr(block, "gradient_checkpointing", False) is True and hasattr(block, "_gradient_checkpointing_func"):
            saved[j] = block._gradient_checkpointing_func
            block.gradient_checkpointing = False
            turned.append(j)
    if turned:
        log.info("lazytrain: the model's own gradient checkpointing is off on blocks %s while they stream (the plan's "
                 "re-runs are the activation checkpointing); it is back on when the strategy closes", turned)


def restore(blocks: Sequence[nn.Module], saved: dict[int, Any]) -> None:
    """Turn back on the flags ``quiet`` turned off, on the blocks whose checkpointing the user has not changed since."""
    for j, func in saved.items():
        if j < len(blocks) and getattr(blocks[j], "_gradient_checkpointing_func", None) is func:
            blocks[j].gradient_checkpointing = True
    saved.clear()
