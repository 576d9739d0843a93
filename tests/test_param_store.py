"""Parameter store: staged + bound compute copies give the same outputs and grads as plain autograd."""

from __future__ import annotations

import contextlib
import copy
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_lazytrain.engine.copy_cpu import ThreadCopyEngine
from lightning_lazytrain.engine.param_store import ALIGN, REST, ParamStore

V, D, L = 11, 16, 4
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class Tiny(nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block(D) for _ in range(L))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.layers:
            x = b(x)
        return self.head(self.norm(x))


def _loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V).float(), tgt.reshape(-1))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (3, 7), generator=g), torch.randint(0, V, (3, 7), generator=g)


def streamed_step(m: Tiny, ps: ParamStore, ids: torch.Tensor, tgt: torch.Tensor,
                  *, wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A minimal executor: block-boundary checkpointing with double-buffered weights. ``wait=False``:
    gradients are accumulated on the host lane without waiting (``wait_host`` at the end)."""
    dev = ps.device
    ids, tgt = ids.to(dev), tgt.to(dev)
    sq = torch.zeros((), dtype=torch.float32)
    norms = []
    ps.stage(REST)
    with ps.bind(REST):
        x0 = m.emb(ids)
        acts = [x0.detach()]
        ps.stage(0, 0)
        with torch.no_grad():
            for i in range(L):
                if i + 1 < L:
                    ps.stage(i + 1, (i + 1) % 2)  # prefetch the next block while this one runs
                with ps.bind(i, i % 2):
                    acts.append(m.layers[i](acts[-1]))
        xl = acts[-1].requires_grad_()
        loss = _loss(m.head(m.norm(xl)), tgt)
        loss.backward()
        g = xl.grad
        for i in reversed(range(L)):
            if i != L - 1:  # the last block's weights are still staged from the forward
                ps.stage(i, i % 2)
            with ps.bind(i, i % 2):
                xin = acts[i].detach().requires_grad_()
                m.layers[i](xin).backward(g)
                g = xin.grad
                norms.append(ps.finish_grads(ps.send_grads(i, i % 2), wait=wait))
        x0.backward(g)
    sq += ps.write_back_grads(REST)
    ps.wait_host()
    return loss.detach(), sq + sum(norms)


def _reference(m: Tiny, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Plain autograd over the whole model, grads accumulated across the batches."""
    losses = []
    for ids, tgt in batches:
        loss = _loss(m(ids), tgt)
        loss.backward()
        losses.append(loss.detach())
    return losses


class SlowHostEngine(ThreadCopyEngine):
    """Delay injection: every piece of host-lane work starts 20 ms late."""

    def host(self, fn, **kw):
        def late():
            time.sleep(0.02)
            fn()
        return super().host(late, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_host_lane_work_is_asynchronous_and_exact(dtype: torch.dtype) -> None:
    """Casts (fp32 masters -> bf16 staging) and gradient accumulation run on the host lane, not in
    the caller: stage() returns before its cast has run, finish_grads(wait=False) before the
    accumulation. With every host job started late, two accumulated micro-batches give bit-equal
    grads, norms and losses to the same run without delays (fp32: no casts, so only the landing
    buffer's own dependency keeps the next D2H from overwriting grads not yet accumulated)."""
    torch.manual_seed(0)
    base = Tiny(tied=False)
    results = []
    for engine in (ThreadCopyEngine(), SlowHostEngine()):
        m = copy.deepcopy(base)
        ps = ParamStore(m, "layers", compute_dtype=dtype, copy_engine=engine)
        try:
            if isinstance(engine, SlowHostEngine) and dtype != torch.float32:
                h = ps.stage(1, 1)
                assert not h.done()  # its cast is still queued
                h.wait()
            out = [streamed_step(m, ps, *_batch(k), wait=False) for k in range(2)]
            results.append((out, [p.grad.clone() for p in m.parameters()]))
            records = engine.records()
        finally:
            ps.close()
            engine.close()
        kinds = {r.tag.split(":")[0] for r in records if r.lane == "host"}
        assert kinds == ({"accum"} if dtype == torch.float32 else {"cast", "accum"})
    (out_a, grads_a), (out_b, grads_b) = results
    assert all(torch.equal(x, y) for pa, pb in zip(out_a, out_b) for x, y in zip(pa, pb))
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_same_outputs_and_grads_fp32_exact(tied: bool) -> None:
    torch.manual_seed(0)
    m = Tiny(tied)
    ref = copy.deepcopy(m)
    batches = [_batch(1), _batch(2)]  # two micro-batches: grads accumulate
    ref_losses = _reference(ref, batches)
    ps = ParamStore(m)
    assert ps.blocks.path == "layers" and ps.num_layers == L
    losses = []
    for ids, tgt in batches:
        loss, sq = streamed_step(m, ps, ids, tgt)
        losses.append(loss)
    for a, b in zip(losses, ref_losses):
        assert torch.equal(a, b)
    ref_params = dict(ref.named_parameters())
    total = torch.zeros(())
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert torch.equal(p.grad, ref_params[name].grad), name
        total += p.grad.double().square().sum().float()
    assert sq.dtype == torch.float32 and torch.allclose(sq, total, rtol=1e-5)  # last micro-batch's norm
    ps.close()


def test_masters_are_packed_views_and_optimizer_updates_them() -> None:
    torch.manual_seed(0)
    m = Tiny().to(torch.bfloat16)  # a bf16 module keeps bf16 masters (precision="bf16-true")
    ps = ParamStore(m, compute_dtype=torch.bfloat16)
    for i in [*range(L), REST]:
        flat = ps.master_flat(i)
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.nbytes
        mods = [m.layers[i]] if i != REST else [m.emb, m.norm, m.head]
        for mod in mods:
            for p in mod.parameters():
                assert p.dtype == torch.bfloat16 and lo <= p.data_ptr() < hi
                assert (p.data_ptr() - lo) % (ALIGN * p.element_size()) == 0  # aligned like a tensor of its own
        assert not flat.is_pinned()  # pinned only when the device is CUDA
    aligned = sum(-(-p.numel() // ALIGN) * ALIGN for p in m.layers[0].parameters())
    assert ps.group_numel(0) == aligned
    assert ps.group_numel(REST) == -(-m.emb.weight.numel() // ALIGN) * ALIGN + 2 * ALIGN  # norm w+b; tied head once
    ids, tgt = _batch(3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss0, _ = streamed_step(m, ps, ids, tgt)
    opt.step()  # updates the module's params == the packed masters, in place
    opt.zero_grad(set_to_none=True)
    loss1, _ = streamed_step(m, ps, ids, tgt)  # restaged weights reflect the step
    assert loss1 < loss0
    ref = copy.deepcopy(m)
    for p in ref.parameters():
        p.grad = None
    ref_loss = _loss(ref(ids), tgt)
    ref_loss.backward()
    assert torch.equal(loss1, ref_loss.detach())
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n  # set_to_none was handled: fresh accumulation
    assert ps.engine.bytes_moved["h2d"] > 0 and ps.engine.bytes_moved["d2h"] > 0


def test_replaced_param_data_is_repaired_on_stage() -> None:
    m = Tiny()
    ps = ParamStore(m)
    w = m.layers[1].fc.weight
    w.data = torch.full_like(w, 0.5)  # an optimizer that replaces .data instead of updating it
    ps.stage(1, 0).wait()
    with ps.bind(1, 0, grads=False):
        assert torch.equal(m.layers[1].fc.weight, torch.full_like(w, 0.5))
    assert ps.master_flat(1).data_ptr() <= w.data_ptr() < ps.master_flat(1).data_ptr() + ps.master_flat(1).nbytes


def test_bind_swaps_and_restores_parameters() -> None:
    m = Tiny()
    ps = ParamStore(m)
    before = {n: p for n, p in m.named_parameters()}
    ps.stage(2, 1)
    with torch.no_grad(), ps.bind(2, 1):
        bound = m.layers[2].fc.weight
        assert bound is not before["layers.2.fc.weight"] and not bound.requires_grad  # no grads under no_grad
        assert torch.equal(bound, before["layers.2.fc.weight"])
    assert {n: p for n, p in m.named_parameters()} == before
    ps.stage(REST)
    with ps.bind(REST):
        assert m.head.weight is m.emb.weight  # tying preserved: one wrapper at both sites
        assert m.head.weight.requires_grad and m.head.weight.grad is not None
    assert m.head.weight is before["emb.weight"]


def test_frozen_params_get_no_grads() -> None:
    torch.manual_seed(0)
    m = Tiny()
    for p in m.layers[0].parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(m)
    ids, tgt = _batch(5)
    _reference(ref, [(ids, tgt)])
    ps = ParamStore(m)
    streamed_step(m, ps, ids, tgt)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), n


def test_bf16_compute_copy_close_to_bf16_reference() -> None:
    torch.manual_seed(0)
    m = Tiny()
    ref = copy.deepcopy(m).to(torch.bfloat16)
    ids, tgt = _batch(7)
    ref_loss = _loss(ref(ids), tgt)
    ref_loss.backward()
    ps = ParamStore(m, compute_dtype=torch.bfloat16)
    loss, _ = streamed_step(m, ps, ids, tgt)
    assert torch.allclose(loss, ref_loss.detach(), rtol=2e-2)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert p.grad.dtype == torch.float32
        assert torch.allclose(p.grad, q.grad.float(), rtol=0.1, atol=2e-2), n
    assert ps.engine.bytes_moved["h2d"] % 2 == 0  # only bf16 bytes crossed the link


def test_misuse_errors() -> None:
    m = Tiny()
    ps = ParamStore(m)
    with pytest.raises(RuntimeError, match="not staged"):
        with ps.bind(0, 0):
            pass
    with pytest.raises(ValueError, match="slot"):
        ps.stage(0, 2)
    with pytest.raises(IndexError):
        ps.stage(L, 0)
    ps.stage(0, 0)
    with ps.bind(0, 0):
        with pytest.raises(RuntimeError, match="bound"):
            ps.stage(1, 0)
    with pytest.raises(RuntimeError, match="not the one staged"):
        ps.write_back_grads(1, 0)

    shared = Tiny()  # a module inside two blocks: its weights are the non-block group's (Note: [modules shared by blocks])
    shared.layers[1].fc = shared.layers[0].fc
    store = ParamStore(shared)
    assert store.shared_across_blocks
    assert {id(p) for p in store.group_parameters(-1)} >= {id(p) for p in shared.layers[0].fc.parameters()}
    store.close()
    twice = Tiny()
    twice.layers[1] = twice.layers[0]
    with pytest.raises(NotImplementedError, match="block 1 of the stack is block 0 again"):
        ParamStore(twice)


def test_hf_llama_all_blocks_bound_matches_plain_autograd() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )
    m = transformers.LlamaForCausalLM(cfg).float()
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 64, (2, 9))
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    ps = ParamStore(m, num_slots=3)
    assert ps.blocks.path == "model.layers"
    with contextlib.ExitStack() as stack:
        ps.stage(REST)
        stack.enter_context(ps.bind(REST))
        for i in range(3):
            ps.stage(i, i)
            stack.enter_context(ps.bind(i, i))
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        for i in range(3):
            ps.write_back_grads(i, i, norm=False)
        ps.write_back_grads(REST, norm=False)
    assert torch.equal(out.logits, ref_out.logits)
    ref_params = dict(ref.named_parameters())
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ref_params[n].grad, rtol=1e-5, atol=1e-7), n


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_streaming_matches_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    m = Tiny()
    ref = copy.deepcopy(m).cuda().to(dtype)
    ids, tgt = _batch(11)
    ref_loss = _loss(ref(ids.cuda()), tgt.cuda())
    ref_loss.backward()
    ps = ParamStore(m, device="cuda", compute_dtype=dtype)
    assert ps.master_flat(0).is_pinned()
    loss, _ = streamed_step(m, ps, ids, tgt)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0.1, atol=2e-2)
    assert torch.allclose(loss.cpu(), ref_loss.detach().cpu(), **tol)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert p.grad.device.type == "cpu" and p.grad.dtype == torch.float32
        assert torch.allclose(p.grad, q.grad.float().cpu(), **tol), n
    ps.close()


@gpu
@needs_cuda
def test_buffers_go_back_to_the_host_at_close() -> None:
    m = Tiny()
    m.register_buffer("scale", torch.ones(3))
    ps = ParamStore(m, device="cuda")
    assert m.scale.device.type == "cuda"
    ps.close()
    assert m.scale.device.type == "cpu"


# --------------------------------------------------------------- host memory accounting
@pytest.mark.parametrize("case", ["fp32", "bf16_compute", "bf16_true", "fp32_4_slots"])
@pytest.mark.slow
def test_host_pinned_bytes_equal_the_planner_formula(case: str) -> None:
    """The store's host arenas (pinned on CUDA) hold exactly what ``param_store_host_bytes`` predicts:
    one arena of packed masters, one of slot staging (grad landing, and cast buffers when masters and
    16-bit compute copies differ); nothing is allocated later (a bind with grads, a step)."""
    from lightning_lazytrain.engine.host_arena import HOST_ARENA_ALIGN
    from lightning_lazytrain.planner.workload import host_arena_bytes, param_store_host_bytes

    torch.manual_seed(0)
    m = Tiny(tied=False)
    compute, slots, master_bytes, cast = torch.float32, 2, 4, False
    if case == "bf16_compute":
        compute, cast = torch.bfloat16, True
    elif case == "bf16_true":
        m, compute, master_bytes = m.to(torch.bfloat16), torch.bfloat16, 2  # bf16 masters: no cast buffers
    elif case == "fp32_4_slots":
        slots = 4
    ps = ParamStore(m, compute_dtype=compute, num_slots=slots)
    blocks = [ps.group_numel(j) for j in range(L)]
    rest = ps.group_numel(REST)
    e = torch.empty((), dtype=compute).element_size()
    want = param_store_host_bytes(blocks, rest, master_bytes=master_bytes, compute_bytes=e, cast=cast,
                                  block_slots=slots)
    assert ps.host_pinned_bytes == want
    arenas = {a["name"]: a["reserved_bytes"] for a in ps.host_arenas()}
    assert set(arenas) == {"masters", "staging"} | ({"cast"} if cast else set())
    assert arenas["masters"] == host_arena_bytes([n * master_bytes for n in [*blocks, rest]])
    slot_bytes = [max(blocks) * e] * slots + [rest * e]
    assert arenas["staging"] == host_arena_bytes(slot_bytes)  # the gradient landing buffers
    assert arenas.get("cast", 0) == (host_arena_bytes(slot_bytes) if cast else 0)
    assert ps.host_grad_bytes == (sum(blocks) + rest) * master_bytes
    for slot in ps._slots:  # staging slices are aligned like the masters
        assert slot.grad_host.data_ptr() % HOST_ARENA_ALIGN == 0
        assert (slot.cast is not None) == cast
    del slot
    for j in [*range(L), REST]:
        assert ps.master_flat(j).data_ptr() % HOST_ARENA_ALIGN == 0
    streamed_step(m, ps, *_batch(5))  # binds with grads, sends them: no further host allocation
    assert ps.host_pinned_bytes == want
    ps.close()
    import gc

    gc.collect()
    assert ps.host_pinned_bytes == arenas["masters"]  # staging and cast buffers gone; the masters are the module's
    assert all(p.data_ptr() for p in m.parameters())


def test_widened_accumulation_is_bit_identical_to_the_mixed_dtype_add() -> None:
    """16-bit grads are added into fp32 host grads through a chunked fp32 scratch over the host's
    threads (engine/host_ops.py; faster on the host); the sums must be those of the plain
    mixed-dtype ``add_``, across chunk and widening-piece boundaries."""
    from lightning_lazytrain.engine.host_ops import HostOps

    ops = HostOps(2, chunk_bytes=1 << 20, widen_bytes=64 << 10)
    ps = ParamStore(Tiny(tied=False), "layers", host_ops=ops)
    try:
        n = 2 * ops.chunk + 5
        for dtype in (torch.bfloat16, torch.float16):
            base = torch.randn(n)
            src = torch.randn(n).to(dtype)
            want, got = base.clone(), base.clone()
            want.add_(src)
            ps._add(got, src)
            assert torch.equal(got, want), dtype
    finally:
        ps.close()
        ops.close()


# --------------------------------------------------------------- grad write-back ordering
def test_compute_waits_for_a_gradient_copy_only_where_it_rewrites_the_grads() -> None:
    """Note: [grad write-back ordering]: finishing a gradient copy queues its accumulation and
    returns; a forward-only bind of the same slot does not wait for the copy (the next micro-batch's
    F0 after layer 0's gradients leave); a bind with grads, which zeroes the slot's grad buffer,
    does, and the host gradient is the one the copy carried (CPU: the waits block the caller)."""
    from lightning_lazytrain.engine.copy_engine import LinkSpec

    torch.manual_seed(0)
    m = Tiny(tied=False)
    ref = copy.deepcopy(m.layers[0])
    x = torch.randn(3, 7, D)
    ref(x).square().sum().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    engine = ThreadCopyEngine({"d2h": LinkSpec(1e12, 0.4)})  # every D2H takes 0.4 s
    ps = ParamStore(m, copy_engine=engine)
    try:
        ps.stage(0, 0)
        with ps.bind(0, 0, grads=True):
            m.layers[0](x).square().sum().backward()
        t0 = time.perf_counter()
        ps.finish_grads(ps.send_grads(0, 0), wait=False)
        with ps.bind(0, 0, grads=False), torch.no_grad():
            m.layers[0](x)
        fast = time.perf_counter() - t0
        with ps.bind(0, 0, grads=True):  # zeroes the slot's grads: after the copy
            slow = time.perf_counter() - t0
            m.layers[0](x).sum().backward()
        ps.wait_host()
        assert fast < 0.3 <= slow, (fast, slow)
        for n, p in m.layers[0].named_parameters():
            assert torch.equal(p.grad, want[n]), n
    finally:
        ps.close()
        engine.close()
