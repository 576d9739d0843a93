"""Review 19: user code that touches parameters INSIDE an open micro-batch (after the model's forward, before its
backward), compared with ``strategy="auto"`` bit for bit (fp32, CPU; losses and final state dicts).

Probed (Trainer with manual and automatic optimization, and Fabric loops; ``LazyTrainStrategy(policy="megatrain")``
and ``"recompute_all"``):

* WGAN weight clipping after the critic's step inside the micro-batch (``p.data.clamp_`` through
  ``self.critic.parameters()``);
* in-place edits of a non-block weight through the module (``self.head.weight.mul_(0.5)``, a target network's
  ``lerp_`` towards the online head, an automatic ``training_step``'s clamp after the forward, a ``mul_`` in
  ``on_before_backward``); reads of ``.weight`` / ``.grad`` there;
* a critic stepped and zeroed (``set_to_none`` True and False) between (and inside) the micro-batches of a manually
  accumulated generator step;
* an optimizer that steps BLOCK weights between a forward and its backward, and ``.data`` edits of block weights
  there;
* ``toggle_optimizer`` / ``untoggle_optimizer`` and an lr scheduler step inside the micro-batch;
* bf16-true with ``fp32_masters=True`` (clipping; the refreshed copy in an accumulated step's second micro-batch).

Fixed the same day (the tests' docstrings keep the numbers): edits of the bound non-block copies reach their masters
(Note: [an edit of a bound copy] in engine/bound_edits.py), each copy has its own version counter (Note: [one version
counter per copy] in engine/param_binding.py), and a backward after a step that changed a block's weights is refused
as under ``auto`` (Note: [a step inside a micro-batch] in core/microbatches.py). Still OPEN (README limits): ``.grad``
read through the module inside the micro-batch, ``.data`` edits of block weights there.

Found (each was an ``xfail(strict=True)`` test below, with the numbers):

* Inside a micro-batch the module holds the bound non-block device copies (engine/param_binding.py), and nothing
  writes an edit made through the module back to the host master when the bind ends: WGAN clipping, a head
  ``mul_``, a target-network ``lerp_``, an automatic ``training_step``'s clamp after the forward are used by the
  rest of that micro-batch and then silently lost (Trainer and Fabric; fp32 and fp32 masters alike).
* ``.grad`` read through the module inside the micro-batch is the bound copy's device gradient buffer: zeros where
  ``auto`` shows ``None`` or the gradients accumulated so far (manual accumulation; Lightning's automatic loop,
  whose ``zero_grad`` runs after ``training_step``; Fabric).
* An in-place edit (under ``no_grad``) of a non-block weight the loss does not even use, in ``on_before_backward``,
  bumps the version counter of the one flat buffer all non-block copies view: the backward is refused with
  "modified by an inplace operation" on another weight (the head's), where ``auto`` trains.
* An optimizer stepping block weights between a forward and its backward: ``auto`` refuses the backward ("modified
  by an inplace operation"); lazytrain trains on silently (and megatrain and recompute_all differ from each other).
  ``.data`` edits of block weights there (auto: the backward uses the edited saved weights) differ silently too.

Passing (kept as regression tests): the critic stepped/zeroed between or inside the micro-batches of an accumulated
step (no gradient leaks, both ``set_to_none``), toggle/untoggle and a scheduler step inside, the weight read inside
(no edit) equal to the master, the Fabric accumulated loop, and under bf16-true + fp32 masters the refreshed copy in
a second micro-batch equal to ``master.to(bfloat16)``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from test_conformance import Net, assert_same_model, fit
from test_step_inside_microbatch import CriticInside

from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy
from lightning_lazytrain.strategy import LazyTrainStrategy

POLICIES = ["megatrain", "recompute_all"]
CLIP = 0.05  # the critic's init (Linear(16, 1), up to 0.25) is clipped from the first step


def _gen(module):
    return [p for n, p in module.named_parameters() if not n.startswith("critic")]


def _grad_max(g):
    return None if g is None else g.abs().max().item()


# ---- 1. WGAN weight clipping inside the micro-batch -----------------------------------------------------------

class WGANClip(CriticInside):
    """Forward, the critic's step, its weights clipped through the module, the critic used, the backward."""

    def after_critic_step(self):
        for p in self.critic.parameters():
            p.data.clamp_(-CLIP, CLIP)


@pytest.mark.parametrize("policy", POLICIES)
def test_wgan_clipping_inside_the_micro_batch_reaches_the_master(policy):
    """Was OPEN (the clamp reaches only the bound device copy, not the master: after 4 steps critic.weight max |w|
    0.24637 (auto 0.05), max diff 0.19637; loss 2: 0.063688062 vs auto 0.063549176); fixed: Note: [an edit of a bound
    copy]."""
    want_model, want = fit("auto", WGANClip(), steps=4)
    got_model, got = fit(LazyTrainStrategy(policy=policy), WGANClip(), steps=4)
    assert got_model.critic.weight.abs().max() <= CLIP
    assert got == want
    assert_same_model(got_model, want_model)


def test_wgan_clipping_inside_the_micro_batch_reaches_fp32_masters():
    """Was OPEN (fp32 masters never clipped: critic.weight max |w| 0.24595 after the fit (auto bf16-true: 0.05005));
    fixed: Note: [an edit of a bound copy]."""
    want_model, _ = fit("auto", WGANClip(), steps=4, precision="bf16-true")
    assert want_model.critic.weight.abs().max().item() <= CLIP * 1.01
    got_model, _ = fit(LazyTrainStrategy(policy="megatrain", fp32_masters=True), WGANClip(), steps=4,
                       precision="bf16-true")
    assert got_model.critic.weight.abs().max().item() <= CLIP * 1.01


# ---- 2. edits and reads of a non-block weight through the module ------------------------------------------------

class HeadInside(Net):
    """Manual accumulation over two batches; after the forward, ``head.weight`` and its ``.grad`` are recorded and,
    with ``edit``, the head's weight is halved through the module before its use."""

    def __init__(self, edit):
        super().__init__()
        self.automatic_optimization = False
        self.edit = edit
        self.weights: list[torch.Tensor] = []
        self.grads: list[torch.Tensor | None] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        h = self(batch)
        self.weights.append(self.head.weight.detach().cpu().clone())
        g = self.head.weight.grad
        self.grads.append(None if g is None else g.detach().cpu().clone())
        if self.edit:
            with torch.no_grad():
                self.head.weight.mul_(0.5)
        loss = self.head(h).square().mean()
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_head_edit_inside_the_micro_batch_reaches_the_master(policy):
    """Was OPEN (head.weight.mul_(0.5) inside the micro-batch is lost at the bind's end: loss 2: 0.146037445 vs auto
    0.034086996, head.weight max diff 0.23847 after 2 steps); fixed: Note: [an edit of a bound copy]."""
    want_model, want = fit("auto", HeadInside(edit=True), steps=2)
    got_model, got = fit(LazyTrainStrategy(policy=policy), HeadInside(edit=True), steps=2)
    assert got == want
    assert_same_model(got_model, want_model)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_weight_read_inside_the_micro_batch_is_the_masters(policy):
    """No edit: training and the weight read through the module after the forward are auto's."""
    want_model, want = fit("auto", HeadInside(edit=False), steps=2)
    got_model, got = fit(LazyTrainStrategy(policy=policy), HeadInside(edit=False), steps=2)
    assert got == want
    assert_same_model(got_model, want_model)
    assert len(got_model.weights) == len(want_model.weights) == 4
    assert all(torch.equal(g, w) for g, w in zip(got_model.weights, want_model.weights))


@pytest.mark.xfail(strict=True, reason="OPEN: .grad read through the module inside the micro-batch is the bound "
                   "copy's zeroed device buffer: max |grad| [0.0, 0.0, 0.0, 0.0] vs auto [None, 0.3937, None, 0.1333] "
                   "(the first micro-batch's accumulated gradient)")
def test_the_grad_read_inside_a_manual_micro_batch_is_the_masters():
    want_model, _ = fit("auto", HeadInside(edit=False), steps=2)
    got_model, _ = fit(LazyTrainStrategy(policy="megatrain"), HeadInside(edit=False), steps=2)
    assert [_grad_max(g) for g in got_model.grads] == [_grad_max(g) for g in want_model.grads]


class TargetLerp(Net):
    """A target network (the critic) moved towards the online head inside the micro-batch, then used."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        h = self(batch)
        with torch.no_grad():
            self.critic.weight.lerp_(self.head.weight, 0.5)
        loss = self.head(h).square().mean() + 0.1 * self.critic(h.detach()).square().mean()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        self.log("train_loss", loss)


def test_a_target_network_update_inside_the_micro_batch_reaches_the_master():
    """Was OPEN (the target's lerp_ inside the micro-batch is lost: loss 2: 0.065745093 vs auto 0.063532844,
    critic.weight max diff 0.40699); fixed: Note: [an edit of a bound copy]."""
    want_model, want = fit("auto", TargetLerp(), steps=3)
    got_model, got = fit(LazyTrainStrategy(policy="megatrain"), TargetLerp(), steps=3)
    assert got == want
    assert_same_model(got_model, want_model)


class AutoEdit(Net):
    """Automatic optimization. ``where="step"``: the head clamped in training_step after the forward, before its use;
    ``"hook"``: the critic (unused by the loss) halved in ``on_before_backward``; ``"read"``: ``head.weight.grad``
    recorded after the forward."""

    def __init__(self, where):
        super().__init__()
        self.where = where
        self.grads: list[float | None] = []

    def training_step(self, batch, batch_idx):
        h = self(batch)
        if self.where == "step":
            with torch.no_grad():
                self.head.weight.clamp_(-CLIP, CLIP)
        if self.where == "read":
            self.grads.append(_grad_max(self.head.weight.grad))
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss

    def on_before_backward(self, loss):
        if self.where == "hook":
            with torch.no_grad():
                self.critic.weight.mul_(0.5)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_automatic_clamp_after_the_forward_reaches_the_master(policy):
    """Was OPEN (automatic training_step's clamp after the forward is lost: loss 2: 0.003036113 vs auto 0.001845489,
    head.weight max diff 0.2164 after 3 steps); fixed: Note: [an edit of a bound copy]."""
    want_model, want = fit("auto", AutoEdit("step"), steps=3)
    got_model, got = fit(LazyTrainStrategy(policy=policy), AutoEdit("step"), steps=3)
    assert got == want
    assert_same_model(got_model, want_model)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_edit_of_an_unused_weight_in_on_before_backward_trains_as_auto(policy):
    """Was OPEN (critic.weight.mul_(0.5) under no_grad in on_before_backward (the critic is not in the loss) bumps the
    version of the flat buffer every non-block copy views: lazytrain's backward raises 'modified by an inplace
    operation' ([16, 1]: the head's saved weight), auto trains); fixed: Note: [one version counter per copy]."""
    want_model, want = fit("auto", AutoEdit("hook"), steps=3)
    got_model, got = fit(LazyTrainStrategy(policy=policy), AutoEdit("hook"), steps=3)
    assert got == want
    assert_same_model(got_model, want_model)


@pytest.mark.xfail(strict=True, reason="OPEN: head.weight.grad read after the forward, accumulate_grad_batches=2: "
                   "max |grad| [0.0, 0.4359, 0.0, 0.5630] vs auto [None, 0.4359, 1.6133, 0.5630] (auto's zero_grad "
                   "runs after training_step: the previous step's gradient; lazytrain: the bound copy's zeros)")
def test_the_grad_read_after_an_automatic_forward_is_the_masters():
    want_model, want = fit("auto", AutoEdit("read"), steps=2, accumulate_grad_batches=2)
    got_model, got = fit(LazyTrainStrategy(policy="megatrain"), AutoEdit("read"), steps=2, accumulate_grad_batches=2)
    assert got == want  # (training itself is the same)
    assert got_model.grads == want_model.grads


# ---- 3. a critic stepped and zeroed between the micro-batches of an accumulated step ---------------------------

class AccumulatedGenerator(Net):
    """Two forwards and manual_backwards per generator step; the critic (SGD with momentum) steps and is zeroed
    between them (``inside``: after the second forward, before its use and backward). ``probe``: after that step,
    whether the critic's weight the module holds is its master in the module's dtype."""

    def __init__(self, set_to_none=True, inside=False, probe=False):
        super().__init__()
        self.automatic_optimization = False
        self.set_to_none, self.inside, self.probe = set_to_none, inside, probe
        self.seen: list[bool] = []

    def _critic_step(self, opt_c):
        opt_c.step()
        opt_c.zero_grad(set_to_none=self.set_to_none)
        if self.probe:
            master = opt_c.optimizer.param_groups[0]["params"][0]
            held = self.critic.weight
            self.seen.append(torch.equal(held.detach().cpu(), master.detach().to(held.dtype)))

    def training_step(self, batch, batch_idx):
        opt_g, opt_c = self.optimizers()
        h1 = self(batch)
        l1 = self.head(h1).square().mean() + 0.1 * self.critic(h1.detach()).square().mean()
        self.manual_backward(l1 / 2)
        if not self.inside:
            self._critic_step(opt_c)
        h2 = self(batch.flip(1))
        if self.inside:
            self._critic_step(opt_c)
        l2 = self.head(h2).square().mean() + 0.1 * self.critic(h2.detach()).square().mean()
        self.manual_backward(l2 / 2)
        opt_g.step()
        opt_g.zero_grad()
        self.log("train_loss", l1 + l2)

    def configure_optimizers(self):
        return (torch.optim.AdamW(_gen(self), lr=1e-2),
                torch.optim.SGD(self.critic.parameters(), lr=0.1, momentum=0.9))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("inside", [False, True], ids=["between", "inside"])
def test_a_critic_stepped_between_accumulated_micro_batches_trains_as_auto(policy, set_to_none, inside):
    want_model, want = fit("auto", AccumulatedGenerator(set_to_none, inside), steps=4)
    got_model, got = fit(LazyTrainStrategy(policy=policy), AccumulatedGenerator(set_to_none, inside), steps=4)
    assert got == want
    assert_same_model(got_model, want_model)


@pytest.mark.parametrize("conversions", ["host", "device"])
def test_the_refreshed_copy_in_a_second_micro_batch_is_the_fp32_master_in_bf16(conversions):
    model = AccumulatedGenerator(inside=True, probe=True)
    fit(LazyTrainStrategy(policy="megatrain", fp32_masters=True, conversions=conversions), model, steps=4,
        precision="bf16-true")
    assert model.seen == [True, True]


# ---- 4. an optimizer stepping BLOCK weights between a forward and its backward ----------------------------------

class BlockStep(Net):
    """Non-block weights under AdamW; the blocks under SGD, stepped (or, with ``data_edit``, scaled through
    ``.data``) after the forward, before the backward."""

    def __init__(self, data_edit=False):
        super().__init__()
        self.automatic_optimization = False
        self.data_edit = data_edit

    def training_step(self, batch, batch_idx):
        opt_o, opt_b = self.optimizers()
        h = self(batch)
        if self.data_edit:
            for p in self.layers.parameters():
                p.data.mul_(0.9)
        else:
            opt_b.step()
            opt_b.zero_grad()
        loss = self.head(h).square().mean()
        self.manual_backward(loss)
        opt_o.step()
        opt_o.zero_grad()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        other = [p for n, p in self.named_parameters() if not n.startswith(("critic", "layers"))]
        return torch.optim.AdamW(other, lr=1e-2), torch.optim.SGD(self.layers.parameters(), lr=0.1)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_step_between_a_forward_and_its_backward_is_refused_as_under_auto(policy):
    """Was OPEN (auto refuses the backward after the block step ('modified by an inplace operation', [16, 16]);
    lazytrain trains on silently (losses [0.256753, 0.369559, 0.269095] megatrain, 0.269015 recompute_all at the
    3rd)); fixed: Note: [a step inside a micro-batch]."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fit("auto", BlockStep(), steps=6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fit(LazyTrainStrategy(policy=policy), BlockStep(), steps=6)


@pytest.mark.xfail(strict=True, reason="OPEN: .data edits of block weights between a forward and its backward (auto: "
                   "the backward uses the edited saved weights): loss 2: 0.313558 megatrain vs auto 0.311332; the "
                   "policies differ from each other at loss 3 (0.226642 / 0.226646 vs auto 0.224080)")
@pytest.mark.parametrize("policy", POLICIES)
def test_a_data_edit_of_block_weights_inside_the_micro_batch_trains_as_auto(policy):
    want_model, want = fit("auto", BlockStep(data_edit=True), steps=6)
    got_model, got = fit(LazyTrainStrategy(policy=policy), BlockStep(data_edit=True), steps=6)
    assert got == want
    assert_same_model(got_model, want_model)


# ---- 5. toggle_optimizer and an lr scheduler step inside the micro-batch ----------------------------------------

class ToggleInside(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_g, opt_c = self.optimizers()
        h = self(batch)
        self.toggle_optimizer(opt_c)
        opt_c.step()
        opt_c.zero_grad()
        self.lr_schedulers().step()
        self.untoggle_optimizer(opt_c)
        self.toggle_optimizer(opt_g)
        loss = self.head(h).square().mean() + 0.1 * self.critic(h.detach()).square().mean()
        self.manual_backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.log("train_loss", loss)

    def configure_optimizers(self):
        opt_c = torch.optim.SGD(self.critic.parameters(), lr=0.1)
        return [torch.optim.AdamW(_gen(self), lr=1e-2), opt_c], [torch.optim.lr_scheduler.StepLR(opt_c, 1, 0.5)]


@pytest.mark.parametrize("policy", POLICIES)
def test_toggle_and_a_scheduler_step_inside_the_micro_batch_train_as_auto(policy):
    want_model, want = fit("auto", ToggleInside(), steps=6)
    got_model, got = fit(LazyTrainStrategy(policy=policy), ToggleInside(), steps=6)
    assert got == want
    assert_same_model(got_model, want_model)


# ---- Fabric equivalents ----------------------------------------------------------------------------------------

def fabric_loop(strategy, pattern, steps=4):
    torch.manual_seed(5)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    net = Net()
    opt_g = torch.optim.AdamW(_gen(net), lr=1e-2)
    opt_c = torch.optim.SGD(net.critic.parameters(), lr=0.1)
    net, opt_g, opt_c = fabric.setup(net, opt_g, opt_c)
    g = torch.Generator().manual_seed(3)
    losses, grads = [], []
    for k in range(steps):
        x = torch.randn(3, 5, 6, generator=g)
        if pattern == "clip":
            h = net(x)
            opt_c.step()
            opt_c.zero_grad()
            for p in net.critic.parameters():
                p.data.clamp_(-CLIP, CLIP)
            loss = net.head(h).square().mean() + 0.1 * net.critic(h.detach()).square().mean()
            fabric.backward(loss)
            opt_g.step()
            opt_g.zero_grad()
        elif pattern == "edit":
            h = net(x)
            grads.append(_grad_max(net.head.weight.grad))
            with torch.no_grad():
                net.head.weight.mul_(0.5)
            loss = net.head(h).square().mean()
            fabric.backward(loss)
            if k % 2 == 1:
                opt_g.step()
                opt_g.zero_grad()
        else:  # "accumulate-<set_to_none>"
            h1 = net(x)
            l1 = net.head(h1).square().mean() + 0.1 * net.critic(h1.detach()).square().mean()
            fabric.backward(l1 / 2)
            h2 = net(x.flip(1))
            opt_c.step()
            opt_c.zero_grad(set_to_none=pattern.endswith("True"))
            l2 = net.head(h2).square().mean() + 0.1 * net.critic(h2.detach()).square().mean()
            fabric.backward(l2 / 2)
            opt_g.step()
            opt_g.zero_grad()
            loss = l1 + l2
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in net.module.named_parameters()}, grads


def _assert_same_fabric(pattern, grads=True):
    want, want_params, want_grads = fabric_loop("auto", pattern)
    got, got_params, got_grads = fabric_loop(LazyTrainFabricStrategy(policy="megatrain"), pattern)
    assert got == want
    assert got_params.keys() == want_params.keys()
    for n in want_params:
        assert torch.equal(got_params[n], want_params[n]), n
    if grads:
        assert got_grads == want_grads


def test_fabric_wgan_clipping_inside_the_micro_batch_reaches_the_master():
    """Was OPEN (Fabric, the clamp after the critic's step inside the micro-batch is lost: loss 2: 0.180046216 vs auto
    0.179954663, critic.weight max diff 0.19658); fixed: Note: [an edit of a bound copy]."""
    _assert_same_fabric("clip")


def test_fabric_head_edit_inside_the_micro_batch_reaches_the_master():
    """Was OPEN (head.weight.mul_(0.5) inside the micro-batch was lost: loss 2: 0.067453414 vs auto 0.025573397);
    fixed: Note: [an edit of a bound copy]."""
    _assert_same_fabric("edit", grads=False)


@pytest.mark.xfail(strict=True, reason="OPEN (a README limit): Fabric, .grad read through the module inside the "
                   "micro-batch is the bound copy's zeroed device buffer ([0.0, 0.0, 0.0, 0.0] vs auto "
                   "[None, 0.3011, None, 0.1060])")
def test_fabric_grad_read_inside_the_micro_batch_is_the_masters():
    _assert_same_fabric("edit")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_fabric_critic_stepped_between_accumulated_micro_batches_trains_as_auto(set_to_none):
    _assert_same_fabric(f"accumulate-{set_to_none}")


# ---- an edit before a backward that updates the head in it (HybridAdamW, updates_in_backward) -----------------

class HalveHead(L.Callback):
    """``on_before_backward``: the LM head's weight (a non-block part the plan updates during the backward) is
    scaled in place through the module."""

    def on_before_backward(self, trainer, pl_module, loss):
        with torch.no_grad():
            pl_module.model.lm_head.weight.mul_(0.99)


def test_an_edit_before_a_backward_that_updates_its_weight_in_the_backward():
    """The edit reaches the master before the backward's update of the head (Note: [an edit of a bound copy]: synced
    before the strategies' backward): merged after it, the edited copy overwrote the update (every element differs
    from the updated master)."""
    from test_updates_in_backward import fit_tiny

    want, want_params, _ = fit_tiny(False, steps=4, callbacks=[HalveHead()])
    got, got_params, opt = fit_tiny(True, steps=4, callbacks=[HalveHead()])
    assert "head" in opt.in_backward  # the head was updated in the backward
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))
