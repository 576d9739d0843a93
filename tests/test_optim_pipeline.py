"""Layer-pipelined step == serial step, bitwise; per-layer events; deferred zero_grad."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from lightning_lazytrain.optim import HybridAdamW, LayerPipeline, group_by_layer
from models import layer_of, mlp_stack

N_LAYERS = 4



make_model = functools.partial(mlp_stack, N_LAYERS, 64, 96, act=torch.nn.Tanh, norm=True)


def make_opt(model: torch.nn.Module, eight_bit: object, max_grad_norm: float | None = 0.3, **kw: object) -> HybridAdamW:
    # Two groups per layer (decay / no-decay) to exercise layers spanning groups.
    groups = []
    for g in group_by_layer(model.named_parameters(), layer_of):
        decay = [(n, p) for n, p in g["params"] if p.ndim >= 2]  # type: ignore[union-attr]
        no_decay = [(n, p) for n, p in g["params"] if p.ndim < 2]  # type: ignore[union-attr]
        groups.append({"params": decay, "layer": g["layer"], "weight_decay": 0.1})
        groups.append({"params": no_decay, "layer": g["layer"], "weight_decay": 0.0})
    return HybridAdamW(groups, lr=1e-2, eight_bit=eight_bit, max_grad_norm=max_grad_norm, **kw)  # type: ignore[arg-type]


def all_tensors(model: torch.nn.Module, opt: HybridAdamW) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out.extend(v.clone() for v in opt.state[p].values() if isinstance(v, torch.Tensor))
    return out


@pytest.mark.parametrize("eight_bit", ["none", "all", 0.3])
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_pipelined_equals_serial_bitwise(eight_bit: object, impl: str) -> None:
    """A training loop where the next forward waits per layer: bitwise equal to the serial loop."""
    if eight_bit != "none":
        pytest.importorskip("bitsandbytes")
    serial_model, piped_model = make_model(), make_model()
    serial = make_opt(serial_model, eight_bit, impl=impl)
    piped = make_opt(piped_model, eight_bit, impl=impl)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(16, 64, generator=g) for _ in range(8)]
    for x in xs:
        serial.zero_grad()
        serial_model(x).pow(2).mean().backward()
        serial.step()
    handle: LayerPipeline | None = None
    for x in xs:
        # Forward layer by layer, each waiting only for its own layer's update.
        h = x
        for layer in range(N_LAYERS):
            if handle is not None:
                handle.wait_updated(layer)
            h = piped_model[layer](h)
        piped.zero_grad()  # deferred while the previous step is in flight
        h.pow(2).mean().backward()
        handle = piped.step_pipelined(order=list(range(N_LAYERS)))
    assert handle is not None
    handle.wait_all()
    a, b = all_tensors(serial_model, serial), all_tensors(piped_model, piped)
    assert len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_forward_waits_only_for_its_layer() -> None:
    """While the last layer's update is held back, earlier layers are already usable."""
    model = make_model()
    opt = make_opt(model, "none")
    model(torch.randn(4, 64)).sum().backward()
    release = threading.Event()
    order_seen: list[int] = []
    real_update = opt._update_layer

    def slow_update(layer: int, plan: object) -> None:
        order_seen.append(layer)
        if layer == 0:  # updated last in the order below
            assert release.wait(30)
        real_update(layer, plan)  # type: ignore[arg-type]

    opt._update_layer = slow_update  # type: ignore[method-assign]
    handle = opt.step_pipelined(order=[3, 2, 1, 0])
    for layer in (3, 2, 1):
        handle.wait_updated(layer, timeout=30)
        assert handle.is_updated(layer)
    assert not handle.is_updated(0) and not handle.done
    with pytest.raises(TimeoutError):
        handle.wait_updated(0, timeout=0.05)
    release.set()
    handle.wait_all(timeout=30)
    assert order_seen == [3, 2, 1, 0]
    assert all(opt.state[p]["step"].item() == 1 for p in model.parameters())


def test_deferred_zero_grad_clears_each_layer_after_its_update() -> None:
    model = make_model()
    opt = make_opt(model, "none")
    model(torch.randn(4, 64)).sum().backward()
    release = threading.Event()
    real_update = opt._update_layer

    def gated(layer: int, plan: object) -> None:
        if layer == 2:
            assert release.wait(30)
        real_update(layer, plan)  # type: ignore[arg-type]

    opt._update_layer = gated  # type: ignore[method-assign]
    handle = opt.step_pipelined()  # default order: 0, 1, 2, 3
    handle.wait_updated(1, timeout=30)
    opt.zero_grad()
    assert all(p.grad is None for p in model[0].parameters())
    assert all(p.grad is None for p in model[1].parameters())
    assert all(p.grad is not None for p in model[3].parameters())  # still needed by the worker
    release.set()
    handle.wait_all(timeout=30)
    assert all(p.grad is None for p in model.parameters())
    assert all(opt.state[p]["step"].item() == 1 for p in model.parameters())


def test_nonfinite_pipelined_step_is_skipped() -> None:
    model = make_model()
    opt = make_opt(model, "none")
    model(torch.randn(4, 64)).sum().backward()
    before = all_tensors(model, opt)
    next(model.parameters()).grad[0, 0] = float("nan")
    handle = opt.step_pipelined()
    for layer in range(N_LAYERS):
        handle.wait_updated(layer, timeout=30)  # events fire even though nothing is updated
    handle.wait_all()
    assert opt.skipped_steps == 1
    assert all(torch.equal(x, y) for x, y in zip(before, all_tensors(model, opt)))


def test_worker_error_surfaces_on_wait() -> None:
    model = make_model()
    opt = make_opt(model, "none")
    model(torch.randn(4, 64)).sum().backward()

    def boom(layer: int, plan: object) -> None:
        raise RuntimeError("kaput")

    opt._update_layer = boom  # type: ignore[method-assign]
    handle = opt.step_pipelined()
    with pytest.raises(RuntimeError, match="worker thread") as info:
        handle.wait_updated(0, timeout=30)
    assert "kaput" in repr(info.value.__cause__)
    with pytest.raises(RuntimeError):
        opt.step()  # the next step surfaces the failed in-flight step first


def test_order_must_cover_all_layers() -> None:
    model = make_model()
    opt = make_opt(model, "none")
    with pytest.raises(ValueError, match="every layer"):
        opt.step_pipelined(order=[0, 1, 2])
    with pytest.raises(ValueError):
        opt.step_pipelined(order=[0, 1, 2, 3, 3])
    assert opt.layers == [0, 1, 2, 3]


def test_state_dict_waits_for_inflight_step() -> None:
    model = make_model()
    opt = make_opt(model, "none")
    model(torch.randn(4, 64)).sum().backward()
    opt.step_pipelined()
    sd = opt.state_dict()  # must see the finished step, not a half-updated one
    assert all(s["step"].item() == 1 for s in sd["state"].values())


def test_grads_set_to_none_during_a_pipelined_step_do_not_change_it() -> None:
    """Lightning zeroes the module's grads (set_to_none) before validation while a pipelined update
    may still run: the update uses the grads as they were when the step started."""
    serial_model, piped_model = make_model(), make_model()
    serial, piped = make_opt(serial_model, "none"), make_opt(piped_model, "none")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    for model in (serial_model, piped_model):
        model(x).pow(2).mean().backward()
    serial.step()
    release = threading.Event()
    original = piped._update_layer

    def slow_update(layer, plan):  # hold the worker at layer 0 until the grads are gone
        if layer == 0:
            release.wait(timeout=10)
        original(layer, plan)

    piped._update_layer = slow_update  # test-only instrumentation of the worker
    handle = piped.step_pipelined(order=list(range(N_LAYERS)))
    piped_model.zero_grad(set_to_none=True)
    release.set()
    handle.wait_all()
    assert all(torch.equal(a, b) for a, b in zip(all_tensors(serial_model, serial), all_tensors(piped_model, piped)))


@pytest.mark.parametrize("eight_bit", ["none", "all"])
def test_clipped_grads_are_scaled_when_the_pipelined_step_returns(eight_bit: object) -> None:
    """Note: [gradients read after a clipped step]: with ``clipped_grads=True`` every ``.grad`` holds its
    clipped value when ``step_pipelined`` returns (as after ``clip_grad_norm_``), while the updates still run;
    the step is bit for bit the one that scales each layer on the worker, and the gradients after it too."""
    if eight_bit != "none":
        pytest.importorskip("bitsandbytes")
    models = [make_model(), make_model()]
    opts = [make_opt(m, eight_bit, max_grad_norm=0.05) for m in models]
    gate = threading.Event()
    slow_layer = opts[1]._update_layer

    def held(layer, plan):  # the first layer's update waits until the gradients were read
        gate.wait(10)
        slow_layer(layer, plan)

    opts[1]._update_layer = held
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(16, 64, generator=g)
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).pow(2).mean().backward()
        grads_in = [p.grad.clone() for p in models[1].parameters()]
        opts[0].step_pipelined().wait_all()
        gate.clear()
        pipe = opts[1].step_pipelined(clipped_grads=True)
        assert opts[1].last_grad_norm > 0.05  # the clip is active
        coef = 0.05 / (opts[1].last_grad_norm + 1e-6)
        seen = [p.grad.clone() for p in models[1].parameters()]  # read while no update has run
        assert not pipe.done
        gate.set()
        pipe.wait_all()
        for a, b in zip(seen, grads_in):
            torch.testing.assert_close(a, b * coef, rtol=1e-5, atol=0)
        assert all(torch.equal(a, p.grad) for a, p in zip(seen, models[1].parameters()))
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(models[0].parameters(), models[1].parameters()))
    assert all(torch.equal(a, b) for a, b in zip(all_tensors(models[0], opts[0]), all_tensors(models[1], opts[1])))
