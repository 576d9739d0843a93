"""HybridAdamW(updates_in_backward=True): blocks updated during the backward, bit for bit the serial step.

Note: [updates in backward] (optim/backward_updates.py) and Note: [updates in the backward pass]
(core/optimizer_steps.py).
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.strategy import LazyTrainStrategy
from test_optim_pipeline import N_LAYERS, make_model
from test_optim_pipeline import all_tensors as everything
from test_optim_pipeline import make_opt as pipeline_opt


def make_opt(model: torch.nn.Module, eight_bit: object = "none", **kw: object) -> HybridAdamW:
    """The pipeline tests' optimizer (two groups per layer), without clip and skip."""
    return pipeline_opt(model, eight_bit, max_grad_norm=None, skip_nonfinite=False, **kw)


def hand_over_in_backward(model: torch.nn.Module, opt: HybridAdamW, submitted: list) -> None:
    """Each layer but the first goes to ``update_in_backward`` from autograd's own thread, once the
    backward has accumulated all of its parameters' gradients (as the executor's final-grads hook)."""
    for layer in range(1, N_LAYERS):
        params = list(model[layer].parameters())
        left = {"n": len(params)}

        def hook(_p, layer=layer, left=left, n=len(params)):
            left["n"] -= 1
            if left["n"] == 0:
                left["n"] = n
                submitted.append(layer)
                opt.update_in_backward(layer)

        for p in params:
            p.register_post_accumulate_grad_hook(hook)


@pytest.mark.parametrize("eight_bit", ["none", 0.5])
def test_updates_in_the_backward_equal_the_serial_step_bitwise(eight_bit):
    """Layers 3, 2, 1 updated while the backward runs, the rest by step_pipelined: parameters and every
    state equal the serial step's bit for bit over several steps; the next forward waits per layer."""
    if eight_bit != "none":
        pytest.importorskip("bitsandbytes")
    serial_model, eager_model = make_model(), make_model()
    serial, eager = make_opt(serial_model, eight_bit), make_opt(eager_model, eight_bit, updates_in_backward=True)
    submitted: list[int] = []
    hand_over_in_backward(eager_model, eager, submitted)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(16, 64, generator=g) for _ in range(5)]
    for x in xs:
        serial.zero_grad()
        serial_model(x).pow(2).mean().backward()
        serial.step()
    handle = None
    for x in xs:
        h = x
        for layer in range(N_LAYERS):
            if handle is not None:
                handle.wait_updated(layer)
            h = eager_model[layer](h)
        eager.zero_grad()
        h.pow(2).mean().backward()
        assert eager.updating_in_backward
        handle = eager.step_pipelined(order=list(range(N_LAYERS)))
        assert not eager.updating_in_backward
    handle.wait_all()
    assert submitted == [3, 2, 1] * len(xs)
    assert all(torch.equal(a, b) for a, b in zip(everything(serial_model, serial), everything(eager_model, eager)))


def test_a_serial_step_finishes_a_step_begun_in_the_backward():
    serial_model, eager_model = make_model(), make_model()
    serial, eager = make_opt(serial_model), make_opt(eager_model, updates_in_backward=True)
    hand_over_in_backward(eager_model, eager, [])
    x = torch.randn(8, 64)
    for model, opt in ((serial_model, serial), (eager_model, eager)):
        model(x).pow(2).mean().backward()
        opt.step()
    assert not eager.updating_in_backward
    assert all(torch.equal(a, b) for a, b in zip(everything(serial_model, serial), everything(eager_model, eager)))


def test_clip_or_skip_is_refused_with_updates_in_the_backward():
    model = make_model()
    with pytest.raises(ValueError, match="max_grad_norm=None and skip_nonfinite=False"):
        HybridAdamW(model.parameters(), updates_in_backward=True)  # skip_nonfinite defaults to True
    with pytest.raises(ValueError, match="max_grad_norm=1.0"):
        HybridAdamW(model.parameters(), updates_in_backward=True, skip_nonfinite=False, max_grad_norm=1.0)


@pytest.mark.parametrize("change", ["edit", "replace", "lr"])
def test_a_change_after_the_backward_is_refused_loudly(change):
    """What an early update used must not change before the step: a gradient edited in place or
    replaced, or the learning rate set, raises at the step naming it (the update cannot be undone)."""
    model = make_model()
    opt = make_opt(model, updates_in_backward=True)
    hand_over_in_backward(model, opt, [])
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.seal_backward()  # as the training core does when the backward ends: what changes from here is an edit
    p = model[3][0].weight
    if change == "edit":
        p.grad.mul_(0.5)
    elif change == "replace":
        p.grad = p.grad * 0.5
    else:
        for group in opt.param_groups:
            group["lr"] = 0.5
    what = "a hyperparameter" if change == "lr" else "were edited or replaced"
    with pytest.raises(RuntimeError, match=what):
        opt.step_pipelined(order=list(range(N_LAYERS)))
    assert not opt.updating_in_backward


# ---- under the Trainer ------------------------------------------------------------------------------
class Losses(L.Callback):
    reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

    def __init__(self):
        self.values = []
        self.plan = None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values.append(outputs["loss"].item())
        self.plan = trainer.strategy.core.plan


class CountingHybridAdamW(HybridAdamW):
    """Counts the layers handed over during the backward (a subclass: nothing is patched)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.in_backward: list = []

    def update_in_backward(self, layer, after=None):
        self.in_backward.append(layer)
        super().update_in_backward(layer, after)


def plan_file(schedule) -> str:
    """A plan file holding ``schedule`` (a plan file's choice is kept: the planner would pick its own)."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"schedule": schedule.to_json()}, f)
    return f.name


def plan_in_backward(layers: int = 4) -> str:
    """A plan file: recompute_all with the updates in the backward (the planner would pick the faster way
    for this tiny CPU model)."""
    import dataclasses

    from lightning_lazytrain.planner import recompute_all

    return plan_file(dataclasses.replace(recompute_all(layers), updates_in_backward=True, policy="test-in-backward"))


def fit_tiny(updates_in_backward: bool, *, accumulate: int = 1, clip: float | None = None, steps: int = 5,
             policy: str | None = None, precision: str = "32-true", callbacks=(), model_overrides=None,
             **strategy_kw):
    policy = policy or plan_in_backward()
    from lightning_lazytrain.lit_module import CausalLMModule

    class Module(CausalLMModule):
        def configure_optimizers(self):
            return CountingHybridAdamW(self.param_groups(), lr=self.lr, betas=self.betas, eps=self.eps,
                                       weight_decay=self.weight_decay, eight_bit="none", skip_nonfinite=False,
                                       updates_in_backward=updates_in_backward)

    torch.manual_seed(0)
    module = Module(model_name="tiny", model_overrides=model_overrides, optimizer="hybrid_adamw",
                    lr_schedule="constant", warmup_steps=0)
    losses = Losses()
    strategy = LazyTrainStrategy(policy=policy, **strategy_kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, accumulate_grad_batches=accumulate,
                        logger=False, enable_checkpointing=False, callbacks=[losses, *callbacks],
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        gradient_clip_val=clip, precision=precision)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(steps * accumulate)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    params = [p.detach().clone() for p in module.parameters()]
    fit_tiny.last_plan = losses.plan  # the plan's workload says where the updates were priced
    return losses.values, params, trainer.optimizers[0]


@pytest.mark.parametrize("accumulate,precision", [(1, "32-true"), (2, "32-true"), (2, "bf16-true")])
def test_the_trainer_updates_blocks_in_the_backward_exactly(accumulate, precision):
    """strategy="lazytrain", HybridAdamW(updates_in_backward=True): after the profiled first step, every
    step hands the head, then blocks 3, 2, 1 to the optimizer during its backward (block 0 and the
    embedding go with the step), and the losses and final weights equal the run without it bit for bit (bf16-true:
    with fp32 masters, each micro-batch's gradients on the host, as the kit's fit runs)."""
    kw = {"fp32_masters": True} if precision == "bf16-true" else {}
    want, want_params, _ = fit_tiny(False, accumulate=accumulate, precision=precision, **kw)
    got, got_params, opt = fit_tiny(True, accumulate=accumulate, precision=precision, **kw)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))
    # steps 2..5 at least; the first is the profile (with fp32 masters and accumulation the profile is its
    # first micro-batch: the plan is in place for its last one)
    steps = 5 if precision == "bf16-true" and accumulate > 1 else 4
    # the head part (with the final norm) as soon as its gradients are complete, before block 3's backward
    # (Note: [early non-block parts] in engine/early_parts.py)
    assert opt.in_backward == ["head", 3, 2, 1] * steps
    assert fit_tiny.last_plan.result.workload.updates_in_backward  # and the plan priced them there


def test_with_gradient_clipping_the_updates_wait_for_the_step(caplog):
    """A clip needs every gradient: the fit says why the updates wait, and trains as without the option."""
    want, want_params, _ = fit_tiny(False, clip=0.5)
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain"):
        got, got_params, opt = fit_tiny(True, clip=0.5)
    assert "gradient_clip_val=0.5" in caplog.text and opt.in_backward == []
    assert not fit_tiny.last_plan.result.workload.updates_in_backward
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_params, want_params))


def test_a_hook_between_backward_and_step_keeps_the_updates_for_the_step(caplog):
    """on_before_optimizer_step may edit gradients: the updates wait for the step (said once)."""

    class Halve(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)

    want, want_params, _ = fit_tiny(False, callbacks=[Halve()])
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain"):
        got, got_params, opt = fit_tiny(True, callbacks=[Halve()])
    assert "on_before_optimizer_step" in caplog.text and opt.in_backward == []
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_params, want_params))


def test_a_callback_that_only_reads_gradients_keeps_the_updates_in_the_backward():
    """``reads_gradients_only = True`` on a callback (it logs or times): the updates still run in the
    backward, the run equals the one without them; a callback that says so and edits anyway is caught
    at the step, naming what changed."""

    class Norms(L.Callback):
        reads_gradients_only = True

        def __init__(self):
            self.norms = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.norms.append(sum(float(p.grad.norm()) for p in pl_module.parameters() if p.grad is not None))

    class Liar(Norms):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)

    want_cb, got_cb = Norms(), Norms()
    want, want_params, _ = fit_tiny(False, callbacks=[want_cb])
    got, got_params, opt = fit_tiny(True, callbacks=[got_cb])
    assert opt.in_backward == ["head", 3, 2, 1] * 4
    assert got == want and got_cb.norms == want_cb.norms
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))
    with pytest.raises(RuntimeError, match="were edited or replaced"):
        fit_tiny(True, callbacks=[Liar()])


def test_the_plan_decides_whether_the_updates_run_in_the_backward(caplog):
    """A named policy (and the MILP) takes the faster way by the simulator's prediction; the run follows
    the plan's choice and says so; without the option no schedule updates in the backward."""
    with caplog.at_level(logging.INFO, logger="lightning_lazytrain"):
        _, _, opt = fit_tiny(True, policy="recompute_all")
    plan = fit_tiny.last_plan
    assert plan.result.workload.updates_in_backward  # allowed, and priced both ways
    # the head part (the final norm and the untied head) priced where it runs: in B{L-1} (Note: [early
    # non-block parts])
    assert plan.result.workload.early_parts == (1,) and plan.result.workload.nonblock_part_count == 2
    chosen = plan.result.schedule.updates_in_backward
    assert (opt.in_backward != []) == chosen
    if not chosen:
        assert "the plan updates at the step" in caplog.text
    _, _, opt = fit_tiny(False, policy="recompute_all")
    assert not fit_tiny.last_plan.result.schedule.updates_in_backward and opt.in_backward == []
    assert fit_tiny.last_plan.result.workload.early_parts == ()


def test_gradients_dropped_after_the_step_returns_do_not_change_it():
    """The layers queued at the step (layer 0 here) are updated with the gradients they had when the step
    started, as the serial step's: a ``zero_grad(set_to_none=True)`` while they wait (Lightning's before
    validation) changes nothing. Before, the worker read them when it reached them and skipped layer 0."""
    import time as _time

    class Slow(HybridAdamW):
        def _update_layer(self, layer, plan):
            _time.sleep(0.05)
            super()._update_layer(layer, plan)

    serial_model, eager_model = make_model(), make_model()
    serial = make_opt(serial_model)
    eager = Slow(make_opt(eager_model).param_groups, lr=1e-2, eight_bit="none", skip_nonfinite=False,
                 updates_in_backward=True)
    hand_over_in_backward(eager_model, eager, [])
    x = torch.randn(8, 64)
    serial_model(x).pow(2).mean().backward()
    serial.step()
    eager_model(x).pow(2).mean().backward()
    pipe = eager.step_pipelined(order=list(range(N_LAYERS)))
    eager_model.zero_grad(set_to_none=True)
    pipe.wait_all()
    assert all(torch.equal(a, b) for a, b in zip(serial_model.parameters(), eager_model.parameters()))


def test_validation_during_the_fit_keeps_it_exact():
    def run(flag):
        from lightning_lazytrain.lit_module import CausalLMModule

        class Module(CausalLMModule):
            def configure_optimizers(self):
                return CountingHybridAdamW(self.param_groups(), lr=self.lr, eight_bit="none", skip_nonfinite=False,
                                           updates_in_backward=flag)

        torch.manual_seed(0)
        module = Module(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
        trainer = L.Trainer(strategy=LazyTrainStrategy(policy=plan_in_backward()), accelerator="cpu", max_steps=6,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=2,
                            limit_val_batches=1)
        g = torch.Generator().manual_seed(3)
        data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(6)]
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None),
                    val_dataloaders=torch.utils.data.DataLoader(data[:1], batch_size=None))
        return [p.detach().clone() for p in module.parameters()], trainer.optimizers[0]

    want, _ = run(False)
    got, opt = run(True)
    assert opt.in_backward  # the updates did run in the backward
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_own_optimizer_step_keeps_the_updates_for_the_step(caplog):
    """A LightningModule that overrides optimizer_step may run the closure without stepping (Lightning's
    documented pattern): no update may start in that backward. Said once; trains as without the option."""
    from lightning_lazytrain.lit_module import CausalLMModule

    def run(flag):
        class Module(CausalLMModule):
            def configure_optimizers(self):
                return CountingHybridAdamW(self.param_groups(), lr=self.lr, eight_bit="none", skip_nonfinite=False,
                                           updates_in_backward=flag)

            def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
                if batch_idx % 2:  # every other batch: the closure only (no step)
                    optimizer_closure()
                else:
                    optimizer.step(closure=optimizer_closure)

        torch.manual_seed(0)
        module = Module(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
        trainer = L.Trainer(strategy=LazyTrainStrategy(policy=plan_in_backward()), accelerator="cpu", max_steps=3,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_train_batches=6)
        g = torch.Generator().manual_seed(3)
        data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(6)]
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        return [p.detach().clone() for p in module.parameters()], trainer.optimizers[0]

    want, _ = run(False)
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain"):
        got, opt = run(True)
    assert "overrides optimizer_step" in caplog.text and opt.in_backward == []
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_post_accumulate_hook_registered_during_the_fit_keeps_it_exact():
    """The hook edits a block's gradients when the micro-batch ends, after a hand-over would have used
    them: from the step it exists in, the updates wait for the step."""

    def halve(p):
        p.grad.mul_(0.5)

    class AddHook(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 3:
                for p in module.model.layers[2].parameters():
                    p.register_post_accumulate_grad_hook(halve)

    want, want_params, _ = fit_tiny(False, callbacks=[AddHook()], steps=5)
    got, got_params, opt = fit_tiny(True, callbacks=[AddHook()], steps=5)
    assert opt.in_backward == ["head", 3, 2, 1] * 2  # steps 2 and 3 (index 1, 2); none once the hook exists
    assert got == want and all(torch.equal(a, b) for a, b in zip(got_params, want_params))


def test_a_one_rank_choice_does_not_follow_a_plan_to_several_ranks():
    import dataclasses

    from lightning_lazytrain.planner import recompute_all

    s = dataclasses.replace(recompute_all(4), updates_in_backward=True)
    for mode in ("replicate", "replicate_overlap", "shard"):
        assert not s.in_mode(mode).updates_in_backward
    assert s.in_mode("none") is s
