"""Review 25: today's changes (KV-cache gradient refusal, evaluation weight gradients, optimizer states converted as
they load, the resumable data order and the app's resume) probed for false refusals, silent differences and
breakage, every case against ``strategy="auto"`` (or the pre-change code, commit cb68e40) on the same seed and data,
fp32 on CPU, ``torch.equal``.

PROBED: training forwards with ``use_cache`` True / False, a prefix cache computed under ``no_grad`` (Dynamic and
Static caches) then a grad continuation, HF gradient checkpointing, on Llama, GPT-2, Qwen2, Mistral (sliding window),
Gemma2, GPT-NeoX, BART (EncoderDecoderCache, cross-attention caches), under the MILP plan, recompute_all, keep_all and
megatrain (all bit-equal to auto by hand; a few kept below for runtime); Fabric evaluation (``fabric.setup``, eval
mode, ``no_grad`` and grad-enabled forwards, trainable-element count, generate, training after it); evaluation
forwards with grad enabled that never backpropagate; HybridAdamW states 32 -> 8 and 8 -> 32 bits (fp32 and bf16
parameters, 1-D, odd sizes, a parameter that never had a gradient, 'step', a converted state saved and reloaded);
``StdlibTextDataModule``'s order against the pre-change loader (epochs 0..2, num_workers 0 and 1, validation
mid-epoch, accumulation) and resumes from ModelCheckpoint files (mid-epoch, at an epoch's end, accumulate 2,
validation mid-epoch, num_workers 1, limit_train_batches, a checkpoint without datamodule state); ``resume_path``
errors; LossHistory; dead writers' temp files; AsyncCheckpointIO routes; 8-bit states without bitsandbytes.
T5 (``T5ForConditionalGeneration`` with 2 encoder / 3 decoder layers) fails under auto itself (IndexError in
transformers' EncoderDecoderCache.update): not probed further.

DEFECTS FOUND (9; 7 fixed the same day -- each test failed before its fix -- and 2 open, README limits,
strict xfails):
1. LOUD, BARE (regression of today's evaluation guard): a model that edits a block's output in place
   (``h = block(h); h.mul_(0.5)``) in an evaluation forward with grad enabled (``Trainer(inference_mode=False)`` +
   ``torch.enable_grad()`` in validation_step, a loss only logged, never backpropagated) fails with torch's
   "Output 0 of RefuseBackward is a view and is being modified inplace ... This behavior is forbidden" where auto
   and the pre-change code (cb68e40) compute it (val losses 0.2058633 / 0.0284099, bit-equal to auto before).
   Training and no_grad evaluation of the same model are fine. Cause: engine/eval_grads.py ``guard_outputs`` ->
   engine/refuse_backward.py ``RefuseBackward`` returns views (``t.view_as(t)``) of the block's outputs, and torch
   forbids in-place edits of a custom Function's view outputs under grad mode (a clone, or returning the
   tensors themselves, would not be views). (test_inplace_edit_of_a_block_output_in_evaluation_with_grad)
   FIXED: the evaluation guard hands out copies.
2. SILENT (pre-existing, cb68e40 too): BART trained on a decoder prefix cache computed under ``no_grad``
   (cross-attention keys/values cached, so the continuation never uses the encoder's output): under auto the
   encoder's parameters get ``grad None`` (AdamW skips them); under lazytrain they get zero gradients (encoder fc1
   grad max 0.0), so AdamW decays them and counts their steps: 88 tensors differ after 2 steps (layer norms by
   2.0e-4, embed_positions 1.5e-5) with bit-equal losses. Cause: the streamed block's node returns a (zero) gradient
   for an input that requires grad (``encoder_hidden_states``) which the block did not use, where autograd gives
   None (engine/block_fn.py, the node's backward). (test_bart_no_grad_prefix_cache_leaves_the_encoder_untouched_like_auto)
   OPEN (README limit).
3. SILENT: a checkpoint at the end of an epoch shortened by ``Trainer(limit_train_batches=2)`` (3 batches per
   epoch in the data) resumes the *old* epoch's permutation: resumed [(1, 523), (2, 719), (2, 879)] vs uninterrupted
   [(1, 719), (1, 879), (2, 623), (2, 523)] ((epoch, window sum)): epoch 0's third batch, which the uninterrupted run
   never trained, then epoch 1's order one epoch late, one batch fewer. Cause: data.py ``StdlibTextDataModule.state_dict`` takes the epoch's length from the dataset
   (``len(order) // batch_size``), not from the Trainer (``num_training_batches``), so ``epoch_done`` is False.
   (test_a_resume_with_limit_train_batches_sees_the_uninterrupted_runs_batches[at-the-limited-epochs-end])
   FIXED: the epoch's length is the Trainer's num_training_batches.
4. SILENT: with ``num_workers=1`` (the module always makes workers persistent) the order differs from the
   pre-change ``DataLoader(shuffle=True, generator=...)`` from epoch 1 on: window sums epoch 1 old [732, 819, 754]
   vs new [754, 732, 879]; new epoch 2 is old epoch 1. With workers the loader prefetches indices past the epoch's
   end, so the old RandomSampler made its trailing (empty) randperm draw, which ResumableOrder never makes (its
   docstring: "it stops at the loader's length" holds in-process only). Resumes with a worker are consistent with
   the new uninterrupted run. (data.py ResumableOrder.__iter__) (test_order_with_a_worker_equals_the_pre_change_loader)
   FIXED: the sampler makes the old loader's in-process draws on its own generator, so the order is the same for
   any number of workers (test_order_with_a_worker_is_the_order_without).
5. SILENT (the review-24 fix covers one route only): ``Trainer(strategy="lazytrain", plugins=[AsyncCheckpointIO()])``
   ends with ``AsyncCheckpointIO(TorchCheckpointIO)``: the verified atomic IO is dropped, as review 24 found for
   the constructor route (a damaged checkpoint then resumes silently). adapters/trainer.py puts VerifiedCheckpointIO
   into a wrapper given to the constructor only; Lightning's connector assigns the plugin afterwards and its getter
   fills the empty wrapper with TorchCheckpointIO. (test_async_checkpoint_io_as_a_trainer_plugin_keeps_the_verified_io)
   FIXED: the strategy's checkpoint_io property fills an empty wrapper with VerifiedCheckpointIO.
6. LOUD, MISLEADING (pre-existing): ``Trainer(strategy=LazyTrainStrategy(), plugins=[AsyncCheckpointIO()])`` is
   refused with Lightning's "checkpoint_io set through both strategy class and plugins, choose one" (the user set it
   once; auto and e.g. DDPStrategy() accept it): the strategy always sets its own checkpoint_io.
   (test_async_checkpoint_io_as_a_plugin_with_a_strategy_instance) FIXED: None is kept until asked for.
7. LOUD, MISLEADING: an 8-bit HybridAdamW checkpoint loaded into ``HybridAdamW(eight_bit='none')`` on a host
   without bitsandbytes fails with "8-bit optimizer states need bitsandbytes>=0.50 ...; eight_bit='none' works
   without it" -- the setting in use. The dequantisation it needs is a table lookup times a block scale (no
   kernel): optim/checkpoint.py ``convert_state`` -> bnb8bit ``dequantized_moments`` -> ``require_bnb``.
   (test_an_8bit_state_loads_into_a_32bit_optimizer_without_bitsandbytes) FIXED: dequantised in torch.
8. LOUD, MISLEADING: with Fabric, ``torch.autograd.grad(eval_loss, model.lm_head.weight)`` in evaluation (the pattern
   Note: [weights in evaluation] calls exact) fails with Lightning's "requires you to call fabric.backward(loss)
   instead of loss.backward()" (no backward was called); Fabric auto computes it. Now that the head's copy requires
   grad the output gets Fabric's backward hook (the lazytrain Fabric strategy overrides backward); the Note does not
   say it holds for the Trainer only. (test_fabric_weight_gradient_in_evaluation_computed_or_refused_by_name)
   OPEN (README limit; the Note now says Trainer only).
9. SILENT (app, pre-existing in cb68e40; met while probing today's checkpoint_every_n_steps, whose default is
   "every val_check_interval steps"): with ``trainer.accumulate_grad_batches=2`` and ``val_check_interval=3``
   (documented as optimizer steps) the app validates after steps [1, 3, 4] (+ before training and after the last:
   [0, 1, 3, 4, 5] vs [0, 3, 5]): cli/train.py passes ``val_check_interval`` to Lightning, whose int counts
   micro-batches. The default checkpoint interval (optimizer steps) then no longer coincides with validation.
   (test_the_app_validates_every_val_check_interval_optimizer_steps_with_accumulation) FIXED: the interval is
   given to Lightning in batches.
   Not a defect, noted: extending a run (max_steps 3, then resume with max_steps 5) restores the short run's LR
   schedule, so step 5 differs from a 5-step run (4.726280 vs 4.595701; step 4 equal) -- as under auto.

PASSING (37, ~35 s on 2 cores): training with use_cache / no_grad prefix caches (Dynamic, Static) / HF gradient
checkpointing bit-equal to auto (Llama, GPT-2 under recompute_all, Gemma2 static prefix, Mistral sliding window under
megatrain, GPT-NeoX keep_all, BART with its cross-attention cache, two continuations of one no_grad prompt cache
per step, Fabric on a no_grad prefix); an EMA swapped in for a grad-enabled validation; caches of training forwards freed after the step as under auto; evaluation
forwards with grad enabled and no backward (also mid-accumulation), the head's weight gradient in validation
mid-accumulation, a frozen model validated with grad enabled, Fabric evaluation (no_grad, grad enabled, trainable
count, generate, training after); HybridAdamW conversions (32 -> 8 within 8-bit error: max error / max |moment|
<= 1e-2 on 1000x3, 64x64, 513x5 and a never-stepped one; 8 -> 32 equal to the dequantised moments, in the
parameter's dtype for bf16; 'step' kept; a converted state saved and reloaded exactly; conversion to 8 bits without
bitsandbytes names it); data order epochs 0..2 (num_workers 0; full batches, a dropped tail, validation every batch,
accumulate 2) equal to the pre-change loader; resumes equal to the uninterrupted run (mid-epoch, epoch end,
accumulate 2, validation mid-epoch, num_workers 1, mid an epoch shortened by limit_train_batches); a checkpoint
without datamodule state resumes as the pre-change code did; bad resume paths give a one-line TrainConfigError;
LossHistory one mean of unscaled micro-batch losses per step (accumulate 2, 3 with a partial window, manual
optimization); a dead writer's temp file goes, a live one's stays; AsyncCheckpointIO given to the strategy keeps
VerifiedCheckpointIO inside.
Also passing by hand, not kept (runtime): every arch above x {use_cache, prefix, static prefix, gradient
checkpointing} under MILP and Llama/GPT-2/Gemma2 x {use_cache, prefix, static prefix} under recompute_all, keep_all,
megatrain; bf16-mixed use_cache and prefix training; bf16-mixed head gradient in validation; BART use_cache=False.
NOT COVERED: a GPU, several processes / sharded optimizer states, torch.compile / torch.func, the SWA callback.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from models import WideBlock
from quiet_logs import quiet_logs
from test_review22_hf_generation import GenNet, batches, build, compare, diffs

from lightning_lazytrain import data as newdata
from lightning_lazytrain.strategy import LazyTrainStrategy

ROOT = Path(__file__).resolve().parents[1]
PRE_CHANGE = "cb68e40"  # the commit before today's changes


# =====================================================================================================
# (1) KV caches in training forwards: bit-equal to auto
# =====================================================================================================
def use_cache(m, b):
    return m.model(**b, use_cache=True).loss


def prefix(m, b):
    ids, mask, lab = b["input_ids"], b["attention_mask"], b["labels"]
    with torch.no_grad():
        pre = m.model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True).past_key_values
    return m.model(input_ids=ids[:, 4:], attention_mask=mask, past_key_values=pre, labels=lab[:, 4:]).loss


def static_prefix(m, b):
    ids, mask, lab = b["input_ids"], b["attention_mask"], b["labels"]
    cache = transformers.StaticCache(config=m.model.config, max_cache_len=16)
    with torch.no_grad():
        m.model(input_ids=ids[:, :4], attention_mask=mask[:, :4], past_key_values=cache, use_cache=True)
    return m.model(input_ids=ids[:, 4:], attention_mask=mask, past_key_values=cache, labels=lab[:, 4:],
                   use_cache=True).loss


def grad_checkpointing(m, b):
    if not m.model.is_gradient_checkpointing:
        m.model.gradient_checkpointing_enable()
    return m.model(**b, use_cache=True).loss


@pytest.mark.parametrize("name, fn, policy", [
    ("llama", use_cache, None),
    ("gpt2", prefix, "recompute_all"),
    ("gemma2", static_prefix, None),
    ("mistral-sw", prefix, "megatrain"),
    ("neox", grad_checkpointing, "keep_all"),
], ids=["llama-use_cache", "gpt2-prefix-recompute_all", "gemma2-static_prefix", "mistral-prefix-megatrain",
        "neox-gc-keep_all"])
def test_training_with_a_cache_equals_auto(name, fn, policy):
    ref, got, _ = compare(lambda: GenNet(name, extra=fn), strategy=LazyTrainStrategy(policy=policy) if policy else None,
                          steps=2, val=False)
    assert len(ref.losses) == 2
    assert diffs(ref, got) == []


# ---- encoder-decoder (BART): EncoderDecoderCache with cross-attention caches ----
BART = dict(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=2, forced_eos_token_id=None)


class Seq2Seq(L.LightningModule):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.BartForConditionalGeneration(
            transformers.BartConfig(**BART, attn_implementation="eager"))
        self.mode, self.losses, self.val, self.grad_none = mode, [], [], None

    def training_step(self, b, i):
        ids, lab = b
        if self.mode == "cache":
            loss = self.model(input_ids=ids, labels=lab, use_cache=True).loss
        else:  # a decoder prefix under no_grad (its cross-attention keys / values cached), then the continuation
            from transformers.models.bart.modeling_bart import shift_tokens_right
            dec = shift_tokens_right(lab, 0, 2)
            with torch.no_grad():
                pre = self.model(input_ids=ids, decoder_input_ids=dec[:, :3], use_cache=True).past_key_values
            logits = self.model(input_ids=ids, decoder_input_ids=dec[:, 3:], past_key_values=pre, use_cache=True).logits
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), lab[:, 3:].flatten())
        self.losses.append(loss.detach().clone())
        return loss

    def on_before_optimizer_step(self, optimizer):
        if self.grad_none is None:
            self.grad_none = sorted(n for n, p in self.named_parameters() if p.grad is None)

    def validation_step(self, b, i):
        ids, lab = b
        self.val.append(self.model(input_ids=ids, labels=lab).loss.detach().clone())
        self.val.append(self.model.generate(input_ids=ids, max_new_tokens=4, do_sample=False).float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def s2s_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 96, (2, 8), generator=g), torch.randint(3, 96, (2, 7), generator=g)) for _ in range(n)]


def run_s2s(strategy, mode):
    with quiet_logs("lightning", "lightning.pytorch", "lightning_lazytrain"):
        m = Seq2Seq(mode)
        t = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      val_check_interval=2)
        t.fit(m, torch.utils.data.DataLoader(s2s_data(2, 1), batch_size=None),
              torch.utils.data.DataLoader(s2s_data(1, 2), batch_size=None))
    return m


def s2s_diffs(a, b):
    out = []
    if not all(torch.equal(x, y) for x, y in zip(a.losses + a.val, b.losses + b.val)):
        out.append(f"losses {[float(x) for x in a.losses]} vs {[float(x) for x in b.losses]}")
    sa, sb = a.state_dict(), b.state_dict()
    bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
    if bad:
        out.append(f"{len(bad)} weights differ: {bad[:3]} (max {max(float((sa[k] - sb[k]).abs().max()) for k in bad):.3g})")
    if a.grad_none != b.grad_none:
        out.append(f"grad None on {len(a.grad_none)} params under auto, {len(b.grad_none)} under lazytrain "
                   f"(e.g. {sorted(set(a.grad_none) - set(b.grad_none))[:2]})")
    return out


def test_bart_training_with_its_cross_attention_cache_equals_auto():
    a, b = run_s2s("auto", "cache"), run_s2s(LazyTrainStrategy(), "cache")
    assert s2s_diffs(a, b) == []


@pytest.mark.xfail(strict=True, reason="OPEN (README limit; silent, pre-existing): encoder params get zero grads instead of None "
                                       "when the decoder blocks do not use encoder_hidden_states (cached cross K/V): "
                                       "AdamW decays them (88 tensors differ, up to 2.0e-4)")
def test_bart_no_grad_prefix_cache_leaves_the_encoder_untouched_like_auto():
    a, b = run_s2s("auto", "prefix"), run_s2s(LazyTrainStrategy(), "prefix")
    assert any("encoder" in n for n in a.grad_none)  # auto: the encoder is not in the graph
    assert s2s_diffs(a, b) == []


# =====================================================================================================
# (2) evaluation with grad enabled
# =====================================================================================================
class InplaceNet(L.LightningModule):
    """emb -> 4 WideBlocks (each output optionally scaled in place) -> head; validation computes its loss with grad
    enabled (``Trainer(inference_mode=False)``) and only logs it."""

    def __init__(self, inplace=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(6, 16)
        self.layers = nn.ModuleList(WideBlock(16) for _ in range(4))
        self.head = nn.Linear(16, 1)
        self.inplace, self.val, self.losses = inplace, [], []

    def forward(self, x):
        h = self.emb(x)
        for b in self.layers:
            h = b(h)
            if self.inplace:
                h.mul_(0.5)
        return self.head(h)

    def training_step(self, b, i):
        loss = self(b).square().mean()
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, b, i):
        with torch.enable_grad():
            loss = self(b).square().mean()
        self.val.append(loss.detach().clone())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run_inplace(strategy, inplace):
    def data(n, seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(4, 5, 6, generator=g) for _ in range(n)]

    with quiet_logs("lightning", "lightning.pytorch", "lightning_lazytrain"):
        m = InplaceNet(inplace)
        t = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      inference_mode=False, val_check_interval=1)
        t.fit(m, torch.utils.data.DataLoader(data(2, 1), batch_size=None),
              torch.utils.data.DataLoader(data(1, 2), batch_size=None))
    return m


def test_an_evaluation_forward_with_grad_and_no_backward_equals_auto():
    a, b = run_inplace("auto", False), run_inplace(LazyTrainStrategy(), False)
    assert len(a.val) == 2
    assert all(torch.equal(x, y) for x, y in zip(a.losses + a.val, b.losses + b.val))


def test_inplace_edit_of_a_block_output_in_evaluation_with_grad():
    """Was DEFECT 1 (loud, bare; a regression of today's guard: 'Output 0 of RefuseBackward is a view and is being
    modified inplace'); fixed: the guard hands out copies in evaluation (refuse_backward.refusing_views(copy=True))."""
    a = run_inplace("auto", True)
    assert [round(float(x), 7) for x in a.val] == [0.2058633, 0.0284099]
    b = run_inplace(LazyTrainStrategy(), True)
    assert all(torch.equal(x, y) for x, y in zip(a.losses + a.val, b.losses + b.val))


def test_the_same_inplace_model_trains_and_validates_under_no_grad_like_auto():
    """the in-place edit itself is fine in training and in no_grad evaluation (so defect 1 is the guard's view)"""

    class NoGradVal(InplaceNet):
        def validation_step(self, b, i):
            self.val.append(self(b).square().mean().detach().clone())

    def run(strategy):
        with quiet_logs("lightning", "lightning.pytorch", "lightning_lazytrain"):
            m = NoGradVal(True)
            g = torch.Generator().manual_seed(1)
            data = [torch.randn(4, 5, 6, generator=g) for _ in range(3)]
            t = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          val_check_interval=1)
            t.fit(m, torch.utils.data.DataLoader(data[:2], batch_size=None),
                  torch.utils.data.DataLoader(data[2:], batch_size=None))
        return m

    a, b = run("auto"), run(LazyTrainStrategy())
    assert len(a.val) == 2
    assert all(torch.equal(x, y) for x, y in zip(a.losses + a.val, b.losses + b.val))


# ---- Fabric ----
def fabric_llama(strategy):
    """(fabric, model, optimizer): the tiny Llama and AdamW set up by Fabric on the CPU."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    model = build("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    return fabric, model, opt


def fabric_run(strategy, *, weight_grad=False):
    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy  # noqa: F401  (registers)

    rec = []
    with quiet_logs("lightning", "lightning.fabric", "lightning_lazytrain"):
        fabric, model, opt = fabric_llama(strategy)
        model.mark_forward_method("generate")
        bs = batches(4)
        for b in bs[:2]:
            model.train()
            loss = model(**b).loss
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            rec.append(loss.detach())
        model.eval()
        with torch.no_grad():
            rec.append(model(**bs[2]).loss)
        rec.append(model(**bs[2]).loss.detach())  # grad enabled, never backpropagated
        if weight_grad:
            (g,) = torch.autograd.grad(model(**bs[2]).loss, model.lm_head.weight)
            rec.append(g)
        rec.append(torch.tensor(float(sum(p.numel() for p in model.parameters() if p.requires_grad))))
        with torch.no_grad():
            rec.append(model.generate(input_ids=bs[3]["input_ids"], attention_mask=bs[3]["attention_mask"],
                                      max_new_tokens=3, do_sample=False).float())
        model.train()
        loss = model(**bs[3]).loss
        fabric.backward(loss)
        opt.step()
        rec.append(loss.detach())
        rec += [p.detach().clone() for p in model.parameters()]
    return rec


def test_fabric_evaluation_with_and_without_grad_equals_auto():
    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy

    a, b = fabric_run("auto"), fabric_run(LazyTrainFabricStrategy())
    assert len(a) == len(b)
    assert [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)] == []


@pytest.mark.xfail(strict=True, reason="OPEN (README limit; loud, misleading): with Fabric, autograd.grad(eval_loss, "
                                       "lm_head.weight) fails with 'call fabric.backward(loss) instead of "
                                       "loss.backward()'; Fabric auto computes it")
def test_fabric_weight_gradient_in_evaluation_computed_or_refused_by_name():
    from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern
    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy

    a = fabric_run("auto", weight_grad=True)
    try:
        b = fabric_run(LazyTrainFabricStrategy(), weight_grad=True)
    except UnsupportedBlockPattern:
        return  # refused by name: acceptable
    assert [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)] == []


# =====================================================================================================
# (3) HybridAdamW: states converted as they load
# =====================================================================================================
def _params(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(300,), (1000, 3), (4097,), (64, 64), (7,), (513, 5)]
    return [nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in shapes]


def _train(opt, ps, steps, seed=1, skip_last=False):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for i, p in enumerate(ps):
            p.grad = None if (skip_last and i == len(ps) - 1) else torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_states_converted_32_to_8_and_back(dtype, caplog):
    pytest.importorskip("bitsandbytes")
    from lightning_lazytrain.optim import HybridAdamW
    from lightning_lazytrain.optim.bnb8bit import dequantized_moments

    ps = _params(dtype)
    a = HybridAdamW(ps, lr=1e-2, eight_bit="none")
    _train(a, ps, 3, skip_last=True)  # the last one never had a gradient
    sd = a.state_dict()
    ps8 = [nn.Parameter(p.detach().clone()) for p in ps]
    b = HybridAdamW(ps8, lr=1e-2, eight_bit="all", min_8bit_numel=1)
    b.load_state_dict(copy.deepcopy(sd))
    eight = [i for i, p in enumerate(ps8) if "state1" in b.state[p]]
    assert eight == [1, 3, 5]  # 2-D ones (1000x3 and 513x5: not multiples of 256)
    assert "converted" in caplog.text
    for i in eight:
        p, s = ps8[i], sd["state"][i]
        m, v = dequantized_moments(b.state[p])
        assert torch.equal(b.state[p]["step"], s["step"])
        for got, want in ((m, s["exp_avg"]), (v, s["exp_avg_sq"])):
            err = float((got.reshape(p.shape) - want.float()).abs().max())
            assert err <= 1e-2 * max(float(want.float().abs().max()), 1e-30), (i, err)
    _train(b, ps8, 1, seed=2)  # steps after conversion
    sd8 = b.state_dict()
    ps32 = [nn.Parameter(p.detach().clone()) for p in ps8]
    c = HybridAdamW(ps32, lr=1e-2, eight_bit="none")
    c.load_state_dict(copy.deepcopy(sd8))
    for i in eight:
        p = ps32[i]
        m, v = dequantized_moments(sd8["state"][i])
        assert c.state[p]["exp_avg"].dtype == p.dtype
        assert torch.equal(c.state[p]["exp_avg"], m.reshape(p.shape).to(p.dtype))
        assert torch.equal(c.state[p]["exp_avg_sq"], v.reshape(p.shape).to(p.dtype))
        assert torch.equal(c.state[p]["step"], sd8["state"][i]["step"])
    _train(c, ps32, 1, seed=3)
    sd32 = c.state_dict()
    d = HybridAdamW([nn.Parameter(p.detach().clone()) for p in ps32], lr=1e-2, eight_bit="none")
    d.load_state_dict(copy.deepcopy(sd32))
    again = d.state_dict()
    for k, st in sd32["state"].items():
        for kk, val in st.items():
            assert torch.equal(again["state"][k][kk], val) if isinstance(val, torch.Tensor) else again["state"][k][kk] == val


# =====================================================================================================
# (4) the data module's order and resume
# =====================================================================================================
@pytest.fixture(scope="module")
def old_data(tmp_path_factory):
    src = subprocess.run(["git", "show", f"{PRE_CHANGE}:lightning_lazytrain/data.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    assert "ResumableOrder" not in src
    path = tmp_path_factory.mktemp("pre_change") / "old_data_r25.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_data_r25", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_data_r25"] = mod
    spec.loader.exec_module(mod)
    return mod


class Seen(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, b, i):
        self.seen.append((self.current_epoch, int(b[0].sum())))
        return self.w.sum() * b[0].float().mean()

    def validation_step(self, b, i):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def dm(mod, nw=0, windows=13):
    return mod.StdlibTextDataModule(seq_len=8, batch_size=4, max_bytes=60000, train_windows=windows, val_windows=2,
                                    seed=3, num_workers=nw)


def trainer(**kw):
    kw.setdefault("enable_checkpointing", bool(kw.get("callbacks")))
    return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     accelerator="cpu", **kw)


def seen(mod, nw=0, windows=13, **kw):
    with quiet_logs("lightning", "lightning.pytorch"):
        m = Seen()
        trainer(max_epochs=3, **kw).fit(m, datamodule=dm(mod, nw, windows))
    return m.seen


@pytest.mark.parametrize("windows, kw", [(12, {}), (13, {}), (10, dict(limit_val_batches=1, val_check_interval=1)),
                                         (13, dict(accumulate_grad_batches=2))],
                         ids=["full-batches", "a-dropped-tail", "validation-every-batch", "accumulate-2"])
def test_order_equals_the_pre_change_loader(old_data, windows, kw):
    old = seen(old_data, 0, windows, **kw)
    assert len({e for e, _ in old}) == 3
    assert seen(newdata, 0, windows, **kw) == old


def test_order_with_a_worker_is_the_order_without(old_data):
    """Was DEFECT 4 (silent: with num_workers=1 the order differed from the pre-change loader from epoch 1 on). The
    pre-change loader's own order depended on the workers (with one, the loader asked past the epoch's end and
    RandomSampler made its trailing draw); the order is now the main process's for any number of workers (data.py
    ResumableOrder), equal to the pre-change loader's without workers (test above)."""
    assert seen(newdata, 1) == seen(newdata, 0) == seen(old_data, 0)
    assert seen(old_data, 1) != seen(old_data, 0)  # (what the pre-change loader did)


@pytest.mark.parametrize("nw, every, kw", [(0, 4, {}), (0, 3, {}), (0, 2, dict(accumulate_grad_batches=2)),
                                           (1, 4, {}), (0, 4, dict(limit_val_batches=1, val_check_interval=2))],
                         ids=["mid-epoch", "epoch-end", "accumulate-2", "one-worker", "validation-mid-epoch"])
def test_a_resume_sees_the_uninterrupted_runs_batches(tmp_path, nw, every, kw):
    from lightning.pytorch.callbacks import ModelCheckpoint

    with quiet_logs("lightning", "lightning.pytorch"):
        m = Seen()
        ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=every, save_top_k=-1, filename="{step}")
        trainer(max_epochs=3, callbacks=[ck], **kw).fit(m, datamodule=dm(newdata, nw))
        (path,) = glob.glob(f"{tmp_path}/step={every}.ckpt")
        m2 = Seen()
        trainer(max_epochs=3, **kw).fit(m2, datamodule=dm(newdata, nw), ckpt_path=path)
    full = m.seen
    assert 0 < len(m2.seen) < len(full)
    assert m2.seen == full[len(full) - len(m2.seen):]
    assert len(full) - len(m2.seen) == (every * kw.get("accumulate_grad_batches", 1) if every != 2 else 3)


def test_a_checkpoint_without_datamodule_state_still_loads(tmp_path, old_data):
    from lightning.pytorch.callbacks import ModelCheckpoint

    with quiet_logs("lightning", "lightning.pytorch"):
        m = Seen()
        ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3, save_top_k=-1, filename="{step}")
        trainer(max_epochs=1, callbacks=[ck]).fit(m, datamodule=dm(old_data))
        state = torch.load(f"{tmp_path}/step=3.ckpt", weights_only=False)
        assert "StdlibTextDataModule" not in state
        m2, m_old = Seen(), Seen()
        trainer(max_epochs=3).fit(m2, datamodule=dm(newdata), ckpt_path=f"{tmp_path}/step=3.ckpt")
        trainer(max_epochs=3).fit(m_old, datamodule=dm(old_data), ckpt_path=f"{tmp_path}/step=3.ckpt")
    # no state to go on from: the order restarts from the seed, as the pre-change code's resume did
    assert len(m2.seen) == 6 and m2.seen == m_old.seen


@pytest.mark.parametrize("value", ["/nonexistent/run", "/tmp"])
def test_a_bad_resume_path_is_one_line(value):
    from lightning_lazytrain.cli.train_checks import TrainConfigError, resume_path

    with pytest.raises(TrainConfigError) as err:
        resume_path(value)
    assert "\n" not in str(err.value) and "no checkpoint" in str(err.value)


def test_an_evaluation_forward_with_grad_mid_accumulation_equals_auto():
    """validation after the first of two micro-batches (the recompute-slot path), grad enabled, no backward"""
    def data(n, seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(4, 5, 6, generator=g) for _ in range(n)]

    def run(strategy):
        with quiet_logs("lightning", "lightning.pytorch", "lightning_lazytrain"):
            m = InplaceNet(False)
            t = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          inference_mode=False, val_check_interval=1, accumulate_grad_batches=2)
            t.fit(m, torch.utils.data.DataLoader(data(4, 1), batch_size=None),
                  torch.utils.data.DataLoader(data(1, 2), batch_size=None))
        return m

    a, b = run("auto"), run(LazyTrainStrategy())
    assert len(a.val) == 4 and len(a.losses) == 4
    assert all(torch.equal(x, y) for x, y in zip(a.losses + a.val, b.losses + b.val))


# =====================================================================================================
# (5) the app's LossHistory, checkpoint IO
# =====================================================================================================
@pytest.mark.parametrize("acc, manual", [(2, False), (3, False), (1, True)], ids=["acc2", "acc3-partial", "manual"])
def test_loss_history_is_one_mean_of_unscaled_micro_batch_losses_per_step(acc, manual):
    from collections import defaultdict

    from lightning_lazytrain.cli.train_callbacks import LossHistory

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.raw = []
            self.automatic_optimization = not manual

        def training_step(self, b, i):
            loss = (self.w * b).sum().square() / 10
            self.raw.append((self.trainer.global_step, float(loss)))
            if manual:
                o = self.optimizers()
                self.manual_backward(loss)
                o.step()
                o.zero_grad()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    data = [torch.randn(3, generator=g) for _ in range(5)]  # 5 per epoch: a partial window at each epoch's end
    m, h = M(), LossHistory()
    with quiet_logs("lightning", "lightning.pytorch"):
        L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=[h], **({} if manual else dict(accumulate_grad_batches=acc))
                  ).fit(m, torch.utils.data.DataLoader(data, batch_size=None))
    per = defaultdict(list)
    for s, loss in m.raw:
        per[s].append(loss)
    want = [(s + 1, sum(v) / len(v)) for s, v in sorted(per.items())]
    assert [s for s, _ in h.train] == [s for s, _ in want]
    assert all(abs(a - b) <= 1e-6 * abs(b) for (_, a), (_, b) in zip(h.train, want))


def test_dead_writers_temp_files_go_and_live_ones_stay(tmp_path):
    from lightning_lazytrain.adapters.checkpoint_io import VerifiedCheckpointIO

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (tmp_path / f".last.ckpt.tmp-{live.pid}").write_bytes(b"x" * 10)
        (tmp_path / f".last.ckpt.tmp-{dead.pid}").write_bytes(b"x" * 10)
        VerifiedCheckpointIO().save_checkpoint({"a": torch.ones(2)}, tmp_path / "last.ckpt")
        left = sorted(p.name for p in tmp_path.iterdir())
    finally:
        live.kill()
        live.wait()
    assert left == sorted([f".last.ckpt.tmp-{live.pid}", "last.ckpt"])


def _inner_io(**kw):
    with quiet_logs("lightning", "lightning.pytorch"):
        t = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, **kw)
    io = t.strategy.checkpoint_io
    return type(io).__name__, type(getattr(io, "checkpoint_io", None)).__name__


def test_async_checkpoint_io_given_to_the_strategy_keeps_the_verified_io():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    assert _inner_io(strategy=LazyTrainStrategy(checkpoint_io=AsyncCheckpointIO())) == (
        "AsyncCheckpointIO", "VerifiedCheckpointIO")


def test_async_checkpoint_io_as_a_trainer_plugin_keeps_the_verified_io():
    """Was DEFECT 5 (silent: the plugins route kept Lightning's plain TorchCheckpointIO inside); fixed: the strategy's
    checkpoint_io property fills an empty wrapper with VerifiedCheckpointIO whichever way it came."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    assert _inner_io(strategy="lazytrain", plugins=[AsyncCheckpointIO()]) == (
        "AsyncCheckpointIO", "VerifiedCheckpointIO")


def test_async_checkpoint_io_as_a_plugin_with_a_strategy_instance():
    """Was DEFECT 6 (loud, misleading: 'checkpoint_io set through both strategy class and plugins'); fixed: the strategy
    keeps None until its checkpoint_io is asked for."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    assert _inner_io(strategy=LazyTrainStrategy(), plugins=[AsyncCheckpointIO()]) == (
        "AsyncCheckpointIO", "VerifiedCheckpointIO")


@pytest.mark.parametrize("every", [
    pytest.param(2,  # was DEFECT 3 (silent): the epoch's length came from the dataset, not the Trainer; fixed
                 id="at-the-limited-epochs-end"),
    pytest.param(3, id="mid-limited-epoch")])
def test_a_resume_with_limit_train_batches_sees_the_uninterrupted_runs_batches(tmp_path, every):
    from lightning.pytorch.callbacks import ModelCheckpoint

    kw = dict(limit_train_batches=2)  # 2 of the 3 batches per epoch
    with quiet_logs("lightning", "lightning.pytorch"):
        m = Seen()
        ck = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=every, save_top_k=-1, filename="{step}")
        trainer(max_epochs=3, callbacks=[ck], **kw).fit(m, datamodule=dm(newdata))
        m2 = Seen()
        trainer(max_epochs=3, **kw).fit(m2, datamodule=dm(newdata), ckpt_path=f"{tmp_path}/step={every}.ckpt")
    full = m.seen
    assert len(full) == 6
    assert m2.seen == full[every:]


class HeadGradInValidation(GenNet):
    """a gradient-norm metric of the (untied) head in validation, grad enabled, no backward"""

    def validation_step(self, batch, batch_idx):
        with torch.enable_grad():
            out = self.model(**batch)
            (g,) = torch.autograd.grad(out.loss, self.model.lm_head.weight)
        self.val.append(out.loss.detach().clone())
        self.generated.append(("g", g.detach().clone()))


def test_a_head_gradient_in_validation_mid_accumulation_equals_auto():
    ref, got, _ = compare(lambda: HeadGradInValidation("llama"), steps=2, val_check_interval=1, inference_mode=False,
                          accumulate_grad_batches=2)
    assert len(ref.generated) == 4
    assert diffs(ref, got) == []


class FrozenGradVal(GenNet):
    """validate only, the whole model frozen, a forward with grad enabled (a saliency-free metric)"""

    def validation_step(self, batch, batch_idx):
        with torch.enable_grad():
            out = self.model(**batch, use_cache=True)
        assert not out.loss.requires_grad
        self.val.append(out.loss.detach().clone())
        self.generated.append(("n", torch.tensor(sum(p.numel() for p in self.parameters() if p.requires_grad))))


def test_a_frozen_model_validated_with_grad_enabled_equals_auto():
    def go(strategy):
        m = FrozenGradVal("llama")
        m.requires_grad_(False)
        with quiet_logs("lightning", "lightning.pytorch", "lightning_lazytrain"):
            t = L.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, inference_mode=False)
            t.validate(m, dataloaders=torch.utils.data.DataLoader(batches(2, seed=5), batch_size=None), verbose=False)
        return m

    ref, got = go("auto"), go(LazyTrainStrategy())
    assert len(ref.val) == 2
    assert diffs(ref, got) == []


def test_caches_of_training_forwards_are_freed_as_under_auto():
    """marking the cached keys / values keeps no cache (nor its tensors) alive after the step"""
    import gc
    import weakref

    refs = []

    def kept(m, b):
        out = m.model(**b, use_cache=True)
        refs.append(weakref.ref(out.past_key_values))
        return out.loss

    from test_review22_hf_generation import run as run22

    for strategy in ("auto", LazyTrainStrategy()):
        refs.clear()
        run22(strategy, lambda: GenNet("llama", extra=kept), steps=3, n_train=3, val=False)
        gc.collect()
        assert len(refs) == 3 and [r() for r in refs if r() is not None] == []


def _without_bnb(monkeypatch):
    from lightning_lazytrain.optim import bnb8bit

    def missing():
        raise ImportError("No module named 'bitsandbytes'")

    monkeypatch.setattr(bnb8bit, "_bnb_functional", None)
    monkeypatch.setattr(bnb8bit, "_import_bnb", missing)


def test_a_conversion_to_8_bits_without_bitsandbytes_names_it(monkeypatch):
    from lightning_lazytrain.optim.checkpoint import convert_state

    p = nn.Parameter(torch.randn(64, 64))
    saved = {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 64), "exp_avg_sq": torch.rand(64, 64)}
    _without_bnb(monkeypatch)
    with pytest.raises(ImportError, match="bitsandbytes"):
        convert_state(p, saved, 8, {})


def test_an_8bit_state_loads_into_a_32bit_optimizer_without_bitsandbytes(monkeypatch):
    """Was DEFECT 7 (loud, misleading: bitsandbytes required to read 8-bit states); fixed: optim/checkpoint.py dequantises
    in torch (bnb8bit.dequantize_blockwise, bitwise bitsandbytes' result: tests/test_optim_bnb.py)."""
    pytest.importorskip("bitsandbytes")
    from lightning_lazytrain.optim import HybridAdamW
    from lightning_lazytrain.optim.bnb8bit import dequantized_moments

    p = nn.Parameter(torch.randn(64, 64))
    a = HybridAdamW([p], lr=1e-2, eight_bit="all", min_8bit_numel=1)
    p.grad = torch.randn(64, 64)
    a.step()
    sd = a.state_dict()
    m, _ = dequantized_moments(sd["state"][0])
    _without_bnb(monkeypatch)
    q = nn.Parameter(p.detach().clone())
    c = HybridAdamW([q], lr=1e-2, eight_bit="none")
    try:
        c.load_state_dict(copy.deepcopy(sd))
    except ImportError as err:
        assert "eight_bit='none' works without it" not in str(err), str(err)
        return
    assert torch.equal(c.state[q]["exp_avg"], m.reshape(q.shape))


def two_continuations(m, b):
    """a shared prompt's cache under no_grad, two continuations with grad (a DPO-like pair): two forwards per step"""
    ids, mask, lab = b["input_ids"], b["attention_mask"], b["labels"]
    with torch.no_grad():
        pre = m.model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True).past_key_values
    other = copy.deepcopy(pre)
    l1 = m.model(input_ids=ids[:, 4:], attention_mask=mask, past_key_values=pre, labels=lab[:, 4:]).loss
    l2 = m.model(input_ids=ids[:, 4:].flip(1), attention_mask=mask, past_key_values=other,
                 labels=lab[:, 4:].flip(1)).loss
    return l1 - 0.5 * l2


def test_two_continuations_of_a_no_grad_prompt_cache_equal_auto():
    ref, got, _ = compare(lambda: GenNet("llama", extra=two_continuations),
                          strategy=LazyTrainStrategy(policy="recompute_all"), steps=2, val=False)
    assert diffs(ref, got) == []


def test_fabric_training_on_a_no_grad_prefix_cache_equals_auto():
    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy

    def go(strategy):
        rec = []
        with quiet_logs("lightning", "lightning.fabric", "lightning_lazytrain"):
            fabric, model, opt = fabric_llama(strategy)
            for b in batches(3):
                ids, mask, lab = b["input_ids"], b["attention_mask"], b["labels"]
                with torch.no_grad():
                    pre = model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True).past_key_values
                loss = model(input_ids=ids[:, 4:], attention_mask=mask, past_key_values=pre, labels=lab[:, 4:]).loss
                fabric.backward(loss)
                opt.step()
                opt.zero_grad()
                rec.append(loss.detach())
            rec += [p.detach().clone() for p in model.parameters()]
        return rec

    a, b = go("auto"), go(LazyTrainFabricStrategy())
    assert [round(float(x), 6) for x in a[:3]] == [4.611869, 4.594762, 4.54188]
    assert [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)] == []


class EMASwap(L.Callback):
    """an EMA of the weights, swapped in for validation (on_validation_start / _end), updated after each batch"""

    def __init__(self):
        self.shadow, self.backup = None, None

    def on_train_batch_end(self, trainer, m, *a):
        with torch.no_grad():
            ps = [p.detach() for p in m.parameters()]
            if self.shadow is None:
                self.shadow = [p.clone() for p in ps]
            else:
                for s, p in zip(self.shadow, ps):
                    s.mul_(0.5).add_(p, alpha=0.5)

    def on_validation_start(self, trainer, m):
        if self.shadow is not None:
            with torch.no_grad():
                self.backup = [p.detach().clone() for p in m.parameters()]
                for p, s in zip(m.parameters(), self.shadow):
                    p.copy_(s)

    def on_validation_end(self, trainer, m):
        if self.backup is not None:
            with torch.no_grad():
                for p, b in zip(m.parameters(), self.backup):
                    p.copy_(b)
            self.backup = None


class GradEnabledVal(GenNet):
    def validation_step(self, batch, batch_idx):
        with torch.enable_grad():
            out = self.model(**batch)
        self.val.append(out.loss.detach().clone())


def test_an_ema_swapped_in_for_a_grad_enabled_validation_equals_auto():
    ref, got, _ = compare(lambda: GradEnabledVal("llama"), steps=4, val_check_interval=2, callbacks=lambda: [EMASwap()],
                          inference_mode=False)
    assert len(ref.val) == 2
    assert diffs(ref, got) == []


def test_the_app_validates_every_val_check_interval_optimizer_steps_with_accumulation(tmp_path):
    """Was DEFECT 9 (silent, app: with accumulation 2 it validated at steps [0, 1, 3, 4, 5] for an interval of 3); fixed:
    cli/train.py gives Lightning the interval in batches."""
    import json

    from lightning_lazytrain.cli.train import train_job
    from test_train_app import FAST, compose_cfg

    train_job(compose_cfg(*FAST, "model.num_layers=2", "trainer.accumulate_grad_batches=2"), tmp_path / "run")
    got = json.loads((tmp_path / "run" / "losses.json").read_text())
    assert [s for s, _ in got["train"]] == [1, 2, 3, 4, 5]
    assert [s for s, _ in got["val"]] == [0, 3, 5]  # before training, every 3 steps, after the last
