"""Modules shared by blocks (Note: [modules shared by blocks] in engine/param_store.py): their parameters
join the non-block group, resident on the device for the step; the gradients of every block's use add up
as under ``strategy="auto"`` (bit for bit in fp32), trainable or frozen, under re-running and keeping plans
and the pipelined step. The same block twice in the stack is refused by name."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from test_review_clip_manual import LAYERS, Net, assert_same, fit, lazy
from torch import nn

from lightning_lazytrain.strategy import LazyTrainStrategy

D = 16


class SharedBlock(nn.Module):
    def __init__(self, shared: nn.Module):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.shared = shared

    def forward(self, x):
        return x + torch.tanh(self.lin(x) + self.shared(torch.sin(x)))


class SharedNet(Net):
    """Four blocks calling one ``nn.Linear`` (trainable, or frozen)."""

    def __init__(self, frozen=False, opt="hybrid"):
        super().__init__(opt=opt)
        shared = nn.Linear(D, D)
        shared.requires_grad_(not frozen)
        self.layers = nn.ModuleList(SharedBlock(shared) for _ in range(LAYERS))

    def groups(self):  # HybridAdamW one layer per block; the shared module's weights with the non-block ones
        shared = {id(p) for p in self.layers[0].shared.parameters()}
        rest = [p for n, p in self.named_parameters() if not n.startswith("layers.") or id(p) in shared]
        return [{"params": rest, "layer": "rest"}] + [
            {"params": [p for p in b.parameters() if id(p) not in shared], "layer": i}
            for i, b in enumerate(self.layers)]


class InRest(L.Callback):
    """Records, each step, whether ``weight(module)`` (default: the shared module's) is with the non-block
    weights."""

    reads_gradients_only = True

    def __init__(self, weight=lambda module: module.layers[0].shared.weight):
        self.seen, self.weight = [], weight

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step > len(self.seen):
            store = trainer.strategy.executor.params
            self.seen.append(any(p is self.weight(module) for p in store.group_parameters(-1)))


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("accum", [1, 2])
def test_a_module_shared_by_every_block_trains_as_under_auto(plan, frozen, accum):
    kw = {"accum": accum, "gradient_clip_val": 0.05, "steps": 3}
    where = InRest()
    got = fit(lazy(plan), SharedNet(frozen), callbacks=[where], **kw)
    want = fit("auto", SharedNet(frozen), **kw)
    assert_same(got, want)
    assert where.seen == [True] * 3  # with the non-block weights
    shared = got[2].lightning_module.layers[0].shared.weight
    if not frozen:
        init = SharedNet(frozen).layers[0].shared.weight
        assert not torch.equal(shared.detach(), init)


class HookedSharedNet(SharedNet):
    """A clamping tensor hook on the shared module's weight (nonlinear: it must see the sum of the blocks' uses)."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.layers[0].shared.weight.register_hook(self._clamp)

    def _clamp(self, g):
        self.seen.append(g.detach().clone())
        return g.clamp(-1e-3, 1e-3)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_a_tensor_hook_on_a_shared_weight_fires_once_per_backward_on_the_sum(plan):
    """Note: [gradient hooks on streamed parameters]: it had fired once per block, on that block's share."""
    got_m, want_m = HookedSharedNet(), HookedSharedNet()
    got = fit(lazy(plan), got_m, steps=3, accum=2)
    want = fit("auto", want_m, steps=3, accum=2)
    assert len(got_m.seen) == len(want_m.seen) == 6
    assert all(torch.equal(a, b) for a, b in zip(got_m.seen, want_m.seen))
    assert_same(got, want)


@pytest.mark.parametrize("policy", ["keep_all", "milp"])
def test_a_shared_module_under_the_builtin_policies(policy):
    kw = {"steps": 3, "accum": 2}
    assert_same(fit(LazyTrainStrategy(policy=policy), SharedNet(opt="adamw"), **kw),
                fit("auto", SharedNet(opt="adamw"), **kw))


class TwiceNet(Net):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([self.layers[0], self.layers[1], self.layers[0], self.layers[3]])


def test_the_same_block_twice_in_the_stack_is_refused():
    with pytest.raises(NotImplementedError, match=r"block 2 of the stack is block 0 again"):
        fit(lazy("serial"), TwiceNet(), steps=1)


class TiedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.mix = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.lin(x) + self.mix(torch.sin(x)))


class TiedNet(Net):
    """Blocks with modules of their own whose ``mix.weight`` is one Parameter in blocks 1 and 3 (Zamba2 ties its
    shared attention block into each hybrid layer so); ``all_blocks``: in every block."""

    def __init__(self, all_blocks=False, opt="hybrid"):
        super().__init__(opt=opt)
        self.layers = nn.ModuleList(TiedBlock() for _ in range(LAYERS))
        for i in (range(1, LAYERS) if all_blocks else (3,)):
            self.layers[i].mix.weight = self.layers[0 if all_blocks else 1].mix.weight

    def groups(self):
        tied = {id(self.layers[1].mix.weight)}
        rest = [p for n, p in self.named_parameters(remove_duplicate=True)
                if not n.startswith("layers.") or id(p) in tied]
        return [{"params": rest, "layer": "rest"}] + [
            {"params": [p for p in b.parameters() if id(p) not in tied and not any(p is q for q in rest)],
             "layer": i} for i, b in enumerate(self.layers)]


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("all_blocks", [False, True])
@pytest.mark.parametrize("accum", [1, 2])
def test_a_weight_tied_across_blocks_trains_as_under_auto(plan, all_blocks, accum):
    """Note: [modules shared by blocks]: the tied weight joins the non-block group (it had been refused)."""
    kw = {"accum": accum, "gradient_clip_val": 0.05, "steps": 3}
    where = InRest(lambda module: module.layers[1].mix.weight)
    got = fit(lazy(plan), TiedNet(all_blocks), callbacks=[where], **kw)
    want = fit("auto", TiedNet(all_blocks), **kw)
    assert_same(got, want)
    assert where.seen == [True] * 3  # with the non-block weights
    tied = got[2].lightning_module.layers[1].mix.weight
    assert not torch.equal(tied.detach(), TiedNet(all_blocks).layers[1].mix.weight)


@pytest.mark.parametrize("policy", ["keep_all", "milp"])
def test_a_tied_weight_under_the_builtin_policies(policy):
    kw = {"steps": 3, "accum": 2}
    assert_same(fit(LazyTrainStrategy(policy=policy), TiedNet(opt="adamw"), **kw),
                fit("auto", TiedNet(opt="adamw"), **kw))


def zamba2_run(strategy, use_cache, steps=2, **trainer_kw):
    """A tiny Zamba2 (its one shared attention block tied into the hybrid blocks 1 and 3) fit with AdamW: (losses,
    state_dict). ``use_cache``: passed to the model (None: its default)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Zamba2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, layers_block_type=["mamba", "hybrid"] * 2,
        mamba_d_state=8, n_mamba_heads=4, chunk_size=8, num_mem_blocks=1, adapter_rank=8, use_mem_eff_path=False,
        use_mamba_kernels=False, pad_token_id=0, attn_implementation="eager")

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.Zamba2ForCausalLM(cfg)
            self.losses = []

        def training_step(self, batch, batch_idx):
            kw = {} if use_cache is None else {"use_cache": use_cache}
            loss = self.model(input_ids=batch, labels=batch, **kw).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(1, 128, (2, 16), generator=g)
               for _ in range(steps * trainer_kw.get("accumulate_grad_batches", 1))]
    module = LM()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return module.losses, {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("policy", ["milp", "recompute_all"])
def test_zamba2_trains_as_under_auto(policy):
    """Zamba2 ties its one shared attention block into every hybrid layer (blocks 1 and 3 here): a Lightning fit,
    AdamW, 3 steps, bit for bit as ``strategy="auto"`` (it was refused before the tied weights joined the
    non-block group)."""
    (lg, sg), (lw, sw) = zamba2_run(LazyTrainStrategy(policy=policy), False, steps=3), zamba2_run("auto", False, steps=3)
    assert lg == lw
    assert sg.keys() == sw.keys()
    assert [k for k in sw if not torch.equal(sg[k], sw[k])] == []
