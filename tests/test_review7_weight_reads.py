"""Review 7: user code that reads the weights while a pipelined optimizer step is still updating them (Note:
[weights read before the forward] in core/weight_reads.py, Note: [weights read after the step] in
adapters/weight_readers.py), each compared bit for bit with ``strategy="auto"`` on the same seed and data
(fp32 on CPU): what the user's code read, the per-step losses and the final state dict.

Every lazytrain fit here runs the tiny CausalLMModule with ``SlowHybridAdamW`` (each layer's update takes 30 ms,
so a pipelined step is still running when the next batch begins) under a plan file forcing a pipelined step.

Defects were ``xfail(strict=True)`` with ``OPEN:``; the other tests are passing probes kept as regression tests.
The review found 10. Fixed (2026-12-05): an overridden ``optimizer_step`` and the batch-transfer hooks reading
weights after the step (now ``weight_readers.MODULE_HOOKS``: a serial step); the guard taken off for every block
at the forward's first staging, so a hook in block 0 reading block 3 (with grad: the run diverged) or a lone call
of block 0 then reads read mid-update (now each block is released as the forward waits for it). Fixed later
(the guard watches the bytes of the parameters and their optimizer states, and views read nothing): aliases of
the weights taken earlier, optimizer states read in training_step, and metadata reached through ``p.data``
waiting (the overlap lost, values exact). Also fixed: weights edited and gradients read in training_step before
the forward (the micro-batch now begins at the model's call: Note: [the micro-batch begins at the model's call]
in core/microbatches.py), and ``p.grad`` checks waiting.
"""

from __future__ import annotations

import dataclasses
import functools

import lightning as L
import pytest
import torch
from torch.overrides import TorchFunctionMode, _len_torch_function_stack

from lightning_lazytrain.lit_module import CausalLMModule
from lightning_lazytrain.planner import keep_all
from lightning_lazytrain.strategy import LazyTrainStrategy
from test_conformance import Losses
from test_updates_in_backward import plan_file
from test_weights_read_after_step import SlowHybridAdamW

STEPS = 4


@functools.lru_cache(maxsize=None)
def pipelined(layers: int = 4, updates_in_backward: bool = False) -> str:
    """A plan file forcing a pipelined step for ``layers`` blocks."""
    return plan_file(dataclasses.replace(keep_all(layers), optimizer="pipelined",
                                         updates_in_backward=updates_in_backward, policy="t"))


@functools.lru_cache(maxsize=None)
def serial() -> str:
    """A plan file forcing a serial step (keep all, 4 blocks)."""
    return plan_file(dataclasses.replace(keep_all(4), optimizer="serial", policy="t"))


def lazy(layers: int = 4, updates_in_backward: bool = False) -> LazyTrainStrategy:
    return LazyTrainStrategy(policy=pipelined(layers, updates_in_backward))


def fit(strategy, cls, *, steps=STEPS, callbacks=(), layers=4, updates_in_backward=False, val=False, batches=None,
        **trainer_kw):
    """The tiny CausalLMModule subclass ``cls`` with a slow HybridAdamW: (module, per-step losses)."""

    class Module(cls):
        def configure_optimizers(self):
            return SlowHybridAdamW(self.param_groups(), lr=self.lr, eight_bit="none", skip_nonfinite=False,
                                   **({"updates_in_backward": True} if updates_in_backward else {}))

    Module.__name__ = cls.__name__
    torch.manual_seed(0)
    module = Module(model_name="tiny", model_overrides=None if layers == 4 else {"num_layers": layers},
                    optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
    losses = Losses()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[losses, *callbacks], **trainer_kw)
    g = torch.Generator().manual_seed(3)
    n = batches or steps * trainer_kw.get("accumulate_grad_batches", 1)
    data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(n)]
    val_data = torch.utils.data.DataLoader(data[:2], batch_size=None) if val else None
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None), val_dataloaders=val_data)
    return module, losses.values


def snap(module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if n.startswith(prefix)}


def record(module, what, attr: str = "read") -> None:
    if not hasattr(module, attr):
        setattr(module, attr, [])
    getattr(module, attr).append(what)


def stale(want: list[dict], got: list[dict]) -> list[tuple[int, str]]:
    """(read, name) of every tensor that differs from auto's (empty: bit-equal)."""
    assert len(want) == len(got)
    assert all(a.keys() == b.keys() for a, b in zip(want, got))
    return [(i, k) for i, (a, b) in enumerate(zip(want, got)) for k in a if not torch.equal(a[k], b[k])]


def same_state(a, b) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


def waited(module) -> int:
    return module.trainer.strategy.core.steps.reads_waited


class ReadsFirst(CausalLMModule):
    """Reads every weight at the start of ``training_step`` (before the model is called)."""

    def training_step(self, batch, batch_idx):
        record(self, snap(self))
        return super().training_step(batch, batch_idx)


@functools.lru_cache(maxsize=None)
def auto_start(accumulate: int = 1, steps: int = STEPS):
    """auto's weights at the start of each training_step, its losses and its module (one fit per setting)."""
    module, losses = fit("auto", ReadsFirst, steps=steps, accumulate_grad_batches=accumulate)
    return module.read, losses, module


def check(got, have, *, accumulate=1, steps=STEPS, prefix=""):
    """``got.read`` (weights at the start of each training_step) and the run equal auto's bit for bit."""
    want_reads, want, ref = auto_start(accumulate, steps)
    want_reads = [{k: v for k, v in r.items() if k.startswith(prefix)} for r in want_reads]
    assert have == want
    assert same_state(ref, got) == []
    assert stale(want_reads, got.read) == []


# =====================================================================================================
# DEFECTS
# =====================================================================================================

class EMAInOptimizerStep(CausalLMModule):
    """A common EMA pattern: the LightningModule's ``optimizer_step`` steps, then reads the weights."""

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        record(self, snap(self))


def test_weights_read_in_an_overridden_optimizer_step_after_the_step():
    """Under auto the weights read right after ``super().optimizer_step()`` are the step's new ones; under a
    pipelined step the layers still being updated are read as they were (reads 2..4 differ in blocks 1..3).
    weights_read_after_step (adapters/weight_readers.py) checks only HOOKS, so the step stays pipelined."""
    ref, want = fit("auto", EMAInOptimizerStep)
    got, have = fit(lazy(), EMAInOptimizerStep)
    assert have == want and same_state(ref, got) == []
    assert stale(ref.read, got.read) == []


class ReadsAfterBatchTransfer(CausalLMModule):
    """``on_after_batch_transfer`` (runs after the previous step, before on_train_batch_start) reads the weights
    (e.g. an augmentation scaled by a weight norm)."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training:
            record(self, snap(self))
        return batch


def test_weights_read_in_on_after_batch_transfer():
    got, have = fit(lazy(), ReadsAfterBatchTransfer)
    check(got, have)


class ReadsLaterBlockInForward(CausalLMModule):
    """A forward hook on block 0 reads block 3's weights (no grad): the forward has begun, block 3's update may
    still be running."""

    def on_fit_start(self):
        def hook(mod, args, out):
            with torch.no_grad():
                record(self, snap(self, "model.layers.3."))

        self.model.layers[0].register_forward_hook(hook)


def test_a_forward_reading_a_later_blocks_weights_before_calling_it():
    got, have = fit(lazy(), ReadsLaterBlockInForward)
    check(got, have, prefix="model.layers.3.")


class UsesLaterBlockInForward(CausalLMModule):
    """As above, with grad: block 0's output depends on block 3's weight (a cross-layer term)."""

    def on_fit_start(self):
        self.model.layers[0].register_forward_hook(
            lambda mod, args, out: out + 1e-2 * self.model.layers[3].o_proj.weight.sum())


def test_a_forward_using_a_later_blocks_weight_with_grad():
    """Losses from step 3 and the final state differ from auto. With a serial plan (keep_all or recompute_all,
    optimizer="serial") the same model is exact, so the gradients are right and the values read are stale.
    outside_uses._outside_use returns early when autograd accumulated into the host view in place, so
    ``outside_uses_seen`` never turns on and TrainingCore._step_waits keeps the step pipelined."""
    ref, want = fit("auto", UsesLaterBlockInForward)
    got, have = fit(lazy(), UsesLaterBlockInForward)
    assert have == want
    assert same_state(ref, got) == []


class CallsBlock0ThenReads(CausalLMModule):
    """training_step runs the embedding and block 0 alone under no_grad (a probe of the first layer's output),
    then reads every weight, then trains."""

    def training_step(self, batch, batch_idx):
        from lightning_lazytrain.models.llama import rotary

        m = self.model
        with torch.no_grad():
            h = m.embed_tokens(batch[:, :-1])
            pe = rotary(h.shape[1], m.spec.head_dim, m.rope_theta, h.device, h.dtype)
            m.layers[0](h, position_embeddings=pe)
        record(self, snap(self))
        return super().training_step(batch, batch_idx)


def test_training_step_reads_weights_after_calling_one_block():
    got, have = fit(lazy(), CallsBlock0ThenReads)
    check(got, have)


class ReadsAliases(CausalLMModule):
    """Keeps aliases of the block weights (``p.data``) from on_train_start and reads them in training_step."""

    def on_train_start(self):
        self.alias = {n: p.data for n, p in self.named_parameters() if n.startswith("model.layers.")}

    def training_step(self, batch, batch_idx):
        record(self, {n: a.clone() for n, a in self.alias.items()})
        return super().training_step(batch, batch_idx)


def test_aliases_of_the_weights_read_before_the_forward():
    got, have = fit(lazy(), ReadsAliases)
    check(got, have, prefix="model.layers.")


class ReadsOptimizerState(CausalLMModule):
    """Logs the Adam first moments at the start of training_step."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers().optimizer  # (keyed by position: in training_step the module's non-block
        # parameters are the executor's bound copies, not the optimizer's)
        record(self, {f"{i}.{j}": opt.state[p]["exp_avg"].clone() for i, g in enumerate(opt.param_groups)
                      for j, p in enumerate(g["params"]) if "exp_avg" in opt.state[p]})
        return super().training_step(batch, batch_idx)


def test_optimizer_state_read_before_the_forward():
    ref, want = fit("auto", ReadsOptimizerState)
    got, have = fit(lazy(), ReadsOptimizerState)
    assert have == want and same_state(ref, got) == []
    assert stale(ref.read, got.read) == []


class ReadsGradsFirst(CausalLMModule):
    """Reads ``.grad`` at the start of training_step (under Lightning the previous step's gradients: zero_grad
    runs after training_step)."""

    def training_step(self, batch, batch_idx):
        record(self, {n: None if p.grad is None else p.grad.clone() for n, p in self.named_parameters()})
        return super().training_step(batch, batch_idx)


def _grads_differ(want, got):
    return [(i, k) for i, (a, b) in enumerate(zip(want, got)) for k in a
            if (a[k] is None) != (b[k] is None) or (a[k] is not None and not torch.equal(a[k], b[k]))]


def test_gradients_read_at_the_start_of_training_step():
    """Not specific to the pipelined step (the bind happens under any schedule); the block weights' .grad agree."""
    ref, want = fit("auto", ReadsGradsFirst)
    got, have = fit(lazy(), ReadsGradsFirst)
    assert have == want
    assert _grads_differ(ref.read, got.read) == []


class ClampsWeights(CausalLMModule):
    """WGAN-style weight clipping at the start of training_step, before the forward."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.05, 0.05)
        return super().training_step(batch, batch_idx)


def test_weights_edited_in_training_step_before_the_forward():
    """Under any schedule (here keep_all with a serial step): the losses differ from step 1 on."""
    ref, want = fit("auto", ClampsWeights)
    got, have = fit(LazyTrainStrategy(policy=serial()), ClampsWeights)
    assert have == want
    assert same_state(ref, got) == []


class CountsThroughData(CausalLMModule):
    """A parameter count through ``p.data`` (a metadata read)."""

    def training_step(self, batch, batch_idx):
        self.count = sum(p.data.numel() for p in self.parameters())
        return super().training_step(batch, batch_idx)


class ChecksGradPresence(CausalLMModule):
    """Counts the parameters that have a gradient (``p.grad is None``: a metadata read)."""

    def training_step(self, batch, batch_idx):
        self.count = sum(p.grad is None for p in self.parameters())
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("cls", [CountsThroughData, ChecksGradPresence],
                         ids=["data_numel", "grad_is_none"])
def test_metadata_through_data_or_grad_keeps_the_step_pipelined(cls):
    """``p.grad`` reads no weight value (the pipelined update does not write the gradients): it waits for nothing."""
    got, _ = fit(lazy(), cls)
    assert waited(got) == 0


# =====================================================================================================
# PASSING PROBES
# =====================================================================================================

@pytest.mark.parametrize("accumulate", [2, 3])
def test_reads_before_the_forward_in_every_micro_batch(accumulate):
    steps = 4 if accumulate == 2 else 3
    got, have = fit(lazy(), ReadsFirst, steps=steps, accumulate_grad_batches=accumulate)
    check(got, have, accumulate=accumulate, steps=steps)
    assert waited(got) > 0


def test_accumulation_without_reads_waits_for_nothing():
    got, have = fit(lazy(), CausalLMModule, accumulate_grad_batches=2)
    assert have == auto_start(2)[1] and same_state(auto_start(2)[2], got) == []
    assert waited(got) == 0


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class ReadsUnder(CausalLMModule):
    """Reads every weight before the forward under a context (set per test), the forward under it too where
    it allows grad."""

    context = "no_grad"

    def _ctx(self):
        return {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "user_mode": PassThrough,
                "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[self.context]()

    def training_step(self, batch, batch_idx):
        with self._ctx():
            record(self, {n: p.clone() for n, p in self.named_parameters()})
        if self.context == "user_mode":
            with PassThrough():
                return super().training_step(batch, batch_idx)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "user_mode", "autocast"])
def test_reads_before_the_forward_under_a_context(context):
    cls = type(f"ReadsUnder_{context}", (ReadsUnder,), {"context": context})
    got, have = fit(lazy(), cls)
    check(got, have)
    assert waited(got) > 0
    assert _len_torch_function_stack() == 0


class NoGradForwardFirst(CausalLMModule):
    """A no-grad forward of the whole model, then a read, then the training forward."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self._nll(batch)
        record(self, snap(self))
        return super().training_step(batch, batch_idx)


class ReadsAfterTheForward(CausalLMModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("w", torch.stack([p.detach().norm() for p in self.parameters()]).sum())
        record(self, snap(self))
        return loss


@pytest.mark.parametrize("cls", [NoGradForwardFirst, ReadsAfterTheForward], ids=["between_forwards", "after_forward"])
def test_reads_between_or_after_forwards(cls):
    """The first forward waited for each block (they all run): nothing is read mid-update, no guard wait."""
    got, have = fit(lazy(), cls)
    check(got, have)
    assert waited(got) == 0


class ReadsStateDict(CausalLMModule):
    def training_step(self, batch, batch_idx):
        assert self.trainer.strategy.core is not None
        record(self, {k: v.clone() for k, v in self.state_dict().items()})
        return super().training_step(batch, batch_idx)


def test_state_dict_in_training_step():
    got, have = fit(lazy(), ReadsStateDict)
    want_reads, want, ref = auto_start()
    assert have == want and same_state(ref, got) == []
    assert stale([{k: v for k, v in r.items()} for r in want_reads],
                 [{k: r[k] for k in want_reads[0]} for r in got.read]) == []


class ValReads(ReadsFirst):
    def validation_step(self, batch, batch_idx):
        record(self, snap(self), attr="vread")
        return super().validation_step(batch, batch_idx)


def test_validation_mid_epoch_between_pipelined_steps():
    ref, want = fit("auto", ValReads, val=True, val_check_interval=2, batches=8)
    got, have = fit(lazy(), ValReads, val=True, val_check_interval=2, batches=8)
    assert have == want and same_state(ref, got) == []
    assert stale(ref.read, got.read) == [] and stale(ref.vread, got.vread) == []


def test_updates_in_the_backward_with_reads_before_the_forward():
    ref, want = fit("auto", ReadsFirst, updates_in_backward=True)
    got, have = fit(lazy(updates_in_backward=True), ReadsFirst, updates_in_backward=True)
    assert have == want and same_state(ref, got) == []
    assert stale(ref.read, got.read) == []


@functools.lru_cache(maxsize=None)
def _compiled_norm():
    return torch.compile(lambda ps: torch.stack([p.norm() for p in ps]).sum(), backend="eager")


class CompiledReader(CausalLMModule):
    """A torch.compile'd weight norm (dynamo traces under the guard's mode from step 3)."""

    def training_step(self, batch, batch_idx):
        record(self, {"norm": _compiled_norm()(list(self.parameters())).detach().clone()})
        return super().training_step(batch, batch_idx)


def test_a_compiled_reader_before_the_forward():
    got, have = fit(lazy(), CompiledReader)
    want_reads, want, ref = auto_start()
    assert have == want and same_state(ref, got) == []
    norms = [torch.stack([r[k].norm() for k in r]).sum() for r in want_reads]
    assert all(torch.equal(a, b["norm"]) for a, b in zip(norms, got.read))
    assert waited(got) > 0


class Boom(Exception):
    pass


DEPTHS: list[int] = []


class RaisesInTrainingStep(CausalLMModule):
    where = "before"

    def training_step(self, batch, batch_idx):
        if self.where == "in_user_mode":
            with PassThrough():
                loss = super().training_step(batch, batch_idx)
                if self.trainer.global_step == 2:
                    DEPTHS.append(_len_torch_function_stack())
                    raise Boom()
            return loss
        if self.trainer.global_step == 2:
            DEPTHS.append(_len_torch_function_stack())
            if self.where == "after_read":
                self.model.layers[1].q_proj.weight.detach().norm()
            raise Boom()
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("where", ["before", "after_read", "in_user_mode"])
def test_an_exception_in_training_step_restores_the_mode_stack(where):
    DEPTHS.clear()
    cls = type(f"Raises_{where}", (RaisesInTrainingStep,), {"where": where})
    base = _len_torch_function_stack()
    with pytest.raises(Boom):
        fit(lazy(), cls)
    assert DEPTHS == [base + (2 if where == "in_user_mode" else 1)]  # the guard was on while it raised
    assert _len_torch_function_stack() == base
    got, have = fit(lazy(), ReadsFirst)  # the next fit works, guarded as before
    check(got, have)
    assert waited(got) > 0


def test_a_single_block():
    ref, want = fit("auto", ReadsFirst, layers=1)
    got, have = fit(lazy(layers=1), ReadsFirst, layers=1)
    assert have == want and same_state(ref, got) == []
    assert stale(ref.read, got.read) == []


class ReadsAtBatchStart(CausalLMModule):
    """on_train_batch_start reads the weights, declared honestly (no reads_gradients_only): the step is serial.
    (Declaring ``reads_gradients_only = True`` here is a user's lie: reads 3 and 4 then see blocks mid-update;
    not a defect.)"""

    def on_train_batch_start(self, batch, batch_idx):
        record(self, snap(self))


def test_an_undeclared_reader_at_batch_start():
    got, have = fit(lazy(), ReadsAtBatchStart)
    check(got, have)


class ClampsAtBatchStart(CausalLMModule):
    """The same clipping in on_train_batch_start (the README's way out): before the micro-batch stages anything."""

    def on_train_batch_start(self, batch, batch_idx):
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.05, 0.05)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_weights_edited_in_on_train_batch_start_train_as_under_auto(plan):
    """The hook is a reader between step and forward (Note: [weights read after the step]): a pipelined plan's
    step is waited for, and the edit reaches the masters before the micro-batch stages them."""
    policy = serial() if plan == "serial" else pipelined()
    ref, want = fit("auto", ClampsAtBatchStart)
    got, have = fit(LazyTrainStrategy(policy=policy), ClampsAtBatchStart)
    assert have == want
    assert same_state(ref, got) == []


class ScaleFirst(CausalLMModule):
    """A parameter of the LightningModule itself (no module call reads it) used in training_step before the model
    is called: such a module's micro-batch begins with training_step (Note: [the micro-batch begins at the model's
    call]), its parameter bound, and it trains as under auto."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.loss_scale = torch.nn.Parameter(torch.tensor(1.5))

    def training_step(self, batch, batch_idx):
        scale = self.loss_scale * 1.0
        return super().training_step(batch, batch_idx) * scale


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_a_module_parameter_used_before_the_model_call_trains_as_under_auto(plan):
    policy = serial() if plan == "serial" else pipelined()
    ref, want = fit("auto", ScaleFirst)
    got, have = fit(LazyTrainStrategy(policy=policy), ScaleFirst)
    assert have == want
    assert same_state(ref, got) == []
