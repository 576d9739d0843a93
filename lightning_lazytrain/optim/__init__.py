"""Hybrid 8-bit AdamW with fused gradient clipping and a layer-pipelined step.

Imports torch only; bitsandbytes is imported on first use of an 8-bit state, so
``eight_bit="none"`` works without it.
"""

from .assign import (
    BNB_BLOCK_SIZE,
    DEFAULT_MIN_8BIT_NUMEL,
    EightBitPolicy,
    StateBytes,
    assign_state_bits,
    eligible_for_8bit,
    estimate_state_bytes,
    is_norm_name,
    param_state_bytes,
)
from .bnb8bit import bnb_available
from .clip import (
    ClipDecision,
    clip_coefficient,
    decide_clip,
    global_grad_norm,
    norm_from_sq_norms,
)
from .config import HybridAdamWConfig
from .hybrid_adamw import HybridAdamW
from .pipeline import LayerPipeline, group_by_layer

__all__ = [
    "BNB_BLOCK_SIZE",
    "DEFAULT_MIN_8BIT_NUMEL",
    "ClipDecision",
    "EightBitPolicy",
    "HybridAdamW",
    "HybridAdamWConfig",
    "LayerPipeline",
    "StateBytes",
    "assign_state_bits",
    "bnb_available",
    "clip_coefficient",
    "decide_clip",
    "eligible_for_8bit",
    "estimate_state_bytes",
    "global_grad_norm",
    "group_by_layer",
    "is_norm_name",
    "norm_from_sq_norms",
    "param_state_bytes",
]
