"""The training core's checkpoint state: what a checkpoint holds of a streamed run, and how it is
written and read with several processes.

One process (or ``checkpoint_format="full"``, a remote path, ``storage_options``): one plain
checkpoint dict that rank 0 writes through the strategy's ``CheckpointIO``. Several processes with
``checkpoint_format="sharded"`` (the default): one directory written by every rank through
``torch.distributed.checkpoint`` (``sharded_checkpoint.py``, Note: [sharded checkpoint]). With
``data_parallel="shard"`` the state dict and optimizer states stay shard-shaped: a sharded save
writes each rank's rows, a full save gathers every tensor first, a load cuts each rank's rows
(``engine/shard_store.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_lazytrain.core.optimizer_steps import hybrid_adamws
from lightning_lazytrain.core.options import CoreOptions, ProcessLayout
from lightning_lazytrain.engine.shard_store import ShardedParamStore

__all__ = ["CheckpointState", "SHARD_NO_CHECKPOINTS"]

SHARD_NO_CHECKPOINTS = (
    "LazyTrainStrategy(data_parallel='shard', checkpoint_format='full') cannot write 8-bit optimizer states "
    "(they are blockwise over each process's shard, with no whole form): use checkpoint_format='sharded' "
    "(the default: each process writes its own), 32-bit states (HybridAdamW(eight_bit='none')), "
    "Trainer(enable_checkpointing=False), or data_parallel='replicate'")


class CheckpointState:
    """The checkpoint transforms of one run: built by ``TrainingCore`` from its options, its process
    layout, its gradient sync (several processes) and its sharded store (``data_parallel="shard"``)."""

    def __init__(self, options: CoreOptions, layout: ProcessLayout, grad_sync: Any, store: ShardedParamStore | None,
                 warn: Callable[[str], None]) -> None:
        self.options = options
        self.layout = layout
        self.grad_sync = grad_sync
        self.store = store
        self._warn = warn

    def writes_sharded(self, filepath: Any, storage_options: Any, *, warn: bool = True) -> bool:
        """``filepath`` is saved as a sharded directory (several processes, ``checkpoint_format="sharded"``,
        a local path without ``storage_options``)."""
        if self.options.checkpoint_format != "sharded" or not self.layout.is_distributed or self.grad_sync is None:
            return False
        if storage_options is not None or "://" in str(filepath):
            if warn and self.layout.is_global_zero:
                self._warn(f"lazytrain: {filepath} is saved as one full checkpoint from rank 0: sharded "
                           "checkpoints are written to local (or shared) directories without storage_options")
            return False
        return True

    def check_targets(self, dirpaths: list, optimizers: list) -> None:
        """Before the first step: a sharded run's 8-bit optimizer states cannot be saved whole (a full
        checkpoint, or a remote directory); refused with the fix."""
        if self.store is None or not any(8 in o.assignment.values() for o in hybrid_adamws(optimizers)):
            return
        if any(not self.writes_sharded(d, None, warn=False) for d in dirpaths):
            raise ValueError(SHARD_NO_CHECKPOINTS)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any, module: Any,
             optimizers: list) -> dict[str, Any] | None:
        """Write ``checkpoint`` as a sharded directory (every rank; None returned), or return the dict
        rank 0 writes as one file (a sharded store's tensors gathered whole first: a collective)."""
        if self.writes_sharded(filepath, storage_options):
            from lightning_lazytrain.core.sharded_checkpoint import save_sharded

            # data_parallel="shard": each rank writes its rows (and its own 8-bit states); none gathers
            layout = self.store.checkpoint_layout(checkpoint, module, optimizers) if self.store else None
            save_sharded(checkpoint, filepath, group=self.grad_sync.group, layout=layout)
            return None
        if self.store is not None:
            checkpoint = {**checkpoint, "state_dict": self.store.whole_module_state(checkpoint["state_dict"], module)}
            if "optimizer_states" in checkpoint:
                checkpoint["optimizer_states"] = [
                    self.store.whole_optimizer_state(getattr(o, "optimizer", o), st)
                    for o, st in zip(optimizers, checkpoint["optimizer_states"])]
        return checkpoint

    def load(self, path: Any, weights_only: bool | None) -> dict[str, Any] | None:
        """A sharded directory (any world size, one process included) read as one checkpoint dict;
        None when ``path`` is a single file (the strategy's ``CheckpointIO`` reads it)."""
        from lightning_lazytrain.core.sharded_checkpoint import is_sharded_checkpoint, load_sharded

        if not is_sharded_checkpoint(path):
            return None
        sync = self.grad_sync
        group = sync.group if sync is not None else None
        # per-process entries (8-bit states of a sharded run) are this rank's in its shard group
        shard = (sync.shard_rank, sync.shard_size) if sync is not None and self.options.data_parallel == "shard" \
            else None
        # after setup (a late restore) the module's parameters are shards: read only this rank's rows
        return load_sharded(path, group=group, weights_only=weights_only, verify=self.options.verify_checkpoints,
                            shard=shard, model_rows=self.store is not None)

    def model_state(self, checkpoint: dict[str, Any], module: Any) -> dict[str, Any]:
        """The checkpoint to load into the module: this rank's rows of every sharded parameter."""
        if self.store is None:
            return checkpoint
        return {**checkpoint, "state_dict": self.store.shard_module_state(checkpoint["state_dict"], module)}

    def optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer state to load: this rank's rows of every sharded parameter's states."""
        if self.store is None:
            return state
        return self.store.shard_optimizer_state(getattr(optimizer, "optimizer", optimizer), state)
