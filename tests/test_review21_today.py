"""Review 21: today's mechanisms (a step inside a micro-batch, edits of the bound non-block copies, one version
counter per copy, a Fabric backward that reaches nothing) in combinations the earlier tests do not cover, against
``strategy="auto"`` bit for bit (fp32 on the CPU, same seeds and data; fp32 masters against the plain-PyTorch master
reference of tests/test_fp32_masters.py with the documented merge of an edit).

Probed (Trainer, ``LazyTrainStrategy(policy="megatrain")`` unless said; Fabric, ``LazyTrainFabricStrategy``):
automatic accumulation (``accumulate_grad_batches=2``) with edits between the micro-batches -- in on_train_batch_end /
on_train_batch_start, where the non-block copies stay bound (checked), and in on_after_backward (which makes every
micro-batch whole: the module holds the masters there), in place and by replacing ``.data``; ``keep_compute_copy``;
manual accumulation with edits between and inside; bf16-true + ``fp32_masters`` (host / device conversions, kept
copy) against the plain master reference; a Hugging Face Llama with ``tie_word_embeddings=True``; checkpoints written
after an edit (``trainer.save_checkpoint`` inside training_step and between accumulated micro-batches); validation mid
accumulated step and edits made in validation; ``nn.Embedding(max_norm=...)`` (a built-in in-place edit in the
forward); a pipelined HybridAdamW plan; WGAN clipping with a scheduler; NaN / inf edits; ``torch.inference_mode``;
frozen non-block weights; ``requires_grad_`` toggles; edits in ``on_before_optimizer_step`` of a step inside the
micro-batch; a fit / Fabric loop ending with an open micro-batch; HybridAdamW(updates_in_backward=True) with an edit
between micro-batches; Fabric: an edit then ``fabric.save`` between forward and backward, Lightning's DCGAN shape
(D's ``fabric.backward`` on ``fake.detach()`` reaching nothing, ``fabric.clip_gradients`` and D's step, then G's loss)
and G's micro-batch left without backward with an edit in it; the same DCGAN order with D a non-block module of the
streamed model (Trainer and Fabric); a LightningModule's own parameter clamped; a spectral-normed head.

Fixed the same day (each test's docstring keeps its numbers): the first four below -- evaluation's bind watches
edits, ``on_before_optimizer_step`` edits are taken in after the hooks (adapters/precision.py ``_after_closure``),
the marks include the integer sum of the copy's bit patterns, the executor takes edits in when it closes (Note: [an
edit of a bound copy] in engine/bound_edits.py). Still OPEN, a documented limit: the last (strict xfails).

Found (the first four SILENT differences from auto, the last a refusal where auto trains):

* Edits made during evaluation are lost where the evaluation binds non-block copies of its own
  (``Executor.inference`` binds them without ``watch_edits``): at a step boundary, and also mid-step when every
  micro-batch is whole (an overridden on_after_backward, fp32 masters, manual optimization). A ``.data`` shift in
  on_validation_epoch_end (test_an_edit_in_validation[boundary], [mid-full]) and -- a realistic case -- the in-place
  renorm of ``nn.Embedding(max_norm=1.0)`` for the rows validation looks up
  (test_embedding_max_norm_renorm_in_validation_between_steps: val losses 0.0353271 vs auto 0.0353201, emb.weight
  3.31 off). Mid-step validation with the step's bind held (no on_after_backward) syncs them (passes).
* An edit in ``on_before_optimizer_step`` of an optimizer stepped inside the micro-batch (manual optimization) is lost:
  ``step_inside`` syncs edits before Lightning runs the hook, and after the step ``refresh_bound`` overwrites the
  stepped copies and resets every copy's marks -- the edit of the stepped critic (a clamp before the step) and the
  edit of another weight (the head's bias) both vanish (test_an_edit_in_on_before_optimizer_step_of_a_step_inside).
* A ``.data`` edit of a bound copy that already holds a NaN or an inf is not seen (the version counter does not move
  through ``.data`` and the sum / 2-norm marks stay NaN / inf): later ``.data.mul_`` of the critic lost
  (test_a_data_edit_of_a_copy_that_holds_nan_or_inf; a case beyond the documented "permutation" blind spot).
* An edit inside a micro-batch still open when training ends is lost: ``Executor.close`` drops the bind without
  ``sync_edits`` -- the fit's last training_step edits and returns None (no checkpoint / validation after it)
  (test_an_edit_in_the_fits_last_skipped_training_step), and a Fabric loop ending with G's forward, D's backward that
  reaches nothing and an edit of G, then ``fabric.strategy.teardown()``
  (test_fabric_loop_that_ends_in_an_open_micro_batch_holding_an_edit).
* Refused (by name) where auto trains: Lightning's DCGAN order -- D's loss on ``fake.detach()`` backpropagated and D
  stepped between G's forward and G's loss on the same ``fake`` -- when D is a non-block module of the streamed model:
  in the Trainer (manual optimization; D's ``manual_backward`` always ends G's micro-batch; with ``opt_d.step()`` and
  with ``opt_d.step(closure)``: test_trainer_dcgan_order_with_the_discriminator_inside) and in Fabric (D's backward
  reaches D's bound copies, so Note: [a backward that reaches nothing] does not apply:
  test_fabric_dcgan_order_with_the_discriminator_in_the_streamed_model). G's backward raises "backward through block
  3's forward of an earlier micro-batch ... call manual_backward after each forward".

Passing (kept as regression tests): edits between accumulated micro-batches (bind held or not, in place or by
``.data =``), keep_compute_copy, manual accumulation, fp32 masters (an on_after_backward edit is an fp32 edit of the
masters the module holds; an edit after the forward is the bf16 copy's, merged as documented; host / device / kept
copy alike), the tied Llama (an edit between micro-batches trains as auto; one after the forward is refused as under
auto), checkpoints after edits hold them as auto's do, mid-step validation after an edit, the Embedding renorm in
training, the pipelined plan, WGAN + scheduler, a NaN edit of a used weight, an edit under inference_mode (torch
allows it; both train alike), frozen weights, requires_grad_ toggles, ``.data =`` replacement, updates in the backward,
the WGAN clip with fp32 masters and a kept copy, a LightningModule's own parameter (a logit scale) clamped through
``.data`` before / after the forward, a spectral-normed head (in-place buffer updates in the forward), and the Fabric
save / DCGAN-with-clip (D set up beside the streamed model) / dropped-micro-batch loops.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import lightning as L
import pytest
import torch
from models import DropoutBlock
from test_conformance import Losses, Net, data, fit
from test_fp32_masters import MasterNet
from torch import nn

from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.strategy import LazyTrainStrategy

CLIP = 0.05
POLICY = "megatrain"


def lazy(**kw):
    kw.setdefault("policy", POLICY)
    return LazyTrainStrategy(**kw)


def _gen(module):
    return [p for n, p in module.named_parameters() if not n.startswith("critic")]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where NaN."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(), b.nan_to_num())


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    bad = {k: float((got[k].float() - want[k].float()).abs().nan_to_num(nan=-1.0).max())
           for k in want if not same(got[k], want[k])}
    assert not bad, f"state differs (max abs diff; -1: NaN placement): {bad}"


def assert_same_losses(got, want) -> None:
    norm = lambda ls: [None if isinstance(x, float) and math.isnan(x) else x for x in ls]
    assert norm(got) == norm(want), f"losses differ: lazytrain {got} vs auto {want}"


def train(strategy, module, batches, *, steps=None, val=None, epochs=None, **kw):
    """``fit`` of tests/test_conformance.py with data of one's own (and validation batches: every batch)."""
    losses = Losses()
    torch.manual_seed(11)
    kw.setdefault("enable_checkpointing", False)
    if val is not None:
        kw.update(val_check_interval=1, check_val_every_n_epoch=None, limit_val_batches=len(val))
    else:
        kw.update(limit_val_batches=0)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps if steps is not None else -1,
                        max_epochs=epochs, logger=False, callbacks=[losses], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, **kw)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None),
                val_dataloaders=None if val is None else torch.utils.data.DataLoader(val, batch_size=None))
    return module, losses.values


def both(make, **kw):
    """``make()`` trained under auto and under lazytrain (megatrain): (lazytrain model, losses), (auto ...)."""
    strategy_kw = kw.pop("strategy_kw", {})
    want = fit("auto", make(), **kw)
    got = fit(lazy(**strategy_kw), make(), **kw)
    return got, want


def assert_both_same(make, **kw):
    (got_model, got), (want_model, want) = both(make, **kw)
    assert_same_losses(got, want)
    assert_same_state(got_model.state_dict(), want_model.state_dict())
    return got_model, want_model


# =====================================================================================================================
# 1. automatic accumulation: edits between the micro-batches of a step (the non-block copies stay bound there)
# =====================================================================================================================
class AccEdit(Net):
    """accumulate_grad_batches=2; ``where``: "batch_end" (on_train_batch_end of a step's first micro-batch),
    "batch_start" (on_train_batch_start of its second, before its forward). No on_after_backward: the non-block
    copies stay bound between the micro-batches (an overridden on_after_backward makes every micro-batch whole)."""

    def __init__(self, where):
        super().__init__()
        self.where = where
        self._idx = 0

    def training_step(self, batch, batch_idx):
        self._idx = batch_idx
        return super().training_step(batch, batch_idx)

    def _edit(self):
        with torch.no_grad():
            self.head.weight.mul_(0.9)
            self.emb.bias.clamp_(-0.1, 0.1)
        self.critic.weight.data.clamp_(-CLIP, CLIP)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx % 2 == 0 and self.where == "batch_end":
            self._edit()

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx % 2 == 1 and self.where == "batch_start":
            self._edit()


class AccEditAB(AccEdit):
    """The edits in on_after_backward of a step's first micro-batch (``where="data"``: replacing ``.data``)."""

    def on_after_backward(self):
        if self._idx % 2 == 0 and self.where == "after_backward":
            self._edit()
        if self._idx % 2 == 0 and self.where == "data":
            self.head.weight.data = self.head.weight.data * 0.9
            self.critic.weight.data = self.critic.weight.data.clamp(-CLIP, CLIP)


class SeesBind(L.Callback):
    """Whether the module holds the bound copies (not the masters) in on_train_batch_end of a step's first
    micro-batch: the bind is held between the micro-batches."""

    reads_gradients_only = True

    def __init__(self):
        self.bound: list[bool] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx % 2 == 0 and isinstance(trainer.strategy, LazyTrainStrategy):
            master = trainer.optimizers[0].param_groups[0]["params"][0]  # emb.weight's master
            self.bound.append(module.emb.weight is not master)


@pytest.mark.parametrize("where", ["batch_end", "batch_start", "after_backward", "data"])
def test_edits_between_the_micro_batches_of_an_accumulated_step(where):
    make = (lambda: AccEditAB(where)) if where in ("after_backward", "data") else (lambda: AccEdit(where))
    want_model, want = fit("auto", make(), steps=3, accumulate_grad_batches=2)
    seen = SeesBind()
    got_model, got = fit(lazy(), make(), steps=3, accumulate_grad_batches=2, callbacks_extra=[seen])
    assert_same_losses(got, want)
    assert_same_state(got_model.state_dict(), want_model.state_dict())
    assert got_model.critic.weight.abs().max() <= CLIP
    if where in ("batch_end", "batch_start"):  # the probe reached the bind held between micro-batches
        assert seen.bound and all(seen.bound[1:]), seen.bound


def test_keep_compute_copy_with_edits_between_micro_batches():
    """fp32 on the CPU: keep_compute_copy=True changes nothing (no 16-bit copy), the edits still reach the masters."""
    assert_both_same(lambda: AccEdit("batch_end"), steps=3, accumulate_grad_batches=2,
                     strategy_kw={"keep_compute_copy": True})


# =====================================================================================================================
# 2. manual accumulation: an edit between (masters) and inside (bound copies) the micro-batches
# =====================================================================================================================
class ManualAccEdit(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        h1 = self(batch)
        l1 = self.head(h1).square().mean() + 0.1 * self.critic(h1.detach()).square().mean()
        self.manual_backward(l1 / 2)
        with torch.no_grad():
            self.head.weight.mul_(0.95)  # between the two micro-batches
        h2 = self(batch.flip(1))
        with torch.no_grad():
            self.critic.weight.clamp_(-CLIP, CLIP)  # inside the second, before the critic's use
        l2 = self.head(h2).square().mean() + 0.1 * self.critic(h2.detach()).square().mean()
        self.manual_backward(l2 / 2)
        opt.step()
        opt.zero_grad()
        self.log("train_loss", l1 + l2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_manual_accumulation_with_edits_between_and_inside():
    assert_both_same(ManualAccEdit, steps=4)


# =====================================================================================================================
# 3. bf16-true with fp32 masters (every micro-batch whole: the module holds the fp32 masters between them). The
#    reference: the plain master-weight loop of tests/test_fp32_masters.py; an edit made where the module holds the
#    masters ("between": on_after_backward) is an fp32 edit of the masters; one made inside the micro-batch
#    ("inside": after the forward, on the bf16 copy) is merged as documented (the master takes the copy's value where
#    the two differ in bf16)
# =====================================================================================================================
def _edit16(head_weight, emb_bias):
    with torch.no_grad():
        head_weight.mul_(0.75)
        emb_bias.clamp_(-0.1, 0.1)


class MasterEditRef(MasterNet):
    def __init__(self, where):
        super().__init__()
        self.where = where

    def training_step(self, batch, batch_idx):
        self._idx = batch_idx
        h = self(batch)
        if self.where == "inside":
            _edit16(self.head.weight, self.emb.bias)
            with torch.no_grad():
                for p, m in self.pairs:
                    m.copy_(torch.where(m.to(p.dtype) == p, m, p.float()))
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self):
        super().on_after_backward()  # the gradients folded into the masters
        if self.where == "between" and self._idx % 2 == 0:
            masters = self.masters()
            _edit16(masters["head.weight"], masters["emb.bias"])
            with torch.no_grad():
                for p, m in self.pairs:
                    p.copy_(m)


class LazyEdit16(Net):
    def __init__(self, where):
        super().__init__()
        self.where = where

    def training_step(self, batch, batch_idx):
        self._idx = batch_idx
        h = self(batch)
        if self.where == "inside":
            _edit16(self.head.weight, self.emb.bias)
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self):
        if self.where == "between" and self._idx % 2 == 0:
            _edit16(self.head.weight, self.emb.bias)


@pytest.mark.parametrize("where", ["between", "inside"])
@pytest.mark.parametrize("conversions,keep", [("host", False), ("host", True), ("device", False)])
def test_fp32_masters_take_an_edit(conversions, keep, where):
    kw = {"precision": "bf16-true", "accumulate_grad_batches": 2, "steps": 3}
    ref, want = fit("auto", MasterEditRef(where), **kw)
    got_model, got = fit(lazy(fp32_masters=True, conversions=conversions, keep_compute_copy=keep),
                         LazyEdit16(where), **kw)
    assert got == want
    masters = ref.masters()
    bad = {n: float((p.float() - masters[n]).abs().max()) for n, p in got_model.named_parameters()
           if not n.startswith("critic") and not (p.dtype == torch.float32 and torch.equal(p, masters[n]))}
    assert not bad


# =====================================================================================================================
# 4. tied weights: a Hugging Face Llama with tie_word_embeddings=True (built from a config)
# =====================================================================================================================
class TiedLlama(L.LightningModule):
    """``where``: "between" (the tied weight scaled through lm_head in on_after_backward of a step's first
    micro-batch: accumulate_grad_batches=2), "inside" (scaled through embed_tokens after the forward: lm_head saved
    it, so auto refuses the backward)."""

    def __init__(self, where):
        super().__init__()
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       attn_implementation="eager", tie_word_embeddings=True)
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(cfg)
        assert self.model.lm_head.weight is self.model.model.embed_tokens.weight
        self.where = where
        self._idx = 0

    def training_step(self, batch, batch_idx):
        self._idx = batch_idx
        loss = self.model(input_ids=batch, labels=batch).loss
        if self.where == "inside":
            with torch.no_grad():
                self.model.model.embed_tokens.weight.mul_(0.99)
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self):
        if self.where == "between" and self._idx % 2 == 0:
            with torch.no_grad():
                self.model.lm_head.weight.mul_(0.99)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _tokens(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 12), generator=g) for _ in range(n)]


def test_tied_weight_edited_between_micro_batches():
    want_model, want = train("auto", TiedLlama("between"), _tokens(4), steps=2, accumulate_grad_batches=2)
    got_model, got = train(lazy(), TiedLlama("between"), _tokens(4), steps=2, accumulate_grad_batches=2)
    assert_same_losses(got, want)
    assert got_model.model.lm_head.weight is got_model.model.model.embed_tokens.weight
    assert_same_state(got_model.state_dict(), want_model.state_dict())


def test_tied_weight_edited_after_the_forward_is_refused_as_under_auto():
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train("auto", TiedLlama("inside"), _tokens(2), steps=2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train(lazy(), TiedLlama("inside"), _tokens(2), steps=2)


# =====================================================================================================================
# 5. checkpoints written after an edit inside the micro-batch / between micro-batches
# =====================================================================================================================
class SaveAfterEdit(Net):
    def __init__(self, path, accumulate):
        super().__init__()
        self.path, self.accumulate = str(path), accumulate
        self._idx = 0

    def training_step(self, batch, batch_idx):
        self._idx = batch_idx
        h = self(batch)
        with torch.no_grad():
            self.head.weight.clamp_(-CLIP, CLIP)  # before the head's use
            self.critic.weight.mul_(0.5)
        if self.accumulate == 1 and batch_idx == 1:
            self.trainer.save_checkpoint(self.path)
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.accumulate == 2 and batch_idx == 2:  # the second step's first micro-batch (the bind held)
            with torch.no_grad():
                self.head.bias.add_(0.25)
            self.trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_checkpoint_after_an_edit_holds_the_edit(tmp_path, accumulate):
    want_model, want = fit("auto", SaveAfterEdit(tmp_path / "auto.ckpt", accumulate), steps=3,
                           accumulate_grad_batches=accumulate)
    got_model, got = fit(lazy(), SaveAfterEdit(tmp_path / "lazy.ckpt", accumulate), steps=3,
                         accumulate_grad_batches=accumulate)
    assert_same_losses(got, want)
    assert_same_state(got_model.state_dict(), want_model.state_dict())
    saved_want = torch.load(tmp_path / "auto.ckpt", weights_only=False)["state_dict"]
    saved_got = torch.load(tmp_path / "lazy.ckpt", weights_only=False)["state_dict"]
    assert saved_got["head.weight"].abs().max() <= CLIP
    assert_same_state(saved_got, saved_want)


# =====================================================================================================================
# 6. validation: mid accumulated step after an edit; a module that edits its own weight in its forward
#    (nn.Embedding(max_norm=...) renormalizes the rows it looks up, in place) in training and in validation
# =====================================================================================================================
class ValAfterEdit(AccEdit):
    def __init__(self):
        super().__init__("batch_end")
        self.val: list[float] = []

    def validation_step(self, batch, batch_idx):
        self.val.append(float(self.head(self(batch)).square().mean()))


def test_validation_mid_accumulated_step_after_an_edit():
    val = data(2, seed=5)
    want_model, want = train("auto", ValAfterEdit(), data(), steps=2, val=val, accumulate_grad_batches=2)
    got_model, got = train(lazy(), ValAfterEdit(), data(), steps=2, val=val, accumulate_grad_batches=2)
    assert_same_losses(got, want)
    assert got_model.val == want_model.val and len(want_model.val) == 8
    assert_same_state(got_model.state_dict(), want_model.state_dict())


class ValEdit(ValAfterEdit):
    """accumulate_grad_batches=2, validation after every batch; the head's bias shifted through ``.data`` in
    on_validation_epoch_end: ``when="mid"`` only in the validations between a step's two micro-batches,
    ``"boundary"`` only in those after a step."""

    def __init__(self, when):
        super().__init__()
        self.where = None
        self.when = when

    def on_validation_epoch_end(self):
        mid = self._idx % 2 == 0
        if mid == (self.when == "mid"):
            self.head.bias.data.add_(0.1)


class ValEditFull(ValEdit):
    def on_after_backward(self):  # (overridden: every micro-batch whole, the bind released between them)
        pass




@pytest.mark.parametrize("when", ["mid", "boundary", "mid-full"])
def test_an_edit_in_validation(when):
    """Was OPEN for boundary and mid-full (an edit of a non-block weight during evaluation is lost where the evaluation binds copies of its own
    (Executor.inference binds them without watch_edits: at a step boundary, and mid-step when every micro-batch is
    whole, e.g. on_after_backward overridden): head.bias.data.add_(0.1) in on_validation_epoch_end; boundary:
    losses lazytrain [0.256753, 0.638282, 0.288050, 0.169852] vs auto [.., .., 0.360422, 0.226259], head.bias
    0.1986 off; mid-full: losses [.., 0.638282, 0.288050, 0.169852] vs auto [.., 0.587225, 0.352060, 0.285674]
    (SILENT));
    fixed: evaluation's bind watches edits (Note: [an edit of a bound copy])."""
    val = data(1, seed=5)
    make = (lambda: ValEditFull("mid")) if when == "mid-full" else (lambda: ValEdit(when))
    want_model, want = train("auto", make(), data(), steps=2, val=val, accumulate_grad_batches=2)
    got_model, got = train(lazy(), make(), data(), steps=2, val=val, accumulate_grad_batches=2)
    assert_same_losses(got, want)
    assert got_model.val == want_model.val
    assert_same_state(got_model.state_dict(), want_model.state_dict())


class RenormNet(L.LightningModule):
    """nn.Embedding(40, 16, max_norm=1.0) -> 4 blocks -> Linear(16, 1): every lookup renormalizes the rows it
    reads, in place (torch.embedding_renorm_), under auto on the parameter itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 16, max_norm=1.0)
        self.layers = nn.ModuleList(DropoutBlock(16, 0.0, False) for _ in range(4))
        self.head = nn.Linear(16, 1)
        self.val: list[float] = []

    def forward(self, x):
        h = self.emb(x)
        for b in self.layers:
            h = b(h)
        return h

    def training_step(self, batch, batch_idx):
        loss = self.head(self(batch)).square().mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.val.append(float(self.head(self(batch)).square().mean()))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _ids(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (3, 5), generator=g) for _ in range(n)]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_embedding_max_norm_renorm_in_training(accumulate):
    want_model, want = train("auto", RenormNet(), _ids(4, 0, 40, 1), steps=4 // accumulate,
                             accumulate_grad_batches=accumulate)
    got_model, got = train(lazy(), RenormNet(), _ids(4, 0, 40, 1), steps=4 // accumulate,
                           accumulate_grad_batches=accumulate)
    assert_same_losses(got, want)
    assert_same_state(got_model.state_dict(), want_model.state_dict())


def test_embedding_max_norm_renorm_in_validation_between_steps():
    """Was OPEN (nn.Embedding(max_norm=1.0)'s in-place renorm of the rows validation looks up is lost (the evaluation's
    bind is not watched): val losses lazytrain [0.0863910, 0.0353271, 0.0246458] vs auto [0.0863910, 0.0353201,
    0.0246358]; emb.weight max diff 3.31 (SILENT)); fixed (Note: [an edit of a bound copy]). Validation between
    steps (val_check_interval=1) looks up rows 20..39 that training (rows 0..19) never reads     until the end: auto
    renormalizes them in place there."""
    val = _ids(1, 20, 40, 7)
    want_model, want = train("auto", RenormNet(), _ids(3, 0, 20, 1), steps=3, val=val)
    got_model, got = train(lazy(), RenormNet(), _ids(3, 0, 20, 1), steps=3, val=val)
    assert_same_losses(got, want)
    assert got_model.val == want_model.val
    assert_same_state(got_model.state_dict(), want_model.state_dict())


# =====================================================================================================================
# 7. a pipelined optimizer plan (HybridAdamW, the layer-pipelined step) with edits
# =====================================================================================================================
@functools.cache
def _pipelined_plan() -> str:
    from test_updates_in_backward import plan_file

    from lightning_lazytrain.planner import keep_all

    return plan_file(dataclasses.replace(keep_all(4), optimizer="pipelined", policy="review21-pipelined"))


class HybridEdit(AccEdit):
    def __init__(self):
        super().__init__("batch_end")

    def training_step(self, batch, batch_idx):
        self._idx = batch_idx
        h = self(batch)
        with torch.no_grad():
            self.head.weight.clamp_(-CLIP, CLIP)
            self.critic.weight.mul_(0.5)
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        rest = [p for n, p in self.named_parameters() if not n.startswith(("layers.", "critic"))]
        return HybridAdamW([{"params": rest, "layer": "rest"}] + [
            {"params": list(b.parameters()), "layer": i} for i, b in enumerate(self.layers)], lr=1e-2,
            weight_decay=0.1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_pipelined_plan_with_edits(accumulate):
    want_model, want = fit("auto", HybridEdit(), steps=4 // accumulate, accumulate_grad_batches=accumulate)
    got_model, got = fit(LazyTrainStrategy(policy=_pipelined_plan()), HybridEdit(), steps=4 // accumulate,
                         accumulate_grad_batches=accumulate)
    assert_same_losses(got, want)
    assert_same_state(got_model.state_dict(), want_model.state_dict())


# =====================================================================================================================
# 8. WGAN: the critic stepped inside the micro-batch, clipped, its lr scheduler stepped
# =====================================================================================================================
class WGANSched(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_g, opt_c = self.optimizers()
        h = self(batch)
        opt_c.step()
        opt_c.zero_grad()
        for p in self.critic.parameters():
            p.data.clamp_(-CLIP, CLIP)
        self.lr_schedulers().step()
        loss = self.head(h).square().mean() + 0.1 * self.critic(h.detach()).square().mean()
        self.manual_backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        opt_c = torch.optim.SGD(self.critic.parameters(), lr=0.5, momentum=0.9)
        return [torch.optim.AdamW(_gen(self), lr=1e-2), opt_c], [torch.optim.lr_scheduler.StepLR(opt_c, 1, 0.7)]


def test_wgan_clipping_with_a_scheduler_inside_the_micro_batch():
    got_model, _ = assert_both_same(WGANSched, steps=6)
    assert got_model.critic.weight.abs().max() <= CLIP


# =====================================================================================================================
# 9. edits that produce NaN / inf
# =====================================================================================================================
class NaNEdit(Net):
    """``what``: "used" (a NaN written into the head's weight through .data at batch 1: the loss goes NaN);
    "nan"/"inf" (a NaN / inf written into the unused critic's weight at batch 0 through .data, then the critic halved
    through .data at every later batch)."""

    def __init__(self, what):
        super().__init__()
        self.what = what

    def training_step(self, batch, batch_idx):
        h = self(batch)
        if self.what == "used" and batch_idx == 1:
            self.head.weight.data[0, 3] = float("nan")
        if self.what in ("nan", "inf"):
            if batch_idx == 0:
                self.critic.weight.data[0, 0] = float(self.what)
            else:
                self.critic.weight.data.mul_(0.5)
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss


def test_an_edit_that_makes_the_loss_nan():
    assert_both_same(lambda: NaNEdit("used"), steps=3)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_data_edit_of_a_copy_that_holds_nan_or_inf(value):
    """Was OPEN (a .data edit of a bound copy that holds a NaN or an inf is not seen (EditWatch: the version does not
    move through .data and its sum and norm stay NaN / inf): the critic's later .data.mul_(0.5) is lost,
    critic.weight[0, 1] -0.15527 vs auto -0.03882 after 3 steps, max diff 0.18416 (SILENT)); fixed (Note: [an edit
    of a bound copy])."""
    assert_both_same(lambda: NaNEdit(value), steps=3)


# =====================================================================================================================
# 10. an edit under torch.inference_mode(); edits of frozen non-block weights; requires_grad_ toggles
# =====================================================================================================================
class InferenceModeEdit(Net):
    def training_step(self, batch, batch_idx):
        h = self(batch)
        with torch.inference_mode():
            self.head.weight.mul_(0.5)
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss


def _outcome(strategy, make, **kw):
    try:
        model, losses = fit(strategy, make(), **kw)
    except RuntimeError as err:
        return ("error", str(err).split("\n")[0][:80])
    return ("ok", losses, {k: v.clone() for k, v in model.state_dict().items()})


def test_an_edit_under_inference_mode_inside_the_micro_batch():
    want = _outcome("auto", InferenceModeEdit, steps=3)
    got = _outcome(lazy(), InferenceModeEdit, steps=3)
    assert got[0] == want[0], (got[:2], want[:2])
    if want[0] == "error":
        assert got[1] == want[1]
    else:
        assert_same_losses(got[1], want[1])
        assert_same_state(got[2], want[2])


class FrozenEdit(Net):
    """The embedding frozen (not in the optimizer); edited in place after the forward, and through .data."""

    def __init__(self):
        super().__init__()
        self.emb.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        h = self(batch)
        with torch.no_grad():
            self.emb.weight.mul_(0.9)
        self.emb.bias.data.add_(0.01)
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for n, p in self.named_parameters()
                                  if p.requires_grad and not n.startswith("critic")], lr=1e-2)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_edits_of_frozen_non_block_weights(accumulate):
    assert_both_same(FrozenEdit, steps=4 // accumulate, accumulate_grad_batches=accumulate)


class ToggleEdit(Net):
    """The critic frozen through the module, edited without no_grad, thawed, used; from batch 2 the head frozen for
    good after the forward (and edited without no_grad)."""

    def training_step(self, batch, batch_idx):
        h = self(batch)
        self.critic.requires_grad_(False)
        self.critic.weight.mul_(0.5)
        self.critic.requires_grad_(True)
        if batch_idx == 2:
            self.head.requires_grad_(False)
            self.head.weight.mul_(0.9)
        loss = self.head(h).square().mean() + 0.1 * self.critic(h.detach()).square().mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_requires_grad_toggles_with_edits():
    assert_both_same(ToggleEdit, steps=4)


class DataReplace(Net):
    """``param.data = new_tensor`` (not in place) inside the micro-batch, before the head's use."""

    def training_step(self, batch, batch_idx):
        h = self(batch)
        self.head.weight.data = self.head.weight.data.clamp(-CLIP, CLIP)
        self.critic.weight.data = torch.zeros_like(self.critic.weight.data) + 0.01 * batch_idx
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("accumulate", [1, 2])
def test_replacing_data_inside_the_micro_batch(accumulate):
    got_model, _ = assert_both_same(DataReplace, steps=4 // accumulate, accumulate_grad_batches=accumulate)
    assert got_model.head.weight.abs().max() <= CLIP + 1e-2


# =====================================================================================================================
# 11. an edit in on_before_optimizer_step of an optimizer stepped INSIDE the micro-batch (manual optimization)
# =====================================================================================================================
class HookEditInside(Net):
    """The critic (SGD) stepped between the forward and the loss that uses it; its on_before_optimizer_step edits
    ``what``: "stepped" (clamps the critic it is about to step, as a projection before the step), "other" (shifts
    the head's bias, which the critic's optimizer does not hold)."""

    def __init__(self, what):
        super().__init__()
        self.automatic_optimization = False
        self.what = what

    def on_before_optimizer_step(self, optimizer):
        if isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.SGD):
            with torch.no_grad():
                if self.what == "stepped":
                    self.critic.weight.clamp_(-CLIP, CLIP)
                else:
                    self.head.bias.add_(0.1)

    def training_step(self, batch, batch_idx):
        opt_g, opt_c = self.optimizers()
        h = self(batch)
        opt_c.step()
        opt_c.zero_grad()
        loss = self.head(h).square().mean() + 0.1 * self.critic(h.detach()).square().mean()
        self.manual_backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        self.log("train_loss", loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(_gen(self), lr=1e-2), torch.optim.SGD(self.critic.parameters(), lr=0.1)


@pytest.mark.parametrize("what", ["stepped", "other"])
def test_an_edit_in_on_before_optimizer_step_of_a_step_inside(what):
    """Was OPEN (an edit in on_before_optimizer_step of a step inside the micro-batch is lost (step_inside syncs the
    edits before the hook runs; after the step refresh_bound overwrites the stepped copies and resets every mark):
    'stepped' (critic clamped): losses [0.262442, 0.078979] vs auto [0.258625, 0.064028], critic max |w| 0.2456 vs
    0.0513; 'other' (head.bias +0.1): losses [0.253089, 0.049752] vs auto [.., 0.055689], head.bias 0.186 off
    (SILENT)); fixed (Note: [an edit of a bound copy])."""
    assert_both_same(lambda: HookEditInside(what), steps=4)


# =====================================================================================================================
# 12. a training_step that edits after its forward and returns None (the step skipped) as the fit's last batch
# =====================================================================================================================
class SkipLast(Net):
    def training_step(self, batch, batch_idx):
        h = self(batch)
        with torch.no_grad():
            self.head.weight.clamp_(-CLIP, CLIP)
            self.critic.weight.mul_(0.5)
        if batch_idx == 3:
            return None
        loss = self.head(h).square().mean()
        self.log("train_loss", loss)
        return loss


def test_an_edit_in_the_fits_last_skipped_training_step():
    """Was OPEN (an edit in a micro-batch still open when the fit ends (the last training_step returned None after
    editing) is lost: Executor.close drops the bind without sync_edits; critic.weight[0, 0] 0.0154517 vs auto
    0.0077259 (the last mul_(0.5) missing), max diff 0.01535 (SILENT; a ModelCheckpoint or validation at the epoch's
    end would sync it first)); fixed (Note: [an edit of a bound copy])."""
    want_model, want = train("auto", SkipLast(), data(4), epochs=1)
    got_model, got = train(lazy(), SkipLast(), data(4), epochs=1)
    assert_same_losses(got, want)
    assert_same_state(got_model.state_dict(), want_model.state_dict())


# =====================================================================================================================
# 13. HybridAdamW(updates_in_backward=True) with an edit of the LM head between accumulated micro-batches
# =====================================================================================================================
class ScaleHeadBetween(L.Callback):
    """on_train_batch_end of a step's first micro-batch (an on_after_backward hook would keep the updates for the
    step): the LM head scaled through the module, where the bind is held."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % 2 == 0:
            with torch.no_grad():
                pl_module.model.lm_head.weight.mul_(0.99)


def test_updates_in_backward_with_an_edit_between_micro_batches():
    from test_updates_in_backward import fit_tiny

    want, want_params, _ = fit_tiny(False, accumulate=2, steps=3, callbacks=[ScaleHeadBetween()])
    got, got_params, opt = fit_tiny(True, accumulate=2, steps=3, callbacks=[ScaleHeadBetween()])
    assert "head" in opt.in_backward
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))


# =====================================================================================================================
# 14. Fabric: an edit inside the micro-batch then fabric.save; a backward that reaches nothing then
#     fabric.clip_gradients and steps; a micro-batch no backward reaches that holds an edit
# =====================================================================================================================
def fabric_run(strategy, pattern, path=None, steps=4):
    torch.manual_seed(5)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    net = Net()
    opt_g = torch.optim.AdamW(_gen(net), lr=1e-2)
    net, opt_g = fabric.setup(net, opt_g)
    torch.manual_seed(6)
    disc = nn.Linear(16, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    disc, opt_d = fabric.setup(disc, opt_d)
    g = torch.Generator().manual_seed(3)
    losses, saved = [], None
    for k in range(steps):
        x = torch.randn(3, 5, 6, generator=g)
        h = net(x)
        if pattern == "save":
            with torch.no_grad():
                net.head.weight.mul_(0.5)
                net.critic.weight.clamp_(-CLIP, CLIP)
            if k == 2:
                fabric.save(path, {"model": net})
                saved = torch.load(path, weights_only=True)["model"]
            loss = net.head(h).square().mean()
            fabric.backward(loss)
        else:  # DCGAN: D's loss on h.detach() reaches nothing of the streamed model
            err_d = disc(h.detach()).square().mean()
            fabric.backward(err_d)
            fabric.clip_gradients(disc, opt_d, max_norm=0.01)
            opt_d.step()
            opt_d.zero_grad()
            if pattern == "dcgan-skip" and k % 2 == 1:  # G's backward skipped; its head edited in the open batch
                with torch.no_grad():
                    net.head.weight.mul_(0.5)
                losses.append(err_d.item())
                continue
            loss = net.head(h).square().mean() + 0.1 * disc(h).square().mean()
            fabric.backward(loss)
            fabric.clip_gradients(net, opt_g, max_norm=0.05)
        opt_g.step()
        opt_g.zero_grad()
        losses.append(loss.item())
    state = {n: p.detach().clone() for n, p in net.module.named_parameters()}
    state.update({f"disc.{n}": p.detach().clone() for n, p in disc.named_parameters()})
    if isinstance(fabric.strategy, LazyTrainFabricStrategy):
        fabric.strategy.teardown()
        state.update({n: p.detach().clone() for n, p in net.module.named_parameters()})
    return losses, state, saved


@pytest.mark.parametrize("pattern,steps", [("save", 4), ("dcgan", 4), ("dcgan-skip", 5)])
def test_fabric_edits_saves_and_backwards_that_reach_nothing(pattern, steps, tmp_path):
    """dcgan-skip: at odd iterations G's loss is never backpropagated and G's head is edited in its open micro-batch
    (dropped at the next forward); the loop ends with a complete iteration."""
    want, want_state, want_saved = fabric_run("auto", pattern, tmp_path / "auto.ckpt", steps)
    got, got_state, got_saved = fabric_run(LazyTrainFabricStrategy(policy=POLICY), pattern, tmp_path / "lazy.ckpt",
                                           steps)
    assert_same_losses(got, want)
    assert_same_state(got_state, want_state)
    if pattern == "save":
        assert_same_state(got_saved, want_saved)


def test_fabric_loop_that_ends_in_an_open_micro_batch_holding_an_edit(tmp_path):
    """Was OPEN (Fabric, an edit in the micro-batch still open when the loop ends (D's backward reached nothing, G's
    head halved, no G backward) is lost at fabric.strategy.teardown() (Executor.close without sync_edits):
    head.weight max |w| 0.12381 vs auto 0.06191, max diff 0.0619 (SILENT)); fixed (Note: [an edit of a bound copy]).
    The same loop ending at an odd iteration: its last micro-batch (G's forward, D's backward that reaches nothing,
    G's head edited) is still open when the loop ends; ``fabric.strategy.teardown()`` then closes it."""
    want, want_state, _ = fabric_run("auto", "dcgan-skip", None, 4)
    got, got_state, _ = fabric_run(LazyTrainFabricStrategy(policy=POLICY), "dcgan-skip", None, 4)
    assert_same_losses(got, want)
    assert_same_state(got_state, want_state)


# =====================================================================================================================
# 15. bf16-true + fp32 masters + keep_compute_copy=True: WGAN clipping after a step inside the micro-batch
# =====================================================================================================================
@pytest.mark.parametrize("conversions", ["host", "device"])
def test_wgan_clipping_with_fp32_masters_and_a_kept_compute_copy(conversions):
    """The kept 16-bit copy is valid for one micro-batch only (Note: [kept compute copy]); a step and an edit inside
    it change the masters: the run equals the one without the kept copy, and the clip reached the masters."""
    from test_review19_inside_edits import WGANClip

    runs = [fit(lazy(fp32_masters=True, conversions=conversions, keep_compute_copy=keep), WGANClip(), steps=4,
                precision="bf16-true") for keep in (False, True)]
    (a, la), (b, lb) = runs
    assert la == lb
    assert_same_state(b.state_dict(), a.state_dict())
    assert b.critic.weight.dtype == torch.float32 and b.critic.weight.abs().max().item() <= CLIP * 1.01


# =====================================================================================================================
# 16. a parameter of the LightningModule itself (a CLIP-style logit scale clamped through .data in training_step:
#     such a module begins its micro-batch when training_step does) and a spectral-normed head (its power iteration
#     updates the module's buffers in place in every training forward)
# =====================================================================================================================
class LogitScale(Net):
    def __init__(self, before):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.2))
        self.before = before

    def training_step(self, batch, batch_idx):
        if self.before:
            self.scale.data.clamp_(0.5, 0.9)
        h = self(batch)
        if not self.before:
            self.scale.data.clamp_(0.5, 0.9)
        loss = (self.head(h) * self.scale).square().mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(_gen(self), lr=5e-2)


@pytest.mark.parametrize("before", [True, False], ids=["before_forward", "after_forward"])
def test_a_logit_scale_of_the_lightning_module_clamped(before):
    got_model, _ = assert_both_same(lambda: LogitScale(before), steps=4)
    assert 0.5 <= got_model.scale.item() <= 0.9 + 5e-2


class SpectralHead(Net):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.head = nn.utils.parametrizations.spectral_norm(nn.Linear(16, 1))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_spectral_normed_head(accumulate):
    assert_both_same(SpectralHead, steps=4 // accumulate, accumulate_grad_batches=accumulate)


# =====================================================================================================================
# 17. Trainer, manual optimization: Lightning's DCGAN order with the discriminator inside the LightningModule (a
#     non-block module): D's loss on fake.detach() backpropagated and D stepped between G's forward and G's loss on
#     the same fake; and the same with D's step taking a closure (D's forward and backward inside the step)
# =====================================================================================================================
class DCGANInside(Net):
    def __init__(self, closure):
        super().__init__()
        self.automatic_optimization = False
        self.closure = closure

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        fake = self(batch)

        def d_step():
            real = torch.ones(3, 5, 16)
            d_loss = self.critic(fake.detach()).square().mean() + (1 - self.critic(real)).square().mean()
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            return d_loss

        if self.closure:
            opt_d.step(closure=d_step)
        else:
            d_step()
            opt_d.step()
        opt_d.zero_grad()
        g_loss = self.head(fake).square().mean() + 0.1 * (1 - self.critic(fake)).square().mean()
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.log("train_loss", g_loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(_gen(self), lr=1e-2), torch.optim.SGD(self.critic.parameters(), lr=0.1)


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
    "OPEN (a documented limit, README): refused where auto trains: D's manual_backward (on fake.detach(); it reaches D's bound copies, not a block) "
    "ends G's micro-batch, and G's manual_backward then raises 'backward through block 3's forward of an earlier "
    "micro-batch ... call manual_backward after each forward' (the user did). Fabric keeps such a micro-batch open "
    "(Note: [a backward that reaches nothing]) only when the backward reaches no bound copy either; the Trainer "
    "always ends it. Both with opt_d.step() after the backward and with opt_d.step(closure)"))
@pytest.mark.parametrize("closure", [False, True], ids=["step", "closure"])
def test_trainer_dcgan_order_with_the_discriminator_inside(closure):
    assert_both_same(lambda: DCGANInside(closure), steps=4)


def fabric_dcgan_inside(strategy, steps=4):
    """Fabric, the discriminator a non-block module of the streamed model (``net.critic``)."""
    torch.manual_seed(5)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    net = Net()
    opt_g = torch.optim.AdamW(_gen(net), lr=1e-2)
    opt_d = torch.optim.SGD(net.critic.parameters(), lr=0.1)
    net, opt_g, opt_d = fabric.setup(net, opt_g, opt_d)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        fake = net(torch.randn(3, 5, 6, generator=g))
        err_d = net.critic(fake.detach()).square().mean()
        fabric.backward(err_d)
        opt_d.step()
        opt_d.zero_grad()
        loss = net.head(fake).square().mean() + 0.1 * (1 - net.critic(fake)).square().mean()
        fabric.backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        losses.append(loss.item())
    state = {n: p.detach().clone() for n, p in net.module.named_parameters()}
    if isinstance(fabric.strategy, LazyTrainFabricStrategy):
        fabric.strategy.teardown()
    return losses, state


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason=(
    "OPEN (a documented limit, README): Fabric, the DCGAN order with D a non-block module of the streamed model: D's fabric.backward reaches D's "
    "bound copies, so Note: [a backward that reaches nothing] does not keep G's micro-batch open, and G's backward "
    "raises 'backward through block 3's forward of an earlier micro-batch' where auto trains"))
def test_fabric_dcgan_order_with_the_discriminator_in_the_streamed_model():
    want, want_state = fabric_dcgan_inside("auto")
    got, got_state = fabric_dcgan_inside(LazyTrainFabricStrategy(policy=POLICY))
    assert_same_losses(got, want)
    assert_same_state(got_state, want_state)
