"""``make_copy_engine``: the copy engine's backend for a device (copy_cuda.py or copy_cpu.py), apart
from the interface both implement (copy_engine.py), which imports neither."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lightning_lazytrain.engine.copy_cpu import ThreadCopyEngine
from lightning_lazytrain.engine.copy_cuda import CudaCopyEngine
from lightning_lazytrain.engine.copy_engine import CopyEngine, LinkSpec

__all__ = ["make_copy_engine"]


def make_copy_engine(
    device: torch.device | str,
    links: Mapping[str, LinkSpec] | None = None,
    *,
    timeline: bool = True,
) -> CopyEngine:
    """The copy engine for ``device``: CUDA streams for a CUDA device, threads otherwise.

    ``links`` emulates lanes on the CPU backend; with CUDA only the NVMe lanes
    can be emulated (the PCIe lanes are real). ``timeline`` enables CUDA event
    timing for per-copy records (small overhead).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaCopyEngine(dev, links, timeline=timeline)
    return ThreadCopyEngine(links)
