"""Execution engine: copy engine, activation store, parameter store.

Imports torch, never Lightning. The CUDA paths are guarded so everything
imports (and the CPU paths run) on a CPU-only machine.
"""

from lightning_lazytrain.engine.activation_store import ActivationStore, Tier
from lightning_lazytrain.engine.copy_engine import (
    LANES,
    CopyEngine,
    CopyError,
    CopyHandle,
    CopyRecord,
    LinkSpec,
)
from lightning_lazytrain.engine.copy_factory import make_copy_engine
from lightning_lazytrain.engine.nvme import NvmeDirError, SpillDir, check_nvme_dir
from lightning_lazytrain.engine.param_store import REST, ParamStore

__all__ = [
    "LANES",
    "REST",
    "ActivationStore",
    "CopyEngine",
    "CopyError",
    "CopyHandle",
    "CopyRecord",
    "LinkSpec",
    "NvmeDirError",
    "ParamStore",
    "SpillDir",
    "Tier",
    "check_nvme_dir",
    "make_copy_engine",
]
