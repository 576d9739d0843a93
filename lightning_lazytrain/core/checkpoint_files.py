"""The checkpoint file's checks and errors, without Lightning: ``check_integrity`` (a file's damage,
Note: [checkpoint damage] in adapters/checkpoint_io.py), ``CorruptCheckpoint``, and a failed write's
``CheckpointWriteError`` with the OS error behind it (``failed_write_cause``, ``write_error``).
Both the single-file ``CheckpointIO`` (adapters/checkpoint_io.py) and sharded checkpoints
(sharded_checkpoint.py) use them.
"""

from __future__ import annotations

import errno as errno_mod
import os
import pickle
import pickletools
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["FIX", "CheckpointWriteError", "CorruptCheckpoint", "check_integrity", "failed_write_cause", "gib_text",
           "short_reader_error", "tensor_bytes", "torch_says_damaged", "write_error"]

FIX = "Fix: resume from an earlier checkpoint (or copy this one again from where it was made)."


class CorruptCheckpoint(RuntimeError):
    """A checkpoint failed its integrity check; the message names the file and the fix."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written: the message names the path, the bytes and the fix; ``errno``,
    ``strerror`` and ``filename`` are those of the ``OSError`` that caused it (chained)."""

    def __init__(self, message: str, cause: OSError | None = None, path: Any = None) -> None:
        super().__init__(message)
        if cause is not None:
            self.errno, self.strerror = cause.errno, cause.strerror
        if path is not None:
            self.filename = os.fspath(path)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


def gib_text(n: float) -> str:
    from lightning_lazytrain.planner.units import format_bytes

    return format_bytes(n, binary=True)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors' storages in a (nested) checkpoint dict, each storage once."""
    seen: set[int] = set()
    total, stack = 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            try:
                storage = x.untyped_storage()
                key, n = storage.data_ptr() or id(x), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensors without storage (meta, subclasses)
                key, n = id(x), x.nbytes
            if key not in seen:
                seen.add(key)
                total += n
        elif isinstance(x, dict) and id(x) not in seen:
            seen.add(id(x))
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)) and id(x) not in seen:
            seen.add(id(x))
            stack.extend(x)
    return total


def write_error(target: Any, err: OSError, *, what: str = "checkpoint", size: str | None = None,
                left: str = "no temporary file is left behind") -> CheckpointWriteError:
    """The readable error for a failed checkpoint write of ``target`` (a file or a directory):
    the OS error by name, ``size`` (what was being written, if known), the free space there and
    the fix that fits the error."""
    target = Path(target)
    name = errno_mod.errorcode.get(err.errno or 0, f"errno {err.errno}")
    where = next((p for p in (target.parent, *target.parent.parents) if p.exists()), target.parent)
    try:
        free = f"; {gib_text(shutil.disk_usage(where).free)} free on that file system"
    except OSError:
        free = ""
    elsewhere = ("save to another directory (ModelCheckpoint(dirpath=...), Trainer(default_root_dir=...) or the "
                 "path given to save_checkpoint)")
    if err.errno in (errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EFBIG):
        fix = f"Fix: free space on the file system of {where} (or raise the quota), or {elsewhere}."
    elif err.errno in (errno_mod.EACCES, errno_mod.EPERM, errno_mod.EROFS):
        fix = f"Fix: make {where} writable for this user (or remount it read-write), or {elsewhere}."
    else:
        fix = f"Fix: check the file system of {where} (space, permissions, the drive's health), or {elsewhere}."
    message = (f"could not write {what} {target}: {err.strerror or err} ({name})"
               f"{f' while writing {size}' if size else ''}{free}. An earlier checkpoint at that path is "
               f"unchanged and {left}. {fix}")
    return CheckpointWriteError(message, err, target)


def failed_write_cause(err: BaseException, where: Any, needed: int) -> OSError | None:
    """The ``OSError`` behind a failed checkpoint write, or None: one (with an errno) in ``err``'s chain
    of causes or among the ranks' failures DCP gathered (``CheckpointException.failures``); or, where
    torch's zip writer only says that a write came up short ("unexpected pos": it swallows the OS
    error), ENOSPC when the file system of ``where`` has less than ``needed`` bytes free."""
    seen: set[int] = set()
    todo: list[Any] = [err]
    short = False
    while todo:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        short = short or (isinstance(e, RuntimeError) and "unexpected pos" in str(e))
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    if short:
        try:
            if shutil.disk_usage(where).free < needed:
                return OSError(errno_mod.ENOSPC, os.strerror(errno_mod.ENOSPC))
        except OSError:
            pass
    return None


def torch_says_damaged(err: BaseException) -> bool:
    """An error of ``torch.load`` that means the file is damaged (not a device or class problem)."""
    text = str(err)
    return isinstance(err, EOFError) or any(s in text for s in (
        "PytorchStreamReader", "might be corrupted", "Invalid magic number", "corrupt file",
        "storage has wrong byte size"))  # a legacy pickle whose tensor does not fit its storage


def short_reader_error(err: BaseException) -> str:
    """torch's reader error without its boilerplate."""
    text = str(err).replace("PytorchStreamReader ", "").split(". This is an internal miniz error")[0]
    return text.split("\n")[0].rstrip(".")


# ---- the checks ------------------------------------------------------------------------------------
def check_integrity(path: str | os.PathLike[str], *, crcs: bool = True) -> None:
    """Raise ``CorruptCheckpoint`` if the checkpoint file at ``path`` is damaged (Note: [checkpoint
    damage]). ``crcs=False`` skips the CRC check, the one that reads the whole file."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise CorruptCheckpoint(f"checkpoint {p} cannot be read ({err.strerror or err}). {FIX}") from err
    if size == 0:
        raise CorruptCheckpoint(f"checkpoint {p} is empty (0 bytes): it was not written completely. {FIX}")
    if head == b"PK\x03\x04":  # torch.save's zip archives start with a member's local header
        _check_zip(p, size, crcs)
    elif len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= pickle.HIGHEST_PROTOCOL:
        _check_legacy(p, size)
    else:
        raise CorruptCheckpoint(
            f"checkpoint {p} is not a checkpoint: it is neither a zip archive (torch.save's format) nor torch's "
            f"legacy format (its first bytes are {head!r}); it was overwritten or is another kind of file. {FIX}")


def _check_zip(p: Path, size: int, crcs: bool) -> None:
    try:
        with zipfile.ZipFile(p) as z, open(p, "rb") as f:
            infos = z.infolist()
            offsets = {i.filename: _data_offset(f, i) for i in infos}
            bad = z.testzip() if crcs else None
    except zipfile.BadZipFile as err:
        what = ("its end is missing (the file is truncated)" if "not a zip file" in str(err).lower()
                else f"its zip archive is damaged ({err})")
        raise CorruptCheckpoint(f"checkpoint {p} is damaged: {what}; {size} bytes. {FIX}") from err
    except (OSError, EOFError, ValueError, RuntimeError, NotImplementedError, struct.error) as err:
        # zlib errors, bad sizes and unsupported features of a damaged archive surface as these
        raise CorruptCheckpoint(f"checkpoint {p} cannot be read back intact ({err}). {FIX}") from err
    if bad is not None:
        raise CorruptCheckpoint(f"checkpoint {p} is corrupted: its member {bad!r} fails the CRC check. {FIX}")
    _check_torch_reader(p, infos, offsets)


def _data_offset(f: Any, info: zipfile.ZipInfo) -> int:
    """Where a member's data starts: after its local header (30 bytes, the name, the extra field)."""
    f.seek(info.header_offset)
    header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"member {info.filename!r} has no local header at offset {info.header_offset}")
    return info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


def _check_torch_reader(p: Path, infos: list[zipfile.ZipInfo], offsets: dict[str, int]) -> None:
    """torch's zip reader (miniz) must accept the archive and find every member where ``zipfile``
    (whose CRC check passed) does: same names, offsets and sizes, so torch reads the checked bytes."""
    reader_cls = getattr(torch._C, "PyTorchFileReader", None)
    if reader_cls is None:  # pragma: no cover - torch without it
        return
    try:
        reader = reader_cls(str(p))
        records = reader.get_all_records()
        archive = infos[0].filename.split("/", 1)[0] if infos else ""
        by_name = {i.filename: i for i in infos}
        for rec in records:
            info = by_name.get(f"{archive}/{rec}")
            if info is None:
                raise ValueError(f"torch's reader finds a member {rec!r} the zip directory does not list")
            if info.external_attr & 0x10 or info.filename.endswith("/"):  # miniz would read it as empty
                raise ValueError(f"member {rec!r} is marked as a directory")
            if hasattr(reader, "get_record_offset") and reader.get_record_offset(rec) != offsets[info.filename]:
                raise ValueError(f"torch's reader finds member {rec!r} at another offset than the zip directory")
            if hasattr(reader, "get_record_size") and reader.get_record_size(rec) != info.file_size:
                raise ValueError(f"torch's reader finds member {rec!r} with another size than the zip directory")
        if len(records) != len(infos):
            raise ValueError(f"torch's reader finds {len(records)} members, the zip directory lists {len(infos)}")
    except RuntimeError as err:
        raise CorruptCheckpoint(f"checkpoint {p} is damaged: torch's reader refuses its zip directory "
                                f"({short_reader_error(err)}). {FIX}") from err
    except ValueError as err:
        raise CorruptCheckpoint(f"checkpoint {p} is damaged: its zip directory is inconsistent ({err}). {FIX}") from err


# ---- torch's legacy (pre-1.6) format: a bare pickle stream, no CRCs ----------------------------------
class _Bounded:
    """A reader of ``f`` that never asks for more than the file holds (a damaged length field in a
    pickle must not allocate gigabytes) and counts its position."""

    def __init__(self, f: Any, size: int, pos: int) -> None:
        self.f, self.size, self.pos = f, size, pos
        f.seek(pos)

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data

    def readline(self) -> bytes:
        line = self.f.readline(max(self.size - self.pos, 0))
        self.pos += len(line)
        return line

    def tell(self) -> int:
        return self.pos


class _NoGlobals(pickle.Unpickler):
    """Plain data only: any class or persistent id is refused (nothing is imported or called)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("unexpected persistent id")


class _Global(str):
    """A GLOBAL opcode's argument ("module name"), told apart from strings."""


def _legacy_storages(ops: Any) -> dict[str, tuple[int | None, int]]:
    """The storages a legacy pickle refers to: key -> (element size or None if unknown, elements),
    from its persistent ids ``('storage', <torch XStorage>, key, location, numel, view)``. Walks the
    opcodes with a model of the stack; nothing is built, imported or called."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    found: dict[str, tuple[int | None, int]] = {}
    for op, arg, _ in ops:
        name = op.name
        if name == "STOP":
            return found
        if name == "MARK":
            marks.append(len(stack))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "GLOBAL":
            stack.append(_Global(arg))
        elif name == "STACK_GLOBAL":
            mod, qual = stack.pop(), stack.pop()
            stack.append(_Global(f"{qual} {mod}"))
        elif name == "TUPLE":
            start = marks.pop()
            items = tuple(stack[start:])
            del stack[start:]
            stack.append(items)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            k = int(name[-1])
            items = tuple(stack[-k:])
            del stack[-k:]
            stack.append(items)
        elif name == "BINPERSID":
            pid = stack.pop()
            if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage" and isinstance(pid[1], _Global)
                    and isinstance(pid[2], str) and isinstance(pid[3], str) and isinstance(pid[4], int)
                    and pid[4] >= 0 and found.get(pid[2], (0, pid[4]))[1] == pid[4]):
                raise ValueError(f"a storage reference is malformed: {pid!r}"[:200])
            found[pid[2]] = (_element_size(pid[1]), pid[4])
            stack.append(None)
        else:  # generic: pop what the opcode consumes, push what it produces (its argument if one value)
            before, after = op.stack_before, op.stack_after
            if pickletools.markobject in before:
                start = marks.pop()
                del stack[start:]
                n = before.index(pickletools.markobject)
            else:
                n = len(before)
            if n > len(stack):
                raise ValueError(f"opcode {name} pops more than the stack holds")
            if n:
                del stack[-n:]
            stack.extend([arg] if len(after) == 1 and arg is not None else [None] * len(after))
    raise ValueError("the pickle has no STOP opcode")


def _element_size(storage_type: Any) -> int | None:
    if not isinstance(storage_type, _Global) or not storage_type.startswith("torch "):
        return None
    cls_name = storage_type.split(" ", 1)[1]
    if cls_name == "UntypedStorage":
        return 1
    cls = getattr(torch, cls_name, None) if cls_name.endswith("Storage") else None
    try:
        with warnings.catch_warnings():  # "TypedStorage is deprecated"
            warnings.simplefilter("ignore")
            return torch._utils._element_size(cls.dtype)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - an unknown storage type: its size is not checked
        return None


def _check_legacy(p: Path, size: int) -> None:
    """The structure of a legacy checkpoint (see Note: [checkpoint damage])."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    step = "its header"
    try:
        with open(p, "rb") as f:
            r = _Bounded(f, size, 0)
            magic = _NoGlobals(r).load()
            if magic != MAGIC_NUMBER:
                raise ValueError("wrong magic number")
            if _NoGlobals(r).load() != PROTOCOL_VERSION:
                raise ValueError("unknown protocol version")
            sys_info = _NoGlobals(r).load()
            if not isinstance(sys_info, dict):
                raise ValueError("no system info")
            little = sys_info.get("little_endian", True)
            step = "its pickle"
            storages = _legacy_storages(pickletools.genops(r))
            step = "its list of storages"
            kr = _Bounded(f, size, r.pos)
            keys = _NoGlobals(kr).load()
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError("not a list of names")
            pos = kr.pos
            step = "its tensor data"
            for key in keys:
                if key not in storages:
                    raise ValueError(f"storage {key!r} is not referred to by the pickle")
                f.seek(pos)
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError(f"the file ends before storage {key!r}")
                numel = int.from_bytes(head, "little" if little else "big", signed=True)
                esize, expected = storages[key]
                if numel != expected:
                    raise ValueError(f"storage {key!r} holds {numel} elements, the pickle says {expected}")
                if esize is None:  # an unknown storage type: the rest is not checked
                    return
                pos += 8 + numel * esize
                if pos > size:
                    raise ValueError(f"the file ends {pos - size} bytes before storage {key!r} does")
    except Exception as err:  # noqa: BLE001 - any failure to parse is damage
        raise CorruptCheckpoint(
            f"checkpoint {p} is damaged: it starts like torch's legacy (pre-1.6) format, but {step} cannot be "
            f"read ({type(err).__name__}: {err}); {size} bytes. {FIX}") from err
