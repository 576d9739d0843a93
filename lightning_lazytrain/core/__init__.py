"""The training core: layer-streaming training without Lightning (``TrainingCore``), between the
engine (``engine/``) and the Lightning/Fabric strategies (``adapters/``). Imports torch, the engine,
the planner and the optimizer, never Lightning."""

from lightning_lazytrain.core.options import CoreOptions, FitSettings, ProcessLayout
from lightning_lazytrain.core.training_core import TrainingCore

__all__ = ["CoreOptions", "FitSettings", "ProcessLayout", "TrainingCore"]
