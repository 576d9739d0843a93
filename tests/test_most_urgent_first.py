"""Updates handed over in the backward but not started when the step comes go in the next forward's
order, and the step does not wait for them (Note: [most urgent first] in optim/pipeline.py): exact."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.optim.pipeline import LayerPipeline
from lightning_lazytrain.strategy import LazyTrainStrategy
from test_optim_pipeline import N_LAYERS, make_model
from test_optim_pipeline import all_tensors as everything
from test_updates_in_backward import hand_over_in_backward, make_opt, plan_in_backward
from test_weights_read_after_step import fit


def gated_pipeline(reorder: bool) -> tuple[list, LayerPipeline]:
    """An open-ended step whose worker holds the first layer submitted until the step is closed."""
    done: list = []
    gate, started = threading.Event(), threading.Event()
    pipe = LayerPipeline(["rest", 0, 1, 2, 3], done.append, lambda layer, none: None, open_ended=True).start()
    pipe.submit(3, after=lambda: (started.set(), gate.wait(30)))
    assert started.wait(30)  # the worker is on layer 3
    pipe.submit(2)
    pipe.submit(1)
    pipe.close(["rest", 0, 1, 2, 3], reorder=reorder)
    gate.set()
    pipe.wait_all(timeout=30)
    return done, pipe


def test_close_queues_the_waiting_layers_in_the_steps_order():
    done, pipe = gated_pipeline(reorder=True)
    assert done == [3, "rest", 0, 1, 2]  # 3 had started; 2 and 1 take their places in the forward's order
    assert pipe.waiting_at_close == 2
    done, pipe = gated_pipeline(reorder=False)
    assert done == [3, 2, 1, "rest", 0]  # first in, first out: the forward's first layers last
    assert pipe.waiting_at_close == 2


class Gated(HybridAdamW):
    """The first update of a step waits for ``gate``: the step comes while the others still wait."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.started = threading.Event(), threading.Event()
        self.order: list = []

    def _update_layer(self, layer, plan):
        if not self.order or self.order[-1] == "end":
            self.started.set()
            self.gate.wait(30)
        self.order.append(layer)
        super()._update_layer(layer, plan)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_step_that_does_not_wait_for_the_backwards_updates_is_exact(set_to_none):
    """Layers 3, 2, 1 handed over in the backward; layer 3's update is held, so 2 and 1 still wait when
    the step comes: the step returns at once, queues 0, 1, 2 in the forward's order, and gradients zeroed
    right after it (Lightning's zero_grad) change nothing: every parameter and state equal the serial step's."""
    serial_model, eager_model = make_model(), make_model()
    serial = make_opt(serial_model)
    eager = Gated(make_opt(eager_model).param_groups, lr=1e-2, eight_bit="none", skip_nonfinite=False,
                  updates_in_backward=True)
    hand_over_in_backward(eager_model, eager, [])
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(8, 64, generator=g) for _ in range(3)]
    for x in xs:
        serial.zero_grad()
        serial_model(x).pow(2).mean().backward()
        serial.step()
    left = 0
    for x in xs:
        eager.gate.clear()
        eager.started.clear()
        eager_model(x).pow(2).mean().backward()
        assert eager.started.wait(30)  # the worker holds layer 3's update
        eager.seal_backward()
        pipe = eager.step_pipelined(order=list(range(N_LAYERS)))
        left += pipe.waiting_at_close
        assert not pipe.done  # the step did not wait: layer 3's update is still held
        eager.zero_grad(set_to_none=set_to_none)
        eager.gate.set()
        pipe.wait_all(timeout=30)
        eager.order.append("end")
    assert eager.order == [3, 0, 1, 2, "end"] * len(xs)
    assert left == 2 * len(xs) == eager.backward_updates_left_at_step
    assert all(torch.equal(a, b) for a, b in zip(everything(serial_model, serial), everything(eager_model, eager)))


def test_an_unsealed_step_still_waits_and_stays_exact():
    """Without ``seal_backward`` (a loop of one's own) the step reads what the early updates used before
    deciding: it waits for them, and the order stays the submitted one."""
    serial_model, eager_model = make_model(), make_model()
    serial = make_opt(serial_model)
    eager = make_opt(eager_model, updates_in_backward=True)
    hand_over_in_backward(eager_model, eager, [])
    x = torch.randn(8, 64)
    serial_model(x).pow(2).mean().backward()
    serial.step()
    eager_model(x).pow(2).mean().backward()
    pipe = eager.step_pipelined(order=list(range(N_LAYERS)))
    assert pipe.waiting_at_close == 0 and all(pipe.is_updated(layer) for layer in (1, 2, 3))
    pipe.wait_all(timeout=30)
    assert all(torch.equal(a, b) for a, b in zip(everything(serial_model, serial), everything(eager_model, eager)))


def test_under_the_trainer_a_slow_host_update_is_reordered_and_exact():
    """strategy="lazytrain" with a host update slower than the backward (each layer's update sleeps): the
    blocks handed over are still waiting at the step, go in the forward's order, and the run equals the
    one with every update at the step bit for bit."""
    want, _ = fit(LazyTrainStrategy(policy=plan_in_backward()), updates_in_backward=False)
    got, opt = fit(LazyTrainStrategy(policy=plan_in_backward()), updates_in_backward=True)
    assert opt.backward_updates_left_at_step > 0  # blocks handed over were still waiting at some step
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("call", ["state_dict", "load_state_dict", "wait_step", "zero_grad"])
def test_what_would_give_up_an_open_step_raises(call):
    """Between a backward whose updates began and its optimizer step, reading or loading the optimizer's
    state, waiting for its step or zeroing its gradients would give the open step up, and the step after
    it would update the layers handed over in the backward a second time: each raises, the step then
    runs and equals the serial one bit for bit (found by a review: state_dict() there gave two updates)."""
    serial_model, eager_model = make_model(), make_model()
    serial, eager = make_opt(serial_model), make_opt(eager_model, updates_in_backward=True)
    hand_over_in_backward(eager_model, eager, [])
    x = torch.randn(8, 64)
    serial_model(x).pow(2).mean().backward()
    serial.step()
    saved = eager.state_dict()
    eager_model(x).pow(2).mean().backward()
    eager.seal_backward()
    args = {"load_state_dict": (saved,), "zero_grad": ()}.get(call, ())
    with pytest.raises(RuntimeError, match=f"{call}\\(\\) between a backward whose updates began"):
        getattr(eager, call)(*args)
    eager.step_pipelined(order=list(range(N_LAYERS))).wait_all()
    assert all(torch.equal(a, b) for a, b in zip(everything(serial_model, serial), everything(eager_model, eager)))


def test_abandon_step_gives_an_open_step_up():
    model = make_model()
    opt = make_opt(model, updates_in_backward=True)
    hand_over_in_backward(model, opt, [])
    model(torch.randn(8, 64)).pow(2).mean().backward()
    assert opt.updating_in_backward
    opt.abandon_step()
    assert not opt.updating_in_backward
    opt.state_dict()  # nothing open any more


@pytest.mark.parametrize("seed", range(40))
def test_every_layer_is_updated_once_whatever_the_timing(seed):
    """The worker's queue under random timing: layers submitted while others run (slow or not), the step
    closed in a random order (reordered or not) or aborted: every layer updated exactly once, an abort
    leaving exactly the layers never submitted."""
    import random
    import time

    rng = random.Random(seed)
    layers = ["rest", 0, 1, 2, 3, 4, 5]
    counts: dict = {}

    def update(layer):
        if rng.random() < 0.3:
            time.sleep(0.002 * rng.random())
        counts[layer] = counts.get(layer, 0) + 1

    pipe = LayerPipeline(layers, update, lambda layer, none: None, open_ended=True).start()
    handed = rng.sample([1, 2, 3, 4, 5], rng.randint(0, 5))
    for layer in handed:
        delay = 0.002 * rng.random() if rng.random() < 0.5 else 0.0
        pipe.submit(layer, after=(lambda d=delay: time.sleep(d)))
    if rng.random() < 0.2:
        left = pipe.abort()
        pipe.wait_all(timeout=30)
        assert set(left) == set(layers) - set(handed)
        assert counts == {layer: 1 for layer in handed}
        return
    order = rng.sample(layers, len(layers))
    pipe.close(order, reorder=rng.random() < 0.7)
    pipe.wait_all(timeout=30)
    assert counts == {layer: 1 for layer in layers}
