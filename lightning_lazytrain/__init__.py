"""lightning-lazytrain: train models larger than GPU memory from PyTorch Lightning.

The package's layers, each importing only those before it::

    planner/ (no torch) -> engine/ -> core/ (the training core, no Lightning) -> adapters/ (Trainer, Fabric) -> cli/

Importing the package imports neither torch nor Lightning (the planner and ``lazytrain-plan`` need
neither, and Lightning takes seconds to import), and registers nothing. The strategies register their
names when their modules are imported::

    import lightning_lazytrain.strategy          # Trainer(strategy="lazytrain"), "lazytrain_megatrain"
    import lightning_lazytrain.fabric_strategy   # Fabric(strategy="lazytrain"), "lazytrain_megatrain"
"""

__version__ = "0.1.0"
