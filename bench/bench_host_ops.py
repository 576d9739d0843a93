"""Host kernels (engine/host_ops.py) against the host's own fp32 copy rate, same run (the target:
casts, adds and the 32-bit AdamW update at >= 0.7x of the copy rate).

    python bench/bench_host_ops.py [N | N1,N2,...] [--mib 256] [--repeats 5] [--rounds 3] [--inner 1]
                                   [--chunk-mib M] [--widen-kib K]

For 1..N threads (N: default os.cpu_count(); or the listed counts, e.g. 1,4,8,16), on fp32 tensors of
``--mib`` MiB (AdamW: that many MiB per state, 64M params at 256 MiB): each op through ``HostOps(n)``
(chunked over n worker threads, one OpenMP thread each) and as the plain single torch call with
``torch.set_num_threads(n)``, median of ``--repeats`` timed calls after a warm-up
(``measure_host_rates``). Bytes counted as read + written per element, as ``measure_host_rates`` and
the first GPU measurements (bench/RESULTS.md) count them: copy fp32 8, cast fp32 -> bf16 6, add
bf16 into fp32 10, add fp32 into fp32 12, AdamW fp32 28 (p, g, m, v read; p, m, v written); a copy's
write-allocate read of its destination is not counted, so the adds and AdamW (which read what they
write) can exceed 1.0x. Ratios: to the plain torch fp32 copy at the same thread count in the same
round; rates and ratios are medians over ``--rounds``. Last rows of each thread count:
``torch.optim.AdamW(fused=True).step()`` itself on one fp32 parameter of ``--mib`` MiB. ``--inner K``:
each worker runs torch with K OpenMP threads (``HostOps(inner_threads=K)``; 1, the default, is what
the pool is for; K > 1 shows what oversubscription costs).

2-core CPU machine (KVM, 2026-12-04, torch 2.13.0+cpu, ``python bench/bench_host_ops.py``): one core
saturates memory (copy ~13 GB/s on 1 and 2 threads); host_ops / copy: cast 0.71-0.80 (torch's own
0.75-0.83), add bf16 into fp32 1.02-1.15 (torch's mixed ``add_`` 0.37-0.38), add fp32 1.47-1.66;
torch's fused AdamW step 1.76-1.92 (the chunked call 0.92-0.97x of it here). ``--inner 2``: 5-20%
slower than ``--inner 1``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lightning_lazytrain.engine.host_ops import BYTES_PER_ELEM, measure_host_rates

NAMES = {"copy_fp32": "copy fp32", "cast_fp32_bf16": "cast fp32->bf16", "add_bf16_fp32": "add bf16 into fp32",
         "add_fp32_fp32": "add fp32 into fp32", "norm_fp32": "norms fp32 (8 tensors)", "adamw_fp32": "_fused_adamw_ fp32",
         "step": "AdamW(fused).step()"}


def optimizer_step_rates(mib: int, threads: range, repeats: int) -> dict[int, float]:
    """GB/s (28 B/param) of ``torch.optim.AdamW(fused=True).step()`` on one fp32 parameter of ``mib`` MiB
    (32-bit states), median of ``repeats`` steps after a warm-up step, with ``torch.set_num_threads(n)``."""
    p = torch.nn.Parameter(torch.randn((mib << 20) // 4))
    p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    before, out = torch.get_num_threads(), {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            opt.step()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            out[n] = 28 * p.numel() / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(before)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("threads", nargs="?", default=str(os.cpu_count()))
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner", type=int, default=1)
    ap.add_argument("--chunk-mib", type=float, default=None, help="HostOps chunk_bytes in MiB (default: HostOps')")
    ap.add_argument("--widen-kib", type=float, default=None, help="HostOps widen_bytes in KiB (default: HostOps')")
    args = ap.parse_args()
    sizes = {k: int(v * m) for k, v, m in (("chunk_bytes", args.chunk_mib, 1 << 20), ("widen_bytes", args.widen_kib, 1 << 10))
             if v is not None}
    counts = [int(x) for x in args.threads.split(",")]
    t0, threads = time.perf_counter(), counts if len(counts) > 1 else range(1, counts[0] + 1)
    print(f"# bench_host_ops: {args.mib} MiB fp32 tensors, median of {args.repeats} calls, median of {args.rounds} "
          f"rounds (ratios: median of the rounds' ratios), torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"inner threads {args.inner}, {sizes or 'default chunk sizes'}, {time.strftime('%Y-%m-%d')}", flush=True)
    cells: dict = {}  # (threads, op, impl) -> [(rate, rate / copy of that round and thread count)]
    for _ in range(args.rounds):
        r = measure_host_rates(args.mib << 20, threads=threads, repeats=args.repeats, ops=list(BYTES_PER_ELEM),
                               statistic="median", inner_threads=args.inner, **sizes)["rates"]
        steps = optimizer_step_rates(args.mib, threads, args.repeats)
        for n, row in r.items():
            copy = row["copy_fp32"]["torch"]
            for op, v in row.items():
                for impl, rate in v.items():
                    cells.setdefault((n, op, impl), []).append((rate, rate / copy))
            cells.setdefault((n, "step", "torch"), []).append((steps[n], steps[n] / copy))

    def cell(n, op, impl, k):
        return statistics.median(x[k] for x in cells[(n, op, impl)]) if (n, op, impl) in cells else None

    print(f"{'threads':>7} {'op':<20} {'B/elem':>6} {'host_ops GB/s':>13} {'torch GB/s':>10} "
          f"{'host_ops/copy':>13} {'torch/copy':>10}")
    for n in threads:
        for op in (*BYTES_PER_ELEM, "step"):
            vals = [cell(n, op, impl, k) for k in (0, 1) for impl in ("host_ops", "torch")]
            a, b, c, d = ("" if v is None else f"{v:.{2 if i > 1 else 1}f}" for i, v in enumerate(vals))
            print(f"{n:>7} {NAMES[op]:<20} {BYTES_PER_ELEM.get(op, 28):>6} {a:>13} {b:>10} {c:>13} {d:>10}")
    print(f"# ratios: to the plain torch fp32 copy at the same thread count in the same round; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
