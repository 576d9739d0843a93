"""``LazyTrainStrategy``, the Trainer's layer-streaming strategy. Importing this module registers its
names with the Trainer::

    import lightning_lazytrain.strategy          # Trainer(strategy="lazytrain"), "lazytrain_megatrain"

The class is ``adapters/trainer.py``'s (the Trainer's hooks over the training core, ``core/``).
"""

from lightning_lazytrain.adapters.trainer import COMPUTE_DTYPES, LazyTrainStrategy

__all__ = ["COMPUTE_DTYPES", "LazyTrainStrategy"]
