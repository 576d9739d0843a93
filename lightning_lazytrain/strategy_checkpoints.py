"""Checkpoints of ``LazyTrainStrategy`` (a mixin of it, strategy.py): the state dicts Lightning saves
and loads, one verified file or a sharded directory (``sharded_checkpoint.py``), and, with
``data_parallel="shard"``, each process's rows of the sharded tensors (``engine/shard_store.py``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["StrategyCheckpoints"]


class StrategyCheckpoints:
    """Checkpoint methods of ``LazyTrainStrategy`` (it provides ``executor``, ``optimizers``,
    ``grad_sync``, ``data_parallel``, ``checkpoint_format`` and the rest of Lightning's strategy)."""

    _SHARD_NO_CHECKPOINTS = (
        "LazyTrainStrategy(data_parallel='shard', checkpoint_format='full') cannot write 8-bit optimizer states "
        "(they are blockwise over each process's shard, with no whole form): use checkpoint_format='sharded' "
        "(the default: each process writes its own), 32-bit states (HybridAdamW(eight_bit='none')), "
        "Trainer(enable_checkpointing=False), or data_parallel='replicate'")

    def _eight_bit_states(self) -> bool:
        from lightning_lazytrain.optim import HybridAdamW

        return any(isinstance(inner := getattr(o, "optimizer", o), HybridAdamW) and 8 in inner.assignment.values()
                   for o in self.optimizers)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._finish_optimizer_steps()  # the host masters may still be being updated
        # data_parallel="shard": each rank's rows of the sharded parameters, as they are (no gather);
        # save_checkpoint writes them as rows of a sharded checkpoint, or gathers them for one file
        return super().lightning_module_state_dict()

    def _shard_store(self) -> Any:
        """The executor's ShardedParamStore (data_parallel="shard" with several processes), or None."""
        params = self.executor.params if self.executor is not None else None
        return params if params is not None and hasattr(params, "whole_module_state") else None

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
        from lightning.pytorch.utilities.model_helpers import is_overridden

        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if module is None or trainer is None or is_overridden("on_fit_start", module):
            return False
        return not any(is_overridden("on_fit_start", cb, parent=Callback)
                       and not type(cb).__module__.startswith(("lightning.", "lightning_lazytrain."))
                       for cb in trainer.callbacks)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        store = self._shard_store()
        if store is not None:  # this rank's rows of every sharded parameter
            checkpoint = {**checkpoint, "state_dict": store.shard_module_state(checkpoint["state_dict"],
                                                                               self.lightning_module)}
        super().load_model_state_dict(checkpoint, strict=strict)

    # ---- checkpoints --------------------------------------------------------------------------
    def _sharded_checkpoint(self, filepath: Any, storage_options: Any, *, warn: bool = True) -> bool:
        """Save ``filepath`` as a sharded directory (several processes, ``checkpoint_format="sharded"``)."""
        if self.checkpoint_format != "sharded" or not self.is_distributed or self.grad_sync is None:
            return False
        if storage_options is not None or "://" in str(filepath):
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            if warn:
                rank_zero_warn(f"lazytrain: {filepath} is saved as one full checkpoint from rank 0: sharded "
                               "checkpoints are written to local (or shared) directories without storage_options")
            return False
        return True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Several processes (``checkpoint_format="sharded"``): every rank writes its share of one
        directory through DCP, atomically (``sharded_checkpoint.py``). Otherwise rank 0 writes the
        whole checkpoint through ``checkpoint_io`` (one verified file, atomically)."""
        self._finish_optimizer_steps()
        store = self._shard_store()
        if self._sharded_checkpoint(filepath, storage_options):
            from lightning_lazytrain.sharded_checkpoint import save_sharded

            # data_parallel="shard": each rank writes its rows (and its own 8-bit states); none gathers
            layout = store.checkpoint_layout(checkpoint, self.lightning_module, self.optimizers) if store else None
            save_sharded(checkpoint, filepath, group=self.grad_sync.group, layout=layout)
            return
        if store is not None:  # one file: every sharded tensor gathered whole first (collective)
            checkpoint = {**checkpoint, "state_dict": store.whole_module_state(checkpoint["state_dict"],
                                                                               self.lightning_module)}
            if "optimizer_states" in checkpoint:
                checkpoint["optimizer_states"] = [store.whole_optimizer_state(getattr(o, "optimizer", o), st)
                                                  for o, st in zip(self.optimizers, checkpoint["optimizer_states"])]
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory (any world size, one process included) or a single file (every rank
        reads it through ``checkpoint_io``)."""
        from lightning_lazytrain.sharded_checkpoint import is_sharded_checkpoint, load_sharded

        if is_sharded_checkpoint(checkpoint_path):
            sync = self.grad_sync
            group = sync.group if sync is not None else None
            # per-process entries (8-bit states of a sharded run) are this rank's in its shard group
            shard = (sync.shard_rank, sync.shard_size) if sync is not None and self.data_parallel == "shard" else None
            # after setup (restore_checkpoint_after_setup) the module's parameters are shards: read
            # only this rank's rows of the model too
            return load_sharded(checkpoint_path, group=group, weights_only=weights_only,
                                verify=self._verify_checkpoints, shard=shard,
                                model_rows=self._shard_store() is not None)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """As Lightning's, but the states stay where the optimizer's parameters are -- on the host --
        instead of moving to the root device (``load_state_dict`` places them, HybridAdamW keeps
        8-bit dtypes; optim/checkpoint.py)."""
        store = self._shard_store()
        for optimizer, opt_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if store is not None:  # this rank's rows of every sharded parameter's states
                opt_state = store.shard_optimizer_state(getattr(optimizer, "optimizer", optimizer), opt_state)
            optimizer.load_state_dict(opt_state)
