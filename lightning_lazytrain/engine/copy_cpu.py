"""CPU copy engine: a worker thread per lane, optional link emulation.

Used when the compute device is the CPU (tests, CI, dry runs). "Device"
tensors are ordinary host tensors; what matters is that copies run
asynchronously, in FIFO order per lane, concurrently across lanes and, with
``links``, take the wall time a real link would. torch releases the GIL
inside ``copy_``, so the lanes really do overlap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from lightning_lazytrain.engine.copy_engine import (
    CopyEngine,
    CopyHandle,
    LaneWorker,
    LinkSpec,
    copy_through,
    link_bytes,
)

__all__ = ["ThreadCopyEngine"]


def _check_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"copy shape mismatch: dst {tuple(dst.shape)} vs src {tuple(src.shape)}")


class ThreadCopyEngine(CopyEngine):
    kind = "cpu"

    def __init__(self, links: Mapping[str, LinkSpec] | None = None) -> None:
        super().__init__(links)
        self._workers.update({lane: LaneWorker(self, lane, self.links.get(lane)) for lane in ("h2d", "d2h")})

    def _copy(
        self, lane: str, dst: torch.Tensor, src: torch.Tensor, after: Iterable[CopyHandle], tag: str | None,
        via: torch.Tensor | None,
    ) -> CopyHandle:
        self._check_open()
        _check_pair(dst, src)

        def run() -> None:
            with torch.no_grad():
                copy_through(lane, dst, src, via)

        # Bytes on the wire are the source's (a dtype cast happens on arrival), or via's dtype's.
        h = self._workers[lane].submit(link_bytes(lane, dst, src, via), run, list(after), tag, (dst, src, via))
        return self._track(h)

    def h2d(
        self, dst: torch.Tensor, src: torch.Tensor, *, after: Iterable[CopyHandle] = (), tag: str | None = None,
        via: torch.Tensor | None = None,
    ) -> CopyHandle:
        return self._copy("h2d", dst, src, after, tag, via)

    def d2h(
        self, dst: torch.Tensor, src: torch.Tensor, *, after: Iterable[CopyHandle] = (), tag: str | None = None,
        via: torch.Tensor | None = None,
    ) -> CopyHandle:
        return self._copy("d2h", dst, src, after, tag, via)
