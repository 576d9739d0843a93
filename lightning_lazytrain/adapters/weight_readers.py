"""Which hooks of a fit may read the weights between an optimizer step and the next forward.

Note: [weights read after the step]
    A pipelined step (core/optimizer_steps.py, Note: [pipelined step]) returns before every host
    master is updated -- the next forward waits for each block in turn -- and so do the updates of a
    step begun in the backward that were still waiting (Note: [most urgent first] in
    optim/pipeline.py). Under ``strategy="auto"`` every weight holds its new value when the step
    returns. A hook that runs in between and reads weights (an EMA or weight-averaging callback, a
    logger of weight norms) would see some layers updated and others not. So where the module or a
    callback overrides a hook that runs there (``HOOKS``; for the module also ``MODULE_HOOKS``: the batch's transfer
    hooks and ``optimizer_step``), the fit is planned with a serial optimizer
    step (the MILP prices it so) and a pipelined step (a plan file's) is waited for before the step
    returns; the log says which hook. Trusted, and so not counted: Lightning's own callbacks except
    the ones that read or change weights (``WEIGHT_CALLBACKS``), the project's own, and any callback or
    module that declares ``reads_gradients_only = True`` (it reads no weights and edits nothing: it
    logs, times or reads gradients).

    ``training_step`` itself runs under a guard that waits for the updates before it reads their weights
    (Note: [weights read before the forward] in core/weight_reads.py). A read the guard cannot see -- a
    TorchScript function, another thread, a numpy array kept as an alias of a weight -- is declared with
    ``reads_weights_unseen = True`` on the module: the step is then serial, as for a hook above.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

__all__ = ["HOOKS", "gradients_read_after_step", "weights_read_after_step"]

# the hooks that run after an optimizer step and before the next forward (validation, checkpoints and
# teardown wait for the updates themselves; on_before_zero_grad runs after the next forward)
HOOKS = ("on_train_batch_end", "on_train_epoch_end", "on_train_epoch_start", "on_train_batch_start")
# ... and the LightningModule's own that run there: the batch's transfer hooks (before on_train_batch_start), and
# optimizer_step itself, whose override may read the weights after calling super() (an EMA kept there)
MODULE_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer", "optimizer_step")


def _weight_callbacks() -> tuple[type, ...]:
    """Lightning's callbacks that read or change weights between steps, or run the user's code there
    (``LambdaCallback``; names as of lightning 2.6)."""
    import lightning.pytorch.callbacks as cbs

    names = ("WeightAveraging", "StochasticWeightAveraging", "ModelPruning", "BaseFinetuning", "LambdaCallback")
    return tuple(getattr(cbs, n) for n in names if hasattr(cbs, n))


def _trusted(cb: Any) -> bool:
    if getattr(cb, "reads_gradients_only", False):
        return True
    if isinstance(cb, _weight_callbacks()):
        return False
    return type(cb).__module__.startswith(("lightning.", "lightning_lazytrain."))


def weights_read_after_step(module: Any, callbacks: list) -> str | None:
    """Why the fit's optimizer step must have updated every weight when it returns (Note: [weights
    read after the step]), naming the hooks; None when no untrusted hook runs between a step and the
    next forward. Manual optimization counts too (``training_step`` itself may read the weights after
    ``optimizer.step()``)."""
    found = []
    if getattr(module, "reads_weights_unseen", False):
        found.append("training_step (the module declares reads_weights_unseen)")
    if not getattr(module, "reads_gradients_only", False):
        found += _hooks(module)
        if not module.automatic_optimization:
            found.append("manual optimization (training_step may read the weights after optimizer.step())")
    for cb in callbacks:
        if not _trusted(cb):
            found += _hooks(cb)
    if not found:
        return None
    return (f"{', '.join(found[:4])}{' ...' if len(found) > 4 else ''} may read the weights between the step and "
            "the next forward (declare reads_gradients_only = True on a callback or module that reads none)")


def gradients_read_after_step(module: Any, callbacks: list) -> str | None:
    """The hooks trusted to read no weights (``reads_gradients_only = True``) that run between a step and
    the next forward and so may read its gradients (Note: [gradients read after a clipped step] in
    optim/hybrid_adamw.py); None when there are none."""
    found = [hook for obj in [module, *callbacks] if getattr(obj, "reads_gradients_only", False)
             for hook in _hooks(obj)]
    return ", ".join(found) if found else None


def _hooks(obj: Any) -> list[str]:
    """The ``HOOKS`` the LightningModule ``obj`` or the callback ``obj`` overrides, named for a message."""
    if isinstance(obj, Callback):
        return [f"{type(obj).__name__}.{name}" for name in HOOKS if is_overridden(name, obj, parent=Callback)]
    return [f"the LightningModule's {name}" for name in HOOKS + MODULE_HOOKS if is_overridden(name, obj)]
