"""The Lightning strategies over the training core (``core/``): the Trainer's (``trainer.py``) and
Fabric's (``fabric.py``), the Trainer's precision plugins, what both need of devices and processes,
and the one module that uses Lightning's private names (``lightning_internals.py``). Import
``lightning_lazytrain.strategy`` or ``lightning_lazytrain.fabric_strategy`` to register the names."""
