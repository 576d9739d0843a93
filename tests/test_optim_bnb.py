"""8-bit states: bitsandbytes 0.50 API facts we rely on, fused == unfused clip, loss tracking."""

from __future__ import annotations

import contextlib
import functools
import math

import pytest
import torch

bnb_f = pytest.importorskip("bitsandbytes.functional")

from lightning_lazytrain.optim import HybridAdamW, group_by_layer  # noqa: E402
from lightning_lazytrain.optim.bnb8bit import dequantized_moments  # noqa: E402
from models import layer_of, mlp_stack  # noqa: E402



def _bnb_adam(n: int, grad_mult: float, gnorm_scale: float, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    p, g = torch.randn(n), torch.randn(n) * grad_mult
    s1, s2 = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    blocks = -(-n // 256)
    a1, a2 = torch.zeros(blocks), torch.zeros(blocks)
    q1, q2 = bnb_f.create_dynamic_map(signed=True), bnb_f.create_dynamic_map(signed=False)
    for step in range(1, steps + 1):
        bnb_f.optimizer_update_8bit_blockwise(
            "adam", g, p, s1, s2, 0.9, 0.999, 0.0, 0.0, 1e-8, step, 1e-3, q1, q2, a1, a2,
            weight_decay=0.01, gnorm_scale=gnorm_scale,
        )
    return [p, s1, s2, a1, a2]


def test_bnb_cpu_gnorm_scale_scales_the_gradient() -> None:
    """gnorm_scale=c is bitwise the same update as a gradient multiplied by c (CPU kernel)."""
    scaled_grad = _bnb_adam(1000, 0.25, 1.0)
    scaled_in_kernel = _bnb_adam(1000, 1.0, 0.25)
    unscaled = _bnb_adam(1000, 1.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(scaled_grad, scaled_in_kernel))
    assert not torch.equal(scaled_in_kernel[3], unscaled[3])  # and it is not ignored


def test_bnb_cpu_block_is_256() -> None:
    """One absmax per 256 elements: a 1000-element state quantises into 4 blocks."""
    p, s1, s2, a1, a2 = _bnb_adam(1000, 1.0, 1.0, steps=1)
    assert a1.numel() == 4 and bool((a1 > 0).all())
    x = torch.randn(1000)
    q, state = bnb_f.quantize_blockwise(x, blocksize=256)
    assert state.absmax.numel() == 4


def test_bnb_update_is_adamw() -> None:
    """The CPU kernel's 'adam' is torch AdamW up to 8-bit quantisation of the moments."""
    n = 4096
    torch.manual_seed(0)
    p8 = torch.randn(n)
    p32 = p8.clone().requires_grad_(True)
    ref = torch.optim.AdamW([p32], lr=1e-3, weight_decay=0.1)
    state = {"step": torch.zeros(())}
    from lightning_lazytrain.optim.bnb8bit import adamw_8bit_update, init_8bit_state, make_qmaps

    state = init_8bit_state(p8, *make_qmaps(p8.device))
    for _ in range(5):
        g = torch.randn(n)
        p32.grad = g.clone()
        ref.step()
        adamw_8bit_update(p8, g, state, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, gnorm_scale=1.0)
    step_sizes = (p32.detach() - p8).abs().max().item()
    assert step_sizes < 2e-4  # 5 steps of lr=1e-3 move params by ~5e-3; quantisation error << that
    m, v = dequantized_moments(state)
    torch.testing.assert_close(m, ref.state[p32]["exp_avg"], rtol=0.05, atol=0.02)
    assert state["step"].item() == 5


make_model = functools.partial(mlp_stack, 3, 64, 128, act=torch.nn.Tanh)  # (bias=False: without biases)


def fixed_grads(model: torch.nn.Module, steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [[torch.randn(p.shape, generator=g) * 0.1 for p in model.parameters()] for _ in range(steps)]


def test_fused_clip_equals_unfused_clip_on_8bit_states() -> None:
    """gnorm_scale fused into the 8-bit update == clip_grad_norm_ then an unclipped 8-bit update.

    Same gradients fed to both (no feedback through the model), clip active on every step.
    8-bit parameters and states must be bitwise equal; 32-bit ones (biases) within 1e-6.
    """
    fused_model, unfused_model = make_model(), make_model()
    fused = HybridAdamW(fused_model.named_parameters(), lr=1e-3, eight_bit="all", max_grad_norm=0.5)
    unfused = HybridAdamW(unfused_model.named_parameters(), lr=1e-3, eight_bit="all", max_grad_norm=None)
    assert fused.assignment == unfused.assignment and 8 in fused.assignment.values()
    for grads in fixed_grads(fused_model, 10):
        for p, g in zip(fused_model.parameters(), grads):
            p.grad = g.clone()
        for p, g in zip(unfused_model.parameters(), grads):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(unfused_model.parameters(), 0.5)
        assert norm.item() > 0.5
        fused.step()
        unfused.step()
        assert fused.last_grad_norm == pytest.approx(norm.item(), rel=1e-6)
    for (name, p), q in zip(fused_model.named_parameters(), unfused_model.parameters()):
        if fused.assignment[name] == 8:
            assert torch.equal(p, q), name
            for key in ("state1", "state2", "absmax1", "absmax2"):
                assert torch.equal(fused.state[p][key], unfused.state[q][key]), (name, key)
        else:
            assert (p - q).abs().max().item() <= 1e-6 * q.abs().max().item(), name


def test_fused_clip_equals_unfused_in_training_loop_all_8bit() -> None:
    """With every parameter 8-bit (no biases), even a training loop (feedback) stays bitwise equal."""
    fused_model, unfused_model = make_model(bias=False), make_model(bias=False)
    fused = HybridAdamW(fused_model.named_parameters(), lr=1e-2, eight_bit="all", max_grad_norm=0.1)
    unfused = HybridAdamW(unfused_model.named_parameters(), lr=1e-2, eight_bit="all")
    assert set(fused.assignment.values()) == {8}
    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        x = torch.randn(8, 64, generator=g)
        for m in (fused_model, unfused_model):
            m.zero_grad()
            m(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(unfused_model.parameters(), 0.1)
        fused.step()
        unfused.step()
    for p, q in zip(fused_model.parameters(), unfused_model.parameters()):
        assert torch.equal(p, q)


def _train(policy: object, steps: int = 100) -> torch.Tensor:
    model = make_model()
    opt = HybridAdamW(
        group_by_layer(model.named_parameters(), layer_of), lr=3e-3, weight_decay=0.01, eight_bit=policy,  # type: ignore[arg-type]
        max_grad_norm=1.0,
    )
    g = torch.Generator().manual_seed(11)
    w_true = torch.randn(64, 64, generator=g) / 8
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=g)
        opt.zero_grad()
        loss = (model(x) - torch.sin(x @ w_true)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses)


def test_8bit_loss_curve_tracks_32bit() -> None:
    """Tiny model, 100 steps: the all-8-bit loss curve stays within 1 % of the 32-bit one.

    Measured (torch 2.13 CPU, bnb 0.50.2): max relative deviation 0.11 % over the curve
    (0.06 % with eight_bit=0.3); the model learns (loss 0.432 -> 0.168).
    """
    l32 = _train("none")
    l8 = _train("all")
    dev = ((l8 - l32).abs() / l32).max().item()
    assert l32[-1] < 0.5 * l32[0]
    assert dev < 0.01, f"max relative loss deviation {dev:.4f}"
    assert not torch.equal(l8, l32)  # the 8-bit path really ran


def test_cpu_chunked_update_is_bitwise_identical() -> None:
    """Block-aligned chunking of the CPU update (memory-bounded temporaries) changes nothing."""
    from lightning_lazytrain.optim.bnb8bit import adamw_8bit_update, init_8bit_state, make_qmaps

    results = []
    for chunk in (None, 512, 1024):
        torch.manual_seed(0)
        p = torch.randn(37, 81)  # 2997 elements: the last chunk and block are partial
        state = init_8bit_state(p, *make_qmaps(p.device))
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            adamw_8bit_update(
                p, torch.randn(p.shape, generator=g), state, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.1, gnorm_scale=0.7, chunk_numel=chunk,
            )
        results.append([p] + [state[k] for k in ("state1", "state2", "absmax1", "absmax2")])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    with pytest.raises(ValueError, match="multiple of 256"):
        adamw_8bit_update(p, p.clone(), state, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                          gnorm_scale=1.0, chunk_numel=1000)


# --------------------------------------------------------------------------------------------
# One semantics on CPU and CUDA: torch AdamW's decay order, one non-finite
# policy, block-aligned chunks for any size, the caller's stream. See bnb8bit.py's module doc.
# --------------------------------------------------------------------------------------------
from lightning_lazytrain.optim import bnb8bit  # noqa: E402
from lightning_lazytrain.optim.bnb8bit import (  # noqa: E402
    CUDA_KERNEL_MAX_NUMEL,
    adamw_8bit_update,
    chunk_spans,
    default_chunk_numel,
    init_8bit_state,
    make_qmaps,
)

HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8)
UNCHUNKED = 1 << 40  # a chunk longer than any test tensor: one kernel call (CPU)


def _fresh(shape: tuple[int, ...], device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return p, init_8bit_state(p, *make_qmaps(p.device))


def _grads(shape: tuple[int, ...], steps: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(steps)]


def _snapshot(p: torch.Tensor, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().cpu().clone()] + [state[k].cpu().clone() for k in ("state1", "state2", "absmax1", "absmax2")]


def _ref_blockwise_adamw(
    p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], step: int, *, lr: float, wd: float,
    gnorm_scale: float = 1.0, decay_first: bool = True,
) -> None:
    """Reference 8-bit blockwise AdamW in plain torch ops (bitsandbytes only for the (de)quantiser).

    ``decay_first=True`` is torch.optim.AdamW's order (decay in the parameter's dtype, then the
    update computed in float32); ``False`` is the order of bitsandbytes' CUDA kernel.
    """
    q = torch.ops.bitsandbytes
    m = q.dequantize_blockwise(state["state1"].view(-1), state["absmax1"], state["qmap1"], 256, torch.float32)
    v = q.dequantize_blockwise(state["state2"].view(-1), state["absmax2"], state["qmap2"], 256, torch.float32)
    grad = g.reshape(-1).float() * gnorm_scale
    b1, b2, eps = HYPER["beta1"], HYPER["beta2"], HYPER["eps"]
    m.mul_(b1).add_(grad, alpha=1.0 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    c1, c2 = 1.0 - b1**step, math.sqrt(1.0 - b2**step)
    denom = (v.sqrt() / c2).add_(eps)
    flat = p.view(-1)
    if decay_first:
        flat.mul_(1.0 - lr * wd)
        pf = flat.float()
        pf.addcdiv_(m, denom, value=-lr / c1)
    else:
        pf = flat.float()
        pf.addcdiv_(m, denom, value=-lr / c1)
        pf.mul_(1.0 - lr * wd)
    flat.copy_(pf)
    for key, x in (("1", m), ("2", v)):
        codes, absmax = q.quantize_blockwise(x, state[f"qmap{key}"], 256)
        state[f"state{key}"].view(-1).copy_(codes)
        state[f"absmax{key}"].copy_(absmax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_decay_is_applied_before_the_update_like_torch_adamw(dtype: torch.dtype) -> None:
    """Strong decay (lr*wd = 0.05): bitwise the decay-first reference, far from decay-after."""
    shape, lr, wd = (37, 81), 0.1, 0.5
    ours, ours_state = _fresh(shape, dtype=dtype)
    first, first_state = _fresh(shape, dtype=dtype)
    after, after_state = _fresh(shape, dtype=dtype)
    for step, g in enumerate(_grads(shape, 4, dtype), start=1):
        adamw_8bit_update(ours, g, ours_state, lr=lr, weight_decay=wd, gnorm_scale=0.7, **HYPER)
        _ref_blockwise_adamw(first, g, first_state, step, lr=lr, wd=wd, gnorm_scale=0.7)
        _ref_blockwise_adamw(after, g, after_state, step, lr=lr, wd=wd, gnorm_scale=0.7, decay_first=False)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(ours, ours_state), _snapshot(first, first_state)))
    gap = (ours.float() - after.float()).abs().max().item()
    assert gap > 1e-3, f"decay order should matter at lr*wd=0.05; max gap {gap}"
    assert ours_state["step"].item() == 4


def test_fp32_cpu_update_is_bitwise_the_kernels_own_decay() -> None:
    """For float32 on CPU, decaying ourselves changes nothing: the kernel also decays first."""
    shape, lr, wd = (1000,), 0.05, 0.3
    ours, ours_state = _fresh(shape)
    kern, kern_state = _fresh(shape)
    for step, g in enumerate(_grads(shape, 3), start=1):
        adamw_8bit_update(ours, g, ours_state, lr=lr, weight_decay=wd, gnorm_scale=1.0, **HYPER)
        bnb_f.optimizer_update_8bit_blockwise(
            "adam", g, kern, kern_state["state1"], kern_state["state2"], 0.9, 0.999, 0.0, 0.0, 1e-8, step, lr,
            kern_state["qmap1"], kern_state["qmap2"], kern_state["absmax1"], kern_state["absmax2"],
            weight_decay=wd, gnorm_scale=1.0,
        )
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(ours, ours_state), _snapshot(kern, kern_state)))


def _run_chunked(shape: tuple[int, ...], chunk: int | None, steps: int = 3) -> list[torch.Tensor]:
    p, state = _fresh(shape)
    for g in _grads(shape, steps):
        adamw_8bit_update(p, g, state, lr=1e-2, weight_decay=0.1, gnorm_scale=0.7, chunk_numel=chunk, **HYPER)
    return _snapshot(p, state)


def test_chunked_update_with_small_artificial_limit_is_bitwise_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit of 3 x 4096 elements (as the CUDA limit of 2^30, shrunk) splits a 2-D parameter
    into 3 chunks, the last one and its last block partial; block scales and codes are written
    through views of the same state tensors. Same bits as one call, explicit or default limit."""
    shape = (23, 1111)  # 25553 elements: chunks of 12288, 12288, 977; 100 blocks, last one partial
    limit = 4096 * 3
    assert chunk_spans(23 * 1111, limit) == [(0, 12288), (12288, 24576), (24576, 25553)]
    whole = _run_chunked(shape, UNCHUNKED)
    assert all(torch.equal(a, b) for a, b in zip(whole, _run_chunked(shape, limit)))
    monkeypatch.setattr(bnb8bit, "CPU_CHUNK_NUMEL", limit)
    assert default_chunk_numel(torch.device("cpu")) == limit
    assert all(torch.equal(a, b) for a, b in zip(whole, _run_chunked(shape, None)))


def test_chunk_limits_cover_two_to_the_31_elements() -> None:
    """The default CUDA chunk keeps every launch under the kernel's 32-bit count, block-aligned."""
    cuda_chunk = default_chunk_numel(torch.device("cuda"))
    assert cuda_chunk % 256 == 0 and cuda_chunk <= CUDA_KERNEL_MAX_NUMEL < 2**31
    n = 2**31 + 2**30 + 5
    spans = chunk_spans(n, cuda_chunk)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a % 256 == 0 and b - a < 2**31 and (b == n or b % 256 == 0) for a, b in spans)
    assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="multiple of 256"):
        chunk_spans(1000, 1000)
    with pytest.raises(ValueError, match="multiple of 256"):
        adamw_8bit_update(*_fresh((300,))[:1], torch.zeros(300), _fresh((300,))[1], lr=1e-2, weight_decay=0.0,
                          gnorm_scale=1.0, chunk_numel=1000, **HYPER)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradient_propagates_by_block(bad: float) -> None:
    """Policy "propagate by block": the element's parameter becomes NaN, its block's scales NaN;
    every other element is bitwise what it would be with a finite gradient there; at the next
    update the whole block's parameters are NaN and the other blocks are untouched by it."""
    shape, idx = (1024,), 300  # block 1 = elements 256..511
    clean, clean_state = _fresh(shape)
    dirty, dirty_state = _fresh(shape)
    g0, g1, g2 = _grads(shape, 3)
    for p, st in ((clean, clean_state), (dirty, dirty_state)):
        adamw_8bit_update(p, g0, st, lr=1e-2, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
    g_dirty, g_clean = g1.clone(), g1.clone()
    g_dirty[idx], g_clean[idx] = bad, 0.0
    adamw_8bit_update(dirty, g_dirty, dirty_state, lr=1e-2, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
    adamw_8bit_update(clean, g_clean, clean_state, lr=1e-2, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
    assert (~torch.isfinite(dirty)).nonzero().flatten().tolist() == [idx] and math.isnan(dirty[idx].item())
    others = torch.ones(1024, dtype=torch.bool)
    others[idx] = False
    assert torch.equal(dirty[others], clean[others])
    for key in ("absmax1", "absmax2"):
        assert torch.isnan(dirty_state[key][1]).item(), key
        keep = torch.tensor([0, 2, 3])
        assert torch.equal(dirty_state[key][keep], clean_state[key][keep]), key
    outside = torch.cat([torch.arange(0, 256), torch.arange(512, 1024)])
    for key in ("state1", "state2"):
        assert torch.equal(dirty_state[key][outside], clean_state[key][outside]), key
    adamw_8bit_update(dirty, g2, dirty_state, lr=1e-2, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
    adamw_8bit_update(clean, g2, clean_state, lr=1e-2, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
    assert bool(torch.isnan(dirty[256:512]).all())
    assert torch.equal(dirty[outside], clean[outside])


def test_grads_finite_skips_only_the_check() -> None:
    """With finite gradients the promise changes no bit (it only skips the isfinite pass)."""
    shape = (3000,)
    results = []
    for promise in (False, True):
        p, state = _fresh(shape)
        for g in _grads(shape, 3):
            adamw_8bit_update(p, g, state, lr=1e-2, weight_decay=0.1, gnorm_scale=0.9, grads_finite=promise, **HYPER)
        results.append(_snapshot(p, state))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_empty_parameter_is_a_no_op() -> None:
    p, state = _fresh((0,))
    adamw_8bit_update(p, torch.zeros(0), state, lr=1e-2, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
    assert state["step"].item() == 1 and p.numel() == 0


def test_hybrid_adamw_promises_finite_grads_only_after_a_finite_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call site passes grads_finite=True exactly when the step's global norm was computed
    (and finite); with skip_nonfinite=False and no clipping the update checks by itself and a NaN
    gradient poisons its parameter and block, as the policy says."""
    import lightning_lazytrain.optim.hybrid_adamw as hybrid

    seen: list[bool] = []

    def spy(*args, **kwargs):
        seen.append(kwargs["grads_finite"])
        return adamw_8bit_update(*args, **kwargs)

    monkeypatch.setattr(hybrid, "adamw_8bit_update", spy)
    for skip_nonfinite, expected in ((True, True), (False, False)):
        seen.clear()
        model = make_model(bias=False)
        opt = HybridAdamW(model.named_parameters(), lr=1e-2, eight_bit="all", skip_nonfinite=skip_nonfinite)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01)
        first = next(model.parameters())
        first.grad.view(-1)[5] = math.nan
        before = first.detach().clone()
        opt.step()
        if skip_nonfinite:
            assert seen == [] and opt.skipped_steps == 1 and torch.equal(first, before)
        else:
            assert seen and set(seen) == {expected}
            assert torch.isnan(first.view(-1)[5]).item() and torch.isfinite(first.view(-1)[6:]).all().item()
            assert torch.isnan(opt.state[first]["absmax1"][0]).item()
        seen.clear()
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01)
        opt.step()
        assert seen and set(seen) == {skip_nonfinite}  # a computed finite norm -> the promise


# ------------------------------------------------------------------------------------ CUDA
def _cuda_copy(p: torch.Tensor, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    q = p.detach().cuda()
    st = init_8bit_state(q, *make_qmaps(q.device))
    for key in ("state1", "state2", "absmax1", "absmax2"):
        st[key].copy_(state[key])
    st["step"].copy_(state["step"])
    return q, st


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_8bit_kernel_uses_the_legacy_stream_and_our_update_the_callers() -> None:
    """Finding (a) and its fix. On a side stream that is still busy (a ~50 ms sleep, then the
    gradient is written): bitsandbytes called directly launches at once on the legacy default
    stream and reads the gradient before it exists; adamw_8bit_update waits for the caller's
    stream, and work queued after it on that stream sees the update."""
    assert torch.cuda.default_stream().cuda_stream == 0  # torch's default stream is the legacy one
    n = 1 << 20
    p0, st0 = _fresh((n,))
    g_src = torch.randn(n, generator=torch.Generator().manual_seed(7)).cuda()
    ref, ref_state = _cuda_copy(p0, st0)
    adamw_8bit_update(ref, g_src, ref_state, lr=1e-2, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
    torch.cuda.synchronize()

    def on_busy_side_stream(update) -> tuple[torch.Tensor, torch.Tensor]:
        p, st = _cuda_copy(p0, st0)
        g = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
            g.copy_(g_src)
            update(p, g, st)
            after = p.clone()  # queued behind the update on the caller's stream
        torch.cuda.synchronize()
        return p, after

    def direct(p, g, st):  # our update's ops, but the kernel called as bitsandbytes launches it
        p.mul_(1.0 - 1e-2 * 0.1)
        bnb_f.optimizer_update_8bit_blockwise(
            "adam", g, p, st["state1"], st["state2"], 0.9, 0.999, 0.0, 0.0, 1e-8, 1, 1e-2, st["qmap1"], st["qmap2"],
            st["absmax1"], st["absmax2"], weight_decay=0.0, gnorm_scale=1.0,
        )

    raced, _ = on_busy_side_stream(direct)
    assert not torch.allclose(raced, ref, atol=1e-4), "bitsandbytes now honours the current stream: simplify bnb8bit"
    p, after = on_busy_side_stream(
        lambda p, g, st: adamw_8bit_update(p, g, st, lr=1e-2, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
    )
    assert torch.equal(p, ref) and torch.equal(after, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_and_cpu_agree_on_decay_order_and_nonfinite_policy(dtype: torch.dtype) -> None:
    """Strong decay: after one update CUDA's parameters match CPU's to approximate-math accuracy,
    far inside the gap between the two decay orders; a NaN/inf gradient element gives the same
    NaN parameter and NaN block scales on both; later steps agree closely (not bitwise)."""
    shape, lr, wd = (4096,), 0.1, 0.5
    cpu_p, cpu_st = _fresh(shape, dtype=dtype)
    cuda_p, cuda_st = _cuda_copy(cpu_p, cpu_st)
    after, after_st = _fresh(shape, dtype=dtype)
    g = _grads(shape, 1, dtype)[0]
    adamw_8bit_update(cpu_p, g, cpu_st, lr=lr, weight_decay=wd, gnorm_scale=1.0, **HYPER)
    adamw_8bit_update(cuda_p, g.cuda(), cuda_st, lr=lr, weight_decay=wd, gnorm_scale=1.0, **HYPER)
    _ref_blockwise_adamw(after, g, after_st, 1, lr=lr, wd=wd, decay_first=False)
    if dtype == torch.float32:  # decay orders differ by lr*wd*|update| ~ 5e-3 everywhere
        gap = (cpu_p - after).abs().max().item()
        diff = (cuda_p.cpu() - cpu_p).abs().max().item()
        assert diff <= 1e-5 < 1e-3 < gap, (diff, gap)
    else:  # bf16: the decay orders round differently on ~92 % of elements (measured on CPU)
        order_mismatch = (cpu_p != after).float().mean().item()
        device_mismatch = (cuda_p.cpu() != cpu_p).float().mean().item()
        assert device_mismatch < 0.05 < 0.5 < order_mismatch, (device_mismatch, order_mismatch)
    for bad in (math.nan, math.inf):
        gb = _grads(shape, 1, dtype, seed=5)[0]
        gb[1000] = bad  # block 3
        adamw_8bit_update(cpu_p, gb, cpu_st, lr=1e-3, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
        adamw_8bit_update(cuda_p, gb.cuda(), cuda_st, lr=1e-3, weight_decay=0.1, gnorm_scale=1.0, **HYPER)
        for p in (cpu_p, cuda_p.cpu()):
            nonfinite = (~torch.isfinite(p)).nonzero().flatten()
            assert set(nonfinite.tolist()) >= {1000} and set(nonfinite.tolist()) <= set(range(768, 1024))
        for key in ("absmax1", "absmax2"):
            for st in (cpu_st, cuda_st):
                scales = st[key].cpu()
                assert torch.isnan(scales[3]).item() and torch.isfinite(scales[torch.arange(16) != 3]).all().item()
    outside = torch.ones(4096, dtype=torch.bool)
    outside[768:1024] = False
    rtol = 1e-3 if dtype == torch.float32 else 1.6e-2  # bf16: a 1-ulp rounding difference is allowed
    torch.testing.assert_close(cuda_p.cpu()[outside], cpu_p[outside], rtol=rtol, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chunked_update_is_bitwise_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA chunk limit, shrunk to 3 x 4096: same bits as one launch; too long a chunk is refused."""
    shape = (23, 1111)
    results = []
    for chunk in (CUDA_KERNEL_MAX_NUMEL, None):
        if chunk is None:
            monkeypatch.setattr(bnb8bit, "CUDA_CHUNK_NUMEL", 4096 * 3)
        p, st = _fresh(shape, device="cuda")
        for g in _grads(shape, 3):
            adamw_8bit_update(p, g.cuda(), st, lr=1e-2, weight_decay=0.1, gnorm_scale=0.7, chunk_numel=chunk, **HYPER)
        results.append(_snapshot(p, st))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(ValueError, match="too large"):
        adamw_8bit_update(p, g.cuda(), st, lr=1e-2, weight_decay=0.0, gnorm_scale=1.0,
                          chunk_numel=CUDA_KERNEL_MAX_NUMEL + 256, **HYPER)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_update_of_more_than_two_to_the_31_elements() -> None:
    """2^31 + 512 bf16 elements (~12 GiB with grad and states): the elements past 2^31 are updated
    exactly like the first ones (one launch would have wrapped its int32 count)."""
    n = 2**31 + 512
    if torch.cuda.mem_get_info()[0] < 16 * 2**30:
        pytest.skip("needs 16 GiB of free device memory")
    p = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    g = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    st = init_8bit_state(p, *make_qmaps(p.device))
    adamw_8bit_update(p, g, st, lr=1e-2, weight_decay=0.0, gnorm_scale=1.0, grads_finite=True, **HYPER)
    head, tail = p[:512].float().cpu(), p[-512:].float().cpu()
    assert bool((head != 0).all()) and torch.equal(head, tail)
    assert torch.equal(st["absmax1"][:2].cpu(), st["absmax1"][-2:].cpu())
    del p, g, st
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_adamw_on_a_side_stream_equals_the_default_stream() -> None:
    """HybridAdamW (all 8-bit, clipping) stepped from a side stream: bitwise the default-stream run."""
    results = []
    for use_side in (False, True):
        model = make_model(bias=False).cuda()
        opt = HybridAdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1, eight_bit="all", max_grad_norm=0.5)
        ctx = torch.cuda.stream(torch.cuda.Stream()) if use_side else contextlib.nullcontext()
        with ctx:
            for grads in fixed_grads(model, 3):
                torch.cuda._sleep(20_000_000)
                for p, gr in zip(model.parameters(), grads):
                    p.grad = gr.cuda()
                opt.step()
            out = [p.detach().clone() for p in model.parameters()]
        torch.cuda.synchronize()
        results.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_torch_dequantisation_is_bitsandbytes_bit_for_bit():
    """bnb8bit.dequantize_blockwise (what dequantized_moments and a 8 -> 32-bit state conversion use, with no
    bitsandbytes needed) equals bitsandbytes' own dequantize_blockwise bit for bit, sizes off the 256 blocks too."""
    from lightning_lazytrain.optim.bnb8bit import dequantize_blockwise, make_qmaps, require_bnb

    bnb_f = require_bnb()
    g = torch.Generator().manual_seed(0)
    for shape, signed in (((300,), True), ((1000, 3), False), ((4097,), True), ((7,), False), ((513, 5), True)):
        x = torch.randn(*shape, generator=g)
        x = x if signed else x.square()
        code = make_qmaps(x.device)[0 if signed else 1]
        codes, qs = bnb_f.quantize_blockwise(x, code=code, blocksize=256)
        want = bnb_f.dequantize_blockwise(codes, absmax=qs.absmax, code=code, blocksize=256)
        got = dequantize_blockwise(codes, qs.absmax, code)
        assert got.shape == want.shape and torch.equal(got, want), shape
