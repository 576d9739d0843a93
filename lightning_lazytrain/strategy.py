"""``LazyTrainStrategy``, the Trainer's layer-streaming strategy. Importing this module registers its
names with the Trainer::

    import lightning_lazytrain.strategy          # Trainer(strategy="lazytrain"), "lazytrain_megatrain"

The class is ``adapters/trainer.py``'s (the Trainer's hooks over the training core, ``core/``).

The errors the strategy raises are here too: ``BlockDiscoveryError`` (no block stack found in the
module), ``CorruptCheckpoint`` (a damaged checkpoint, before anything is loaded) and
``CheckpointWriteError`` (a failed save, an ``OSError``).
"""

from lightning_lazytrain.adapters.trainer import COMPUTE_DTYPES, LazyTrainStrategy
from lightning_lazytrain.core.checkpoint_files import CheckpointWriteError, CorruptCheckpoint
from lightning_lazytrain.engine.blocks import BlockDiscoveryError

__all__ = ["COMPUTE_DTYPES", "BlockDiscoveryError", "CheckpointWriteError", "CorruptCheckpoint", "LazyTrainStrategy"]
