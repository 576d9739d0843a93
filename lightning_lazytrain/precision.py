"""The strategy's precision extension: Lightning's own precision plugin, subclassed.

``LazyTrainStrategy`` hands Lightning an instance of a subclass of whatever plugin the Trainer
chose (``Precision``, ``MixedPrecision``, ``HalfPrecision``, ...) that changes two things, and
only for ``HybridAdamW``:

- ``clip_gradients`` (norm): the clip is fused into HybridAdamW's update, its global norm taken
  from each parameter's gradient norm, computed on the executor's host lane and handed over after
  the backward — no separate pass over the gradients, and bit for bit the ``clip_grad_norm_`` the
  original plugin would run (Note: [exact clip] in optim/clip.py);
- ``optimizer_step``: when the plan's optimizer is ``pipelined`` and the optimizer's layers follow
  the blocks, the closure (forward, backward, ``on_before_optimizer_step``, clipping) runs as usual
  and then a layer-pipelined update starts in forward order and returns; the next forward stages
  block j as soon as block j is updated.

Everything else is the original plugin's (autocast, module conversion, loss scaling).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType

__all__ = ["LazyTrainPrecision", "with_lazytrain_precision"]


class LazyTrainPrecision:
    """Mixed into a subclass of the Trainer's precision plugin (see ``with_lazytrain_precision``)."""

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        from lightning_lazytrain.optim import HybridAdamW

        inner = getattr(optimizer, "optimizer", optimizer)
        norm = GradClipAlgorithmType(gradient_clip_algorithm) == GradClipAlgorithmType.NORM
        if isinstance(inner, HybridAdamW) and norm:
            inner.max_grad_norm = float(clip_val) if clip_val and clip_val > 0 else None
            return
        sharded = getattr(self, "_sharded_clip", None)  # the strategy, with data_parallel="shard"
        if norm and clip_val and clip_val > 0 and sharded is not None:
            # a norm over this rank's tensors would be over its shards: the clip with the norm of the
            # whole gradients, as DDP's (strategy.py, LazyTrainStrategy.clip_sharded)
            sharded.clip_sharded(optimizer, float(clip_val))
            return
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        strategy = getattr(getattr(model, "trainer", None), "strategy", None)
        inner = getattr(optimizer, "optimizer", optimizer)
        pipelined = getattr(strategy, "pipelined_order", None)
        if pipelined is None or pipelined(inner) is None or getattr(self, "scaler", None) is not None or kwargs:
            return super().optimizer_step(optimizer, model, closure, **kwargs)  # type: ignore[misc]
        result = self._wrap_closure(model, optimizer, closure)  # type: ignore[attr-defined]
        strategy.start_pipelined_step(inner)
        return result


_SUBCLASSES: dict[type, type] = {}


def with_lazytrain_precision(plugin: Precision) -> Precision:
    """The same plugin (same state), as an instance of a ``LazyTrainPrecision`` subclass of its class."""
    if isinstance(plugin, LazyTrainPrecision):
        return plugin
    base = type(plugin)
    cls = _SUBCLASSES.get(base)
    if cls is None:
        cls = _SUBCLASSES[base] = type(f"LazyTrain{base.__name__}", (LazyTrainPrecision, base), {})
    routed = object.__new__(cls)
    routed.__dict__.update(plugin.__dict__)
    return routed
