"""Activation store tiers, NVMe spill files, directory checks and crash cleanup."""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_lazytrain.engine import nvme
from lightning_lazytrain.engine.activation_store import ActivationStore, Tier
from lightning_lazytrain.engine.copy_cpu import ThreadCopyEngine
from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.nvme import (
    SPILL_PREFIX,
    NvmeDirError,
    SpillDir,
    check_nvme_dir,
    remove_stale_spill_dirs,
)

TENSORS = {
    "f32": lambda: torch.randn(33, 65),
    "bf16": lambda: torch.randn(4, 1000).to(torch.bfloat16),
    "f16-noncontig": lambda: torch.randn(40, 30).half().t(),
    "int64": lambda: torch.randint(-(2**40), 2**40, (777,)),
    "scalar": lambda: torch.tensor(3.5),
}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ActivationStore]:
    s = ActivationStore("cpu", nvme_dir=tmp_path / "spill")
    yield s
    s.close()


def _spill_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith(SPILL_PREFIX))


# ------------------------------------------------------------------- tiers
@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
@pytest.mark.parametrize("name", list(TENSORS))
def test_round_trip_bit_exact(store: ActivationStore, tier: str, name: str) -> None:
    x = TENSORS[name]()
    store.offload("k", x, tier)
    got = store.get("k")
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got.contiguous().view(-1).view(torch.uint8), x.contiguous().view(-1).view(torch.uint8))
    if tier == "gpu":
        assert got.data_ptr() == x.data_ptr()  # kept, not copied
    else:
        assert got.data_ptr() != x.data_ptr()
    store.free("k")
    assert "k" not in store and store.device_bytes == 0


@pytest.mark.parametrize("direct", [True, False], ids=["odirect", "buffered"])
def test_nvme_files_and_lanes(tmp_path: Path, direct: bool) -> None:
    if direct:
        ok, why = nvme.probe_direct_io(tmp_path)
        if not ok:
            pytest.skip(f"no O_DIRECT on {tmp_path}: {why}")
    with ActivationStore("cpu", nvme_dir=tmp_path, direct_io=direct) as s:
        assert s.spill is not None and s.spill.direct is direct
        xs = {i: torch.randn(1000 + i) for i in range(3)}  # sizes not multiples of 4 KiB
        for i, x in xs.items():
            s.offload(i, x, Tier.NVME)
        s.engine.synchronize()
        files = s.spill.spill_files()
        assert len(files) == 3
        for i in reversed(range(3)):
            s.prefetch(i)
        for i, x in xs.items():
            assert torch.equal(s.get(i), x)
        moved = s.bytes_moved
        raw = sum(x.nbytes for x in xs.values())
        assert moved["d2h"] == raw == moved["h2d"]
        assert moved["nvme_write"] >= raw and moved["nvme_read"] == moved["nvme_write"]
        s.free(0)
        assert not files[0].exists() and files[1].exists()
        s.end_step()  # removes the rest of this step's files, keeps the directory
        assert s.spill.spill_files() == [] and s.spill.path.is_dir() and len(s) == 0
        spill_path = s.spill.path
    assert not spill_path.exists()  # close() removes the directory


def test_write_tensor_reports_direct_and_handles_unaligned_memory(tmp_path: Path) -> None:
    if not nvme.probe_direct_io(tmp_path)[0]:
        pytest.skip("no O_DIRECT here")
    base = torch.randint(0, 255, (nvme._CHUNK + 3 * nvme.ALIGN + 5,), dtype=torch.uint8)
    x = base[1:]  # unaligned address, > one bounce chunk: exercises the chunked bounce path
    p = str(tmp_path / "u.spill")
    assert nvme.write_tensor(p, x, direct=True) is True
    out = torch.empty_like(x)
    assert nvme.read_tensor(p, out, direct=True) is True
    assert torch.equal(out, x)
    with pytest.raises(EOFError, match="truncated"):
        nvme.read_tensor(p, torch.empty(x.numel() + 10, dtype=torch.uint8), direct=True)


def test_nvme_read_buffer_is_kept_until_its_h2d(store: ActivationStore) -> None:
    """A reload's file read lands in a pooled host buffer that the later H2D reads: a ``reap``
    between the two (the executor reaps at every window) must not hand it to another offload."""
    x = torch.randn(64, 64)
    store.offload("a", x, "nvme").wait()
    store.read_to_host("a").wait()
    store.reap()
    for k in range(3):  # take pooled buffers of the same size and fill them
        store.offload(f"other{k}", torch.full((64, 64), float(k)), "nvme").wait()
    assert torch.equal(store.get("a"), x)


def test_device_byte_accounting(store: ActivationStore) -> None:
    a, b = torch.randn(256), torch.randn(512)  # 1 KiB, 2 KiB
    store.offload("a", a, "gpu")
    store.offload("b", b, "cpu")
    store.engine.synchronize()
    assert store.device_bytes == 1024  # b's source is released once on the host
    assert store.peak_device_bytes == 3072
    store.get("b")
    assert store.device_bytes == 3072
    store.free("a")
    assert store.device_bytes == 2048
    store.end_step()
    assert store.device_bytes == 0 and store.peak_device_bytes == 3072
    store.reset_peak()
    assert store.peak_device_bytes == 0


def test_prefetch_overlaps_with_offload_on_emulated_links(tmp_path: Path) -> None:
    link = LinkSpec(200e6, latency_s=0.0)  # 4 MB -> 20 ms
    eng = ThreadCopyEngine(links={"d2h": link, "h2d": link})
    with ActivationStore("cpu", eng) as s:
        xs = [torch.randn(1 << 20) for _ in range(4)]
        s.offload(0, xs[0], "cpu")
        s.offload(1, xs[1], "cpu")
        h = s.prefetch(0)  # h2d lane runs while d2h lane still works on 1
        s.offload(2, xs[2], "cpu")
        h.wait()
        for i in range(3):
            assert torch.equal(s.get(i), xs[i])
        recs = [r for r in eng.records() if r.tag == "act:0" and r.lane == "h2d"]
        (up,) = recs
        offs = [r for r in eng.records() if r.lane == "d2h"]
        assert all(b.start >= a.end for a, b in zip(offs, offs[1:]))  # FIFO per lane
        assert up.start >= offs[0].end  # prefetch of 0 waited for its offload
    eng.close()


def test_api_errors(tmp_path: Path) -> None:
    class PlannerTier(enum.Enum):  # a foreign enum with the same names works
        NVME = 2

    assert Tier.parse(PlannerTier.NVME) is Tier.NVME and Tier.parse("CPU") is Tier.CPU
    with pytest.raises(ValueError, match="unknown activation tier"):
        Tier.parse("recompute")
    with ActivationStore("cpu") as s:
        with pytest.raises(ValueError, match="nvme_dir"):
            s.offload("x", torch.ones(2), "nvme")
        s.offload("x", torch.ones(2), "cpu")
        with pytest.raises(KeyError, match="already stored"):
            s.offload("x", torch.ones(2), "cpu")
    with pytest.raises(RuntimeError, match="closed"):
        s.offload("y", torch.ones(2), "gpu")


# -------------------------------------------------------------- dir checks
def test_check_dir_creates_missing(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert check_nvme_dir(target, 1) == target and target.is_dir()


def test_check_dir_path_under_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NvmeDirError) as ei:
        check_nvme_dir(f / "spill")
    msg = str(ei.value)
    assert str(f / "spill") in msg and "cannot be created" in msg and "Fix:" in msg
    with pytest.raises(NvmeDirError, match="not a directory"):
        check_nvme_dir(f)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_check_dir_read_only(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(NvmeDirError, match="not writable") as ei:
            check_nvme_dir(ro)
        assert str(ro) in str(ei.value) and "Fix:" in str(ei.value)
    finally:
        ro.chmod(0o700)


def test_check_dir_too_small(tmp_path: Path) -> None:
    need = shutil.disk_usage(tmp_path).free + (1 << 40)
    with pytest.raises(NvmeDirError) as ei:
        check_nvme_dir(tmp_path, need)
    msg = str(ei.value)
    assert str(tmp_path) in msg and "free" in msg and str(need) in msg and "Fix:" in msg
    with pytest.raises(NvmeDirError, match="free"):
        ActivationStore("cpu", nvme_dir=tmp_path, nvme_required_bytes=need)


def test_check_dir_too_small_prints_small_sizes_readably(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a nearly full drive: 1.5 KiB free against a 96 MiB plan used to read "has 0.00 GiB free, ... needs 0.09 GiB"
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda _p: usage._replace(free=1536))
    need = 96 * 2**20
    with pytest.raises(NvmeDirError) as ei:
        check_nvme_dir(tmp_path, need)
    msg = str(ei.value)
    assert f"has 1.50 KiB free, but the plan needs 96.0 MiB ({need} bytes)" in msg, msg
    rest = msg.replace(str(tmp_path), "<dir>")
    assert "0.0" not in rest and "GiB" not in rest, msg


# ---------------------------------------------------------- stale cleanup
_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from lightning_lazytrain.engine.nvme import SpillDir, write_tensor
    d = SpillDir(sys.argv[1])
    print(d.path, flush=True)
    if sys.argv[2] == "write":
        t = torch.zeros(4 << 20)
        i = 0
        while True:  # keep writing until killed
            write_tensor(str(d.file(i % 3)), t)
            i += 1
    elif sys.argv[2] == "sleep":
        time.sleep(60)
    # "exit": leave without close(); atexit must clean up
    """
)


def _spawn(root: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), mode], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, Path(p.stdout.readline().strip())


@pytest.mark.slow
def test_sigkill_mid_write_is_cleaned_at_next_start(tmp_path: Path) -> None:
    root = tmp_path / "spill"
    writer, wdir = _spawn(root, "write")
    sleeper, sdir = _spawn(root, "sleep")
    try:
        deadline = time.monotonic() + 30
        while not list(wdir.glob("*.spill")) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        assert list(wdir.glob("*.spill"))  # the crash left files behind
        own = SpillDir(root)  # start-up: removes the dead run's directory only
        assert not wdir.exists()
        assert sdir.exists()  # its owner is alive (holds the lock)
        assert remove_stale_spill_dirs(root) == []  # our own dir is alive too
        own.close()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale_spill_dirs(root) == [sdir] and _spill_dirs(root) == []


@pytest.mark.slow
def test_normal_exit_without_close_cleans_up(tmp_path: Path) -> None:
    child, d = _spawn(tmp_path, "exit")
    assert child.wait(timeout=60) == 0
    assert not d.exists()


def test_stale_dirs_without_lock_use_pid(tmp_path: Path) -> None:
    dead = tmp_path / f"{SPILL_PREFIX}{2**22 + 12345}-dead"  # above pid_max: never alive
    half = tmp_path / f".{SPILL_PREFIX}{2**22 + 12346}-half"  # crashed while being created
    mine = tmp_path / f".{SPILL_PREFIX}{os.getpid()}-mine"  # being created by a live process
    unlocked = tmp_path / f"{SPILL_PREFIX}{os.getpid()}-unlocked"  # lock file nobody holds
    other = tmp_path / "unrelated"
    for d in (dead, half, mine, unlocked, other):
        d.mkdir()
        (d / "0.spill").write_bytes(b"x")
    (unlocked / ".lock").write_text("1\n")
    removed = remove_stale_spill_dirs(tmp_path)
    assert sorted(removed) == sorted([dead, half, unlocked])
    assert mine.exists() and other.exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(0, 3 * nvme.ALIGN + 7) | st.sampled_from([nvme.ALIGN, 2 * nvme.ALIGN]),
    shift=st.integers(0, 64),
    direct=st.booleans(),
)
def test_spill_io_round_trip_any_size_and_alignment(tmp_path: Path, n: int, shift: int, direct: bool) -> None:
    base = torch.randint(0, 256, (n + 64 + nvme.ALIGN,), dtype=torch.uint8)
    x = base[shift : shift + n]
    out_base = torch.zeros_like(base)
    out = out_base[64 - shift : 64 - shift + n]  # a different misalignment on the way back
    p = str(tmp_path / "h.spill")
    nvme.write_tensor(p, x, direct=direct)
    assert os.path.getsize(p) == n
    nvme.read_tensor(p, out, direct=direct)
    assert torch.equal(out, x)
    outside = torch.cat([out_base[: 64 - shift], out_base[64 - shift + n :]])
    assert int(outside.count_nonzero()) == 0  # nothing written outside `out`


# ------------------------------------------------------------------- host pool accounting
def test_host_pool_holds_exact_page_classes_and_trims_to_the_step(tmp_path: Path) -> None:
    """Each host buffer is its size rounded up to 4 KiB (no power-of-two rounding, no alignment slack);
    buffers are reused; ``end_step`` keeps per size class what the step held at once, none of a class it did
    not use; a host home may take a free buffer up to twice its size (never an NVMe leg)."""
    page = nvme.ALIGN
    with ActivationStore("cpu", nvme_dir=tmp_path) as s:
        assert s.host_pinned_bytes == 0
        a = torch.randn(1024)  # 4096 B: exactly one page (the old pool asked for 8 KiB)
        b = torch.randn(3000)  # 12000 B -> 3 pages
        for i in range(3):
            s.offload(("a", i), a, Tier.CPU)
        s.offload("b", b, Tier.CPU)
        for key in [("a", i) for i in range(3)] + ["b"]:
            buf = s._entries[key].host
            assert buf is not None and buf.data_ptr() % page == 0
        del buf
        assert s.host_pinned_bytes == 3 * page + 3 * page
        s.free(("a", 0))
        s.offload(("a", 3), a, Tier.CPU)  # reuses the freed buffer
        assert s.host_pinned_bytes == 6 * page
        assert torch.equal(s.get(("a", 3)), a)
        s.end_step()
        assert s.host_pinned_bytes == 6 * page  # this step's high-water per class is kept
        s.offload(("a", 0), a, Tier.CPU)  # the next step holds one page-class buffer, no 3-page one
        s.end_step()
        # class used: trimmed to 1; the class the step did not use is dropped (Note: [buffers across batch shapes])
        assert s.host_pinned_bytes == 1 * page
        s.offload("n", b, Tier.NVME)  # NVMe staging comes from the same pool
        s.get("n")
        assert s.host_pinned_bytes >= 4 * page
        s.end_step()
        c = torch.randn(1800)
        s.offload("big", c, Tier.CPU)  # 7200 B -> 2 pages: takes the free 3-page buffer
        before = s.host_pinned_bytes
        s.offload("n2", torch.randn(1800), Tier.NVME)  # exact class: a new 2-page buffer
        assert s.host_pinned_bytes == before + 2 * page
        assert s._entries["big"].host.numel() == 3 * page
        assert torch.equal(s.get("big"), c)
        s.end_step()
    assert s.host_pinned_bytes == 0  # closed: everything given back


# ------------------------------------------------------------- spill faults
def _raise(code: int):
    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize("write, code, meaning", [
    (True, errno.ENOSPC, r"the drive of nvme_dir=\S+ is full \(.* free\)\. Fix: free space on that drive or point "
                         r"nvme_dir at a larger one"),
    (True, errno.EDQUOT, r"quota .* Fix: free space"),
    (False, errno.EIO, r"reported an I/O error: it may be failing, and the activation in this file is lost\. "
                       r"Fix: check the drive \(dmesg, smartctl\) and then restart from the last checkpoint"),
    (True, errno.EIO, r"reported an I/O error: it may be failing\. Fix: check the drive"),
    (True, errno.EACCES, r"permissions of nvme_dir=\S+ changed .* Fix: make it writable for this user"),
    (False, errno.EACCES, r"and the activation in this file is lost\. Fix: make it readable for this user"),
    (True, errno.EROFS, r"mounted read-only now .* Fix: check the drive \(dmesg\), remount it read-write"),
    (True, errno.ENOENT, r"the spill directory was removed while training ran\. Fix: keep nvme_dir=\S+ in place"),
    (False, errno.ENOENT, r"was removed while training ran, and the activation in this file is lost\. Fix: keep"),
])
def test_a_spill_fault_is_one_readable_sentence_with_the_fix_for_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: bool, code: int, meaning: str) -> None:
    """What failed (write or read of which file), the OS error by strerror and errno name, and the fix
    that fits that error; not nested reprs, and a read EIO is not called a full or removed directory."""
    from lightning_lazytrain.engine.copy_engine import CopyError

    s = ActivationStore("cpu", nvme_dir=tmp_path, direct_io=False)
    try:
        assert s.spill is not None
        path = s.spill.file("k")
        monkeypatch.setattr(nvme, "_write_all" if write else "_read_all", _raise(code))
        with pytest.raises(CopyError) as info:
            s.offload("k", torch.randn(100), Tier.NVME)
            s.get("k")
        monkeypatch.undo()
    finally:
        with contextlib.suppress(CopyError):  # closing waits for the failed copy again
            s.close()
    message = str(info.value)
    lane = "nvme_write" if write else "nvme_read"
    verb = "write" if write else "read"
    assert re.match(rf"{lane} copy of \d+ bytes failed: could not {verb} spill file {re.escape(str(path))}: "
                    rf"{re.escape(os.strerror(code))} \({errno.errorcode[code]}\); ", message), message
    assert re.search(meaning, message), message
    assert f"nvme_dir={tmp_path}" in message and "\n" not in message
    assert not re.search(r"\w+Error\(|\\'", message), message  # no reprs, no escaped quotes
    cause = info.value.__cause__
    while isinstance(cause, CopyError):  # a copy that waited for the failed one
        cause = cause.__cause__
    assert isinstance(cause, nvme.SpillIOError) and cause.errno == code and cause.filename == str(path)


def test_a_truncated_spill_file_names_its_size_and_that_the_activation_is_lost(tmp_path: Path) -> None:
    from lightning_lazytrain.engine.copy_engine import CopyError

    s = ActivationStore("cpu", nvme_dir=tmp_path, direct_io=False)
    try:
        s.offload("k", torch.randn(100), Tier.NVME).wait()
        path = s.spill.file("k")
        os.truncate(path, 40)
        with pytest.raises(CopyError, match=rf"nvme_read copy of \d+ bytes failed: could not read spill file "
                                            rf"{re.escape(str(path))}: it is truncated \(40 of \d+ bytes\); .*"
                                            r"activation in this file is lost\. Fix: "):
            s.get("k")
    finally:
        with contextlib.suppress(CopyError):
            s.close()


def test_copies_waiting_on_a_failed_spill_repeat_its_message(tmp_path: Path) -> None:
    """A read after a failed write and an H2D after that read fail with the first failure's sentence,
    not with a repr of a repr of it."""
    from lightning_lazytrain.engine.copy_engine import CopyError

    engine = ThreadCopyEngine()
    try:
        path = tmp_path / "gone" / "lazytrain-spill-1-ab" / "k.spill"
        w = engine.nvme_write(path, torch.ones(64))
        r = engine.nvme_read(path, torch.empty(64), after=[w])
        h = engine.h2d(torch.empty(64), torch.empty(64), after=[r])
        messages = []
        for handle in (w, r, h):
            with pytest.raises(CopyError) as info:
                handle.wait()
            messages.append(str(info.value))
        assert messages[0] == messages[1] == messages[2]
        assert messages[0].startswith(f"nvme_write copy of 256 bytes failed: could not write spill file {path}: "
                                      "No such file or directory (ENOENT); the spill directory was removed")
        assert f"nvme_dir={tmp_path / 'gone'}" in messages[0]
    finally:
        engine.close()
