"""32-bit HybridAdamW == torch AdamW + clip_grad_norm_; norms; handed-over norms; non-finite skips."""

from __future__ import annotations

import functools
import logging
import math

import pytest
import torch

from lightning_lazytrain.optim import HybridAdamW, clip_coefficient, global_grad_norm, group_by_layer
from models import layer_of, mlp_stack

LR = 1e-3
WD = 0.1
STEPS = 20


make_model = functools.partial(mlp_stack, 3, 32, 64, act=torch.nn.GELU, norm=True)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(32, 32, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(16, 32, generator=g)
        out.append((x, x @ target))
    return out


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).pow(2).mean()


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    """max |a - e| <= rel * max |e| (relative to the tensor's scale: elementwise relative error is
    meaningless for entries that happen to sit near zero)."""
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max abs err {err:.3e} > {rel:g} * {scale:.3e}"


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("max_norm", [None, 1e6, 0.5])  # none / clipping inactive / active
def test_none_equals_torch_adamw_plus_clip(impl: str, max_norm: float | None) -> None:
    """fp32: bit for bit torch AdamW (the same implementation) after clip_grad_norm_ (Note: [exact clip])."""
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD, **{impl: True})
    opt = HybridAdamW(
        group_by_layer(model.named_parameters(), layer_of), lr=LR, weight_decay=WD, eight_bit="none",
        max_grad_norm=max_norm, impl=impl,  # type: ignore[arg-type]
    )
    clipped_steps = 0
    for batch in batches(STEPS):
        ref.zero_grad()
        loss_fn(ref_model, batch).backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
            clipped_steps += int(norm.item() > max_norm)
        ref.step()
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
    if max_norm == 0.5:
        assert clipped_steps == STEPS  # the clip really was active on every step
    if max_norm == 1e6:
        assert clipped_steps == 0
    for p, p_ref in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, p_ref)
        assert torch.equal(p.grad, p_ref.grad)  # .grad holds the clipped gradient, as after clip_grad_norm_
        st, st_ref = opt.state[p], ref.state[p_ref]
        assert st["step"].item() == st_ref["step"].item() == STEPS
        assert torch.equal(st["exp_avg"], st_ref["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], st_ref["exp_avg_sq"])
    assert opt.skipped_steps == 0


def test_foreach_unclipped_is_bitwise_torch() -> None:
    """Without clipping the foreach path runs torch's own op sequence: bitwise equal."""
    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD, foreach=True)
    opt = HybridAdamW(model.parameters(), lr=LR, weight_decay=WD, impl="foreach", skip_nonfinite=False)
    for batch in batches(5):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            loss_fn(m, batch).backward()
            o.step()
    for p, p_ref in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, p_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_total_norm_is_get_total_norm_with_handed_norms(dtype: torch.dtype) -> None:
    """Any subset of the per-tensor norms handed over: torch's total norm bit for bit, also with
    gradients of several dtypes (torch stacks them in its device/dtype bucket order)."""
    from lightning_lazytrain.optim.clip import grad_total_norm

    g = torch.Generator().manual_seed(4)
    for trial in range(10):
        grads = [torch.randn(int(torch.randint(1, 3000, (), generator=g)), generator=g).to(
            dtype if (i + trial) % 3 else torch.float32) for i in range(7)]
        norms = torch._foreach_norm(grads, 2.0)
        want = torch.nn.utils.get_total_norm(grads, 2.0)
        for keep in (range(7), range(0, 7, 2), ()):
            got = grad_total_norm(grads, [n if i in keep else None for i, n in enumerate(norms)])
            assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_handed_per_parameter_norms_are_clip_grad_norm_bitwise(impl: str, pipelined: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's hand-over (each parameter's norm): no norm pass, and norm, factor and update
    bit for bit torch AdamW after clip_grad_norm_ (clip active on every step)."""
    import lightning_lazytrain.optim.grad_norms as ha  # where HybridAdamW takes its norms

    ref_model, model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD, **{impl: True})
    opt = HybridAdamW(group_by_layer(model.named_parameters(), layer_of), lr=LR, weight_decay=WD,
                      max_grad_norm=0.5, impl=impl)  # type: ignore[arg-type]
    monkeypatch.setattr(ha, "global_grad_norm", lambda grads: pytest.fail("a norm pass"))
    for batch in batches(6):
        ref.zero_grad()
        loss_fn(ref_model, batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        ref.step()
        opt.zero_grad()
        loss_fn(model, batch).backward()
        params = list(model.parameters())
        opt.set_grad_norms(dict(zip(params, torch._foreach_norm([p.grad for p in params], 2.0))))
        if pipelined:
            opt.step_pipelined(list(reversed(opt.layers))).wait_all()
        else:
            opt.step()
        assert opt.last_grad_norm == norm.item() > 0.5
    for p, p_ref in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, p_ref)
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[p_ref]["exp_avg_sq"])


def test_handed_per_parameter_norms_are_used_once() -> None:
    """Norms are for one step: the next step without a hand-over takes its own norm pass."""
    model = make_model()
    opt = HybridAdamW(model.parameters(), lr=LR, max_grad_norm=1.0)
    loss_fn(model, batches(1)[0]).backward()
    opt.set_grad_norms({p: torch.tensor(float("inf")) for p in model.parameters()})
    opt.step()
    assert opt.skipped_steps == 1  # the handed (bogus) norms were used
    opt.step()
    assert opt.skipped_steps == 1 and math.isfinite(opt.last_grad_norm)
    opt.set_grad_norms({p: torch.tensor(float("inf")) for p in model.parameters()})
    opt.set_grad_norms(None)  # withdrawn
    opt.step()
    assert opt.skipped_steps == 1


def test_global_norm_matches_clip_grad_norm() -> None:
    model = make_model()
    loss_fn(model, batches(1)[0]).backward()
    grads = [p.grad for p in model.parameters()]
    ours = global_grad_norm(grads)
    theirs = torch.nn.utils.get_total_norm(grads, 2.0)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
    assert clip_coefficient(ours, 1e9).item() == 1.0
    assert clip_coefficient(ours, ours.item() / 2).item() == pytest.approx(0.5, rel=1e-5)
    # Half-precision gradients: the norm is still accumulated in float32.
    half = [g.to(torch.bfloat16) for g in grads]
    assert global_grad_norm(half).dtype == torch.float32
    assert global_grad_norm(half).item() == pytest.approx(ours.item(), rel=1e-2)


def _per_layer_sq_norms(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[layer_of(name)] = out.get(layer_of(name), torch.zeros(())) + p.grad.pow(2).sum()
    return out


@pytest.mark.parametrize("how", ["set", "add_per_param"])
def test_handed_over_sq_norms_replace_the_norm_pass(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = make_model(), make_model()
    opt_a = HybridAdamW(group_by_layer(a.named_parameters(), layer_of), lr=LR, max_grad_norm=0.5)
    opt_b = HybridAdamW(group_by_layer(b.named_parameters(), layer_of), lr=LR, max_grad_norm=0.5)
    import lightning_lazytrain.optim.grad_norms as ha  # where HybridAdamW takes its norms

    calls = []
    real = ha.global_grad_norm
    monkeypatch.setattr(ha, "global_grad_norm", lambda grads: calls.append(1) or real(grads))
    for batch in batches(5):
        for m in (a, b):
            m.zero_grad()
            loss_fn(m, batch).backward()
        if how == "set":
            opt_b.set_grad_sq_norms(_per_layer_sq_norms(b))
        else:
            for name, p in b.named_parameters():
                opt_b.add_layer_sq_norm(layer_of(name), float(p.grad.pow(2).sum()))
        opt_a.step()
        n_calls = len(calls)
        opt_b.step()
        assert len(calls) == n_calls  # opt_b made no norm pass of its own
        assert opt_b.last_grad_norm == pytest.approx(opt_a.last_grad_norm, rel=1e-5)
    for p, q in zip(a.parameters(), b.parameters()):
        assert_rel_close(q.detach(), p.detach())


def test_handed_over_norms_must_cover_every_layer() -> None:
    model = make_model()
    opt = HybridAdamW(group_by_layer(model.named_parameters(), layer_of), max_grad_norm=1.0)
    loss_fn(model, batches(1)[0]).backward()
    opt.add_layer_sq_norm(0, 1.0)
    with pytest.raises(ValueError, match="not for layers"):
        opt.step()
    with pytest.raises(KeyError):
        opt.add_layer_sq_norm(7, 1.0)


def _snapshot(opt: torch.optim.Optimizer, model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out.extend(v.clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor))
    return out


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("eight_bit", ["none", "all"])
def test_nonfinite_gradient_skips_step(bad: float, max_norm: float | None, eight_bit: str,
                                       caplog: pytest.LogCaptureFixture) -> None:
    if eight_bit == "all":
        pytest.importorskip("bitsandbytes")
    model = make_model()
    opt = HybridAdamW(model.parameters(), lr=LR, max_grad_norm=max_norm, eight_bit=eight_bit)  # type: ignore[arg-type]
    data = batches(3)
    loss_fn(model, data[0]).backward()
    opt.step()  # one good step so the states are non-trivial
    before = _snapshot(opt, model)
    opt.zero_grad()
    loss_fn(model, data[1]).backward()
    next(model.parameters()).grad[0, 0] = bad
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain.optim"):
        opt.step()
    after = _snapshot(opt, model)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert opt.skipped_steps == 1
    assert "step skipped" in caplog.text and "skipped_steps=1" in caplog.text
    # The next finite step proceeds normally from the untouched state.
    opt.zero_grad()
    loss_fn(model, data[2]).backward()
    opt.step()
    assert opt.skipped_steps == 1
    assert not torch.equal(next(model.parameters()), before[0])
    assert all(opt.state[p]["step"].item() == 2 for p in model.parameters())


def test_nonfinite_handed_over_norm_skips() -> None:
    model = make_model()
    opt = HybridAdamW(group_by_layer(model.named_parameters(), layer_of), max_grad_norm=1.0)
    loss_fn(model, batches(1)[0]).backward()
    before = _snapshot(opt, model)
    opt.set_grad_sq_norms({0: 1.0, 1: float("inf"), 2: 1.0})
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(opt, model)))


def test_closure_and_param_groups_hyperparameters() -> None:
    """Per-group lr is honoured (group 1 with lr=0 must not move apart from weight decay 0)."""
    model = make_model()
    groups = group_by_layer(model.named_parameters(), layer_of, weight_decay=0.0)
    groups[1]["lr"] = 0.0
    opt = HybridAdamW(groups, lr=LR)
    frozen = [p.detach().clone() for p in model[1].parameters()]
    loss = opt.step(lambda: loss_fn(model, batches(1)[0]).backward() or torch.tensor(1.0))
    assert loss.item() == 1.0
    assert all(torch.equal(p, q) for p, q in zip(model[1].parameters(), frozen))
    assert not torch.equal(next(model[0].parameters()), next(make_model()[0].parameters()))
