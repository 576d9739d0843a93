"""Review 9: a Parameter tied across blocks through modules of their own (Note: [modules shared by blocks] in
engine/param_store.py, commit b63ef03) against ``strategy="auto"``: bit for bit in fp32 on CPU (within bf16's
tolerance for bf16-true). Checkpoint save + resume, frozen / thawed tied weights, 8-bit states, the plan
policies and zoo schedules, the updates in the backward, accumulation with clipping, a validation loop, Zamba2.
Found (2026-12-05) and fixed: a tensor hook on a weight several blocks use fired once per block on its share; a
weight held by a module shared by blocks and by a block's own module was refused."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from test_executor import SCHEDULES as EXEC_SCHEDULES
from test_review_clip_manual import LAYERS, MasterNet, assert_same, data, fit, lazy
from test_shared_modules import TiedNet, zamba2_run
from test_updates_in_backward import plan_file
from torch import nn

from lightning_lazytrain.planner import recompute_all
from lightning_lazytrain.planner.policies import min_memory
from lightning_lazytrain.strategy import LazyTrainStrategy


def tied(net):
    return net.layers[1].mix.weight


# ---- checkpoints --------------------------------------------------------------------------------------------------
def _fit_ckpt(strategy, module, *, steps, root, ckpt_path=None, save=None):
    torch.manual_seed(11)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(root))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data(2), batch_size=None), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return {k: v.clone() for k, v in module.state_dict().items()}


def _flat_state(path):
    import os
    if os.path.isdir(path):
        from lightning_lazytrain.adapters.checkpoint_io import VerifiedCheckpointIO
        ckpt = VerifiedCheckpointIO().load_checkpoint(path)
    else:
        ckpt = torch.load(path, weights_only=False)
    return ckpt["state_dict"]


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_checkpoint_save_and_resume_of_a_tied_weight(tmp_path, fmt):
    """2 steps, save, resume to 4 (an epoch is 2 batches): the resumed run equals auto's resumed run bit for bit;
    the saved state_dict holds auto's keys and values."""
    def strat():
        return LazyTrainStrategy(policy=lazy("pipelined").policy, checkpoint_format=fmt)

    ck_l, ck_a = str(tmp_path / "lazy.ckpt"), str(tmp_path / "auto.ckpt")
    _fit_ckpt(strat(), TiedNet(), steps=2, root=tmp_path / "l", save=ck_l)
    _fit_ckpt("auto", TiedNet(), steps=2, root=tmp_path / "a", save=ck_a)
    saved_l, saved_a = _flat_state(ck_l), _flat_state(ck_a)
    assert saved_l.keys() == saved_a.keys()
    assert [k for k in saved_a if not torch.equal(saved_l[k], saved_a[k])] == []
    resumed = _fit_ckpt(strat(), TiedNet(), steps=4, root=tmp_path / "l2", ckpt_path=ck_l)
    resumed_auto = _fit_ckpt("auto", TiedNet(), steps=4, root=tmp_path / "a2", ckpt_path=ck_a)
    assert resumed.keys() == resumed_auto.keys()
    assert [k for k in resumed_auto if not torch.equal(resumed[k], resumed_auto[k])] == []
    assert torch.equal(resumed["layers.1.mix.weight"], resumed["layers.3.mix.weight"])


# ---- frozen, thawed ---------------------------------------------------------------------------------------------
class FrozenTiedNet(TiedNet):
    def __init__(self, **kw):
        super().__init__(**kw)
        tied(self).requires_grad_(False)


class Thaw(L.Callback):
    def __init__(self, to=True):
        self.to = to

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 2:
            tied(module).requires_grad_(self.to)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_a_frozen_tied_weight_thawed_mid_run(plan):
    kw = {"steps": 4, "gradient_clip_val": 0.05}
    got = fit(lazy(plan), FrozenTiedNet(), callbacks=[Thaw()], **kw)
    want = fit("auto", FrozenTiedNet(), callbacks=[Thaw()], **kw)
    assert_same(got, want)
    assert not torch.equal(got[1]["layers.1.mix.weight"], FrozenTiedNet().layers[1].mix.weight.detach())


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_a_trained_tied_weight_frozen_mid_run(plan):
    kw = {"steps": 4, "gradient_clip_val": 0.05}
    assert_same(fit(lazy(plan), TiedNet(), callbacks=[Thaw(False)], **kw),
                fit("auto", TiedNet(), callbacks=[Thaw(False)], **kw))


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_a_frozen_tied_weight(plan):
    got = fit(lazy(plan), FrozenTiedNet(), steps=3, accum=2)
    assert_same(got, fit("auto", FrozenTiedNet(), steps=3, accum=2))
    assert torch.equal(got[1]["layers.3.mix.weight"], FrozenTiedNet().layers[1].mix.weight.detach())


# ---- three blocks, only the middle one trains --------------------------------------------------------------------
class ThreeTiedNet(TiedNet):
    """mix.weight tied in blocks 0, 1, 2; every parameter of blocks 0 and 2 and the embedding frozen, so only
    the middle block (and the tied weight, the head) train; ``tie_frozen``: the tied weight frozen too."""

    def __init__(self, tie_frozen=False, **kw):
        super().__init__(**kw)
        for i in (0, 2):
            self.layers[i].mix.weight = self.layers[1].mix.weight
        for i in (0, 2):
            self.layers[i].lin.requires_grad_(False)
        self.emb.requires_grad_(False)
        self.layers[1].mix.weight.requires_grad_(not tie_frozen)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("tie_frozen", [False, True])
def test_three_blocks_tied_only_the_middle_trains(plan, tie_frozen):
    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05}
    assert_same(fit(lazy(plan), ThreeTiedNet(tie_frozen), **kw), fit("auto", ThreeTiedNet(tie_frozen), **kw))


# ---- optimizer variants ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_a_tied_weight_with_8_bit_states(plan):
    pytest.importorskip("bitsandbytes")
    opt = {"eight_bit": "all", "min_8bit_numel": 256}
    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05}
    got = fit(lazy(plan), _tied_with(opt), **kw)
    assert_same(got, fit("auto", _tied_with(opt), **kw))
    assert any(got[2].record.pipelined) == (plan == "pipelined")
    assert 8 in set(got[2].optimizers[0].assignment.values())


def _tied_with(opt_kw, all_blocks=False):
    net = TiedNet(all_blocks)
    net.opt_kw = opt_kw
    return net


class TiedInBlockGroup(TiedNet):
    """HybridAdamW grouped naively per block (each parameter once): the tied weight in block 1's layer."""

    def groups(self):
        seen: set[int] = set()
        out = [{"params": [p for n, p in self.named_parameters() if not n.startswith("layers.")], "layer": "rest"}]
        for i, b in enumerate(self.layers):
            ps = [p for p in b.parameters() if id(p) not in seen]
            seen |= {id(p) for p in ps}
            out.append({"params": ps, "layer": i})
        return out


class TiedOwnLayer(TiedNet):
    """The tied weight in an optimizer layer of its own ("tied", after the head's): a non-block part of its own."""

    def groups(self):
        t = tied(self)
        gs = super().groups()
        gs[0]["params"] = [p for p in gs[0]["params"] if p is not t]
        return gs + [{"params": [t], "layer": "tied"}]


def plan_in_backward(base=None):
    return plan_file(dataclasses.replace(base or recompute_all(LAYERS), updates_in_backward=True,
                                         policy="review9-in-backward"))


@pytest.mark.parametrize("cls", [TiedNet, TiedInBlockGroup, TiedOwnLayer])
def test_updates_in_backward(cls):
    opt = {"updates_in_backward": True, "skip_nonfinite": False}
    kw = {"steps": 3}

    def net():
        n = cls()
        n.opt_kw = opt
        return n

    assert_same(fit(LazyTrainStrategy(policy=plan_in_backward()), net(), **kw), fit("auto", net(), **kw))


@pytest.mark.parametrize("cls", [TiedInBlockGroup, TiedOwnLayer])
@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_other_optimizer_groupings(cls, plan):
    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05}
    assert_same(fit(lazy(plan), cls(), **kw), fit("auto", cls(), **kw))


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("accum, algo", [(3, "norm"), (2, "value")])
def test_accumulation_with_clipping(plan, accum, algo):
    kw = {"steps": 2, "accum": accum, "gradient_clip_val": 0.05 if algo == "norm" else 0.002,
          "gradient_clip_algorithm": algo}
    assert_same(fit(lazy(plan), TiedNet(all_blocks=True), **kw), fit("auto", TiedNet(all_blocks=True), **kw))


# ---- policies and schedules ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["recompute_all", "megatrain", "min_memory", "offloaded_internals", "partial_keep",
                                    "cpu_homes", "kept_internals_resident"])
def test_policies_and_schedules(policy):
    if policy in ("recompute_all", "megatrain"):
        strategy = LazyTrainStrategy(policy=policy)
    elif policy == "min_memory":
        strategy = LazyTrainStrategy(policy=plan_file(min_memory(LAYERS)))
    else:
        strategy = LazyTrainStrategy(policy=plan_file(EXEC_SCHEDULES[policy]))
    kw = {"steps": 3, "accum": 2}
    assert_same(fit(strategy, TiedNet(opt="adamw"), **kw), fit("auto", TiedNet(opt="adamw"), **kw))


# ---- precision ------------------------------------------------------------------------------------------------------
class TiedMasterNet(MasterNet):
    def __init__(self):
        super().__init__()
        self.layers = TiedNet().layers

    groups = TiedNet.groups


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_bf16_true_fp32_masters(plan):
    kw = {"accum": 2, "gradient_clip_val": 0.05, "precision": "bf16-true", "steps": 3}
    strategy = LazyTrainStrategy(policy=lazy(plan).policy, fp32_masters=True)
    got_losses, got_state, _ = fit(strategy, TiedNet(), **kw)
    ref = TiedMasterNet()
    want_losses, _, _ = fit("auto", ref, **kw)
    assert got_losses == want_losses
    master = {id(p): m for p, m in ref.pairs}
    for name, p in ref.named_parameters(remove_duplicate=False):
        assert got_state[name].dtype == torch.float32 and torch.equal(got_state[name], master[id(p)]), name
    plain_losses, plain_state, _ = fit("auto", TiedNet(), **kw)
    assert max(abs(a - b) for a, b in zip(got_losses, plain_losses)) < 2e-2
    for name, value in got_state.items():
        torch.testing.assert_close(value, plain_state[name].float(), atol=3e-2, rtol=0)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_bf16_true(plan):
    kw = {"accum": 2, "gradient_clip_val": 0.05, "precision": "bf16-true", "steps": 3}
    assert_same(fit(lazy(plan), TiedNet(), **kw), fit("auto", TiedNet(), **kw))


# ---- validation between steps --------------------------------------------------------------------------------------
class ValTiedNet(TiedNet):
    def __init__(self):
        super().__init__()
        self.val = []

    def validation_step(self, batch, batch_idx):
        loss = self.head(self(batch)).square().mean()
        self.val.append(loss.item())
        return loss


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_validation_between_steps(plan):
    def run(strategy):
        m = ValTiedNet()
        torch.manual_seed(11)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=1, limit_val_batches=2, val_check_interval=1,
                            check_val_every_n_epoch=None, gradient_clip_val=0.05)
        dl = torch.utils.data.DataLoader(data(4), batch_size=None)
        trainer.fit(m, train_dataloaders=dl, val_dataloaders=torch.utils.data.DataLoader(data(2, seed=5),
                                                                                          batch_size=None))
        return m.val, {k: v.clone() for k, v in m.state_dict().items()}

    (vg, sg), (vw, sw) = run(lazy(plan)), run("auto")
    assert len(vw) == 9 and vg == vw  # sanity batch + 4 validations of 2
    assert [k for k in sw if not torch.equal(sg[k], sw[k])] == []


# ---- Zamba2 --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, use_cache", [("keep_all", False), ("partial_keep", False), ("min_memory", False),
                                               ("recompute_all", None), ("keep_all", None)])
def test_zamba2(policy, use_cache):
    if policy == "partial_keep":
        from test_hf_matrix import SCHEDULES
        policy = plan_file(SCHEDULES["partial_keep"])
    elif policy == "min_memory":
        policy = plan_file(min_memory(LAYERS))
    (lg, sg), (lw, sw) = zamba2_run(LazyTrainStrategy(policy=policy), use_cache), zamba2_run("auto", use_cache)
    assert lg == lw
    assert sg.keys() == sw.keys()
    assert [k for k in sw if not torch.equal(sg[k], sw[k])] == []


# ---- hooks and reads of the tied weight -----------------------------------------------------------------------------
class HookedTiedNet(TiedNet):
    """A clamping tensor hook (nonlinear: partial gradients clamped apart differ from their clamped sum) and a
    post-accumulate hook on the tied weight, each recording what it saw."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.seen = kind, []
        t = tied(self)
        if kind == "tensor":
            t.register_hook(self._clamp)
        else:
            t.register_post_accumulate_grad_hook(lambda p: self.seen.append(p.grad.detach().clone()))

    def _clamp(self, g):
        self.seen.append(g.detach().clone())
        return g.clamp(-1e-3, 1e-3)


@pytest.mark.parametrize("kind", ["tensor", "post"])
@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_gradient_hooks_on_the_tied_weight(kind, plan):
    """Under auto each hook fires once per backward (6 times), the tensor hook on the sum of both uses. The tensor
    hook had fired once per block on its share (12 times; a clamp then changed the training): it now runs once
    the backward is over (``ParamStore.run_shared_tensor_hooks``)."""
    got_m, want_m = HookedTiedNet(kind), HookedTiedNet(kind)
    got = fit(lazy(plan), got_m, steps=3, accum=2)
    want = fit("auto", want_m, steps=3, accum=2)
    assert len(got_m.seen) == len(want_m.seen) == 6
    assert all(torch.equal(a, b) for a, b in zip(got_m.seen, want_m.seen))
    assert_same(got, want)


class PenaltyTiedNet(TiedNet):
    """training_step adds a penalty on the tied weight itself (a use outside the blocks)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-2 * tied(self).square().sum()


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_a_penalty_on_the_tied_weight_in_training_step(plan):
    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05}
    assert_same(fit(lazy(plan), PenaltyTiedNet(), **kw), fit("auto", PenaltyTiedNet(), **kw))


class GradsSeen(L.Callback):
    """The tied weight's gradient at on_before_optimizer_step; whether both sites hold one Parameter."""

    def __init__(self):
        self.grads, self.same = [], []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.grads.append(tied(module).grad.detach().clone())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.same.append(module.layers[1].mix.weight is module.layers[3].mix.weight)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_the_tied_gradient_before_the_step_and_the_tie_kept(plan):
    g, w = GradsSeen(), GradsSeen()
    got = fit(lazy(plan), TiedNet(), callbacks=[g], steps=3, accum=2)
    assert_same(got, fit("auto", TiedNet(), callbacks=[w], steps=3, accum=2))
    assert len(g.grads) == len(w.grads) == 3 and all(torch.equal(a, b) for a, b in zip(g.grads, w.grads))
    assert g.same == [True] * 6
    m = got[2].lightning_module
    assert m.layers[1].mix.weight is m.layers[3].mix.weight
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in TiedNet().named_parameters()]


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_checkpoints_saved_during_the_fit(tmp_path, plan):
    """ModelCheckpoint after every step: each file's state_dict and optimizer state equal auto's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(strategy, d):
        cb = ModelCheckpoint(dirpath=str(d), every_n_train_steps=1, save_top_k=-1, filename="{step}")
        torch.manual_seed(11)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, logger=False, callbacks=[cb],
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(TiedNet(), train_dataloaders=torch.utils.data.DataLoader(data(3), batch_size=None))
        return sorted(p.name for p in d.iterdir())

    strat = LazyTrainStrategy(policy=lazy(plan).policy, checkpoint_format="full")
    names = run(strat, tmp_path / "l")
    assert names == run("auto", tmp_path / "a") and len(names) == 3
    for n in names:
        sl, sa = _flat_state(str(tmp_path / "l" / n)), _flat_state(str(tmp_path / "a" / n))
        assert sl.keys() == sa.keys() and [k for k in sa if not torch.equal(sl[k], sa[k])] == [], n


# ---- a tie and a module shared by blocks together ---------------------------------------------------------------------
class SharedAndTiedBlock(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.shared = shared
        self.mix = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.lin(x) + self.shared(torch.sin(x)) + self.mix(torch.cos(x)))


class SharedAndTiedNet(TiedNet):
    """Blocks 0 and 1 call one shared Linear; block 3's own ``mix`` holds that Linear's weight (``own_first``:
    blocks 2 and 3 share it, block 0's own ``mix`` holds it)."""

    def __init__(self, own_first=False):
        super().__init__()
        shared = nn.Linear(16, 16, bias=False)
        at = (2, 3) if own_first else (0, 1)
        self.layers = nn.ModuleList(SharedAndTiedBlock(shared if i in at else nn.Linear(16, 16, bias=False))
                                    for i in range(LAYERS))
        self.layers[0 if own_first else 3].mix.weight = shared.weight
        self.shared_weight = [shared.weight]  # (a list: not registered again)

    def groups(self):
        rest_ids = {id(self.shared_weight[0])}
        rest = [p for n, p in self.named_parameters() if not n.startswith("layers.") or id(p) in rest_ids]
        return [{"params": rest, "layer": "rest"}] + [
            {"params": [p for p in b.parameters() if id(p) not in rest_ids], "layer": i}
            for i, b in enumerate(self.layers)]


@pytest.mark.parametrize("own_first", [False, True])
def test_a_module_shared_by_blocks_whose_weight_is_tied_into_another_block(own_first):
    """Was refused as tied 'outside the block stack' (the shared module's site counted as a non-block one); every
    site is inside the stack: it joins the non-block group."""
    kw = {"steps": 3, "accum": 2}
    assert_same(fit(lazy("serial"), SharedAndTiedNet(own_first), **kw), fit("auto", SharedAndTiedNet(own_first), **kw))


# ---- manual optimization --------------------------------------------------------------------------------------------
class ManualTiedNet(TiedNet):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.head(self(batch)).square().mean()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_manual_optimization(plan):
    assert_same(fit(lazy(plan), ManualTiedNet(), steps=3), fit("auto", ManualTiedNet(), steps=3))


@pytest.mark.parametrize("policy", ["milp", "megatrain"])
def test_zamba2_accumulation_and_clipping(policy):
    kw = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    (lg, sg), (lw, sw) = (zamba2_run(LazyTrainStrategy(policy=policy), None, **kw),
                          zamba2_run("auto", None, **kw))
    assert lg == lw and len(lw) == 4
    assert sg.keys() == sw.keys()
    assert [k for k in sw if not torch.equal(sg[k], sw[k])] == []
