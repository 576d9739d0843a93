"""Sharded checkpoints of a data-parallel lazytrain run, through ``torch.distributed.checkpoint`` (DCP).

Note: [sharded checkpoint]
    With several processes ``LazyTrainStrategy(checkpoint_format="sharded")`` (the default) saves a
    checkpoint as a directory at the path Lightning gives (``ModelCheckpoint``'s ``....ckpt``):

    - ``.metadata`` and ``__<rank>_<n>.distcp``: the tensors of the model's ``state_dict`` and of
      every ``optimizer_states`` entry, one flat DCP state dict keyed by their path in Lightning's
      checkpoint dict (``state_dict/model.layers.0.mlp.up_proj.weight``,
      ``optimizer_states/0/state/3/exp_avg``). Every rank offers its own (replicated) tensors and
      DCP's planner deduplicates them (``dedup_save_plans``: each tensor is written once, by the rank
      with the smallest plan so far), so each rank writes about ``1/W`` of the bytes and no rank
      gathers anything. Dtypes are kept (8-bit ``uint8`` states, fp32 block scales and qmaps, fp32
      ``step`` scalars), so ``optimizer.load_state_dict`` sees what ``state_dict()`` gave.
    - ``lightning.pt``: rank 0's checkpoint dict with each of those tensors replaced by a marker
      ``{"__lazytrain_dcp__": key}``; everything else (loops, callbacks, schedulers, hparams,
      versions) as ``torch.save`` writes it -- what a single-file checkpoint holds besides them.
    - ``crc32.json``: size and CRC-32 of every file above, computed by the ranks after writing (each
      a share of the files); checked before a load unless ``verify_checkpoints=False``.

    Atomic: the ranks write into ``.<name>.tmp-<token>`` next to the target (the token comes from
    rank 0), rank 0 fsyncs and renames it into place once every rank has written, and the ranks
    learn the outcome from rank 0 before they continue. A failure on any rank (DCP gathers the
    writers' errors and raises on every rank) removes the temporary directory and raises on every
    rank; a crash leaves it behind, hidden, and the old checkpoint in place (rank 0 removes such
    leftovers of the same target at its next save). A checkpoint that already exists is first
    renamed to ``.<name>.old-<token>`` and removed after the new one is in place: a crash between
    the two renames leaves no checkpoint at the target (and the old one under that name), never
    half of one. The directory must be on a file system every rank sees (one node, or a shared one).

    Loading (``load_sharded``) works on any world size, one process included: the tensors are plain
    (replicated) ones, so each process reads all of them into tensors shaped from DCP's metadata
    and the markers are filled in; the result is the checkpoint dict Lightning expects.

    Sharded host state (``data_parallel="shard"``, engine/shard_store.py): each rank holds dim-0 rows
    of every parameter and of its per-element optimizer states, so no tensor is whole anywhere. The
    caller passes a ``layout`` naming those entries; each rank writes only its rows, as
    ``<key>@<start>:<stop>`` (the rows of the whole tensor, padding dropped; ``row_chunks`` gives every
    rank's from the whole shape and the world size), and the marker carries the whole shape and the
    world size. States with no per-element form (HybridAdamW's 8-bit states and block scales, blockwise
    over a rank's shard) are written per rank, ``<key>#rank<r>``, and resume on the same world size
    only (the load says so otherwise). Nothing is gathered to save (a chunk replicas hold twice is
    written once: DCP deduplicates equal keys). A load returns the model's entries whole (Lightning
    loads them into the whole module, before the strategy shards it) and, for a sharded run
    (``shard=``), each optimizer state as the rank's own rows, read from the chunks that overlap them
    only; so a checkpoint of N sharded ranks resumes on M ranks or on one, and no rank holds the whole
    optimizer state.

The checkpoint dict <-> (skeleton, flat tensors) mapping, row chunks and per-rank entries included, is
sharded_tensors.py (its names are importable from here too); this module holds the files: the save, the
integrity check and the load.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch

from lightning_lazytrain.core.checkpoint_files import (
    CheckpointWriteError,
    CorruptCheckpoint,
    check_integrity,
    failed_write_cause,
    gib_text,
    short_reader_error,
    write_error,
)
from lightning_lazytrain.core.sharded_tensors import (  # noqa: F401 - public here too
    MARKER,
    SHARDED_KEYS,
    Layout,
    _own_rows,
    _wanted,
    join_tensors,
    markers,
    row_chunks,
    split_tensors,
)

__all__ = ["MARKER", "META_FILE", "MANIFEST", "is_sharded_checkpoint", "load_sharded", "save_sharded",
           "split_tensors", "join_tensors", "check_sharded_integrity", "row_chunks"]

META_FILE = "lightning.pt"
MANIFEST = "crc32.json"
DCP_METADATA = ".metadata"
FIX = "Fix: resume from an earlier checkpoint (or copy this one again from where it was made)."


def is_sharded_checkpoint(path: Any) -> bool:
    """A local directory holding (part of) a sharded checkpoint: any of DCP's ``.metadata``, the manifest
    or ``lightning.pt``. A damaged one (a file missing) counts too: ``load_sharded`` then says what is
    wrong (``CorruptCheckpoint``) instead of a file reader failing on a directory."""
    if "://" in str(path):
        return False
    p = Path(path)
    return p.is_dir() and any((p / name).exists() for name in (DCP_METADATA, MANIFEST, META_FILE))


# ---- small file helpers ----------------------------------------------------------------------------
def _crc(path: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _data_files(directory: Path) -> list[str]:
    """The files DCP wrote (all but its ``.metadata``), sorted: the same list on every rank."""
    return sorted(f.name for f in directory.iterdir() if f.is_file() and f.name not in (DCP_METADATA, META_FILE,
                                                                                          MANIFEST))


# ---- save ---------------------------------------------------------------------------------------------
def save_sharded(checkpoint: dict[str, Any], path: Any, *, group: Any = None, layout: Layout | None = None) -> None:
    """Save ``checkpoint`` (this rank's Lightning checkpoint dict) as the directory ``path``; every rank
    of ``group`` calls it (see Note: [sharded checkpoint]; ``layout``: the entries that are this rank's
    rows or its own, keyed as ``split_tensors`` keys them)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    target = Path(path)
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    skeleton, tensors = split_tensors(checkpoint, layout=layout)
    box: list[Any] = [f"{os.getpid()}-{time.time_ns()}" if rank == 0 else None]
    dist.broadcast_object_list(box, src=src, group=group)
    token = box[0]
    tmp = target.with_name(f".{target.name}.tmp-{token}")
    if rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # a crashed save's leftovers
            _remove(stale)
    dist.barrier(group=group)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        # Collective: DCP gathers every rank's plan, deduplicates the replicated tensors, and raises
        # on every rank if any rank failed to write (it gathers the writers' errors).
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=group)
    except BaseException as err:
        cause = _failed_write_cause(err, tmp, tensors, world)  # before the files go (free space)
        dist.barrier(group=group)  # every rank is done with the directory
        if rank == 0:
            _remove(tmp)
        if cause is None:
            raise
        raise _write_error(target, cause, tensors, world) from err
    local: tuple[dict[str, Any], str | None]
    try:  # each rank checksums a share of the files (the same sorted list on every rank)
        local = ({name: _crc(tmp / name) for name in _data_files(tmp)[rank::world]}, None)
    except Exception as err:
        local = ({}, f"rank {rank}: {type(err).__name__}: {err}")
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, local, group=group)
    failure = next((err for _, err in parts if err is not None), None)
    error: BaseException | None = None
    code: int | None = None
    if rank == 0:
        try:
            if failure is not None:
                raise RuntimeError(f"could not checksum the files: {failure}")
            torch.save(skeleton, tmp / META_FILE)
            _fsync_file(tmp / META_FILE)
            manifest = {name: list(v) for crcs, _ in parts for name, v in crcs.items()}
            for name in (DCP_METADATA, META_FILE):
                manifest[name] = list(_crc(tmp / name))
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"format": "lazytrain-dcp-1", "files": manifest}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            old = target.with_name(f".{target.name}.old-{token}")
            had_old = target.exists() or target.is_symlink()
            if had_old:
                os.replace(target, old)
            os.replace(tmp, target)
            _fsync_dir(target.parent)
            if had_old:
                _remove(old)
        except BaseException as err:
            cause = _failed_write_cause(err, tmp, tensors, world)
            _remove(tmp)
            error, failure = err, f"{type(err).__name__}: {err}"
            if cause is not None:  # disk full, no permission, ...: readable, on every rank
                error = _write_error(target, cause, tensors, world)
                error.__cause__ = err
                failure, code = str(error), cause.errno
    box: list[Any] = [(failure, code) if rank == 0 else None]
    dist.broadcast_object_list(box, src=src, group=group)
    if error is not None:
        raise error
    failure, code = box[0]
    if failure is not None:
        if code is not None:
            raise CheckpointWriteError(failure, OSError(code, os.strerror(code)), target)
        raise RuntimeError(f"sharded checkpoint {target} was not written: {failure}")


def _failed_write_cause(err: BaseException, tmp: Path, tensors: dict[str, torch.Tensor], world: int) -> OSError | None:
    where = next((p for p in (tmp, *tmp.parents) if p.exists()), Path("/"))
    return failed_write_cause(err, where, sum(t.nbytes for t in tensors.values()) // max(world, 1))


def _write_error(target: Path, cause: OSError, tensors: dict[str, torch.Tensor], world: int) -> OSError:
    offered = gib_text(sum(t.nbytes for t in tensors.values()))
    size = (f"about {offered} of tensors" if world == 1 else
            f"its share of the tensors (this process offers about {offered}; {world} processes write a share each)")
    return write_error(target, cause, what="sharded checkpoint", size=size,
                       left="no temporary directory is left behind")


# ---- load ---------------------------------------------------------------------------------------------
def _read_manifest(p: Path) -> dict[str, tuple[int, int]]:
    """The manifest's ``{file name: (size, CRC-32)}``; ``ValueError`` naming what is wrong with it."""
    doc = json.loads((p / MANIFEST).read_text())
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict):
        raise ValueError("no 'files' table")
    out: dict[str, tuple[int, int]] = {}
    for name, entry in files.items():
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ValueError(f"{name!r} is not a file name")
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int and v >= 0 for v in entry)):
            raise ValueError(f"the entry of {name!r} is not [size, CRC-32]")
        out[name] = (entry[0], entry[1])
    return out


def _problem(group: Any, problem: str | None) -> None:
    """Raise ``CorruptCheckpoint`` with the first problem any rank of ``group`` found (collective)."""
    if group is not None:
        import torch.distributed as dist

        problems: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
        problem = next((x for x in problems if x is not None), None)
    if problem is not None:
        raise CorruptCheckpoint(problem)


def check_sharded_integrity(path: Any, *, group: Any = None) -> None:
    """Raise ``CorruptCheckpoint`` if a file of the sharded checkpoint at ``path`` is missing, or differs
    in size or CRC-32 from the manifest written with it, or the manifest is missing or unreadable. With
    ``group`` each rank reads a share of the files and every rank raises the first problem found."""
    import torch.distributed as dist

    p = Path(path)
    problem: str | None = None
    manifest: dict[str, tuple[int, int]] | None = None
    if not (p / MANIFEST).exists():
        held = sorted(f.name for f in p.iterdir()) if p.is_dir() else []
        listing = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "") if held else "nothing"
        problem = (f"sharded checkpoint {p} has no {MANIFEST}: it was not finished by lazytrain, or the file was "
                   f"removed (the directory holds {listing}). {FIX}")
    else:
        try:
            manifest = _read_manifest(p)
        except (OSError, ValueError, UnicodeDecodeError) as err:
            problem = f"sharded checkpoint {p}: its {MANIFEST} cannot be read ({err}). {FIX}"
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    if manifest is not None:
        missing = sorted(name for name in manifest if not (p / name).is_file())
        extra = sorted(set(_data_files(p)) - set(manifest))
        if missing:
            problem = f"sharded checkpoint {p} is incomplete: its file(s) {', '.join(missing)} are missing. {FIX}"
        elif extra:
            problem = f"sharded checkpoint {p} holds files its manifest does not list: {extra}. {FIX}"
        for name in sorted(manifest)[rank::world]:
            if problem is not None:
                break
            try:
                got = _crc(p / name)
            except OSError as err:
                problem = f"sharded checkpoint {p}: its file {name!r} cannot be read ({err.strerror or err}). {FIX}"
                break
            if got != manifest[name]:
                what = "size" if got[0] != manifest[name][0] else "CRC"
                problem = f"sharded checkpoint {p} is corrupted: its file {name!r} fails the {what} check. {FIX}"
    _problem(group, problem)


def load_sharded(path: Any, *, group: Any = None, weights_only: bool | None = None,
                 verify: bool = True, shard: tuple[int, int] | None = None,
                 model_rows: bool = False) -> dict[str, Any]:
    """The checkpoint dict saved by ``save_sharded`` at ``path``, on any number of processes: every rank
    of ``group`` calls it (``group=None``: this process alone, no process group needed). Per-process
    entries are read for ``shard = (rank, world)`` (default: this rank in ``group``). With ``shard``
    (a sharded run resuming), row-chunked optimizer states are read as that rank's rows only
    (``(k, *rest)``, padding zero, as the rank's shard holds them): a rank never materialises the
    whole optimizer state; with ``model_rows`` too, so are the model's row-chunked tensors (the
    strategy restores after its setup, into the shards). Without, the model's tensors come whole."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    p = Path(path)
    if verify:
        check_sharded_integrity(p, group=group)
    else:  # unchecked: still say which file is missing, not fail on it deep in a reader
        missing = [name for name in (DCP_METADATA, META_FILE) if not (p / name).is_file()]
        _problem(None, f"sharded checkpoint {p} is incomplete: its file(s) {', '.join(missing)} are missing. {FIX}"
                 if missing else None)
    check_integrity(p / META_FILE, crcs=False)  # its CRC is in the manifest; here what torch's reader needs
    skeleton = torch.load(p / META_FILE, map_location="cpu", weights_only=weights_only)
    reader = dcp.FileSystemReader(p)
    try:
        metadata = reader.read_metadata()
    except Exception as err:  # noqa: BLE001 - checked above only with verify: a damaged file
        raise _unreadable(p, err, verify) from err
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    if shard is not None:
        rank, world = shard
    prefixes = ("optimizer_states/", "state_dict/") if model_rows else ("optimizer_states/",)
    own = {m[MARKER]: _own_rows(m, shard) for m in markers(skeleton)
           if shard is not None and "shape" in m and m[MARKER].startswith(prefixes)}
    wanted: list[str] = []
    for marker in markers(skeleton):
        if marker.get("per_rank") and marker["world"] != world:
            raise ValueError(
                f"sharded checkpoint {p} holds {marker[MARKER]!r} per process of a shard group of {marker['world']} "
                f"(8-bit optimizer states are blockwise over each process's shard): it resumes on shard groups of "
                f"{marker['world']} processes only, not {world}. Fix: resume with data_parallel='shard' and "
                f"{marker['world']} processes per shard group (shard_size; by default the devices per node), or "
                "train with 32-bit states (HybridAdamW(eight_bit='none')) to change the number of processes")
        if marker.get("per_rank") and shard is None and marker["world"] > 1:
            # (review 23: a replicate run read rank r's shard state as the whole parameter's: the ranks diverged)
            raise ValueError(
                f"sharded checkpoint {p} holds {marker[MARKER]!r} per process of a shard group of {marker['world']} "
                "(8-bit optimizer states of a data_parallel='shard' run, blockwise over each process's rows), and "
                "this run is not sharded. Fix: resume with data_parallel='shard' and "
                f"{marker['world']} processes per shard group, as it was saved (a checkpoint whose states are 32-bit, "
                "HybridAdamW(eight_bit='none'), moves between the modes)")
        wanted += _wanted(marker, rank, own.get(marker[MARKER]))
    tensors: dict[str, torch.Tensor] = {}
    for key in wanted:
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"sharded checkpoint {p}: entry {key!r} is missing or not a tensor "
                             "(not written by lazytrain)")
        tensors[key] = torch.empty(md.size, dtype=md.properties.dtype)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        if group is None:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(tensors, storage_reader=reader, no_dist=True)
        else:  # a rank's failure is gathered: every rank raises
            dcp.load(tensors, storage_reader=reader, process_group=group)
    except (CheckpointException, OSError, EOFError, RuntimeError) as err:
        raise _unreadable(p, err, verify) from err
    return join_tensors(skeleton, tensors, rank=rank, own=own)


def _unreadable(p: Path, err: BaseException, verify: bool) -> Exception:
    """``CorruptCheckpoint`` for a sharded checkpoint whose files torch cannot read (a rank's first
    failure, as DCP gathered it)."""
    failures = getattr(err, "failures", None)
    first = next(iter(failures.values()))[0] if isinstance(failures, dict) and failures else err
    detail = f"{type(first).__name__}: {short_reader_error(first)}".rstrip(": ")
    unchecked = "" if verify else " (it was loaded unchecked, verify_checkpoints=False: a check names the damaged file)"
    return CorruptCheckpoint(f"sharded checkpoint {p} cannot be read ({detail}){unchecked}. {FIX}")
