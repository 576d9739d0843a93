"""Review 11: loops a Fabric user writes, ``Fabric(strategy="lazytrain", accelerator="cpu")`` against
``Fabric(accelerator="cpu")`` (the default strategy), fp32, same data and seeds, bit for bit.

Defects (xfail, strict, unless marked FIXED):
- test_loss_on_intermediate_hidden_states_is_bit_equal: a loss term on a block boundary
  (``output_hidden_states=True``; ``hidden_states[2]``) gives gradients that differ from auto in the
  last bits (every policy, keep_all too): the boundary's gradient is summed in another order. FIXED: the
  block node returns each use's gradient of its input apart where the input is used elsewhere too
  (engine/boundary_uses.py, Note: [one gradient per boundary use]).
- test_deepcopy_of_the_set_up_module_is_an_independent_model: ``copy.deepcopy(model.module)`` after
  ``fabric.setup`` (a snapshot, an EMA/teacher copy) keeps the executor's patched block forwards: the copy
  computes with the live model's streamed block weights (silently wrong), and raises
  "param store is closed" after ``fabric.strategy.teardown()``. FIXED: the executor's block forward copies as
  the block's own (engine/streamed_forward.py, Note: [a copy of a streamed block]).
- test_grad_tensors_kept_from_an_earlier_step_keep_their_values: ``g = p.grad`` kept by reference across
  ``zero_grad()`` (set_to_none) is zeroed and overwritten by the next backward (the host gradient buffer is
  reused); under auto it keeps its step's values. FIXED: a group whose ``.grad`` views are still alive when its
  gradients begin afresh gets a new host gradient (engine/kept_grads.py, Note: [a kept gradient]).
- test_swa_averaged_model_of_the_set_up_model: ``torch.optim.swa_utils.AveragedModel(model)`` of the
  model ``fabric.setup`` returned raises ``TypeError: cannot pickle '_thread.lock'`` (auto trains). FIXED: a copy
  of the wrapper holds a plain copy of the module and shares the strategy (adapters/fabric.py).
- test_a_second_module_without_a_block_stack_can_be_set_up: ``fabric.setup(value_head, opt)`` after the
  streamed model raises NotImplementedError (a GAN's discriminator, a value head; auto trains). FIXED: set up
  as Fabric's one-device strategy does (adapters/fabric.py); its optimizer is not the streamed model's.
- test_a_block_called_outside_the_wrapper: ``model.model(...)`` / an unmarked method that calls blocks
  with grad raises UnsupportedBlockPattern naming the Trainer's evaluation (``Trainer(inference_mode=False)``)
  instead of training or naming the Fabric fix (``mark_forward_method`` / call the wrapper). FIXED (refused by
  name): the message names both ways out (engine/block_calls.py).

Passing probes (regression): batches drawn from the global RNG inside the loop and dropout (every policy:
lazytrain consumes no global random numbers); blocks frozen mid-run with ``zero_grad(set_to_none=False)``;
blocks thawed with ``add_param_group``; ``torch.no_grad()`` in-place edits and ``p.data`` reassignment
between steps; ``p.grad`` after each accumulated backward and ``fabric.clip_gradients``' returned norm;
Hugging Face gradient checkpointing; a loss on ``output_attentions``; ``mark_forward_method``; EMA of the
raw module made before setup, with parameter norms and ``state_dict()`` read after each step (HybridAdamW
under a pipelined plan, accumulation); ``torch.inference_mode()`` / ``model.eval()`` evaluation between
steps; a submodule called under ``torch.no_grad()``; ``zero_grad`` between forward and backward; rollback
by ``fabric.save`` + ``fabric.load`` into the live run; an L2 penalty over ``model.parameters()`` after the
forward; a soft prompt with the embedding called outside the model; tied embeddings; growing batch and
sequence sizes; BatchNorm + dropout blocks with evaluation between steps; two forwards then two backwards
(refused by name, as README says)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import tempfile

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy  # (registers the Fabric strategies)
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.planner import Schedule, keep_all
from models import tiny_llama, tiny_llama_config

transformers = pytest.importorskip("transformers")

LAYERS = 4


def _plan_json(schedule: Schedule) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"schedule": schedule.to_json()}, f)
    return f.name


@functools.lru_cache(maxsize=None)
def mixed_plan() -> str:
    """A CPU home, a recomputed boundary and a layer that keeps its internals (tests/test_fabric.py's)."""
    return _plan_json(Schedule(num_layers=LAYERS, homes=("gpu", "cpu", "recompute", "gpu", "gpu"),
                               keep_internals=(True, False, False, False), resident_weights=(False,) * LAYERS,
                               offload_window=(None, 1, None, None, None), reload_window=(None, 3, None, None, None),
                               policy="review11-mixed"))


@functools.lru_cache(maxsize=None)
def pipelined_plan() -> str:
    return _plan_json(dataclasses.replace(keep_all(LAYERS), optimizer="pipelined", policy="review11-pipelined"))


def policy_of(name: str) -> str:
    return {"mixed": mixed_plan(), "pipelined": pipelined_plan()}.get(name, name)


def batches(n: int, seed: int = 1, shape=(4, 32)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, shape, generator=g) for _ in range(n)]


DATA = batches(12)
EVAL = batches(1, seed=2)[0]


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def hybrid(m):
    rest = [p for n, p in m.named_parameters() if not n.startswith("model.layers.")]
    return HybridAdamW([{"params": rest, "layer": "rest"}] + [
        {"params": list(b.parameters()), "layer": i} for i, b in enumerate(m.model.layers)], lr=1e-2, weight_decay=0.1)


def raw_module(model: nn.Module) -> nn.Module:
    """The user's module behind ``fabric.setup``'s wrapper (``_FabricModule.module``)."""
    return model.module


def run(strategy: str, loop, *, model_fn=tiny_llama, opt_fn=adamw, steps: int = 3, precision: str = "32-true"):
    """``loop(fabric, model, opt, steps) -> list of tensors``; returns (that list, final state dict)."""
    model = model_fn()
    opt = opt_fn(model)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision,
                      strategy="auto" if strategy == "auto" else LazyTrainFabricStrategy(policy=policy_of(strategy)))
    model, opt = fabric.setup(model, opt)
    try:
        out = [torch.as_tensor(x).detach().clone() for x in loop(fabric, model, opt, steps)]
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        if isinstance(fabric.strategy, LazyTrainFabricStrategy):
            fabric.strategy.teardown()
    return out, state


_AUTO: dict = {}


def auto(loop, **kw):
    key = (loop.__name__, tuple(sorted((k, getattr(v, "__name__", v)) for k, v in kw.items())))
    if key not in _AUTO:
        _AUTO[key] = run("auto", loop, **kw)
    return _AUTO[key]


def assert_same(got, want) -> None:
    (out_g, st_g), (out_w, st_w) = got, want
    assert len(out_g) == len(out_w)
    bad = [i for i, (a, b) in enumerate(zip(out_g, out_w)) if not torch.equal(a, b)]
    assert not bad, f"recorded values differ at {bad[:6]} (max abs diff {float((out_g[bad[0]] - out_w[bad[0]]).abs().max())})"
    assert st_g.keys() == st_w.keys()
    diff = {k: float((st_g[k] - st_w[k]).abs().max()) for k in st_w if not torch.equal(st_g[k], st_w[k])}
    assert not diff, f"final state differs: {dict(list(diff.items())[:4])}"


def check(loop, policy="mixed", **kw):
    assert_same(run(policy, loop, **kw), auto(loop, **kw))


def step(fabric, model, opt, b, *, set_to_none=True):
    loss = model(input_ids=b, labels=b).loss
    fabric.backward(loss)
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss


# =====================================================================================================================
# defects
# =====================================================================================================================
@pytest.mark.parametrize("policy", ["keep_all", "recompute_all"])
def test_loss_on_intermediate_hidden_states_is_bit_equal(policy):
    """Deep supervision / distillation of a middle layer: a loss term on ``hidden_states[2]`` (block 2's input)."""
    from test_boundary_uses import loop_on  # (it imports this module)

    check(loop_on(2), policy, steps=2)


def test_deepcopy_of_the_set_up_module_is_an_independent_model():
    model = tiny_llama(0)
    opt = adamw(model)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LazyTrainFabricStrategy(policy="recompute_all"))
    model, opt = fabric.setup(model, opt)
    step(fabric, model, opt, DATA[0])
    snapshot = copy.deepcopy(raw_module(model))
    with torch.no_grad():
        for p in snapshot.model.layers.parameters():
            p.mul_(0.5)  # the snapshot's blocks now differ from the live model's
    reference = tiny_llama(0)
    reference.load_state_dict(snapshot.state_dict())
    with torch.no_grad():
        want = reference(input_ids=EVAL).logits
        got = snapshot(input_ids=EVAL).logits
    fabric.strategy.teardown()
    assert torch.equal(got, want), float((got - want).abs().max())
    with torch.no_grad():
        assert torch.equal(snapshot(input_ids=EVAL).logits, want)  # still a model after teardown


def loop_grad_history(fabric, model, opt, steps):
    """Gradients kept by reference across steps (a gradient-similarity log): ``zero_grad()`` sets ``.grad`` to
    None, so under auto the tensors kept hold their step's values."""
    kept = []
    for s in range(steps):
        loss = model(input_ids=DATA[s], labels=DATA[s]).loss
        fabric.backward(loss)
        kept.append([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return [g for grads in kept for g in grads]


def test_grad_tensors_kept_from_an_earlier_step_keep_their_values():
    check(loop_grad_history, "recompute_all", steps=2)


def loop_swa(fabric, model, opt, steps):
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    out = []
    for s in range(steps):
        out.append(step(fabric, model, opt, DATA[s]))
        ema.update_parameters(model)
    out += [p.detach() for p in ema.parameters()]
    return out


def test_swa_averaged_model_of_the_set_up_model():
    check(loop_swa, "recompute_all", steps=2)


def loop_value_head(fabric, model, opt, steps):
    torch.manual_seed(3)
    head = nn.Linear(64, 1)
    head, head_opt = fabric.setup(head, torch.optim.SGD(head.parameters(), lr=0.1))
    out = []
    for s in range(steps):
        o = model(input_ids=DATA[s], labels=DATA[s], output_hidden_states=True)
        loss = o.loss + 0.1 * head(o.hidden_states[-1]).mean()
        fabric.backward(loss)
        opt.step()
        head_opt.step()
        opt.zero_grad()
        head_opt.zero_grad()
        out.append(loss)
    return out + [p.detach() for p in head.parameters()]


def test_a_second_module_without_a_block_stack_can_be_set_up():
    check(loop_value_head, "recompute_all", steps=2)


class WithLoss(transformers.LlamaForCausalLM):
    def my_loss(self, b):
        return self(input_ids=b, labels=b).loss


def with_loss_model():
    torch.manual_seed(0)
    return WithLoss(tiny_llama_config())


def loop_submodules(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        b = DATA[s]
        h = model.model(input_ids=b).last_hidden_state  # the base model, then the head, outside the wrapper
        logits = model.lm_head(h)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), b[:, 1:].reshape(-1))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        out.append(loss)
    return out


def loop_unmarked_method(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        loss = model.my_loss(DATA[s])
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        out.append(loss)
    return out


@pytest.mark.parametrize("loop", [loop_submodules, loop_unmarked_method], ids=["submodules", "unmarked_method"])
def test_a_block_called_outside_the_wrapper(loop):
    """Trains as auto, or is refused by an error that names the Fabric way out (it is now: the message had named
    the Trainer's evaluation only)."""
    try:
        got, err = run("recompute_all", loop, model_fn=with_loss_model, steps=2), None
    except Exception as caught:  # noqa: BLE001 - judged below
        got, err = None, caught
    if err is not None:
        assert "mark_forward_method" in str(err) and "fabric.setup" in str(err), str(err)[:300]
    else:
        assert_same(got, auto(loop, model_fn=with_loss_model, steps=2))


# =====================================================================================================================
# passing probes
# =====================================================================================================================
def dropout_model():
    cfg = tiny_llama_config()
    cfg.attention_dropout = 0.2
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def loop_global_rng(fabric, model, opt, steps):
    """nanoGPT-style: batches drawn from the global RNG inside the loop; a draw recorded after each step."""
    torch.manual_seed(123)
    out = []
    for _ in range(steps):
        b = torch.randint(0, 256, (4, 32))
        out.append(step(fabric, model, opt, b))
        out.append(torch.rand(1))
    return out


@pytest.mark.parametrize("policy", ["milp", "megatrain", "mixed"])
def test_global_rng_and_dropout_as_auto(policy):
    check(loop_global_rng, policy, model_fn=dropout_model)


def loop_freeze_no_none(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        if s == 1:
            raw_module(model).model.layers[1].requires_grad_(False)
            raw_module(model).model.embed_tokens.requires_grad_(False)
        out.append(step(fabric, model, opt, DATA[s], set_to_none=False))
    return out


def test_freeze_mid_run_with_zeroed_not_none_grads():
    """Frozen weights keep zero grads (not None) under auto, so AdamW still decays them: the same here."""
    check(loop_freeze_no_none)


def partial_opt(m):
    return torch.optim.AdamW([p for n, p in m.named_parameters() if not n.startswith(("model.layers.0.",
                                                                                     "model.layers.1."))], lr=1e-2)


def frozen_first_two():
    m = tiny_llama(0)
    for b in m.model.layers[:2]:
        b.requires_grad_(False)
    return m


def loop_thaw(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        if s == 2:
            blocks = raw_module(model).model.layers[:2]
            blocks.requires_grad_(True)
            opt.add_param_group({"params": list(blocks.parameters()), "lr": 5e-3})
        out.append(step(fabric, model, opt, DATA[s]))
    return out


def test_thaw_blocks_and_add_param_group_mid_run():
    check(loop_thaw, "megatrain", steps=4, model_fn=frozen_first_two, opt_fn=partial_opt)


def loop_edits(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        out.append(step(fabric, model, opt, DATA[s]))
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                if i % 2:
                    p.clamp_(-0.05, 0.05)
                else:
                    p.data = p.data.clamp(-0.04, 0.04)  # a new tensor behind the parameter
            raw_module(model).lm_head.weight.mul_(0.9)
    return out


def test_weight_edits_and_data_reassignment_between_steps():
    check(loop_edits)


def loop_grads_seen(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        for k in range(2):
            b = DATA[2 * s + k]
            with fabric.no_backward_sync(model, enabled=k == 0):
                loss = model(input_ids=b, labels=b).loss
                fabric.backward(loss / 2)
            out.append(loss)
            out += [p.grad.clone() for p in model.parameters()]
        out.append(fabric.clip_gradients(model, opt, max_norm=0.5))
        opt.step()
        opt.zero_grad()
    return out


def test_grads_after_each_accumulated_backward_and_the_clip_norm():
    check(loop_grads_seen, steps=2)


def checkpointed_model():
    m = tiny_llama(0)
    m.gradient_checkpointing_enable()
    return m


def loop_plain(fabric, model, opt, steps):
    return [step(fabric, model, opt, DATA[s]) for s in range(steps)]


def test_hf_gradient_checkpointing():
    check(loop_plain, "megatrain", model_fn=checkpointed_model)


def loop_attention_loss(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        o = model(input_ids=DATA[s], labels=DATA[s], output_attentions=True)
        loss = o.loss + 0.1 * sum(a.pow(2).mean() for a in o.attentions)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        out.append(loss)
    return out


def test_loss_on_output_attentions():
    check(loop_attention_loss, steps=2)


def loop_marked(fabric, model, opt, steps):
    model.mark_forward_method("my_loss")
    return loop_unmarked_method(fabric, model, opt, steps)


def test_mark_forward_method():
    check(loop_marked, "megatrain", model_fn=with_loss_model, steps=2)


def loop_ema_and_reads(fabric, model, opt, steps):
    """EMA of a copy made before setup's first step, updated from the live weights; norms and state_dict read
    after every step; accumulation over two backward calls; evaluation of the EMA copy at the end."""
    ema = None
    out = []
    for s in range(steps):
        for k in range(2):
            b = DATA[2 * s + k]
            loss = model(input_ids=b, labels=b).loss
            fabric.backward(loss / 2)
            out.append(loss)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            if ema is None:
                ema = [p.detach().clone() for p in model.parameters()]
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
            out.append(torch.stack([p.norm() for p in model.parameters()]))
            out.append(torch.stack([v.float().norm() for v in model.state_dict().values()]))
    return out + ema


@pytest.mark.parametrize("policy, opt_fn", [("pipelined", hybrid), ("mixed", adamw)], ids=["hybrid-pipelined", "adamw"])
def test_ema_and_weight_reads_between_steps(policy, opt_fn):
    check(loop_ema_and_reads, policy, opt_fn=opt_fn, steps=2)


def loop_eval_modes(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        model.eval()
        with torch.inference_mode():
            out.append(model(input_ids=EVAL).logits.clone())
        model.train()
        loss = model(input_ids=DATA[s], labels=DATA[s]).loss
        opt.zero_grad(set_to_none=s % 2 == 0)  # between the forward and its backward
        fabric.backward(loss)
        opt.step()
        out.append(loss)
        with torch.no_grad():
            out.append(model.model(input_ids=EVAL).last_hidden_state)  # a submodule, no grad
    return out


def test_evaluation_modes_and_zero_grad_between_forward_and_backward():
    check(loop_eval_modes)


def loop_rollback(fabric, model, opt, steps):
    path = tempfile.mkdtemp() + "/ckpt.pt"
    out = []
    for s in range(steps):
        if s == 1:
            fabric.save(path, {"model": model, "optimizer": opt})
        if s == 3:
            fabric.load(path, {"model": model, "optimizer": opt})
        out.append(step(fabric, model, opt, DATA[s]))
    return out


def test_rollback_by_save_and_load_into_the_live_run():
    check(loop_rollback, "megatrain", steps=5)


def loop_penalty_and_soft_prompt(fabric, model, opt, steps):
    torch.manual_seed(7)
    prompt = nn.Parameter(torch.randn(4, 64) * 0.02)
    prompt_opt = torch.optim.Adam([prompt], lr=1e-2)
    out = []
    for s in range(steps):
        b = DATA[s]
        emb = model.get_input_embeddings()(b)
        emb = torch.cat([prompt.expand(b.shape[0], -1, -1), emb], 1)
        labels = torch.cat([torch.full((b.shape[0], 4), -100), b], 1)
        loss = model(inputs_embeds=emb, labels=labels).loss
        loss = loss + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())  # after the forward
        fabric.backward(loss)
        opt.step()
        prompt_opt.step()
        opt.zero_grad()
        prompt_opt.zero_grad()
        out.append(loss)
    return out + [prompt.detach()]


def test_l2_penalty_and_soft_prompt_through_the_embedding():
    check(loop_penalty_and_soft_prompt)


def tied_model():
    cfg = tiny_llama_config()
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def loop_growing(fabric, model, opt, steps):
    g = torch.Generator().manual_seed(5)
    out = []
    for shape in [(4, 16), (4, 32), (6, 48), (2, 8)][:steps]:
        out.append(step(fabric, model, opt, torch.randint(0, 256, shape, generator=g)))
    return out


def test_tied_embeddings_and_growing_batches():
    check(loop_growing, "milp", model_fn=tied_model, steps=4)


D = 16


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(D, D), nn.BatchNorm1d(D), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2)))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.layers, self.head = nn.Linear(6, D), nn.ModuleList(BNBlock() for _ in range(4)), nn.Linear(D, 1)

    def forward(self, x):
        h = self.emb(x)
        for b in self.layers:
            h = b(h)
        return self.head(h)


_X = list(torch.randn(10, 3, 5, 6, generator=torch.Generator().manual_seed(1)))


def loop_bn(fabric, model, opt, steps):
    torch.manual_seed(5)
    out = []
    for s in range(steps):
        loss = model(_X[s]).square().mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            out.append(model(_X[9]))
        model.train()
        out.append(loss)
    return out


@pytest.mark.parametrize("policy", ["megatrain", "mixed"])
def test_batchnorm_dropout_blocks_with_evaluation_between_steps(policy):
    check(loop_bn, policy, model_fn=BNNet)


def loop_two_forwards_two_backwards(fabric, model, opt, steps):
    out = []
    for s in range(steps):
        l1 = model(input_ids=DATA[2 * s], labels=DATA[2 * s]).loss
        l2 = model(input_ids=DATA[2 * s + 1], labels=DATA[2 * s + 1]).loss
        fabric.backward(l1 / 2)
        fabric.backward(l2 / 2)
        opt.step()
        opt.zero_grad()
        out += [l1, l2]
    return out


def test_two_forwards_then_two_backwards_is_refused_by_name():
    """README ('What is exact'): backpropagating a forward of an earlier micro-batch is refused by name."""
    auto(loop_two_forwards_two_backwards, steps=1)  # auto trains
    with pytest.raises(RuntimeError, match="earlier micro-batch"):
        run("recompute_all", loop_two_forwards_two_backwards, steps=1)


def test_a_second_streamed_model_is_refused_by_name():
    """One streamed model per Fabric: a second module with a block stack is refused, naming the way out (a module
    without blocks is set up beside it: test_a_second_module_without_a_block_stack_can_be_set_up)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LazyTrainFabricStrategy(policy="recompute_all"))
    fabric.setup(tiny_llama(0))
    with pytest.raises(NotImplementedError, match="streams one model per Fabric"):
        fabric.setup(tiny_llama(1))
    fabric.strategy.teardown()
