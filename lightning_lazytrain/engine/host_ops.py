"""Host kernels at memory speed: casts, gradient adds, per-tensor norms and the fused AdamW update on
the host, spread over a small persistent pool of threads, bit for bit what the plain torch op gives.

Why: torch's mixed-dtype ``add_`` (bf16 grads into fp32) runs at ~1/5 of the host's
copy bandwidth, its CPU 2-norm is one serial loop, and a single caller gets only the cores torch's
OpenMP team gives it.

How (``HostOps``): a tensor's flat range is cut into chunks, a multiple of ``ALIGN`` = 64 elements,
counted from its first element (the last chunk takes the rest): about two per worker, between
``min_chunk_bytes`` and ``chunk_bytes`` (counted at 4 bytes per element) -- few enough that the
Python around each chunk's torch call stays small next to the call (on the 16-core host of the H200
run, fixed 2 MiB chunks ran a 16-thread copy at 0.29x torch's own and 16 MiB chunks at 0.98x:
bench/device/runs/h200-2026-12-04-e899c93), enough for the workers to balance. The ``threads``
workers take chunks from a shared counter (contiguous chunks, dynamic balance) and run the plain
torch op on each chunk's views: ``dst[a:b].copy_(src[a:b])`` (``cast_into``), ``dst[a:b].add_(src[a:b])``
(``add_into``; a 16-bit ``src`` into fp32 is widened piece by piece into the worker's own fp32 scratch,
``widen_bytes``, 2 MiB: on the H200's host 512 KiB pieces ran the 8-thread widening add at 0.23x the
copy rate and 2 MiB pieces at 0.64x, the Python per piece being the cost; then added
same-dtype: no mixed-dtype kernel), ``torch._fused_adamw_`` on chunk views (``adamw_chunked``).
``norms`` spreads whole tensors over the workers. Each worker runs torch with ``inner_threads``
(default 1) OpenMP threads of its own, so ``threads`` is the number of cores an op uses and nothing is
oversubscribed (on the 2-core machine, 2 workers x 1 thread were as fast as or faster than 1 x 2 or
2 x 2: bench/bench_host_ops.py); the caller hands out the job and waits. A worker's exception is
raised in the caller. Small tensors (under ``inline_bytes``), non-contiguous, broadcast or
overlapping ones run the plain op in the caller: no pool overhead.

Why bit-identical: the ops are elementwise, so an element's result depends on its own inputs, not on
the thread or chunk that computed it, as long as it takes the same code path. torch's CPU kernels
have a vectorised body and a scalar tail (the last ``numel % vector width`` elements of a call) that
may round differently (``_fused_adamw_``'s body uses an FMA: per-tensor calls and one call over the
concatenation differ). Chunk boundaries at multiples of 64 elements from the tensor's start (a
multiple of every vector width in every dtype) leave exactly the whole tensor's tail in the last
chunk, so every element takes the path it takes in one call (NaN payloads and infinities included,
tested). Widening bf16/fp16 to fp32 is exact, so ``dst + float(src)`` is the fp32 sum the mixed
kernel computes. Norms are not chunked: a chunked sum of squares reduces in another order than
torch's serial 2-norm; one tensor's norm on a worker equals ``torch._foreach_norm``'s because torch
computes it the same on any thread count (tested).

Threads: each worker calls ``torch.set_num_threads(inner_threads)`` at start-up (OpenMP keeps the team
size per thread); the process-wide default that call also sets is restored, under a lock, before the
constructor returns.
"""

from __future__ import annotations

import itertools
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["ALIGN", "BYTES_PER_ELEM", "HostOps", "default_host_ops", "default_host_threads", "measure_host_rates"]

ALIGN = 64  # elements: chunk boundaries, a multiple of every SIMD width in every dtype
_WIDEN = (torch.bfloat16, torch.float16)
_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float64)  # thread-count invariant CPU 2-norms
_init_lock = threading.Lock()


class _Job:
    def __init__(self, fn: Callable[[int, int, dict], None], n: int, chunk: int, workers: int) -> None:
        self.fn, self.n, self.chunk = fn, n, chunk
        self.next = itertools.count()  # next() is atomic under the GIL
        self.left = workers
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.inference = torch.is_inference_mode_enabled()  # the caller's (grad mode is off on workers)

    def run(self, scratch: dict) -> None:
        try:
            with torch.no_grad(), torch.inference_mode(self.inference):
                while self.error is None:
                    lo = next(self.next) * self.chunk
                    if lo >= self.n:
                        break
                    self.fn(lo, min(lo + self.chunk, self.n), scratch)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            with self.lock:
                self.error = self.error or e
        finally:
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.done.set()


class HostOps:
    """Chunked, multi-threaded host kernels (see the module docstring); safe to share between
    threads (calls run one at a time). ``close()`` stops the workers."""

    def __init__(self, threads: int | None = None, *, chunk_bytes: int = 16 << 20, widen_bytes: int = 2 << 20,
                 inline_bytes: int = 1 << 20, inner_threads: int = 1, min_chunk_bytes: int = 1 << 20) -> None:
        self.threads = max(1, int(threads or torch.get_num_threads()))
        self.chunk = max(ALIGN, chunk_bytes // 4 // ALIGN * ALIGN)  # the most elements a worker takes at a time
        self.min_chunk = min(self.chunk, max(ALIGN, min_chunk_bytes // 4 // ALIGN * ALIGN))  # the fewest
        self.widen = max(ALIGN, widen_bytes // 4 // ALIGN * ALIGN)  # elements of the fp32 widening scratch
        self.inline_bytes = inline_bytes
        self.inner_threads = inner_threads
        self._call = threading.Lock()
        self._pid = os.getpid()  # workers do not survive a fork
        self._queues: list[queue.SimpleQueue] = []
        self._workers: list[threading.Thread] = []
        ready = threading.Barrier(self.threads + 1)
        self.worker_torch_threads: list[int] = []  # what each worker's torch reports (checks inner_threads)
        with _init_lock:
            before = torch.get_num_threads()  # the workers' set_num_threads also sets the process default
            try:
                for i in range(self.threads):
                    q: queue.SimpleQueue = queue.SimpleQueue()
                    self._queues.append(q)
                    w = threading.Thread(target=self._worker, args=(q, ready), daemon=True, name=f"host-ops-{i}")
                    w.start()
                    self._workers.append(w)
                ready.wait()
            finally:
                torch.set_num_threads(before)

    def _worker(self, q: queue.SimpleQueue, ready: threading.Barrier) -> None:
        try:
            torch.set_num_threads(self.inner_threads)  # this thread's OpenMP team size
        except Exception:  # noqa: BLE001 - a backend that refuses: torch's own team size (reported below)
            pass
        self.worker_torch_threads.append(torch.get_num_threads())
        ready.wait()
        scratch: dict = {}
        while (job := q.get()) is not None:
            job.run(scratch)

    def close(self) -> None:
        with self._call:
            for q in self._queues:
                q.put(None)
            self._queues = []
        for w in self._workers:
            if w is not threading.current_thread():
                w.join()
        self._workers = []

    def __enter__(self) -> HostOps:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, fn: Callable[[int, int, dict], None], n: int, chunk: int | None = None) -> None:
        if not self._queues or self._pid != os.getpid():
            raise RuntimeError("HostOps is closed (or was created before a fork: make a new one)")
        with self._call:
            job = _Job(fn, n, chunk or self.chunk_for(n), len(self._queues))
            for q in self._queues:
                q.put(job)
            job.done.wait()
        if job.error is not None:
            raise job.error

    def chunk_for(self, n: int) -> int:
        """Elements per chunk for an op over ``n``: about two chunks per worker, a multiple of ``ALIGN``,
        between the smallest and the largest chunk."""
        per = -(-n // (2 * self.threads))
        return min(self.chunk, max(self.min_chunk, -(-per // ALIGN) * ALIGN))

    def _chunked(self, dst: torch.Tensor, *others: torch.Tensor) -> bool:
        """Whether the pool should run an op over these (else: the plain op inline)."""
        ts = (dst, *others)
        if dst.numel() * dst.element_size() < self.inline_bytes or not self._queues or self._pid != os.getpid():
            return False
        if any(t.device.type != "cpu" or not t.is_contiguous() or t.shape != dst.shape for t in ts):
            return False
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
        return all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no two overlap

    # ---- the ops -------------------------------------------------------------------------------
    def cast_into(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``dst.copy_(src)`` (a cast, e.g. fp32 -> bf16/fp16, or a same-dtype copy)."""
        if not self._chunked(dst, src):
            with torch.no_grad():
                return dst.copy_(src)
        d, s = dst.view(-1), src.view(-1)
        self._run(lambda a, b, _: d[a:b].copy_(s[a:b]), d.numel())
        return dst

    def add_into(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``dst += src``: bit for bit ``dst.add_(src)`` (= ``dst.add_(src.float())`` for a 16-bit
        ``src`` into fp32: a 16-bit src is widened chunk by chunk in a per-worker fp32 scratch)."""
        widen = src.dtype != dst.dtype and src.dtype in _WIDEN and dst.dtype == torch.float32
        if not self._chunked(dst, src):
            with torch.no_grad():
                return dst.add_(src.to(dst.dtype) if widen else src)
        d, s = dst.view(-1), src.view(-1)
        if not widen:
            self._run(lambda a, b, _: d[a:b].add_(s[a:b]), d.numel())
            return dst

        def add(a: int, b: int, scratch: dict) -> None:
            buf = scratch.get("widen")
            if buf is None or buf.numel() != self.widen:
                buf = scratch["widen"] = torch.empty(self.widen, dtype=torch.float32)
            for lo in range(a, b, self.widen):  # pieces stay in the worker's L2 between widen and add
                hi = min(lo + self.widen, b)
                tmp = buf[:hi - lo]
                tmp.copy_(s[lo:hi])
                d[lo:hi].add_(tmp)

        self._run(add, d.numel())
        return dst

    def norms(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``torch._foreach_norm(tensors, 2.0)`` (each tensor's L2 norm, in its dtype), bit for bit: whole
        contiguous fp32/bf16/fp64 tensors spread over the workers, largest first (torch's CPU 2-norm of
        those is one serial loop, the same on any thread count: tested); others (fp16, strided: their
        norms depend on torch's thread count) in one plain call here. Not chunked within a tensor: a
        chunked sum of squares would reduce in another order."""
        ts = list(tensors)
        pool = [i for i, t in enumerate(ts) if t.dtype in _NORM_DTYPES and t.device.type == "cpu"
                and t.is_contiguous()]
        if sum(ts[i].numel() * ts[i].element_size() for i in pool) < self.inline_bytes or len(pool) < 2 \
                or not self._queues or self._pid != os.getpid():
            pool = []
        out: list = [None] * len(ts)
        rest = [i for i in range(len(ts)) if i not in set(pool)]
        if rest:
            with torch.no_grad():
                for i, n in zip(rest, torch._foreach_norm([ts[i] for i in rest], 2.0)):
                    out[i] = n
        order = sorted(pool, key=lambda i: -ts[i].numel())

        def one(a: int, b: int, _: dict) -> None:
            for k in order[a:b]:
                out[k] = torch._foreach_norm([ts[k]], 2.0)[0]

        if order:
            self._run(one, len(order), chunk=1)
        return out

    def adamw_chunked(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                      state_steps: Sequence[torch.Tensor], *, lr: float | torch.Tensor, beta1: float, beta2: float,
                      weight_decay: float, eps: float, amsgrad: bool = False, maximize: bool = False,
                      max_exp_avg_sqs: Sequence[torch.Tensor] = (), grad_scale: torch.Tensor | None = None,
                      found_inf: torch.Tensor | None = None) -> None:
        """``torch._fused_adamw_`` with the same arguments (the steps already incremented, as
        ``torch.optim.AdamW`` passes them), bit for bit, each tensor's elements chunked over the pool.
        Small or non-contiguous tensors go in one plain call."""
        kw = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
                  maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
        rows = list(itertools.zip_longest(params, grads, exp_avgs, exp_avg_sqs, state_steps, max_exp_avg_sqs))
        small = []
        for p, g, m, v, step, vmax in rows:
            ts = [t for t in (p, g, m, v, vmax if amsgrad else None) if t is not None]
            if not self._chunked(*ts):
                small.append((p, g, m, v, step, vmax))
                continue
            flat = [t.view(-1) for t in ts]
            self._run(lambda a, b, _, flat=flat, step=step: torch._fused_adamw_(
                *([t[a:b]] for t in flat[:4]), [t[a:b] for t in flat[4:]], [step], **kw), p.numel())
        if small:
            p, g, m, v, steps, vmax = (list(c) for c in zip(*small))
            with torch.no_grad():
                torch._fused_adamw_(p, g, m, v, vmax if amsgrad else [], steps, **kw)


_default: HostOps | None = None
_default_lock = threading.Lock()


def _forget_default() -> None:
    global _default, _default_lock
    _default, _default_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_default)  # a forked child makes its own pool


def default_host_threads() -> int:
    """Threads of the engine's host kernels: torch's thread count at first use, less two on a host
    with more than four (the thread that launches the device's work and the copy lanes need cores
    of their own while the host lane runs)."""
    n = torch.get_num_threads()
    return n - 2 if n > 4 else n


def default_host_ops() -> HostOps:
    """A process-wide ``HostOps(default_host_threads())``, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = HostOps(default_host_threads())
        return _default


# ---- measured rates (the profile prices the host lane with these) ----------------------------------
BYTES_PER_ELEM = {"copy_fp32": 8, "cast_fp32_bf16": 6, "add_bf16_fp32": 10, "add_fp32_fp32": 12, "norm_fp32": 4,
                  "adamw_fp32": 28}
NORM_PIECES = 8  # norm_fp32 measures the norms of this many equal tensors, as a group's several parameters


def _seconds(fn: Callable[[], object], repeats: int, statistic: str) -> float:
    fn()  # warm-up (first touch, scratch, OpenMP teams)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) if statistic == "best" else statistics.median(times)


def measure_host_rates(nbytes: int = 256 << 20, threads: Iterable[int] = (1, 2), *, repeats: int = 3,
                       ops: Iterable[str] = ("copy_fp32", "cast_fp32_bf16", "add_bf16_fp32", "add_fp32_fp32"),
                       statistic: str = "best", **host_ops_kw) -> dict:
    """GB/s (1e9 B/s) of each op in ``ops`` on fp32 tensors of ``nbytes`` (``statistic`` "best" or "median"
    of ``repeats`` timed calls after one warm-up call; ``host_ops_kw`` go to ``HostOps``), per thread
    count: ``HostOps(n)``'s kernel and the plain single torch call with ``torch.set_num_threads(n)``
    (restored after). Bytes counted as read + written per element: copy fp32 8, cast fp32 -> bf16 6,
    add bf16 into fp32 10, add fp32 into fp32 12, norms 4 (``"norm_fp32"``: ``NORM_PIECES`` equal tensors'
    norms, as a parameter group's; not measured by default), AdamW fp32 28 (p, g, m, v read; p, m, v
    written; ``"adamw_fp32"``, not measured by default). Returns ``{"nbytes": nbytes, "bytes_per_elem": {...},
    "rates": {n: {op: {"host_ops": GB/s, "torch": GB/s}}}}``."""
    n = nbytes // 4
    gen = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.zeros(n)
    h = b.to(torch.bfloat16)
    ops = list(ops)
    adam = None
    if "adamw_fp32" in ops:
        adam = [a, b.mul(1e-3), torch.rand(n, generator=gen).mul_(1e-3), torch.rand(n, generator=gen).mul_(1e-6)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    step = torch.tensor(1.0)
    pieces = list(b.view(NORM_PIECES, -1)) if n % NORM_PIECES == 0 else [b]
    out: dict = {"nbytes": nbytes, "bytes_per_elem": {o: BYTES_PER_ELEM[o] for o in ops}, "rates": {}}
    before = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            with HostOps(t, **host_ops_kw) as ho:
                calls = {
                    "copy_fp32": (lambda: ho.cast_into(c, a), lambda: c.copy_(a)),
                    "cast_fp32_bf16": (lambda: ho.cast_into(h, a), lambda: h.copy_(a)),
                    "add_bf16_fp32": (lambda: ho.add_into(a, h), lambda: a.add_(h)),
                    "add_fp32_fp32": (lambda: ho.add_into(a, b), lambda: a.add_(b)),
                    "norm_fp32": (lambda: ho.norms(pieces), lambda: torch._foreach_norm(pieces, 2.0)),
                    "adamw_fp32": (lambda: ho.adamw_chunked(*([x] for x in adam), [step], **kw),
                                   lambda: torch._fused_adamw_(*([x] for x in adam), [], [step], **kw)),
                }
                row = out["rates"][t] = {}
                for op in ops:
                    mine, plain = calls[op]
                    with torch.no_grad():
                        row[op] = {k: BYTES_PER_ELEM[op] * n / _seconds(f, repeats, statistic) / 1e9
                                   for k, f in (("host_ops", mine), ("torch", plain))}
    finally:
        torch.set_num_threads(before)
    return out
