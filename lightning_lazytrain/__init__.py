"""lightning-lazytrain: train models larger than GPU memory from PyTorch Lightning.

Importing the package registers the Lightning strategies ``"lazytrain"`` and
``"lazytrain_megatrain"`` when Lightning is installed; the planner (``lightning_lazytrain.planner``)
needs neither torch nor Lightning.
"""

__version__ = "0.1.0"


def _register() -> None:
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:  # planner-only installs (no torch / Lightning)
        return
    from lightning_lazytrain import strategy  # noqa: F401  (registers on import)
    from lightning_lazytrain import fabric_strategy  # noqa: F401  (registers Fabric(strategy="lazytrain"))


_register()
