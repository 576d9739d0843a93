"""Per-parameter dim-0 sharding of a parameter group over the ranks of a node: the layout of the
sharded data-parallel mode (the design is in docs/ARCHITECTURE.md, "Several devices").

Parameter ``p`` of shape ``(d0, *rest)`` (a 0-dim parameter counts as ``(1,)``) is cut into ``world``
row blocks of ``k = ceil(d0 / world)`` rows; rank ``r`` owns rows ``[r k, min((r + 1) k, d0))``
(possibly none) and keeps them, padded to ``k`` rows, at ``shard_offset`` in its flat shard buffer
(every parameter starts at a multiple of ``ALIGN`` elements, as in the ``ParamStore``'s packing:
CPU kernels round differently on misaligned operands). This is FSDP2's layout: a shard is still one
tensor per parameter, so weight decay, 8-bit state assignment and names stay per parameter.

Moving a group then takes one collective each way, on flat buffers:

* weights: every rank contributes its shard buffer to an all-gather into a rank-major buffer
  (``world x shard_numel``); ``gather_into`` copies it out into the param-major flat buffer the
  ``ParamStore`` binds (one strided copy per parameter);
* gradients: ``scatter_into`` copies the param-major gradient buffer into rank-major order (padding
  rows zero), and a reduce-scatter of that buffer leaves each rank the sum of its own shard.

Pure tensor code (no collectives here), device-agnostic; ``tests/test_shard_layout.py`` checks the
round trips on one process and the all-gather / reduce-scatter on two gloo processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ShardLayout", "ShardSpec"]

ALIGN = 64  # as engine/param_store.ALIGN


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ShardSpec:
    shape: torch.Size  # the full parameter's
    rows: int  # d0 (1 for a 0-dim parameter)
    rows_per_rank: int  # k = ceil(rows / world)
    row_numel: int  # elements per row (prod of the other dims)
    full_offset: int  # in the param-major flat buffer
    shard_offset: int  # in a rank's flat shard buffer

    @property
    def shard_numel(self) -> int:
        return self.rows_per_rank * self.row_numel

    def owned_rows(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of the full parameter rank ``rank`` owns (``start == stop``: none)."""
        start = min(rank * self.rows_per_rank, self.rows)
        return start, min(start + self.rows_per_rank, self.rows)


class ShardLayout:
    """The shard layout of one group: ``shapes`` and their ``full_offsets`` in the param-major flat
    buffer (the ``ParamStore``'s packing), over ``world`` ranks."""

    def __init__(self, shapes: Sequence[Sequence[int]], full_offsets: Sequence[int], world: int) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if len(shapes) != len(full_offsets):
            raise ValueError(f"{len(shapes)} shapes but {len(full_offsets)} offsets")
        self.world = world
        specs, off = [], 0
        for shape, full_offset in zip(shapes, full_offsets):
            shape = torch.Size(shape)
            rows = shape[0] if len(shape) else 1
            row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
            k = -(-rows // world)
            specs.append(ShardSpec(shape, rows, k, row_numel, int(full_offset), off))
            off = _aligned(off + k * row_numel)
        self.specs: tuple[ShardSpec, ...] = tuple(specs)
        self.shard_numel = off  # per rank, padded

    @property
    def gathered_numel(self) -> int:
        return self.world * self.shard_numel

    def _rank_major(self, buf: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """``buf`` (world x shard_numel) as the parameter's padded row blocks, ``(world, k, row_numel)``
        (a view: writes land in ``buf``)."""
        return (buf.view(self.world, self.shard_numel)[:, spec.shard_offset: spec.shard_offset + spec.shard_numel]
                .view(self.world, spec.rows_per_rank, spec.row_numel))

    @staticmethod
    def _pairs(blocks: torch.Tensor, rows: torch.Tensor, spec: ShardSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Matching (rank-major, param-major) views covering the parameter's rows: the ranks whose
        block is full, then the one partly filled (at most two copies per parameter)."""
        k = spec.rows_per_rank
        n = spec.rows // k
        out = [(blocks[:n], rows[: n * k].view(n, k, spec.row_numel))] if n else []
        if spec.rows - n * k:
            out.append((blocks[n, : spec.rows - n * k], rows[n * k:]))
        return out

    def _full_rows(self, full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        return full[spec.full_offset: spec.full_offset + spec.rows * spec.row_numel].view(spec.rows, spec.row_numel)

    def shard_of(self, full: torch.Tensor, rank: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank ``rank``'s flat shard buffer of the param-major ``full`` buffer (padding zero)."""
        if out is None:
            out = torch.zeros(self.shard_numel, dtype=full.dtype, device=full.device)
        else:
            out.zero_()  # the alignment gaps too
        for i, spec in enumerate(self.specs):
            self.fill_shard(self.local_view(out, i), self._full_rows(full, spec), i, rank)
        return out

    def fill_shard(self, shard: torch.Tensor, full: torch.Tensor, i: int, rank: int) -> None:
        """Write rank ``rank``'s rows of parameter ``i``'s full-shaped ``full`` into its shard-shaped
        ``shard`` (padding rows zero)."""
        spec = self.specs[i]
        start, stop = spec.owned_rows(rank)
        rows = shard.reshape(spec.rows_per_rank, spec.row_numel)
        rows.zero_()
        if stop > start:
            rows[: stop - start].copy_(full.reshape(spec.rows, spec.row_numel)[start:stop])

    def local_view(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s shard in a flat shard buffer, shaped ``(k, *rest)`` (0-dim: ``(k,)``)."""
        spec = self.specs[i]
        flat = shard[spec.shard_offset: spec.shard_offset + spec.shard_numel]
        return flat.view(spec.rows_per_rank, *spec.shape[1:]) if len(spec.shape) else flat

    def gather_into(self, gathered: torch.Tensor, full: torch.Tensor) -> None:
        """Copy an all-gathered rank-major buffer (``gathered_numel``) out into the param-major
        ``full`` buffer (padding rows dropped; ``full``'s alignment gaps untouched)."""
        for spec in self.specs:
            for blocks, rows in self._pairs(self._rank_major(gathered, spec), self._full_rows(full, spec), spec):
                rows.copy_(blocks)

    def scatter_into(self, full: torch.Tensor, rank_major: torch.Tensor) -> None:
        """Copy the param-major ``full`` buffer into rank-major order (``gathered_numel``, padding
        zero): the input of a reduce-scatter that leaves each rank its shard's sum."""
        rank_major.zero_()
        for spec in self.specs:
            for blocks, rows in self._pairs(self._rank_major(rank_major, spec), self._full_rows(full, spec), spec):
                blocks.copy_(rows)
