"""Every kind of checkpoint damage is ``CorruptCheckpoint`` naming the file and the fix, never the error
the damage happens to cause in torch's reader or unpickler; a write that fails (a full disk) names the
path, the bytes and the fix and leaves nothing behind (adapters/checkpoint_io.py, Note: [checkpoint damage])."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from lightning_lazytrain.adapters import checkpoint_io
from lightning_lazytrain.adapters.checkpoint_io import CheckpointWriteError, CorruptCheckpoint, VerifiedCheckpointIO

FIX = r"Fix: resume from an earlier checkpoint"


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"state_dict": {"w": torch.randn(16, 16, generator=g), "b": torch.randn(16, generator=g).half()},
            "epoch": 1, "global_step": 7}


def same(a: dict, b: dict) -> bool:
    return (a["global_step"] == b["global_step"] and a["state_dict"].keys() == b["state_dict"].keys()
            and all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"]))


def load(path: Path, verify: bool = True) -> dict:
    return VerifiedCheckpointIO(verify=verify).load_checkpoint(path)


def refused(path: Path, pattern: str = "", verify: bool = True) -> str:
    """Loading ``path`` raises CorruptCheckpoint naming it and the fix (and ``pattern``); its message."""
    with pytest.raises(CorruptCheckpoint) as info:
        load(path, verify)
    message = str(info.value)
    assert str(path) in message and re.search(FIX, message), message
    assert re.search(pattern, message), message
    assert "weights_only" not in message, message
    return message


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "good.ckpt"
    VerifiedCheckpointIO().save_checkpoint(state(), path)
    return path


# ---- single files --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_byte_of_the_zip_central_directory_damaged_is_refused_or_harmless(saved: Path, tmp_path: Path) -> None:
    """Damage in the zip central directory that Python's zipfile tolerates used to reach torch's reader
    and fail with its raw RuntimeError (or load a member as empty): each flipped byte now either loads
    the same values (a time stamp, a comment) or is CorruptCheckpoint."""
    raw = saved.read_bytes()
    eocd = raw.rfind(b"PK\x05\x06")
    central = int.from_bytes(raw[eocd + 16:eocd + 20], "little")
    bad = tmp_path / "bad.ckpt"
    outcomes = {"refused": 0, "same": 0}
    for at in range(central, len(raw)):
        for mask in (0x01, 0xFF):  # 0xFF sets the "directory" attribute bit miniz reads
            data = bytearray(raw)
            data[at] ^= mask
            bad.write_bytes(bytes(data))
            try:
                got = load(bad)
            except CorruptCheckpoint as err:
                assert str(bad) in str(err) and re.search(FIX, str(err)), err
                outcomes["refused"] += 1
            else:
                assert same(got, state()), f"byte {at} ^ {mask:#x} loads other values"
                outcomes["same"] += 1
    assert outcomes["refused"] > outcomes["same"] > 0


@pytest.mark.parametrize("field, pattern", [
    (20, r"torch's reader refuses its zip directory \(failed reading zip archive"),  # the first member's size
    (38, r"its zip directory is inconsistent \(member 'data.pkl' is marked as a directory\)"),  # its attributes
])
def test_central_directory_damage_torch_refuses_is_named(saved: Path, tmp_path: Path, field: int, pattern: str) -> None:
    raw = bytearray(saved.read_bytes())
    eocd = raw.rfind(b"PK\x05\x06")
    central = int.from_bytes(raw[eocd + 16:eocd + 20], "little")
    raw[central + field] ^= 0xFF
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(bytes(raw))
    refused(bad, rf"checkpoint {re.escape(str(bad))} is damaged: {pattern}")


def test_truncated_and_empty_files_are_refused(saved: Path, tmp_path: Path) -> None:
    raw = saved.read_bytes()
    bad = tmp_path / "cut.ckpt"
    for cut in [*range(1, len(raw), 97), len(raw) - 1]:
        bad.write_bytes(raw[:cut])
        refused(bad)
    bad.write_bytes(raw[:len(raw) - 100])
    refused(bad, r"is damaged: its end is missing \(the file is truncated\)")
    bad.write_bytes(b"")
    refused(bad, r"is empty \(0 bytes\): it was not written completely")
    refused(bad, r"is empty", verify=False)  # the structure is checked without verify too (only CRCs are not)


@pytest.mark.parametrize("seed", range(8))
def test_garbage_that_looks_like_an_old_pickle_is_not_given_torchs_weights_only_advice(tmp_path: Path,
                                                                                      seed: int) -> None:
    rng = random.Random(seed)
    bad = tmp_path / "garbage.ckpt"
    bad.write_bytes(b"\x80\x02" + rng.randbytes(rng.randint(0, 4000)))
    for verify in (True, False):
        refused(bad, r"is damaged: it starts like torch's legacy \(pre-1\.6\) format, but its header cannot be read",
                verify=verify)


@pytest.mark.parametrize("content", [b"hello, world\n", b"PK\x03\x04" + bytes(range(256)) * 8, b"\x00" * 4096,
                                     b"{\"state_dict\": {}}"])
def test_other_garbage_is_refused(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "garbage.ckpt"
    bad.write_bytes(content)
    refused(bad, r"is (not a checkpoint|damaged)")


def test_genuine_legacy_checkpoints_still_load_and_damaged_ones_are_refused(tmp_path: Path) -> None:
    """torch's pre-1.6 format (no zip, no CRCs): loads as before; its structure is checked, so a
    truncated one is refused at every length."""
    legacy = tmp_path / "legacy.ckpt"
    torch.save(state(), legacy, _use_new_zipfile_serialization=False)
    for verify in (True, False):
        assert same(load(legacy, verify), state())
    raw = legacy.read_bytes()
    bad = tmp_path / "bad.ckpt"
    for cut in range(1, len(raw), 7):
        bad.write_bytes(raw[:cut])
        refused(bad)
    bad.write_bytes(raw[:-10])
    refused(bad, r"legacy .* its tensor data cannot be read \(ValueError: the file ends 10 bytes before storage")


# ---- sharded directories ---------------------------------------------------------------------------------
@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def sharded(tmp_path: Path, one_process_group: None) -> Path:
    from lightning_lazytrain.core.sharded_checkpoint import save_sharded

    path = tmp_path / "sharded.ckpt"
    save_sharded(state(), path)
    return path


def _write(name: str, text: str):
    return lambda p: (p / name).write_text(text)


@pytest.mark.parametrize("damage, pattern", [
    (lambda p: (p / ".metadata").unlink(), r"is incomplete: its file\(s\) \.metadata are missing"),
    (lambda p: (p / "lightning.pt").unlink(), r"is incomplete: its file\(s\) lightning\.pt are missing"),
    (lambda p: (p / "crc32.json").unlink(),
     r"has no crc32\.json: it was not finished by lazytrain, or the file was removed \(the directory holds "
     r"\.metadata, __0_0\.distcp, lightning\.pt\)"),
    (_write("crc32.json", "{not json"), r"its crc32\.json cannot be read \(Expecting property name"),
    (_write("crc32.json", '{"files": [1, 2]}'), r"its crc32\.json cannot be read \(no 'files' table\)"),
    (_write("crc32.json", '{"files": {"../x": [1, 2]}}'),
     r"crc32\.json cannot be read \('\.\./x' is not a file name\)"),
    (lambda p: os.truncate(p / "__0_0.distcp", 100), r"its file '__0_0\.distcp' fails the size check"),
    (lambda p: [f.unlink() for f in p.iterdir()], r"has no crc32\.json: .* \(the directory holds nothing\)"),
], ids=["metadata-deleted", "lightning-pt-deleted", "no-manifest", "manifest-not-json", "manifest-not-a-table",
        "manifest-bad-name", "shard-truncated", "empty"])
def test_a_damaged_sharded_directory_is_refused(sharded: Path, damage, pattern: str) -> None:
    """A directory given as the checkpoint goes to the sharded loader, damaged or not (``.metadata``
    deleted used to reach torch.load as a file: IsADirectoryError)."""
    from lightning_lazytrain.core.sharded_checkpoint import is_sharded_checkpoint, load_sharded

    assert same(load(sharded), state())  # intact: loads through the checkpoint IO as well
    damage(sharded)
    refused(sharded, rf"sharded checkpoint {re.escape(str(sharded))}.*{pattern}")
    with pytest.raises(CorruptCheckpoint, match=pattern):
        load_sharded(sharded)
    if any((sharded / name).exists() for name in (".metadata", "crc32.json", "lightning.pt")):
        assert is_sharded_checkpoint(sharded)  # the strategy sends it to load_sharded too


@pytest.mark.parametrize("damage, pattern", [
    (lambda p: (p / ".metadata").unlink(), r"is incomplete: its file\(s\) \.metadata are missing"),
    (lambda p: os.truncate(p / "__0_0.distcp", 100), r"cannot be read \(EOFError\) \(it was loaded unchecked"),
    (lambda p: (p / ".metadata").write_bytes(b"\x80\x02garbage"), r"cannot be read \(UnpicklingError"),
    (lambda p: (p / "lightning.pt").write_bytes(b"\x80\x02garbage"), r"lightning\.pt is damaged: it starts like"),
], ids=["metadata-deleted", "shard-truncated", "metadata-garbage", "lightning-pt-garbage"])
def test_unverified_sharded_loads_still_name_the_damage(sharded: Path, damage, pattern: str) -> None:
    damage(sharded)
    refused(sharded, pattern, verify=False)


# ---- failed writes ---------------------------------------------------------------------------------------
def _fail(code: int):
    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize("code, fix", [
    (errno.ENOSPC, r"Fix: free space on the file system of \S+ \(or raise the quota\), or save to another directory"),
    (errno.EDQUOT, r"Fix: free space on the file system"),
    (errno.EROFS, r"Fix: make \S+ writable for this user \(or remount it read-write\), or save to another directory"),
    (errno.EIO, r"Fix: check the file system of \S+ \(space, permissions, the drive's health\)"),
])
def test_a_failed_save_names_the_path_the_bytes_and_the_fix_and_leaves_no_temporary_file(
        saved: Path, monkeypatch: pytest.MonkeyPatch, code: int, fix: str) -> None:
    before = saved.read_bytes()
    bigger = {**state(), "extra": torch.zeros(100_000)}
    monkeypatch.setattr(checkpoint_io.os, "fsync", _fail(code))
    with pytest.raises(CheckpointWriteError) as info:
        VerifiedCheckpointIO().save_checkpoint(bigger, saved)
    monkeypatch.undo()
    err = info.value
    assert isinstance(err, OSError) and err.errno == code and err.filename == str(saved)
    message = str(err)
    assert message.startswith(f"could not write checkpoint {saved}: {os.strerror(code)} ({errno.errorcode[code]}) "
                              "while writing about 392 KiB (its tensors), 3"), message
    assert re.search(r"KiB of it written; .* free on that file system\. An earlier checkpoint at that path is "
                     r"unchanged and no temporary file is left behind\. " + fix, message), message
    assert sorted(p.name for p in saved.parent.iterdir()) == ["good.ckpt"]  # no temporary file
    assert saved.read_bytes() == before


def test_a_short_write_torch_reports_without_the_os_error_is_a_full_disk_when_there_is_no_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's zip writer can swallow the OSError of a full disk and say only "unexpected pos": with
    less free space than the checkpoint's tensors that is ENOSPC; with room, torch's error stays."""
    def short_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04" + bytes(1000))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    target = tmp_path / "a.ckpt"
    monkeypatch.setattr(checkpoint_io.torch, "save", short_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(CheckpointWriteError, match=r"No space left on device \(ENOSPC\) while writing about "
                                                   r"1\.00 KiB \(its tensors\), 1004 B of it written; 0 B free"):
        VerifiedCheckpointIO().save_checkpoint({"w": torch.zeros(256)}, target)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 0, 10**12))
    with pytest.raises(RuntimeError, match="unexpected pos") as info:
        VerifiedCheckpointIO().save_checkpoint({"w": torch.zeros(256)}, target)
    assert not isinstance(info.value, OSError)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["dcp-writer", "rank-0-files"])
def test_a_full_disk_during_a_sharded_save_names_the_path_and_leaves_the_old_checkpoint(
        sharded: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    from lightning_lazytrain.core import sharded_checkpoint
    from lightning_lazytrain.core.sharded_checkpoint import load_sharded, save_sharded

    if where == "dcp-writer":  # DCP's FileSystemWriter fsyncs every file it writes
        monkeypatch.setattr(os, "fsync", _fail(errno.ENOSPC))
    else:  # rank 0's lightning.pt, after DCP's files
        monkeypatch.setattr(sharded_checkpoint, "_fsync_file", _fail(errno.ENOSPC))
    with pytest.raises(CheckpointWriteError) as info:
        save_sharded({**state(), "global_step": 8}, sharded)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(sharded)
    assert re.match(rf"could not write sharded checkpoint {re.escape(str(sharded))}: No space left on device "
                    r"\(ENOSPC\) while writing about 1\.03 KiB of tensors; .* free on that file system\. An earlier "
                    r"checkpoint at that path is unchanged and no temporary directory is left behind\. Fix: free "
                    r"space on the file system", str(info.value)), str(info.value)
    assert sorted(p.name for p in sharded.parent.iterdir()) == ["sharded.ckpt"]
    assert load_sharded(sharded)["global_step"] == 7  # the earlier save, whole (its CRCs check)


def test_manifest_written_by_save_is_what_the_check_reads(sharded: Path) -> None:
    manifest = json.loads((sharded / "crc32.json").read_text())
    assert manifest["format"] == "lazytrain-dcp-1"
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "lightning.pt"}
