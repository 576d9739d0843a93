"""Stage (f): NVMe tier probe: O_DIRECT support and spill-file write/read GB/s.

In ``--dir`` (default ``$LAZYTRAIN_NVME_DIR``, else the system temp directory): the engine's own
directory check (``check_nvme_dir``) and O_DIRECT probe (``probe_direct_io``), then a pinned (on
CUDA) or plain host tensor of ``--mib`` MiB is written and read back ``--repeats`` times through
the copy engine's NVMe lanes with ``direct=True`` (the path the activation store uses); best
GB/s of each. Hard failure: the bytes read back differ. Whether O_DIRECT was used (the engine falls
back to buffered I/O where it is refused, e.g. tmpfs) is recorded; buffered reads of a file just
written come from the page cache, so their GB/s says nothing about the drive.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kit import GB, Stage, stage_main


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dir", default=os.environ.get("LAZYTRAIN_NVME_DIR") or tempfile.gettempdir())
    ap.add_argument("--mib", type=int, default=None, help="default: 512 on CUDA, 32 on the CPU")
    ap.add_argument("--repeats", type=int, default=3)


def body(st: Stage, args: argparse.Namespace) -> None:
    from lightning_lazytrain.engine.copy_factory import make_copy_engine
    from lightning_lazytrain.engine.nvme import check_nvme_dir, probe_direct_io, read_tensor, write_tensor

    mib = args.mib or (512 if args.device == "cuda" else 32)
    root = check_nvme_dir(args.dir, required_bytes=2 * mib << 20)
    ok, why = probe_direct_io(root)
    work = Path(tempfile.mkdtemp(prefix="lazytrain-kit-nvme-", dir=root))
    fs = None
    try:
        with open("/proc/mounts") as f:  # the file system the directory is on (longest matching mount point)
            mounts = [line.split()[:3] for line in f]
        best = max((m for m in mounts if str(work).startswith(m[1].rstrip("/") + "/") or m[1] == "/"),
                   key=lambda m: len(m[1]), default=None)
        fs = f"{best[2]} on {best[1]} ({best[0]})" if best else None
    except OSError:
        pass
    st.figures.update({"dir": str(root), "filesystem": fs, "o_direct_probe": ok, "o_direct_reason": why, "mib": mib})
    pin = args.device == "cuda"
    n = mib << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    if pin:
        src = src.pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
    path = work / "probe.spill"
    engine = make_copy_engine("cpu")
    write_s, read_s = [], []
    try:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.nvme_write(path, src, direct=True).wait()
            write_s.append(time.perf_counter() - t0)
            dst.zero_()
            t0 = time.perf_counter()
            engine.nvme_read(path, dst, direct=True).wait()
            read_s.append(time.perf_counter() - t0)
            st.check(torch.equal(src, dst), "bytes read back differ from the bytes written")
        used_direct = write_tensor(str(path), src[: 1 << 20], direct=True)
        used_direct &= read_tensor(str(path), dst[: 1 << 20], direct=True)
    finally:
        engine.close()
        shutil.rmtree(work, ignore_errors=True)
    st.figures.update({"o_direct_used": bool(used_direct), "write_gb_per_s": n / min(write_s) / GB,
                       "read_gb_per_s": n / min(read_s) / GB, "write_seconds": write_s, "read_seconds": read_s})
    if not used_direct:
        st.note(f"O_DIRECT not used in {root} ({why}): buffered I/O, read figures come from the page cache")
    print(f"{root} ({fs}): O_DIRECT {'yes' if used_direct else 'no'} ({why}); {mib} MiB write "
          f"{st.figures['write_gb_per_s']:.2f} GB/s, read {st.figures['read_gb_per_s']:.2f} GB/s", flush=True)


if __name__ == "__main__":
    raise SystemExit(stage_main("nvme", body, add_args))
