"""The Trainer strategy's precision plugins: Lightning's own three (``Precision``, ``MixedPrecision``,
``HalfPrecision``), each subclassed once, here, with the training core at hand.

A strategy chooses its precision plugin (``Strategy.precision_plugin``, as ``FSDPStrategy`` does with
``FSDPPrecision``): ``LazyTrainStrategy`` builds the subclass of the plugin the Trainer resolved
(same arguments: precision, device, scaler). Two methods change, and only for what the core runs:

- ``clip_gradients`` (norm): for a ``HybridAdamW`` the clip is fused into its update, its global norm
  taken from each parameter's gradient norm, computed on the executor's host lane and handed over
  after the backward -- no separate pass over the gradients, and bit for bit the ``clip_grad_norm_``
  Lightning would run (Note: [exact clip] in optim/clip.py). Other optimizers over sharded blocks
  (``data_parallel="shard"``) clip with the norm of the whole gradients (``TrainingCore.clip_sharded``);
- ``optimizer_step``: when the plan's optimizer is ``pipelined`` and the optimizer's layers follow the
  blocks, the closure (forward, backward, ``on_before_optimizer_step``, clipping) runs as usual and
  then a layer-pipelined update starts and returns (core/optimizer_steps.py, Note: [pipelined step]).

Everything else is Lightning's (autocast, module conversion, loss scaling); the checkpoint key of a
plugin's state is its class name (``LazyTrainMixedPrecision`` for a scaler's).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType

__all__ = ["LazyTrainHalfPrecision", "LazyTrainMixedPrecision", "LazyTrainPrecision", "lazytrain_precision"]


class _CoreRouting:
    """The two overrides, shared by the three plugin classes below (``core``: the ``TrainingCore``)."""

    def __init__(self, *args: Any, core: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core = core

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        from lightning_lazytrain.optim import HybridAdamW

        inner = getattr(optimizer, "optimizer", optimizer)
        norm = GradClipAlgorithmType(gradient_clip_algorithm) == GradClipAlgorithmType.NORM
        if not (clip_val and clip_val > 0):
            return  # Lightning calls with 0 every step when no clip is set: nothing to clip
        if not self.core.automatic:  # Note: [a backward outside the strategy] (core/microbatches.py)
            self.core.close_open_microbatch(drop=False)
        # fused into the next step's update (that step only) where it is that step's one clip: the automatic
        # loop's, right before the step; a manual clip (between backwards) or a second clip (the optimizer's
        # own max_grad_norm) clips the gradients here, as under strategy="auto"
        if isinstance(inner, HybridAdamW) and norm and self.core.automatic and inner.max_grad_norm is None:
            inner.clip_next_step(float(clip_val))
            return
        # sharded blocks: a norm over this rank's tensors would be over its shards
        if norm and clip_val and clip_val > 0 and self.core.clip_sharded(optimizer, float(clip_val)):
            return
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[misc]

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # on_before_optimizer_step hooks and the clip run here, inside optimizer.step() before its update: edits they
        # made to bound non-block copies (a step inside a micro-batch) reach the masters before the update does
        # (Note: [an edit of a bound copy] in engine/bound_edits.py)
        super()._after_closure(model, optimizer)  # type: ignore[misc]
        self.core.sync_edits()

    def _closing(self, closure: Any) -> Any:
        """The closure (training_step, backward), then the step's last micro-batch closed if its training_step
        returned None (no backward ran), before the hooks, clipping and unscaling that follow the closure."""
        return _closed_after(self.core, closure) if callable(closure) else closure

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        inner = getattr(optimizer, "optimizer", optimizer)
        if not self.core.automatic:  # Note: [a backward outside the strategy] (core/microbatches.py)
            self.core.close_open_microbatch(drop=False)
        closure = self._closing(closure)
        if not self.core.automatic and self.core.in_microbatch:  # Note: [a step inside a micro-batch] (core/microbatches.py): a serial step
            with self.core.stepping(inner):
                return super().optimizer_step(optimizer, model, closure, **kwargs)  # type: ignore[misc]
        if kwargs or getattr(self, "scaler", None) is not None or self.core.pipelined_order(inner) is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)  # type: ignore[misc]
        result = self._wrap_closure(model, optimizer, closure)  # type: ignore[attr-defined]
        if not self.core.start_pipelined_step(inner):  # the closure's backward re-planned to a serial step
            optimizer.step()
        return result


def _closed_after(core: Any, closure: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        result = closure(*args, **kwargs)
        core.end_skipped_microbatch()  # Note: [a step's last micro-batch skipped] (core/microbatches.py)
        return result

    return run


class LazyTrainPrecision(_CoreRouting, Precision):
    """``Precision`` (32-true)."""


class LazyTrainMixedPrecision(_CoreRouting, MixedPrecision):
    """``MixedPrecision`` (bf16-mixed, 16-mixed: autocast over fp32 weights, a loss scaler for 16-mixed)."""


class LazyTrainHalfPrecision(_CoreRouting, HalfPrecision):
    """``HalfPrecision`` (bf16-true, 16-true)."""


def checkpoint_key(plugin: Any, checkpoint: dict, *, saving: bool) -> None:
    """Note: [the plugin's checkpoint key]
        Lightning stores a precision plugin's state (16-mixed's GradScaler: its scale and growth tracker)
        under the plugin class's ``__qualname__`` and reads it back under the same key. A checkpoint holds
        it under the base class's name ("MixedPrecision") whichever strategy wrote it: the strategy renames
        the key when it saves (``saving``) and back when it loads, so a run resumed under the other strategy
        keeps the scale (under a name of its own each side would find no state and start the scale over)."""
    if not isinstance(plugin, _CoreRouting):
        return
    base = next(c for c in type(plugin).__mro__ if c.__module__.startswith("lightning.")).__qualname__
    ours = type(plugin).__qualname__
    old, new = (ours, base) if saving else (base, ours)
    if old in checkpoint and new not in checkpoint:
        checkpoint[new] = checkpoint.pop(old)


def lazytrain_precision(plugin: Precision | None, core: Any) -> Precision:
    """The strategy's plugin for the one the Trainer resolved: the matching class above, built with the
    same arguments. Any other plugin is returned as it is (the strategy refuses it at setup)."""
    if isinstance(plugin, _CoreRouting):
        return plugin
    if plugin is None or type(plugin) is Precision:
        return LazyTrainPrecision(core=core)
    if type(plugin) is MixedPrecision:
        return LazyTrainMixedPrecision(plugin.precision, plugin.device, plugin.scaler, core=core)
    if type(plugin) is HalfPrecision:
        return LazyTrainHalfPrecision(plugin.precision, core=core)
    return plugin


def is_lazytrain_precision(plugin: Any) -> bool:
    return isinstance(plugin, _CoreRouting)
