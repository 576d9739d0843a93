"""host_ops.py: chunked multi-threaded host kernels are bit for bit the plain torch ops."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from lightning_lazytrain.engine.host_ops import ALIGN, HostOps, default_host_ops, measure_host_rates

CHUNK_BYTES = 4096  # 1024 elements a chunk: many chunks on small tensors
WIDEN_BYTES = 1280  # 320 elements of widening scratch: several pieces a chunk, the last one short
# odd sizes: not a multiple of the chunk (1024) or of ALIGN; one under a chunk; one of many chunks
SIZES = (3 * 1024 + 37, 1000, 10 * 1024 + 1, 40_000 + 3)


@pytest.fixture(scope="module", params=(1, 2, 3), ids=lambda t: f"threads{t}")
def ops(request):
    with HostOps(request.param, chunk_bytes=CHUNK_BYTES, widen_bytes=WIDEN_BYTES, inline_bytes=0) as ho:
        yield ho


def data(n: int, dtype: torch.dtype, seed: int, offset: int = 0) -> torch.Tensor:
    """``n`` values of ``dtype`` as a view ``offset`` elements into a larger buffer."""
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n + offset + 5, generator=g) * 3).to(dtype)
    return base[offset:offset + n]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (stricter than ``torch.equal``: -0.0 vs 0.0; NaNs compared by payload)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def test_workers_use_inner_threads(ops):
    assert ops.worker_torch_threads == [1] * ops.threads
    assert ops.chunk % ALIGN == 0 and ops.widen % ALIGN == 0 and ops.chunk % ops.widen != 0


def test_pool_leaves_the_process_thread_count():
    mine = torch.get_num_threads()
    with HostOps(2, inner_threads=1):
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # a thread made later
        t.start()
        t.join()
    assert torch.get_num_threads() == mine and seen == [mine]


@pytest.mark.parametrize("dst_dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", (0, 7))
def test_cast_into(ops, dst_dtype, n, offset):
    src = data(n, torch.float32, 1, offset)
    src[:3] = torch.tensor([1e30, -1e-30, 65504.5])  # out of fp16 range, subnormal, a tie
    want = torch.empty(n, dtype=dst_dtype).copy_(src)
    dst = data(n, dst_dtype, 2, offset + 3)
    out = ops.cast_into(dst, src)
    assert out is dst and same_bits(dst, want)


@pytest.mark.parametrize("src_dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", (0, 5))
def test_add_into(ops, src_dtype, n, offset):
    src, dst = data(n, src_dtype, 3, offset), data(n, torch.float32, 4, offset + 1)
    want = dst.clone().add_(src)
    assert same_bits(want, dst.clone().add_(src.float()))  # the widening is exact
    assert ops.add_into(dst, src) is dst and same_bits(dst, want)


def test_nan_and_inf_bits(ops):
    src = data(10_037, torch.float32, 8)
    src[::7], src[3::11], src[5::13] = float("nan"), float("inf"), -float("inf")
    src.view(torch.int32)[1::17] = 0x7F800001  # a signalling NaN with a payload
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        assert same_bits(ops.cast_into(torch.empty(src.shape, dtype=dt), src), src.to(dt))
        dst = data(src.numel(), torch.float32, 9)
        dst[::5] = float("nan")
        assert same_bits(ops.add_into(dst.clone(), src.to(dt)), dst.clone().add_(src.to(dt)))


def test_shapes_and_fallbacks(ops):
    a, h = torch.randn(37, 53), torch.randn(37, 53).bfloat16()
    assert same_bits(ops.add_into(a.clone(), h), a.clone().add_(h))
    t = torch.randn(40, 60)
    want = torch.empty(60, 40).copy_(t.t())
    assert same_bits(ops.cast_into(torch.empty(60, 40), t.t()), want)  # not contiguous: plain op
    x = torch.randn(4000)
    ref = x.clone()
    ref[1:].add_(ref[:-1].clone())
    y = x.clone()
    ops.add_into(y[1:], y[:-1].clone())
    assert same_bits(y, ref)
    b = torch.randn(8, 1)
    assert same_bits(ops.add_into(a[:8].clone(), b), a[:8].clone().add_(b))  # broadcast: plain op


def test_small_tensors_run_inline():
    with HostOps(2, inline_bytes=1 << 20) as ho:
        ho.close()  # a closed pool still serves inline ops
        a, h = torch.randn(1000), torch.randn(1000).bfloat16()
        assert same_bits(ho.add_into(a.clone(), h), a.clone().add_(h))
        with pytest.raises(RuntimeError, match="closed"):
            ho._run(lambda lo, hi, s: None, 10)


def test_autograd_leaves_and_caller_thread_settings(ops):
    p = torch.nn.Parameter(torch.randn(5000))
    before = p.detach().clone()
    g = torch.randn(5000).bfloat16()
    ops.add_into(p.data, g)
    assert same_bits(p.detach(), before.add_(g))
    assert torch.get_num_threads() >= 1 and torch.is_grad_enabled()


def test_norms(ops):
    ts = [data(n, dt, 10 + i, i) for i, n in enumerate((*SIZES, 1, 70_001))
          for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
    # fp16 and strided norms depend on torch's thread count (at this size): the plain call takes them
    ts += [data(1_000_003, torch.float16, 21), data(3 * 1_000_003, torch.float32, 20)[::3], torch.randn(300, 301).t()]
    got, want = ops.norms(ts), torch._foreach_norm(ts, 2.0)
    assert len(got) == len(want) and all(same_bits(a, b) for a, b in zip(got, want))
    assert ops.norms([]) == []


def test_norms_equal_on_any_torch_thread_count():
    """What ``norms`` rests on: torch's CPU 2-norm of one tensor does not depend on its thread count."""
    before = torch.get_num_threads()
    for dt in (torch.float32, torch.bfloat16, torch.float64):
        x = data(1_000_003, dt, 7)
        try:
            got = []
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                got.append(torch._foreach_norm([x], 2.0)[0])
        finally:
            torch.set_num_threads(before)
        assert all(same_bits(got[0], y) for y in got), dt


ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False)


def adam_state(sizes, seed):
    """p, g, m, v, max v: views 3 elements into their buffers."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n + 3, generator=g).mul_(s)[3:] for n in sizes] for s in (1.0, 1e-2, 1e-3)] + \
           [[torch.rand(n + 3, generator=g).mul_(s)[3:] for n in sizes] for s in (1e-5, 1e-4)]


@pytest.mark.parametrize("amsgrad", (False, True))
def test_adamw_chunked(ops, amsgrad):
    sizes = (*SIZES, 17, 1)
    ref, mine = adam_state(sizes, 0), adam_state(sizes, 0)
    steps = [torch.tensor(3.0) for _ in sizes]
    torch._fused_adamw_(*ref[:4], ref[4] if amsgrad else [], steps, amsgrad=amsgrad, **ADAM)
    ops.adamw_chunked(*mine[:4], steps, max_exp_avg_sqs=mine[4] if amsgrad else (), amsgrad=amsgrad, **ADAM)
    for r, m in zip(ref, mine):
        assert all(same_bits(a, b) for a, b in zip(r, m))


def test_adamw_chunked_matches_torch_optim_fused():
    """Per parameter, as ``torch.optim.AdamW(fused=True)`` calls it (each tensor's own scalar tail)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    mine = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    ms, vs = [torch.zeros_like(p) for p in mine], [torch.zeros_like(p) for p in mine]
    steps = [torch.tensor(0.0) for _ in mine]
    with HostOps(2, chunk_bytes=CHUNK_BYTES, inline_bytes=0) as ho:
        for _ in range(3):
            grads = [torch.randn(p.shape) for p in params]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
            torch._foreach_add_(steps, 1)
            ho.adamw_chunked(mine, grads, ms, vs, steps, amsgrad=False, **ADAM)
    assert all(same_bits(p.detach(), m) for p, m in zip(params, mine))


def test_worker_exception_reaches_caller(ops):
    seen = []

    def boom(lo, hi, scratch):
        seen.append(threading.current_thread().name)
        if lo >= 2 * ops.chunk:
            raise ValueError(f"chunk at {lo}")

    with pytest.raises(ValueError, match="chunk at"):
        ops._run(boom, 10 * ops.chunk)
    assert all(name.startswith("host-ops-") for name in seen)
    a, h = torch.randn(5000), torch.randn(5000).bfloat16()  # the pool still works
    assert same_bits(ops.add_into(a.clone(), h), a.clone().add_(h))
    with pytest.raises(RuntimeError, match="can't be cast"):  # torch's own error, raised on a worker
        ops.add_into(torch.zeros(5000, dtype=torch.int32), torch.randn(5000))


def test_concurrent_callers():
    with HostOps(2, chunk_bytes=CHUNK_BYTES, inline_bytes=0) as ho:
        xs = [data(50_000 + i, torch.float32, i) for i in range(4)]
        hs = [data(50_000 + i, torch.bfloat16, 10 + i) for i in range(4)]
        want = [x.clone().add_(h) for x, h in zip(xs, hs)]
        threads = [threading.Thread(target=ho.add_into, args=(x, h)) for x, h in zip(xs, hs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(same_bits(x, w) for x, w in zip(xs, want))


def test_default_and_measure():
    assert default_host_ops() is default_host_ops()
    if hasattr(os, "fork"):  # a forked child: the inherited pool runs inline, the default pool is a new one
        parent = default_host_ops()
        pid = os.fork()
        if pid == 0:
            ok = False
            try:
                torch.set_num_threads(1)  # no OpenMP team in a forked child
                a, h = torch.randn(1 << 19), torch.randn(1 << 19).bfloat16()
                ok = same_bits(parent.add_into(a.clone(), h), a.clone().add_(h))
                ok = ok and default_host_ops() is not parent
                ok = ok and same_bits(default_host_ops().add_into(a.clone(), h), a.clone().add_(h))
            finally:
                os._exit(0 if ok else 1)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and done[1] == 0
    before = torch.get_num_threads()
    r = measure_host_rates(1 << 20, threads=(1, 2), repeats=1, ops=("copy_fp32", "add_bf16_fp32", "adamw_fp32"))
    assert torch.get_num_threads() == before
    assert r["nbytes"] == 1 << 20 and r["bytes_per_elem"] == {"copy_fp32": 8, "add_bf16_fp32": 10, "adamw_fp32": 28}
    assert set(r["rates"]) == {1, 2}
    assert all(v["host_ops"] > 0 and v["torch"] > 0 for row in r["rates"].values() for v in row.values())
