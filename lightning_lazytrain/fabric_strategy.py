"""``LazyTrainFabricStrategy``, Fabric's layer-streaming strategy. Importing this module registers its
names with Fabric::

    import lightning_lazytrain.fabric_strategy   # Fabric(strategy="lazytrain"), "lazytrain_megatrain"

The class is ``adapters/fabric.py``'s (Fabric's hooks over the training core, ``core/``).
"""

from lightning_lazytrain.adapters.fabric import SUPPORTED_PRECISIONS, LazyTrainFabricStrategy

__all__ = ["LazyTrainFabricStrategy", "SUPPORTED_PRECISIONS"]
