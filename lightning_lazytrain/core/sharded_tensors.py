"""A sharded checkpoint's tensors: Lightning's checkpoint dict as a skeleton plus one flat dict of tensors
(``split_tensors``), and back (``join_tensors``), without any file or process group.

Every tensor under ``state_dict`` and ``optimizer_states`` becomes a marker ``{"__lazytrain_dcp__": key}``
in the skeleton and an entry of the flat dict, keyed by its path in the checkpoint dict; entries a
``layout`` names are written as this rank's dim-0 rows (``<key>@<start>:<stop>``, ``row_chunks``) or as
its own tensor (``<key>#rank<r>``), and are read back whole or as one rank's rows (``_own_rows``,
``_wanted``). The file format these keys go into, the save and the load: Note: [sharded checkpoint]
in sharded_checkpoint.py.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MARKER", "SHARDED_KEYS", "Layout", "join_tensors", "markers", "row_chunks", "split_tensors"]

MARKER = "__lazytrain_dcp__"
# The parts of Lightning's checkpoint dict whose tensors are replicated on every rank and go through DCP.
SHARDED_KEYS = ("state_dict", "optimizer_states")
# A layout entry: ("rows", whole shape, world, rank) -- this rank's tensor holds its dim-0 rows (padded);
# ("rank", world, rank) -- this rank's own tensor, with no whole form.
Layout = dict[str, tuple]


def row_chunks(rows: int, world: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` of a dim-0 size ``rows`` each of ``world`` ranks holds (the shard layout's
    ``ceil(rows / world)`` rows per rank; the last ranks may hold fewer or none)."""
    k = -(-rows // world)
    return [(min(r * k, rows), min(r * k + k, rows)) for r in range(world)]


def _chunk_key(key: str, start: int, stop: int) -> str:
    return f"{key}@{start}:{stop}"


def _rank_key(key: str, rank: int) -> str:
    return f"{key}#rank{rank}"


def _is_marker(obj: Any) -> bool:
    return isinstance(obj, dict) and MARKER in obj and set(obj) <= {MARKER, "shape", "world", "per_rank"}



def _copy_dict(obj: dict) -> dict:
    """A shallow copy of the same class, with its attributes (a ``state_dict``'s ``_metadata``, which
    modules read when loading, as ``torch.save`` keeps it)."""
    out = obj.copy()
    if getattr(obj, "__dict__", None):
        out.__dict__.update(obj.__dict__)
    return out


def split_tensors(checkpoint: dict[str, Any], keys: tuple[str, ...] = SHARDED_KEYS, layout: Layout | None = None
                  ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(skeleton, tensors): ``checkpoint`` with every tensor under ``keys`` replaced by a marker
    naming its entry in ``tensors`` (CPU tensors, detached, not copied when already on the CPU).
    Entries ``layout`` names are this rank's rows or its own tensor (see Note: [sharded checkpoint]
    in sharded_checkpoint.py)."""
    tensors: dict[str, torch.Tensor] = {}
    layout = layout or {}

    def put(key: str, value: torch.Tensor) -> None:
        if key in tensors:
            raise ValueError(f"checkpoint entry {key!r} is not unique (keys 1 and '1' in one dict?)")
        tensors[key] = value

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            spec = layout.get(key)
            if spec is None:
                put(key, obj.detach().cpu())
                return {MARKER: key}
            if spec[0] == "rank":
                _, world, rank = spec
                put(_rank_key(key, rank), obj.detach().cpu())
                return {MARKER: key, "world": world, "per_rank": True}
            _, shape, world, rank = spec
            rows = shape[0] if len(shape) else 1
            start, stop = row_chunks(rows, world)[rank]
            if stop > start:  # this rank's rows, padding dropped
                mine = obj.detach().reshape(obj.shape[0] if obj.ndim else 1, -1)[: stop - start]
                put(_chunk_key(key, start, stop), mine.reshape(stop - start, *shape[1:]).cpu())
            return {MARKER: key, "shape": list(shape), "world": world}
        if isinstance(obj, dict):
            out = _copy_dict(obj)
            for k, v in obj.items():
                out[k] = walk(v, f"{key}/{k}")
            return out
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(walk(v, f"{key}/{i}") for i, v in enumerate(obj))
        return obj

    skeleton = dict(checkpoint)
    for k in keys:
        if k in checkpoint:
            skeleton[k] = walk(checkpoint[k], k)
    return skeleton, tensors


def _rows(marker: dict[str, Any]) -> int:
    """Dim-0 size of a row-chunked entry (a 0-dim tensor is one row)."""
    return marker["shape"][0] if marker["shape"] else 1


def _chunks(marker: dict[str, Any], own: tuple[int, int, int] | None = None) -> list[tuple[int, int]]:
    """Rows ``[a, b)`` of the (non-empty) chunks a row-chunked entry was written in; with ``own =
    (start, stop, k)``, those that overlap rows ``[start, stop)`` (a rank whose rows are all padding
    still reads one chunk: its dtype)."""
    chunks = [(a, b) for a, b in row_chunks(_rows(marker), marker["world"]) if b > a]
    if own is not None:
        chunks = [(a, b) for a, b in chunks if a < own[1] and b > own[0]] or chunks[:1]
    return chunks


def _wanted(marker: dict[str, Any], rank: int, own: tuple[int, int, int] | None = None) -> list[str]:
    """The entries of ``tensors`` a marker is made of (for ``rank``, when it is a per-rank one; with
    ``own``, only the row chunks ``_chunks`` picks)."""
    key = marker[MARKER]
    if marker.get("per_rank"):
        return [_rank_key(key, rank)]
    if "shape" in marker:
        return [_chunk_key(key, a, b) for a, b in _chunks(marker, own)]
    return [key]


def _own_rows(marker: dict[str, Any], shard: tuple[int, int]) -> tuple[int, int, int]:
    """``(start, stop, k)``: the rows of a row-chunked entry that rank ``shard[0]`` of a shard group of
    ``shard[1]`` holds (``k`` rows, padded), as ``ShardLayout`` cuts them."""
    start, stop = row_chunks(_rows(marker), shard[1])[shard[0]]
    return start, stop, -(-_rows(marker) // shard[1])


def _rows_from_chunks(marker: dict[str, Any], tensors: dict[str, torch.Tensor],
                      own: tuple[int, int, int]) -> torch.Tensor:
    """Rows ``[start, stop)`` of a row-chunked entry as a ``(k, *rest)`` tensor, padding rows zero,
    from the chunks that overlap them."""
    start, stop, k = own
    out = None
    for a, b in _chunks(marker, own):
        chunk = tensors[_chunk_key(marker[MARKER], a, b)]
        if out is None:
            out = torch.zeros((k, *chunk.shape[1:]), dtype=chunk.dtype)
        lo, hi = max(a, start), min(b, stop)
        if hi > lo:
            out[lo - start: hi - start] = chunk[lo - a: hi - a]
    return out if out is not None else torch.zeros((k, *marker["shape"][1:]))  # zero rows: no dtype saved


def _map_markers(obj: Any, fn: Any) -> Any:
    """``obj`` with every marker replaced by ``fn(marker)`` (dicts copied with their attributes)."""
    if _is_marker(obj):
        return fn(obj)
    if isinstance(obj, dict):
        out = _copy_dict(obj)
        for k, v in obj.items():
            out[k] = _map_markers(v, fn)
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_map_markers(v, fn) for v in obj)
    return obj


def markers(skeleton: Any) -> list[dict[str, Any]]:
    """Every marker in ``skeleton``."""
    found: list[dict[str, Any]] = []
    _map_markers(skeleton, lambda m: found.append(m) or m)
    return found


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor], *, rank: int = 0,
                 own: dict[str, tuple[int, int, int]] | None = None) -> Any:
    """The inverse of ``split_tensors``: every marker replaced by its tensor (row chunks joined whole,
    or, for the entries ``own`` names, only those rows, padded; per-rank entries: ``rank``'s)."""
    own = own or {}

    def resolve(marker: dict[str, Any]) -> torch.Tensor:
        key = marker[MARKER]
        missing = [k for k in _wanted(marker, rank, own.get(key)) if k not in tensors]
        if missing:
            raise KeyError(f"sharded checkpoint has no tensor {missing[0]!r}")
        if "shape" not in marker:
            return tensors[_wanted(marker, rank)[0]]
        if key in own:
            return _rows_from_chunks(marker, tensors, own[key])
        rows = _rows(marker)
        return _rows_from_chunks(marker, tensors, (0, rows, rows)).reshape(marker["shape"])  # whole

    return _map_markers(skeleton, resolve)
