"""Host arenas (exact host buffers, sliced by hand) and the planner's host figure equal to what the
stores hold."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.host_arena import HOST_ARENA_ALIGN, HOST_PAGE, HostArena, torch_pinned_bytes
from lightning_lazytrain.engine.profiler import measure_workload
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import Hardware, ModelSpec, Schedule, simulate
from lightning_lazytrain.planner.policies import min_memory
from lightning_lazytrain.planner.workload import host_arena_bytes

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ------------------------------------------------------------------ the arena
def test_arena_is_whole_pages_and_slices_are_aligned_typed_views() -> None:
    a = HostArena(10_000, name="t")
    assert a.nbytes == 3 * HOST_PAGE and a.reserved_bytes == a.nbytes and a.alive and not a.pinned
    x = a.take(3, torch.float32)
    y = a.take(5, torch.bfloat16)
    z = a.take(7, torch.int64)
    base = x.data_ptr()
    assert base % HOST_PAGE == 0
    assert [t.data_ptr() - base for t in (x, y, z)] == [0, 256, 512]
    assert (x.dtype, y.dtype, z.dtype, x.numel(), y.numel(), z.numel()) == (
        torch.float32, torch.bfloat16, torch.int64, 3, 5, 7)
    assert a.used == 512 + 7 * 8
    assert torch.count_nonzero(z) == 0  # zero-filled
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(x, torch.tensor([1.0, 2.0, 3.0]))  # writable, and slices do not overlap
    assert torch.count_nonzero(y) == 0
    with pytest.raises(MemoryError, match="full"):
        a.take(a.nbytes, torch.uint8)
    empty = a.take(0, torch.float32)
    assert empty.numel() == 0
    report = a.report()
    assert report["reserved_bytes"] == 3 * HOST_PAGE and report["used_bytes"] == a.used


@pytest.mark.slow
def test_arena_memory_lives_while_a_slice_does() -> None:
    a = HostArena(HOST_PAGE)
    keep = a.take(4, torch.float32)
    keep.fill_(7.0)
    a.release()
    gc.collect()
    assert a.alive and a.reserved_bytes == HOST_PAGE
    assert torch.equal(keep, torch.full((4,), 7.0))
    view = keep[1:]
    del keep
    gc.collect()
    assert a.alive and torch.equal(view, torch.full((3,), 7.0))
    del view
    gc.collect()
    assert not a.alive and a.reserved_bytes == 0
    with pytest.raises(RuntimeError, match="released"):
        a.take(1)


def test_zero_byte_arena() -> None:
    a = HostArena.for_sizes([0, 0])
    assert a.nbytes == 0 and a.reserved_bytes == 0
    assert a.take(0, torch.float32).numel() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.sampled_from([torch.uint8, torch.bfloat16, torch.float32,
                                                                   torch.float64])), max_size=12),
       st.randoms())
def test_planner_arena_formula_fits_any_order(items, rnd) -> None:
    sizes = [n * torch.empty((), dtype=dt).element_size() for n, dt in items]
    want = host_arena_bytes(sizes)
    assert want % HOST_PAGE == 0 and want >= sum(sizes)
    assert want - sum(sizes) < HOST_PAGE + len(sizes) * HOST_ARENA_ALIGN
    a = HostArena.for_sizes(sizes)
    assert a.reserved_bytes == want
    order = list(items)
    rnd.shuffle(order)
    for n, dt in order:  # any order fits: every slice takes at most its size rounded to the alignment
        t = a.take(n, dt)
        assert t.numel() == n and t.data_ptr() % HOST_ARENA_ALIGN == 0


def test_torch_pinned_bytes_is_the_next_power_of_two() -> None:
    assert [torch_pinned_bytes(n) for n in (0, 1, 4096, 4097, 3 << 20)] == [0, 1, 4096, 8192, 4 << 20]


def test_pin_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        HostArena(HOST_PAGE, pin=True)


@gpu
@needs_cuda
def test_cuda_arena_is_registered_not_rounded() -> None:
    torch.cuda.init()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if hasattr(
        torch.cuda, "host_memory_stats") else None
    n = 3 * (1 << 20) + 12_288  # 3 MiB + 3 pages: the caching allocator would pin 4 MiB
    a = HostArena(n, pin=True)
    assert a.pinned_by == "cudaHostRegister" and a.reserved_bytes == n
    x = a.take(n // 4, torch.float32)
    assert x.is_pinned()
    if before is not None:  # PyTorch's caching host allocator was not involved
        assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    src = torch.arange(n // 4, dtype=torch.float32, device="cuda")
    x.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(x, src.cpu())
    dev = torch.empty_like(src)
    dev.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev, src)
    a.release()
    del x
    gc.collect()
    assert not a.alive  # unregistered, then unmapped (Note: [arena lifetime])
    b = HostArena(n, pin=True)  # the same range may come back: registering it again must work
    assert b.take(4, torch.float32).is_pinned()


# ------------------------------------------------ the planner's figure = what is held
SPEC = ModelSpec(name="tiny", num_layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, head_dim=16, vocab=256)
L = SPEC.num_layers


PLANNED = Schedule(num_layers=L, homes=("gpu", "cpu", "recompute", "cpu", "gpu"), keep_internals=(False,) * L,
                   resident_weights=(False,) * L, offload_window=(None, 1, None, 3, None),
                   reload_window=(None, 3, None, 4, None), policy="custom")


def _hardware() -> Hardware:
    return Hardware(name="cpu-test", gpu_memory_bytes=1e12, gpu_memory_cap_bytes=1e12, peak_tflops=1, efficiency=1,
                    h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
                    nvme_capacity_bytes=1e12, cpu_memory_bytes=1e12, cpu_adam_params_per_s=1e9,
                    cpu_adam8_params_per_s=1e9)


@pytest.mark.parametrize("seq", [32, 33], ids=["page_multiple", "odd"])
def test_planned_host_bytes_equal_what_the_stores_hold(tmp_path, seq: int) -> None:
    """Profile under the provisional schedule (every inner boundary on the host), switch to a plan with
    two host boundaries, run it: the simulator's host figure (host_static_bytes from the profiler + the schedule's host
    boundaries, each rounded up to whole pages as the pool holds them) equals the parameter store's arenas + host
    grads + the activation pool, for a boundary of whole pages and for an odd one."""
    torch.manual_seed(0)
    model = LlamaLM(SPEC)
    tokens = torch.randint(0, SPEC.vocab, (2, seq + 1))
    provisional, planned = min_memory(L), PLANNED  # the strategy's provisional schedule, then a plan
    m = copy.deepcopy(model)
    ex = Executor(m, provisional, nvme_dir=tmp_path)
    try:
        wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=tokens.numel(), state_bytes_per_param=0)
        ps, acts = ex.params, ex.acts
        assert ps is not None and acts is not None
        boundary = int(wl.boundary_bytes[1])
        assert boundary == 2 * seq * SPEC.hidden * 4
        page = -(-boundary // HOST_PAGE) * HOST_PAGE
        assert acts.host_pinned_bytes == (L - 1) * page  # the provisional schedule's pool
        assert wl.host_static_bytes == ps.host_pinned_bytes + ps.host_grad_bytes
        ex.set_schedule(planned)
        assert ex.params is ps  # same slots: the parameter store stays
        ex.begin_microbatch()
        m.loss(tokens).backward()
        ex.end_microbatch()
        assert acts.host_pinned_bytes == 2 * page  # trimmed to the plan at the end of its first step
        held = ps.host_pinned_bytes + ps.host_grad_bytes + acts.host_pinned_bytes
        sim = simulate(planned, wl, _hardware())
        assert sim.peak_cpu_bytes == held  # host buffers are whole pages in both (planner.host_page_bytes)
    finally:
        ex.close()


def test_clearing_the_cuda_error_without_a_cuda_runtime_does_nothing() -> None:
    """Note: [a failed runtime call leaves its error]: on a machine whose process loaded no CUDA runtime (this CPU
    build) the helper finds none and returns; an arena is made as before."""
    from lightning_lazytrain.engine import host_arena

    host_arena.clear_cuda_error()
    host_arena.clear_cuda_error()  # the lookup is cached
    assert host_arena._get_last_error is False or callable(host_arena._get_last_error)
    assert HostArena(HOST_PAGE).reserved_bytes == HOST_PAGE


@gpu
@needs_cuda
def test_a_failed_host_register_leaves_no_error_for_later_kernels() -> None:
    """A cudaHostRegister the runtime refuses (a null pointer) sets the thread's last CUDA error, which torch's
    binding does not clear; after ``clear_cuda_error`` (what HostArena's fallback calls) the next kernel launch
    on this thread runs."""
    from lightning_lazytrain.engine.host_arena import clear_cuda_error

    err = torch.cuda.cudart().cudaHostRegister(0, HOST_PAGE, 1)
    assert int(err) != 0
    clear_cuda_error()
    x = torch.ones(4, device="cuda").add_(1)
    torch.cuda.synchronize()
    assert x.sum().item() == 8.0
