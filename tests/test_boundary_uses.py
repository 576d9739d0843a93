"""Note: [one gradient per boundary use] (engine/boundary_uses.py): a block's input used outside the block too (a loss
on ``hidden_states[i]``: deep supervision, hidden-state distillation) gets each use's gradient added in plain
autograd's order, so every gradient equals ``strategy="auto"``'s bit for bit (fp32 on CPU). Before, the block node
returned its own uses summed and autograd added the outside use to that sum: the gradients of the blocks below
differed in the last bits (review 11)."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch

from lightning_lazytrain.engine.boundary_uses import InputUses, mark_boundary_uses
from lightning_lazytrain.lit_module import CausalLMModule
from lightning_lazytrain.strategy import LazyTrainStrategy
from test_review11_fabric import DATA, check

transformers = pytest.importorskip("transformers")


def loop_on(index: int, *, hooked: bool = False):
    """A loss term on ``hidden_states[index]`` (0: the embedding's output, block 0's input; 4: the last block's
    output after the final norm -- not a block input); ``hooked``: a tensor hook and ``retain_grad`` on it."""

    def loop(fabric, model, opt, steps):
        out = []
        for s in range(steps):
            o = model(input_ids=DATA[s], labels=DATA[s], output_hidden_states=True)
            h = o.hidden_states[index]
            seen = []
            if hooked:
                h.register_hook(lambda g: seen.append(g.clone()))
                h.retain_grad()
            loss = o.loss + 0.1 * h.pow(2).mean()
            fabric.backward(loss)
            out.append(loss)
            out += [p.grad.clone() for p in model.parameters()]
            if hooked:
                out += [seen[0], h.grad.clone()]
            opt.step()
            opt.zero_grad()
        return out

    loop.__name__ = f"loop_on_{index}{'_hooked' if hooked else ''}"
    return loop


@pytest.mark.parametrize("policy", ["keep_all", "recompute_all", "mixed"])
@pytest.mark.parametrize("index", [0, 1, 3, 4])
def test_a_loss_on_a_block_boundary_is_bit_equal(policy, index):
    check(loop_on(index), policy, steps=2)


@pytest.mark.parametrize("policy", ["keep_all", "recompute_all"])
def test_a_hook_on_the_boundary_sees_the_whole_gradient(policy):
    """A tensor hook and ``retain_grad`` on ``hidden_states[2]`` see every use's gradient summed, as under auto (the
    uses are added into the boundary's gradient before its hooks run, not in the block below)."""
    check(loop_on(2, hooked=True), policy, steps=2)


def loop_two_forwards(fabric, model, opt, steps):
    """Two forwards before one backward (the second runs ad hoc) with the first's boundary in the loss."""
    out = []
    for s in range(steps):
        a = model(input_ids=DATA[s], labels=DATA[s], output_hidden_states=True)
        b = model(input_ids=DATA[s + 4], labels=DATA[s + 4])
        loss = a.loss + b.loss + 0.1 * a.hidden_states[2].pow(2).mean()
        fabric.backward(loss)
        out.append(loss)
        out += [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return out


def test_a_boundary_loss_with_two_forwards_before_one_backward():
    check(loop_two_forwards, "recompute_all", steps=2)


@functools.lru_cache(maxsize=None)
def hf_module_class():
    class Module(CausalLMModule):
        def __init__(self):
            super().__init__(model_name="tiny", optimizer="adamw", lr_schedule="constant", warmup_steps=0)
            cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                           attn_implementation="eager")
            torch.manual_seed(0)
            self.model = transformers.LlamaForCausalLM(cfg)

        def training_step(self, batch, batch_idx):
            out = self.model(input_ids=batch, labels=batch, output_hidden_states=True)
            loss = out.loss + 0.1 * sum(h.pow(2).mean() for h in out.hidden_states[:-1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    return Module


def trainer_fit(strategy):
    module = hf_module_class()()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 17), generator=g) for _ in range(3)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


@pytest.mark.parametrize("policy", ["keep_all", "recompute_all"])
def test_deep_supervision_under_the_trainer_is_bit_equal(policy):
    want = trainer_fit("auto")
    got = trainer_fit(LazyTrainStrategy(policy=policy))
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_the_walk_marks_only_inputs_used_elsewhere():
    """``mark_boundary_uses`` on the graph of a loss: no block node is marked for the model's own loss (nothing
    else reads a boundary, so the backward is as before), one for a term on one boundary."""
    from lightning_lazytrain.engine.block_fn import BlockContext

    class Node(torch.autograd.Function):  # a stand-in block node: input x twice (an extra slot), a routed tensor
        @staticmethod
        def forward(fctx, ctx, x, anchor, r, x_again):
            fctx.block = ctx
            return x * 2 + r

        @staticmethod
        def backward(fctx, g):
            return None, g, None, g, None

    def block(x, r):
        ctx = BlockContext(0)
        ctx.n_routed, ctx.extra_inputs, ctx.routed_keys = 1, 1, [id(r)]  # r chained (a key: the planned pass's)
        return Node.apply(ctx, x, torch.ones((), requires_grad=True), r, x), ctx

    x = torch.randn(3, requires_grad=True)
    h = x * 3
    r = torch.randn(3, requires_grad=True)
    y, first = block(h, r)
    z, second = block(y, r)  # r routed into both: not a block input, not marked
    assert mark_boundary_uses(z.sum()) == 0 and not first.split_input and not second.split_input
    assert mark_boundary_uses((z.sum() + y.pow(2).sum())) == 1 and second.split_input and not first.split_input
    y2, third = block(h, r)
    assert mark_boundary_uses(y2.sum() + h.sum()) == 1 and third.split_input
    # r routed into the blocks and read outside them: every node taking it returns its uses apart (no chain)
    y3, fourth = block(h * 2, r)
    y4, fifth = block(y3, r)
    assert mark_boundary_uses(y4.sum() + r.sum()) == 2 and fourth.split == fifth.split == [(0,)]
    assert fourth.split_routed() == {0} and not fourth.split_input


def test_input_uses_come_in_autograd_order():
    """Each use's gradient of a leaf, in the order autograd adds them: their running sum is the leaf's ``.grad``."""
    x = torch.randn(64, requires_grad=True)
    y = x * x.sin() + x.exp() * 3 + x.pow(2).mean()
    with InputUses(x, [y]) as uses:
        y.backward(torch.randn(64))
    assert len(uses.grads) == 4  # mul, sin, exp, pow
    total = uses.grads[0]
    for g in uses.grads[1:]:
        total = total + g
    assert torch.equal(total, x.grad)
    slots = uses.slotted(3)
    assert len(slots) == 3 and slots[0] is uses.grads[0] and slots[1] is uses.grads[1]
    folded = uses.grads[2]
    for g in uses.grads[3:]:
        folded = folded + g
    assert torch.equal(slots[2], folded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["keep_all", "recompute_all"])
def test_a_boundary_loss_on_a_gpu(policy, monkeypatch):
    """The per-use slots on CUDA: the walk marks the blocks whose input the loss reads, and every gradient is within
    1e-5 relative of auto's on the same GPU (TF32 off; the streamed kernels' order differs, so not bitwise)."""
    from models import tiny_llama

    import lightning_lazytrain.engine.executor as executor_module
    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy

    marked = []

    def counting(loss, *rest):
        marked.append(mark_boundary_uses(loss, *rest))
        return marked[-1]

    monkeypatch.setattr(executor_module, "mark_boundary_uses", counting)
    torch.backends.cuda.matmul.allow_tf32 = False

    def grads(strategy):
        model = tiny_llama(0)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        fabric = L.Fabric(accelerator="cuda", devices=1, precision="32-true", strategy=strategy)
        model, opt = fabric.setup(model, opt)
        out = []
        for s in range(2):
            b = DATA[s].to(fabric.device)
            o = model(input_ids=b, labels=b, output_hidden_states=True)
            fabric.backward(o.loss + 0.1 * sum(h.pow(2).mean() for h in o.hidden_states[:-1]))
            out.append([p.grad.detach().float().cpu().clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return out

    want = grads("auto")
    got = grads(LazyTrainFabricStrategy(policy=policy))
    assert marked and min(marked) > 0
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            assert float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) <= 1e-5
