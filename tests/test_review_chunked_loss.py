"""Review: Hugging Face causal LMs under ``chunked_loss`` (models/hf_loss.py, models/loss.py, wired by
core/training_core.py ``_install_chunked_loss``).

Held (regression tests): the strategy with ``chunked_loss`` trains as ``strategy="auto"`` (fp32, CPU:
loss per micro-batch, every gradient at every step, the weights after the steps) with masked prompts,
a fully masked row, right-padded attention masks, tied and untied embeddings, ``num_items_in_batch``
with ``accumulate_grad_batches=2`` (a micro-batch without a label included); the refusals by name
(Gemma2's soft-cap, Cohere's ``logit_scale``) surface through ``Trainer.fit``; a plain module is
refused; a module that computes its loss from the logits trains exactly as ``auto``.

Defects (failing tests): the chunked loss silently differs from the module's own loss, beyond the
stated 1e-5 relative, for
- a micro-batch whose labels are all ``ignore_index``: the gradients are NaN (the module's own: 0);
- the BART-family ``...ForCausalLM`` (and CpmAnt), whose own loss does not shift the labels;
- heads that scale or cap the logits under a config attribute the refusal does not know
  (RecurrentGemma ``logits_soft_cap``, Falcon-H1 ``lm_head_multiplier``, Inkling
  ``logits_mup_width_multiplier``), or that ``final_logit_softcapping=1.0`` lets through;
- JetMoe, whose router loss coefficient is ``aux_loss_coef`` (dropped).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning")

from lightning_lazytrain.models.hf_loss import ChunkedLoss  # noqa: E402
from lightning_lazytrain.models.loss import chunked_lm_loss  # noqa: E402
from lightning_lazytrain.strategy import LazyTrainStrategy  # noqa: E402
from quiet_logs import quiet_logs  # noqa: E402

V, B, S = 128, 2, 12
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
RTOL = 1e-5  # the stated tolerance of the loss (models/hf_loss.py); gradients: 1e-4 as tests/test_hf_chunked_loss.py


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the reference's largest entry; a gradient that is zero in exact
    arithmetic (a key bias: softmax ignores it) is rounding noise on both sides, so below 1e-9 counts as 0."""
    return ((a - b).abs().max().clamp_min(1e-9) - 1e-9).div(b.abs().max() + 1e-12).item()


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_logs("lightning"):
        yield


# ---- through the strategy, against strategy="auto" --------------------------------------------------

class HFLM(L.LightningModule):
    """A Llama causal LM whose training step calls it with labels (its own loss or the chunked one)."""

    def __init__(self, tied=False, opt="sgd", items=False, accum=1, model_cls="LlamaForCausalLM", config=None):
        super().__init__()
        torch.manual_seed(0)
        self.model = getattr(transformers, model_cls)(config or transformers.LlamaConfig(
            **LLAMA, tie_word_embeddings=tied, attn_implementation="eager"))
        self.opt, self.items, self.accum = opt, items, accum
        self.losses: list[float] = []
        self.grads: list[dict] = []

    def training_step(self, batch, batch_idx):
        kw = dict(input_ids=batch["input_ids"], labels=batch["labels"])
        if "attention_mask" in batch:
            kw["attention_mask"] = batch["attention_mask"]
        if self.items:
            kw["num_items_in_batch"] = batch["items"]
        loss = self.model(**kw).loss
        self.losses.append(loss.item())
        # with num_items_in_batch the loss is already the step's share: undo Lightning's 1/accumulate
        return loss * self.accum if self.items else loss

    def on_before_optimizer_step(self, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})

    def configure_optimizers(self):
        if self.opt == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(strategy, data, accum=1, **kw) -> HFLM:
    module = HFLM(accum=accum, **kw)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=len(data) // accum,
                        accumulate_grad_batches=accum, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return module


def chunked(tokens=5):
    return LazyTrainStrategy(policy="recompute_all", chunked_loss=tokens)


def batches(n, *, pad=False, masked_rows=(), masked_batches=(), seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, V, (B, S), generator=g)
        labels = ids.clone()
        labels[:, :2] = -100  # a prompt
        d = {"input_ids": ids}
        if pad:  # right padding, its labels ignored
            mask = torch.ones(B, S, dtype=torch.long)
            mask[0, -4:] = 0
            mask[1, -1:] = 0
            labels[mask == 0] = -100
            d["attention_mask"] = mask
        for r in masked_rows:
            labels[r] = -100
        if i in masked_batches:
            labels[:] = -100
        d["labels"] = labels
        out.append(d)
    return out


def assert_same_training(got: HFLM, want: HFLM, *, weight_rtol=1e-4):
    assert torch.allclose(torch.tensor(got.losses), torch.tensor(want.losses), rtol=RTOL, equal_nan=True), \
        (got.losses, want.losses)
    assert len(got.grads) == len(want.grads)
    for step, (gg, gw) in enumerate(zip(got.grads, want.grads)):
        assert gg.keys() == gw.keys()
        for n in gw:
            assert torch.isfinite(gg[n]).all(), (step, n, "non-finite gradient")
            assert rel(gg[n], gw[n]) <= 1e-4, (step, n, rel(gg[n], gw[n]))
    for (n, p), q in zip(got.named_parameters(), want.parameters()):
        assert torch.isfinite(p).all(), (n, "non-finite weight")
        assert rel(p, q) <= weight_rtol, (n, rel(p, q))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_strategy_trains_as_auto_with_prompts_padding_and_a_masked_row(tied):
    data = batches(3, pad=True, masked_rows=(1,))
    want = fit("auto", data, tied=tied)
    got = fit(chunked(), data, tied=tied)
    assert_same_training(got, want)
    assert not got.model._forward_pre_hooks and not got.model._forward_hooks  # taken off at teardown


def test_strategy_num_items_in_batch_with_accumulation_trains_as_auto():
    """Hugging Face's normalisation: each micro-batch's sum over the step's label count; micro-batch 1
    has no label (its loss 0, no gradient)."""
    data = batches(4, pad=True, masked_batches=(1,))
    for k in range(0, 4, 2):
        items = sum(int((d["labels"][:, 1:] != -100).sum()) for d in data[k:k + 2])
        for d in data[k:k + 2]:
            d["items"] = torch.tensor(items)
    want = fit("auto", data, accum=2, items=True)
    got = fit(chunked(), data, accum=2, items=True)
    assert want.losses[1] == 0.0
    assert_same_training(got, want)


def test_a_fully_masked_micro_batch_trains_as_auto():
    """DEFECT. A micro-batch whose labels are all -100 (a batch of prompts; mean reduction, no
    num_items_in_batch): the module's own loss is NaN (0/0) but its gradient is 0, so under "auto" the
    step is the other micro-batch's and training goes on. The chunked loss's gradient is NaN
    (models/loss.py ``_masked_forward``: ``scale = valid / denom`` with ``denom = 0``), so every weight
    becomes NaN."""
    data = batches(4, masked_batches=(1,))
    want = fit("auto", data, accum=2)
    got = fit(chunked(), data, accum=2)
    assert all(torch.isfinite(p).all() for p in want.parameters())
    assert_same_training(got, want)


def test_fully_masked_targets_give_the_gradients_of_cross_entropy():
    """DEFECT (unit level of the above): all targets ignored, with the mean (0 labels) or with
    ``num_items_in_batch=0`` (an accumulation window without a label): F.cross_entropy's gradient is 0,
    the chunked one's NaN."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=g)
    weight = torch.randn(V, 8, generator=g)
    targets = torch.full((6,), -100)
    for items in (None, torch.tensor(0)):
        h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = h1 @ w1.t()
        if items is None:
            want = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
        else:
            want = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / items
        want.backward()
        h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        got = chunked_lm_loss(h2, w2, targets, 4, ignore_index=-100, num_items_in_batch=items)
        got.backward()
        assert torch.equal(h1.grad, torch.zeros_like(h1)) and torch.equal(w1.grad, torch.zeros_like(w1))
        assert torch.isfinite(h2.grad).all() and torch.isfinite(w2.grad).all(), f"num_items_in_batch={items}: NaN"
        assert torch.equal(h2.grad, h1.grad) and torch.equal(w2.grad, w1.grad)


def test_refused_heads_are_refused_through_the_trainer():
    for cls, cfg, attr in [
        ("Gemma2ForCausalLM", transformers.Gemma2Config(**LLAMA, head_dim=8, attn_implementation="eager"),
         "final_logit_softcapping"),
        ("CohereForCausalLM", transformers.CohereConfig(**LLAMA, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                        attn_implementation="eager"), "logit_scale"),
    ]:
        module = HFLM(model_cls=cls, config=cfg)
        trainer = L.Trainer(strategy=chunked(), accelerator="cpu", max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with pytest.raises(ValueError, match=attr):
            trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(1), batch_size=None))


def test_a_plain_module_is_refused():
    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(V, 16)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
            self.head = torch.nn.Linear(16, V)

        def training_step(self, batch, batch_idx):
            h = self.emb(batch)
            for blk in self.blocks:
                h = torch.relu(blk(h))
            return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), batch.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(strategy=chunked(), accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="found no Hugging Face causal LM"):
        trainer.fit(Plain(), train_dataloaders=torch.utils.data.DataLoader([torch.randint(0, V, (2, 9))],
                                                                           batch_size=None))


def test_the_packages_causal_lm_module_takes_the_chunked_loss_within_its_tolerance():
    """CausalLMModule with a Hugging Face model: under chunked_loss it calls the model with labels and the targets
    as given (``shift_labels``), so the chunked loss replaces the full logits' cross-entropy (review 18: before, it
    called the model without labels and the option silently did nothing): the losses within the chunked loss's fp32
    tolerance of "auto" (1e-5 relative), the weights after three AdamW steps within 1e-4."""
    from lightning_lazytrain.lit_module import CausalLMModule

    cfg = dict(model_type="llama", **LLAMA)
    data = [torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def run(strategy):
        torch.manual_seed(0)
        m = CausalLMModule(hf_config=cfg, optimizer="adamw", lr=1e-2)
        losses = []

        class Seen(L.Callback):
            reads_gradients_only = True

            def on_train_batch_end(self, trainer, pl_module, outputs, *args):
                losses.append(outputs["loss"].item())

        L.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[Seen()]).fit(
            m, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        return m, losses

    want, lw = run("auto")
    got, lg = run(chunked(True))
    assert len(lg) == len(lw) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(lg, lw)), (lg, lw)
    for p, q in zip(got.parameters(), want.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-4)


def test_bart_for_causal_lm_trains_as_auto():
    """DEFECT, through the strategy: BartForCausalLM's own loss is the cross-entropy of logits t against
    label t (no shift: the labels are expected shifted already); the chunked loss shifts them."""
    cfg = transformers.BartConfig(**BART)
    data = batches(2)
    want = fit("auto", data, model_cls="BartForCausalLM", config=cfg)
    got = fit(chunked(), data, model_cls="BartForCausalLM", config=cfg)
    assert_same_training(got, want)


# ---- the chunked loss against the module's own, one forward and backward ---------------------------

BART = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
            forced_eos_token_id=None)
INKLING = dict(LLAMA, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
               sliding_window_size=8, d_rel=4, rel_extent=16, moe_intermediate_size=16, n_routed_experts=4,
               num_experts_per_tok=2, n_shared_experts=1, pad_token_id=0)

# name -> (config class, model class, config kwargs, factor on the head's weight: logits as large as a
# trained model's, where a soft-cap bites)
CASES = {
    # the labels are not shifted by the module's own loss
    "bart": ("BartConfig", "BartForCausalLM", BART, 1.0),
    "mbart": ("MBartConfig", "MBartForCausalLM", BART, 1.0),
    "pegasus": ("PegasusConfig", "PegasusForCausalLM", BART, 1.0),
    "blenderbot": ("BlenderbotConfig", "BlenderbotForCausalLM", BART, 1.0),
    # the head transforms the logits under an attribute models/hf_loss.py does not check
    "recurrent_gemma-logits_soft_cap": (
        "RecurrentGemmaConfig", "RecurrentGemmaForCausalLM",
        dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=1, head_dim=8, lru_width=32, attention_window_size=8, conv1d_width=4,
             block_types=["recurrent", "recurrent", "attention"]), 30.0),
    "falcon_h1-lm_head_multiplier": (
        "FalconH1Config", "FalconH1ForCausalLM",
        dict(LLAMA, head_dim=8, lm_head_multiplier=0.25, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
             mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4), 1.0),
    "inkling-logits_mup_width_multiplier": ("InklingTextConfig", "InklingForCausalLM", INKLING, 1.0),
    # final_logit_softcapping=1.0 passes the check `value not in (None, 1, 1.0)`: tanh(x / 1) * 1 is no identity
    "gemma2-final_logit_softcapping=1.0": (
        "Gemma2Config", "Gemma2ForCausalLM", dict(LLAMA, head_dim=8, final_logit_softcapping=1.0), 30.0),
    # the router loss's coefficient is `aux_loss_coef`, not `router_aux_loss_coef`
    "jetmoe-aux_loss_coef": (
        "JetMoeConfig", "JetMoeForCausalLM",
        dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
             intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
             output_router_logits=True, aux_loss_coef=0.5), 1.0),
    # held: the same families without the transform are accepted and equal
    "gemma2-no-softcap": ("Gemma2Config", "Gemma2ForCausalLM", dict(LLAMA, head_dim=8, final_logit_softcapping=None),
                          30.0),
    "cohere-logit_scale=1": ("CohereConfig", "CohereForCausalLM",
                             dict(LLAMA, logit_scale=1.0, pad_token_id=0, bos_token_id=1, eos_token_id=2), 1.0),
    "falcon_h1-multiplier=1": (
        "FalconH1Config", "FalconH1ForCausalLM",
        dict(LLAMA, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
             mamba_chunk_size=4), 1.0),
}


REFUSED = {"recurrent_gemma-logits_soft_cap", "falcon_h1-lm_head_multiplier", "inkling-logits_mup_width_multiplier",
           "gemma2-final_logit_softcapping=1.0"}
UNSHIFTED = {"bart", "mbart", "pegasus", "blenderbot"}  # their own loss takes the labels shifted already


def build_case(name):
    cfg_cls, model_cls, kwargs, factor = CASES[name]
    if not hasattr(transformers, cfg_cls) or not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg).eval()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_probe_refuses_what_no_name_lists(name, monkeypatch):
    """Without the lists of config names, the probe (the module's own loss against the chunked one on a
    tiny input, logits scaled to +-60) refuses each head transform and names both losses."""
    import lightning_lazytrain.models.hf_loss as hf_loss

    monkeypatch.setattr(hf_loss, "_HEAD_SCALES", ())
    monkeypatch.setattr(hf_loss, "_HEAD_CAPS", ())
    model = build_case(name).train()
    before = torch.random.get_rng_state()
    with pytest.raises(ValueError, match="own loss is not the chunked linear"):
        ChunkedLoss(model)
    assert torch.equal(torch.random.get_rng_state(), before)  # the probe leaves the global RNG as it was
    assert all(m.training for m in model.modules())  # the probe ran in eval mode; the modes are restored


@pytest.mark.parametrize("name", list(CASES))
def test_the_chunked_loss_is_the_modules_own_or_refused(name):
    """The contract of models/hf_loss.py: equal within 1e-5 relative (gradients 1e-4), or a ValueError."""
    factor = CASES[name][3]
    model = build_case(name)
    if factor != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(factor)
    ids = torch.randint(3, V, (B, S), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    want_model, got_model = copy.deepcopy(model), copy.deepcopy(model)
    want = want_model(input_ids=ids, labels=labels).loss
    want.backward()
    if name in REFUSED:
        with pytest.raises(ValueError, match="transforms its logits"):
            ChunkedLoss(got_model, chunk_tokens=7)
        return  # refused: the contract holds (the probe's own refusal: test_the_probe_refuses_what_no_name_lists)
    hooks = ChunkedLoss(got_model, chunk_tokens=7)
    assert hooks.shift == (name not in UNSHIFTED)
    got = got_model(input_ids=ids, labels=labels).loss
    got.backward()
    hooks.remove()
    assert abs(got.item() - want.item()) <= RTOL * abs(want.item()), \
        f"{name} accepted, chunked loss {got.item():.6f} != its own {want.item():.6f}"
    for (n, p), q in zip(got_model.named_parameters(), want_model.parameters()):
        if q.grad is None:
            continue
        assert p.grad is not None and rel(p.grad, q.grad) <= 1e-4, n


def test_shift_labels_without_labels_compute_no_loss_as_the_module():
    """The module computes a loss only when it has ``labels``; ``shift_labels`` alone gives none, hooked or not."""
    model = build_case("gemma2-no-softcap")
    ids = torch.randint(3, V, (B, S), generator=torch.Generator().manual_seed(2))
    shift = torch.roll(ids, -1, dims=1)
    assert model(input_ids=ids, shift_labels=shift).loss is None
    hooks = ChunkedLoss(model, chunk_tokens=5)
    out = model(input_ids=ids, shift_labels=shift)
    hooks.remove()
    assert out.loss is None and out.logits.shape[1] == S  # not hooked: the module's own call, all its logits
