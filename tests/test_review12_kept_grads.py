"""Review 12: ``.grad`` tensors kept or read by reference (Note: [a kept gradient] in engine/kept_grads.py), lazytrain
against ``strategy="auto"``, fp32 on CPU, bit for bit (torch.equal); and what the change costs an ordinary loop
(``kept_grads_moved`` must stay 0 where no user keeps a gradient).

Trainer probes reuse tests/test_kept_grads.py's ``Module``/``fit``; Fabric probes reuse tests/test_review11_fabric.py's
``run``/``check``.

Defects found: 6, all FIXED. A kept ``p.grad.detach()`` / ``p.grad.view(-1)`` (another tensor over the same memory,
not recorded): the references to each group's host gradient are counted (a storage of its own) and a group whose
memory others still hold gets a new host gradient when its gradients begin afresh. The others by moving each kept view out per parameter, before its range is written
(``HandedGrads.release``: ``set_`` onto a copy), instead of renewing a group's buffer when all of its ``.grad`` were
None: a trainable weight left out of the optimizer (its group never "began afresh"); one parameter's gradient taken
out (``p.grad = None``) while the others are zeroed in place; an L2 penalty over the parameters (the outside use's
``.grad`` made the group look begun); and, by the same ``set_``, a user tensor assigned as ``.grad`` before the
backward (now the gradient is added into it, as under auto) and a weight thawed mid-run under
``zero_grad(set_to_none=False)`` (the live ``.grad`` objects follow the grown buffer). The training itself (final
weights) matched auto in each.

Passing probes (regression): updates in the backward (early non-block parts); clipping (Trainer, kept tensors hold
the clipped values; ``fabric.clip_gradients`` read and kept); ``.grad`` kept after each accumulated backward;
``set_to_none`` switching False -> True mid-run; only some grads kept (only they are moved); manual
optimization; mixed / megatrain / milp / pipelined plans; tied embeddings; ``zero_grad`` first with HybridAdamW
pipelined; thawing (set_to_none) a partly or wholly frozen block; two forwards per backward (the ad-hoc path);
ordinary loops (Trainer with LearningRateMonitor, ModelCheckpoint(save_last), a grad-norm logger and validation,
under keep_all / recompute_all / megatrain / milp / pipelined / in_backward, with accumulation and clipping; Fabric
with clip_gradients and a scheduler; the optimizer-in-backward recipe of post-accumulate-grad hooks) move nothing;
grads kept inside those hooks keep their values. Cost documented: a loop-local ``grads = [p.grad ...]`` list
that lives until the next iteration rebinds it is a kept gradient (each tensor moved, a copy, per later step)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_lazytrain.strategy import LazyTrainStrategy
from test_kept_grads import STEPS, Module, assert_kept_same, fit, module, plan
from test_review11_fabric import DATA, check, raw_module

transformers = pytest.importorskip("transformers")


# =====================================================================================================================
# Trainer probes
# =====================================================================================================================
def test_kept_grads_with_updates_in_backward():
    """The non-block group's head part goes early (Note: [early non-block parts]) with the updates in the backward:
    its send is a part > 0 (each kept view is moved out before its own range is written)."""
    want = fit("auto", module(keep=True, hybrid=True, in_backward=True))
    got = fit(LazyTrainStrategy(policy=plan("in_backward")), module(keep=True, hybrid=True, in_backward=True))
    assert_kept_same(got, want)


@pytest.mark.parametrize("kind,hybrid,algo", [("recompute_all", False, "norm"), ("pipelined", True, "norm"),
                                              ("in_backward", True, "norm"), ("recompute_all", False, "value")])
def test_kept_grads_hold_the_clipped_values(kind, hybrid, algo):
    """Under auto ``clip_grad_norm_`` / ``clip_grad_value_`` change ``.grad`` in place: a kept tensor holds its
    step's clipped gradient."""
    ib = kind == "in_backward"
    clip = dict(gradient_clip_val=0.05 if algo == "norm" else 1e-3, gradient_clip_algorithm=algo)
    want = fit("auto", module(keep=True, hybrid=hybrid, in_backward=ib), **clip)
    got = fit(LazyTrainStrategy(policy=plan(kind)), module(keep=True, hybrid=hybrid, in_backward=ib), **clip)
    assert_kept_same(got, want)


class AfterEachBackward(Module):
    """Keeps ``.grad`` by reference after every micro-batch's backward (accumulation: under auto the kept tensor of
    the first micro-batch is accumulated into in place, so it ends with the step's sum)."""

    def on_after_backward(self):
        self.kept.append({n: p.grad for n, p in self.named_parameters() if p.grad is not None})

    def on_before_optimizer_step(self, optimizer):
        pass


def test_kept_after_each_accumulated_backward():
    torch.manual_seed(0)
    want = fit("auto", AfterEachBackward(keep=True, hybrid=False), accumulate_grad_batches=2)
    torch.manual_seed(0)
    got = fit(LazyTrainStrategy(policy="recompute_all"), AfterEachBackward(keep=True, hybrid=False),
              accumulate_grad_batches=2)
    assert len(got.kept) == len(want.kept) == 2 * STEPS
    for k, (a, b) in enumerate(zip(got.kept, want.kept)):
        assert a.keys() == b.keys()
        bad = [n for n in a if not torch.equal(a[n], b[n])]
        assert not bad, f"micro-batch {k}: {bad[:4]}"


class SwitchToNone(Module):
    """``zero_grad(set_to_none=False)`` for the first two steps, then ``set_to_none=True``."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=batch_idx >= 2)


def test_kept_grads_when_set_to_none_switches_mid_run():
    torch.manual_seed(0)
    want = fit("auto", SwitchToNone(keep=True, hybrid=False))
    torch.manual_seed(0)
    got = fit(LazyTrainStrategy(policy="recompute_all"), SwitchToNone(keep=True, hybrid=False))
    assert_kept_same(got, want)


KEEP_SOME = ("model.layers.0.q_proj.weight", "model.lm_head.weight")


class KeepSome(Module):
    def on_before_optimizer_step(self, optimizer):
        named = dict(self.named_parameters())
        self.kept.append({n: named[n].grad for n in KEEP_SOME if named[n].grad is not None})


def test_only_some_grads_kept_moves_only_them():
    torch.manual_seed(0)
    want = fit("auto", KeepSome(keep=True, hybrid=False))
    torch.manual_seed(0)
    got = fit(LazyTrainStrategy(policy="recompute_all"), KeepSome(keep=True, hybrid=False))
    assert len(got.kept[0]) == 2
    assert_kept_same(got, want)
    assert got.moved == (STEPS - 1) * 2  # the two kept tensors, once per later step


class Manual(Module):
    """Manual optimization: ``zero_grad`` (set_to_none) at the step's start, ``.grad`` kept after the backward."""

    def __init__(self, **kw):
        super().__init__(keep=False, **kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = self._nll(batch)
        self.manual_backward(loss)
        self.kept.append({n: p.grad for n, p in self.named_parameters() if p.grad is not None})
        opt.step()
        return loss


def test_kept_grads_under_manual_optimization():
    torch.manual_seed(0)
    want = fit("auto", Manual(hybrid=False))
    torch.manual_seed(0)
    got = fit(LazyTrainStrategy(policy="recompute_all"), Manual(hybrid=False))
    assert_kept_same(got, want)


# --- an ordinary loop with common callbacks moves nothing --------------------------------------------------------------
class GradNormLogger(Callback):
    """Reads every ``.grad`` (norms, logged) without keeping one."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning.pytorch.utilities import grad_norm

        pl_module.log_dict(grad_norm(pl_module, norm_type=2))
        total = torch.stack([p.grad.norm() for p in pl_module.parameters() if p.grad is not None]).norm()
        pl_module.log("grad_total", total)


class WithVal(Module):
    def val_dataloader(self):
        g = torch.Generator().manual_seed(9)
        return torch.utils.data.DataLoader([torch.randint(0, 256, (4, 33), generator=g)], batch_size=None)


@pytest.mark.parametrize("policy,hybrid,accum,clip", [
    ("keep_all", False, 1, None), ("recompute_all", False, 1, None), ("megatrain", False, 1, None),
    ("milp", False, 1, None), ("megatrain", False, 2, 0.5), ("milp", False, 2, 0.5),
    ("pipelined", True, 1, 0.5), ("in_backward", True, 2, None),
])
def test_ordinary_loop_with_callbacks_moves_nothing(policy, hybrid, accum, clip, tmp_path):
    """LearningRateMonitor, ModelCheckpoint(save_last), a grad-norm logger reading every ``.grad``, validation."""
    torch.manual_seed(0)
    m = WithVal(keep=False, hybrid=hybrid, in_backward=policy == "in_backward")
    trainer = L.Trainer(strategy=LazyTrainStrategy(policy=plan(policy)), accelerator="cpu", max_steps=STEPS,
                        accumulate_grad_batches=accum, gradient_clip_val=clip,
                        logger=CSVLogger(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, val_check_interval=2, log_every_n_steps=1,
                        callbacks=[LearningRateMonitor(logging_interval="step"), GradNormLogger(),
                                   ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)])
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(STEPS * accum)]
    trainer.fit(m, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    assert m.moved == 0


# =====================================================================================================================
# Fabric probes
# =====================================================================================================================
def _fwd_bwd(fabric, model, s):
    loss = model(input_ids=DATA[s], labels=DATA[s]).loss
    fabric.backward(loss)
    return loss


def loop_kept_detached(fabric, model, opt, steps):
    """``p.grad.detach()`` kept (shares the storage; another tensor object than ``.grad``)."""
    kept = []
    for s in range(steps):
        _fwd_bwd(fabric, model, s)
        kept.append([p.grad.detach() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return [g for grads in kept for g in grads]


def loop_kept_flat_views(fabric, model, opt, steps):
    """``p.grad.view(-1)`` kept (a gradient-similarity log over flattened gradients)."""
    kept = []
    for s in range(steps):
        _fwd_bwd(fabric, model, s)
        kept.append([p.grad.view(-1) for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return [g for grads in kept for g in grads]


@pytest.mark.parametrize("loop", [loop_kept_detached, loop_kept_flat_views])
def test_kept_views_of_grads(loop):
    check(loop, "recompute_all")


def adamw_without_two(m):
    """A trainable weight left out of the optimizer (its ``.grad`` is never reset: it accumulates)."""
    left = ("model.layers.0.post_attention_layernorm.weight", "model.norm.weight")
    return torch.optim.AdamW([p for n, p in m.named_parameters() if n not in left], lr=1e-2, weight_decay=0.1)


def loop_kept_all(fabric, model, opt, steps):
    kept = []
    for s in range(steps):
        _fwd_bwd(fabric, model, s)
        kept.append([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return [g for grads in kept for g in grads]


def test_kept_grads_with_a_trainable_weight_outside_the_optimizer():
    check(loop_kept_all, "recompute_all", opt_fn=adamw_without_two)


def loop_move_grad_out(fabric, model, opt, steps):
    """Takes block 0's q_proj gradient out (``kept = p.grad; p.grad = None``); the rest are zeroed in place."""
    q = raw_module(model).model.layers[0].self_attn.q_proj.weight
    kept = []
    for s in range(steps):
        _fwd_bwd(fabric, model, s)
        kept.append(q.grad)
        q.grad = None
        opt.step()
        opt.zero_grad(set_to_none=False)
    return kept


def test_grad_taken_out_of_one_parameter_keeps_its_values():
    check(loop_move_grad_out, "recompute_all")


def loop_own_grad_tensor(fabric, model, opt, steps):
    """The user's own tensor assigned as ``.grad`` before the backward: autograd accumulates into it in place."""
    raw = raw_module(model)
    ps = [raw.model.layers[1].mlp.up_proj.weight, raw.lm_head.weight]
    mine = []
    for s in range(steps):
        for p in ps:
            t = torch.full_like(p, 0.5)
            p.grad = t
            mine.append(t)
        _fwd_bwd(fabric, model, s)
        opt.step()
        opt.zero_grad()
    return mine


def test_own_tensor_assigned_as_grad_receives_the_gradient():
    check(loop_own_grad_tensor, "recompute_all")


def loop_kept_after_clip(fabric, model, opt, steps):
    kept, out = [], []
    for s in range(steps):
        _fwd_bwd(fabric, model, s)
        out.append(fabric.clip_gradients(model, opt, max_norm=0.05))
        out += [p.grad.clone() for p in model.parameters()]  # read after the clip
        kept.append([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return out + [g for grads in kept for g in grads]


@pytest.mark.parametrize("policy", ["recompute_all", "pipelined"])
def test_grads_read_and_kept_after_fabric_clip_gradients(policy):
    check(loop_kept_after_clip, policy)


def frozen_block0_mlp():
    from models import tiny_llama

    m = tiny_llama(0)
    m.model.layers[0].mlp.requires_grad_(False)
    return m


def loop_thaw_kept_not_none(fabric, model, opt, steps):
    """``zero_grad(set_to_none=False)`` at each step's start; block 0's MLP (frozen when set up) thawed at step 2;
    ``.grad`` kept by reference: under auto every kept tensor is the live one, ending with the last gradient."""
    kept = []
    for s in range(steps):
        if s == 2:
            raw_module(model).model.layers[0].mlp.requires_grad_(True)
        opt.zero_grad(set_to_none=False)
        _fwd_bwd(fabric, model, s)
        kept.append([p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
    return [g for grads in kept for g in grads]


def test_thaw_with_kept_grads_not_set_to_none():
    check(loop_thaw_kept_not_none, "recompute_all", steps=4, model_fn=frozen_block0_mlp)


def loop_thaw_kept(fabric, model, opt, steps):
    kept = []
    for s in range(steps):
        if s == 2:
            raw_module(model).model.layers[0].mlp.requires_grad_(True)
        _fwd_bwd(fabric, model, s)
        kept.append([p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return [g for grads in kept for g in grads]


def test_thaw_with_kept_grads():
    check(loop_thaw_kept, "recompute_all", steps=4, model_fn=frozen_block0_mlp)


def tied_model():
    from models import tiny_llama_config

    cfg = tiny_llama_config()
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("policy", ["mixed", "megatrain", "milp", "pipelined"])
def test_kept_grads_under_other_plans(policy):
    check(loop_kept_all, policy)


def test_kept_grads_with_tied_embeddings():
    check(loop_kept_all, "recompute_all", model_fn=tied_model)


def loop_kept_with_l2_penalty(fabric, model, opt, steps):
    """An L2 penalty over ``model.parameters()`` after the forward: every master is used outside its block too
    (Note: [a master used outside its block]), so autograd sets ``.grad`` before the block's copy lands."""
    kept = []
    for s in range(steps):
        loss = model(input_ids=DATA[s], labels=DATA[s]).loss
        loss = loss + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
        fabric.backward(loss)
        kept.append([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return [g for grads in kept for g in grads]


def test_kept_grads_with_an_l2_penalty_outside_the_blocks():
    check(loop_kept_with_l2_penalty, "recompute_all")


def loop_zero_first_hybrid(fabric, model, opt, steps):
    """``zero_grad()`` at the step's start (before the forward), HybridAdamW under a pipelined plan."""
    kept = []
    for s in range(steps):
        opt.zero_grad()
        _fwd_bwd(fabric, model, s)
        kept.append([p.grad for p in model.parameters()])
        opt.step()
    return [g for grads in kept for g in grads]


def test_kept_grads_zero_grad_first_pipelined_hybrid():
    from test_review11_fabric import hybrid

    check(loop_zero_first_hybrid, "pipelined", opt_fn=hybrid)


MOVED: dict[str, int] = {}  # kept tensors moved (kept_grads_moved), by loop


def n_params() -> int:
    from models import tiny_llama
    return len(list(tiny_llama(0).parameters()))


def _moved(fabric) -> int | None:
    core = getattr(fabric.strategy, "core", None)
    # kept tensors moved, plus host gradients renewed (neither in a loop that keeps nothing)
    return None if core is None else core.executor.params.kept_grads_moved + core.executor.params.kept_grad_renewals


def loop_local_grads(fabric, model, opt, steps):
    """An ordinary loop that reads ``.grad`` into a local list for a norm; the list lives on until the next
    iteration rebinds it (after that iteration's backward): under auto this costs nothing."""
    out = []
    for s in range(steps):
        _fwd_bwd(fabric, model, s)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out.append(torch.stack([g.norm() for g in grads]).norm())
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
    r = _moved(fabric)
    if r is not None:
        MOVED["local"] = r
    return out


def test_grads_read_into_a_loop_local_list():
    """Documents the cost: a local list alive across the next backward is a kept gradient: each tensor is moved
    (copied) once per later step (values equal auto's either way)."""
    MOVED.clear()
    check(loop_local_grads, "recompute_all", steps=3)
    assert MOVED["local"] == 2 * n_params()


def loop_ordinary_fabric(fabric, model, opt, steps):
    """Fabric's ordinary loop: clip, step, zero_grad; a scheduler; norms read, not kept."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    out = []
    for s in range(steps):
        loss = _fwd_bwd(fabric, model, s)
        out.append(fabric.clip_gradients(model, opt, max_norm=0.5))
        out.append(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm())
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append(loss)
    r = _moved(fabric)
    if r is not None:
        MOVED["ordinary"] = r
    return out


@pytest.mark.parametrize("policy,opt_fn", [("mixed", "adamw"), ("pipelined", "hybrid"), ("milp", "adamw")])
def test_ordinary_fabric_loop_moves_nothing(policy, opt_fn):
    import test_review11_fabric as r11

    MOVED.clear()
    check(loop_ordinary_fabric, policy, opt_fn=getattr(r11, opt_fn))
    assert MOVED["ordinary"] == 0


def frozen_block1():
    from models import tiny_llama

    m = tiny_llama(0)
    m.model.layers[1].requires_grad_(False)
    return m


def loop_thaw_whole_block_kept(fabric, model, opt, steps):
    """Block 1 wholly frozen at setup (no host gradient for it), thawed at step 1; ``.grad`` kept (set_to_none)."""
    kept = []
    for s in range(steps):
        if s == 1:
            raw_module(model).model.layers[1].requires_grad_(True)
        _fwd_bwd(fabric, model, s)
        kept.append([p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return [g for grads in kept for g in grads]


def test_thaw_a_whole_block_with_kept_grads():
    check(loop_thaw_whole_block_kept, "recompute_all", steps=4, model_fn=frozen_block1)


def loop_two_forwards_kept(fabric, model, opt, steps):
    """Two forwards, one backward (a loss over two batches: the second runs ad hoc, its gradients join through
    ``Executor._flush_adhoc_grads``); ``.grad`` kept by reference."""
    kept = []
    for s in range(steps):
        a, b = DATA[2 * s], DATA[2 * s + 1]
        loss = model(input_ids=a, labels=a).loss + 0.5 * model(input_ids=b, labels=b).loss
        fabric.backward(loss)
        kept.append([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    r = _moved(fabric)
    if r is not None:
        MOVED["two"] = r
    return [g for grads in kept for g in grads]


def test_kept_grads_with_two_forwards_per_backward():
    MOVED.clear()
    check(loop_two_forwards_kept, "recompute_all")
    assert MOVED["two"] == 2 * n_params()


def loop_two_forwards_ordinary(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        a, b = DATA[2 * s], DATA[2 * s + 1]
        loss = model(input_ids=a, labels=a).loss + 0.5 * model(input_ids=b, labels=b).loss
        fabric.backward(loss)
        out.append(fabric.clip_gradients(model, opt, max_norm=0.5))
        opt.step()
        opt.zero_grad()
        out.append(loss)
    r = _moved(fabric)
    if r is not None:
        MOVED["two_ordinary"] = r
    return out


def test_two_forwards_per_backward_moves_nothing():
    MOVED.clear()
    check(loop_two_forwards_ordinary, "recompute_all")
    assert MOVED["two_ordinary"] == 0


def test_partially_trainable_blocks_with_kept_grads():
    """LoRA-like: block 0's MLP frozen throughout (its group's host gradient covers the trainable prefix only)."""
    check(loop_thaw_kept, "megatrain", steps=2, model_fn=frozen_block0_mlp)


def sgd_with_hooks(m):
    """The optimizer-in-backward recipe (PyTorch tutorial): an AdamW per parameter, stepped and zeroed
    (``p.grad = None``) in ``register_post_accumulate_grad_hook``; the returned SGD (lr 0) is Fabric's."""
    m._per_param = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in m.parameters()}
    m._hook_log = []

    def hook(p):
        m._hook_log.append((p, p.grad.clone(), p.grad if m._keep_in_hook else None))
        m._per_param[p].step()
        m._per_param[p].zero_grad()

    m._hooks = [p.register_post_accumulate_grad_hook(hook) for p in m.parameters()]
    return torch.optim.SGD(m.parameters(), lr=0.0)


def _hook_loop(fabric, model, opt, steps, keep):
    raw = raw_module(model)
    raw._keep_in_hook = keep
    names = {p: n for n, p in raw.named_parameters()}
    for s in range(steps):
        _fwd_bwd(fabric, model, s)
        opt.step()
        opt.zero_grad()
    r = _moved(fabric)
    if r is not None:
        MOVED["hooks"] = r
    # per step, by name (the order the hooks fire in is not compared)
    order = sorted(range(len(raw._hook_log)), key=lambda i: (i // len(names), names[raw._hook_log[i][0]]))
    out = [raw._hook_log[i][1] for i in order]
    if keep:
        out += [raw._hook_log[i][2] for i in order]
    return out


def loop_hooks_kept(fabric, model, opt, steps):
    return _hook_loop(fabric, model, opt, steps, keep=True)


def loop_hooks_ordinary(fabric, model, opt, steps):
    return _hook_loop(fabric, model, opt, steps, keep=False)


def test_optimizer_in_backward_hooks_keeping_grads():
    MOVED.clear()
    check(loop_hooks_kept, "recompute_all", opt_fn=sgd_with_hooks)


def test_optimizer_in_backward_hooks_move_nothing():
    MOVED.clear()
    check(loop_hooks_ordinary, "recompute_all", opt_fn=sgd_with_hooks)
    assert MOVED["hooks"] == 0
