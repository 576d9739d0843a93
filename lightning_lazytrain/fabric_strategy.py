"""``LazyTrainFabricStrategy``, Fabric's layer-streaming strategy. Importing this module registers its
names with Fabric::

    import lightning_lazytrain.fabric_strategy   # Fabric(strategy="lazytrain"), "lazytrain_megatrain"

The class is ``adapters/fabric.py``'s (Fabric's hooks over the training core, ``core/``).

The errors the strategy raises are here too: ``BlockDiscoveryError`` (no block stack found in the
module), ``CorruptCheckpoint`` (a damaged checkpoint, before anything is loaded) and
``CheckpointWriteError`` (a failed save, an ``OSError``).
"""

from lightning_lazytrain.adapters.fabric import SUPPORTED_PRECISIONS, LazyTrainFabricStrategy
from lightning_lazytrain.core.checkpoint_files import CheckpointWriteError, CorruptCheckpoint
from lightning_lazytrain.engine.blocks import BlockDiscoveryError

__all__ = ["BlockDiscoveryError", "CheckpointWriteError", "CorruptCheckpoint", "LazyTrainFabricStrategy",
           "SUPPORTED_PRECISIONS"]
