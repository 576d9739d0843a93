"""``LazyTrainStrategy``'s checkpoint hooks: a mixin of the Trainer's strategy (``trainer.py``).

Lightning's side of a checkpoint (the state itself is the core's: ``core/checkpoint_state.py``): the pipelined
optimizer updates finished before the masters are read (a step begun in the backward and still open refuses, or,
while the run is failing, gives the checkpoint up), when a resume restores (before setup, or after it into the
shards and fp32 masters), and how the model state, the whole checkpoint and the optimizer states are saved and
loaded (``"sharded"`` through DCP: ``core/sharded_checkpoint.py``; ``"full"`` through ``checkpoint_io``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_lazytrain.adapters.precision import checkpoint_key

__all__ = ["CheckpointHooks"]


class CheckpointHooks(ParallelStrategy):
    """The checkpoint hooks of ``LazyTrainStrategy`` (core/checkpoint_state.py). The strategy provides
    ``core``, the options ``data_parallel`` and ``fp32_masters``, ``is_distributed`` and ``_half_step``."""

    core: Any
    _half_step: bool

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._finish_for_checkpoint()  # the host masters may still be being updated
        # data_parallel="shard": each rank's rows of the sharded parameters, as they are (no gather); the
        # masters, not the compute copies a bind holds in the modules (Note: [a state dict mid-bind])
        with self.core.masters_in_modules():
            return super().lightning_module_state_dict()

    def _finish_for_checkpoint(self) -> None:
        """Before a checkpoint reads the masters: the pipelined updates finished. A step begun in the
        backward and still open raises (its blocks updated cannot be taken back) -- but while the run is
        failing (Lightning's ``on_exception``: OnExceptionCheckpoint) raising would skip Lightning's
        teardown and hide the user's error, so the step is given up and the checkpoint not written."""
        trainer = _trainer_of(self.lightning_module)
        failing = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        if self.core.finish_optimizer_steps(None if failing else "a checkpoint"):
            self._half_step = True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Sharded data parallel: restore a checkpoint after setup, into the shards, so a resume reads
        each process's rows of the model (``load_sharded(model_rows=True)``), not the whole model on
        every process. Unless a user ``on_fit_start`` (module or callback; it runs between setup and
        a late restore) could look at the weights: then before setup, whole, as Lightning does.
        ``fp32_masters`` too: restored before setup, the fp32 masters would go through the precision
        plugin's bf16 conversion (``setup`` refuses that case, the weights-reading hook, by name)."""
        if not ((self.is_distributed and self.data_parallel == "shard") or self.fp32_masters):
            return False
        module = self.lightning_module
        trainer = _trainer_of(module)
        if module is None or trainer is None or is_overridden("on_fit_start", module):
            return False
        return not any(is_overridden("on_fit_start", cb, parent=Callback)
                       and not type(cb).__module__.startswith(("lightning.", "lightning_lazytrain."))
                       for cb in trainer.callbacks)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(self.core.checkpoints.model_state(checkpoint, self.lightning_module),
                                      strict=strict)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Several processes (``checkpoint_format="sharded"``): every rank writes its share of one
        directory through DCP, atomically (``core/sharded_checkpoint.py``). Otherwise rank 0 writes the
        whole checkpoint through ``checkpoint_io`` (one verified file, atomically)."""
        self._finish_for_checkpoint()
        if self._half_step:
            rank_zero_warn(f"lazytrain: the checkpoint {filepath} was not written: the run failed between a backward "
                           "whose HybridAdamW(updates_in_backward=True) updates began and its optimizer step, so the "
                           "weights hold that step half done; resume from the last checkpoint written before")
            return
        checkpoint_key(self.precision_plugin, checkpoint, saving=True)  # Note: [the plugin's checkpoint key]
        full = self.core.checkpoints.save(checkpoint, filepath, storage_options, self.lightning_module,
                                          self.optimizers)
        if full is not None and self.is_global_zero:
            self.checkpoint_io.save_checkpoint(full, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory (any world size, one process included) or a single file (every rank
        reads it through ``checkpoint_io``)."""
        loaded = self.core.checkpoints.load(checkpoint_path, weights_only)
        loaded = loaded if loaded is not None else super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint_key(self.precision_plugin, loaded, saving=False)  # Note: [the plugin's checkpoint key]
        return loaded

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """As Lightning's, but the states stay where the optimizer's parameters are -- on the host --
        instead of moving to the root device (``load_state_dict`` places them, HybridAdamW keeps
        8-bit dtypes; optim/checkpoint.py)."""
        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(self.core.checkpoints.optimizer_state(optimizer, opt_state))


def _trainer_of(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or None."""
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:  # "... is not attached to a `Trainer`"
        return None
