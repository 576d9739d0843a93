"""Review of ac1f7f1 (the chunked loss's probe), 47825f4 (checkpoints and evaluation mid-step) and 1312177
(the early non-block parts in the plan).

Defects (failing tests):
- the probe restores the modules' modes by assigning ``training``, not through ``train()``: a Hugging Face
  model with kernels (``use_kernels``) is left kernelized for inference while it trains;
- the probe refuses freshly initialised BART-family models at random (a relative test of a loss near 0);
- a second causal LM refused by the probe leaves the first one hooked (its loss the chunked one, its logits
  one position) after the fit failed;
- Lightning's own exception path (``OnExceptionCheckpoint``) after an error while a step begun in the
  backward is open: the refusal replaces the error and ``trainer._teardown()`` never runs;
- an error between an accumulated step's micro-batches (here: in the mid-step validation 47825f4 made
  possible): teardown raises ``close() inside bind()`` and leaves the compute copies in the module;
- a validation between micro-batches is counted in the step's ``lazytrain/*`` figures (H2D bytes, time);
- the plan prices a part as early that the run never sends in the backward (a part with a weight used before
  the blocks: BLOOM's ``word_embeddings_layernorm``);
- the MILP's T with ``serial_layers=True``: the per-layer mode's row prices the early parts' updates in T
  for a schedule that runs them in the backward (objective != simulator).

Held (regression tests): the probe on a 16-bit Llama (shift found, buffers untouched); tied embeddings: the
planned early part is sent in the backward; the MILP with the mode forced equals the simulator.
"""

from __future__ import annotations

import dataclasses
import importlib
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning")

from lightning_lazytrain.lit_module import CausalLMModule  # noqa: E402

autoplan = importlib.import_module("lightning_lazytrain.core.autoplan")
plan_module = importlib.import_module("lightning_lazytrain.planner.plan")
from lightning_lazytrain.models.hf_loss import ChunkedLoss  # noqa: E402
from lightning_lazytrain.strategy import LazyTrainStrategy  # noqa: E402
from quiet_logs import quiet_logs  # noqa: E402

V = 128
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_logs("lightning", "lightning_lazytrain"):
        yield


def data(n, vocab=256, shape=(4, 33)):
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.DataLoader([torch.randint(0, vocab, shape, generator=g) for _ in range(n)], batch_size=None)


# ---- ac1f7f1: the probe ---------------------------------------------------------------------------------
def test_the_probe_leaves_a_kernelized_model_in_its_training_kernels():
    """DEFECT. ``PreTrainedModel.train(mode)`` also switches a kernelized model's kernels (``kernels_mode``:
    TRAINING / INFERENCE). The probe calls ``model.eval()`` but restores by assigning ``m.training``
    (models/hf_loss.py ``_probe``), so the model trains with ``training=True`` on its inference kernels."""
    kernels = pytest.importorskip("kernels")
    from transformers.utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("transformers finds no usable kernels package")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).train()
    model.use_kernels = True
    assert model.kernels_mode == kernels.Mode.TRAINING
    ChunkedLoss(model)
    assert model.training
    assert model.kernels_mode == kernels.Mode.TRAINING, model.kernels_mode


class SmoothedLlamaForCausalLM(transformers.LlamaForCausalLM):
    """A causal LM whose own loss no name list knows (label smoothing): the probe refuses it."""

    @property
    def loss_function(self):
        def loss(logits, labels, vocab_size, **kwargs):
            labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                     label_smoothing=0.1)
        return loss


def test_a_causal_lm_refused_by_the_probe_leaves_no_hooks_on_the_others():
    """DEFECT. A module with two causal LMs (a policy and a reference model) where the probe refuses the second:
    the fit fails (right), but the first keeps the chunked loss's hooks -- core/training_core.py
    ``_install_chunked_loss`` builds ``[ChunkedLoss(m) ... for m in found]`` in one expression, so the hooks of
    those made before the refusal are never recorded, and teardown removes none. The model then computes the
    chunked loss and one position of logits in a later run without the strategy."""

    class TwoLMs(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.policy = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
            self.ref = SmoothedLlamaForCausalLM(transformers.LlamaConfig(**LLAMA))

        def training_step(self, batch, batch_idx):
            return self.policy(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.policy.parameters(), lr=0.1)

    module = TwoLMs()
    trainer = L.Trainer(strategy=LazyTrainStrategy(policy="recompute_all", chunked_loss=True,
                                                   blocks="policy.model.layers"),
                        accelerator="cpu", max_steps=1, enable_checkpointing=False, **QUIET)
    with pytest.raises(ValueError, match="SmoothedLlamaForCausalLM's own loss is not the chunked"):
        trainer.fit(module, train_dataloaders=data(1, V, (2, 9)))
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = module.policy(input_ids=ids, labels=ids).logits
    assert not module.policy._forward_pre_hooks and not module.policy._forward_hooks
    assert logits.shape[1] == 9


BART = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [4, 6])
def test_the_probe_accepts_a_freshly_initialised_bart(seed, dtype):
    """DEFECT. BartForCausalLM (its own loss unshifted; head tied to the embedding), built from a config as a
    run from scratch does, seeds 4 and 6 (2 of the first 10): the probe feeds labels = the input ids, so
    unshifted each position is asked for its own input token, which a tied head at logits +-60 predicts
    almost surely: the module's loss is ~1e-4..1e-5 (bf16: 0), a difference of numbers near 60, and the
    probe compares relatively only (models/hf_loss.py ``_probe``: ``abs(got - want) <= rtol * abs(want)``, no
    absolute floor), so fp32 rounding (~4e-6 at 60) refuses a model whose loss the chunked one is (error:
    "on a tiny input: 0.000272562, chunked ... 0.000272017 without")."""
    torch.manual_seed(seed)
    model = transformers.BartForCausalLM(transformers.BartConfig(**BART)).to(dtype)
    assert ChunkedLoss(model).shift is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_probe_accepts_16_bit_models(dtype):
    """Held: a 16-bit Llama passes the probe (rtol 1e-2) with the shift; no buffer changes."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(dtype)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    hooks = ChunkedLoss(model)
    assert hooks.shift is True
    hooks.remove()
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())


# ---- 47825f4: checkpoints and evaluation mid-step ---------------------------------------------------------
def test_on_exception_checkpoint_after_an_error_in_a_step_begun_in_the_backward(tmp_path):
    """DEFECT. An error while a step begun in the backward is open (a callback that declares
    reads_gradients_only fails in on_before_optimizer_step; or Ctrl-C), with Lightning's OnExceptionCheckpoint:
    Lightning calls on_exception -> save_checkpoint -> PipelinedSteps.finish(refuse="a checkpoint") raises
    (core/optimizer_steps.py finish), from inside lightning's _call_and_handle_interrupt: the user sees that
    RuntimeError instead of the error (auto: the error, and its checkpoint), and trainer._teardown() is skipped,
    so the executor stays up (blocks' forward patched, copy threads running)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    from test_review_checkpoints import SlowHybridAdamW, make_strategy

    class Boom(L.Callback):
        reads_gradients_only = True

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2:
                raise ValueError("boom")

    def run(kind):
        class Module(CausalLMModule):
            def configure_optimizers(self):
                return SlowHybridAdamW(self.param_groups(), lr=self.lr, eight_bit="none", skip_nonfinite=False,
                                       updates_in_backward=kind == "in_backward")

        torch.manual_seed(0)
        module = Module(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
        trainer = L.Trainer(strategy=make_strategy(kind), accelerator="cpu", max_steps=4, limit_val_batches=0,
                            callbacks=[Boom(), OnExceptionCheckpoint(tmp_path / kind)], **QUIET)
        with pytest.raises(Exception) as err:
            trainer.fit(module, train_dataloaders=data(4))
        return err.value, trainer

    err, _ = run("auto")
    assert isinstance(err, ValueError) and (tmp_path / "auto" / "on_exception.ckpt").exists()
    err, trainer = run("in_backward")
    assert isinstance(err, ValueError) and str(err) == "boom", repr(err)
    # no checkpoint of a half-done step: the weights hold blocks 3..1 updated, the rest not (a warning says so)
    assert not (tmp_path / "in_backward" / "on_exception.ckpt").exists()
    assert trainer.strategy.core.executor is None  # torn down


def test_an_error_between_accumulated_micro_batches_tears_down_cleanly():
    """DEFECT (executor teardown; reachable through the mid-step validation 47825f4 enabled). A validation
    between an accumulated step's micro-batches fails: the non-block weights are still bound by the step
    (Executor._exit) while no micro-batch is open, so Executor.close skips ``_exit.close()`` (it only closes it
    when ``_micro is not None``) and ParamStore.close raises ``close() inside bind()``: that error replaces the
    user's, and the module keeps the bound compute copies instead of its parameters."""

    class Module(CausalLMModule):
        def validation_step(self, batch, batch_idx):
            raise ValueError("boom")

    torch.manual_seed(0)
    module = Module(model_name="tiny", optimizer="adamw", lr_schedule="constant", warmup_steps=0)
    params = dict(module.named_parameters())
    trainer = L.Trainer(strategy=LazyTrainStrategy(policy="recompute_all"), accelerator="cpu", max_steps=3,
                        accumulate_grad_batches=2, val_check_interval=1, limit_val_batches=1,
                        enable_checkpointing=False, **QUIET)
    with pytest.raises(Exception) as err:
        trainer.fit(module, train_dataloaders=data(6), val_dataloaders=data(1))
    assert isinstance(err.value, ValueError) and str(err.value) == "boom", repr(err.value)
    assert [n for n, p in module.named_parameters() if p is not params[n]] == []


def test_a_validation_between_micro_batches_is_not_counted_in_the_step():
    """DEFECT. val_check_interval=1 with accumulate_grad_batches=2: the validation after each step's first
    micro-batch runs inside the step's measurement (engine bytes reset at the first micro-batch, the step's
    time from TrainingCore._t_step): lazytrain/h2d_gb (and step_seconds, which the drift monitor reads) of
    every step include the validation's weight stream."""

    def h2d(val):
        seen = {}

        class Rec(L.Callback):
            reads_gradients_only = True

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if batch_idx % 2:
                    seen[trainer.global_step] = trainer.strategy.core.metrics["lazytrain/h2d_gb"]

        torch.manual_seed(0)
        module = CausalLMModule(model_name="tiny", optimizer="adamw", lr_schedule="constant", warmup_steps=0)
        kw = dict(val_check_interval=1, limit_val_batches=1) if val else dict(limit_val_batches=0)
        L.Trainer(strategy=LazyTrainStrategy(policy="recompute_all"), accelerator="cpu", max_steps=3,
                  accumulate_grad_batches=2, enable_checkpointing=False, callbacks=[Rec()], **QUIET, **kw).fit(
            module, train_dataloaders=data(6), val_dataloaders=data(1) if val else None)
        return seen

    assert h2d(True) == h2d(False)


# ---- 1312177: the early parts in the plan -------------------------------------------------------------------
def _updates_in_backward_where_allowed(s, wl, hw):
    """``with_update_timing`` that takes the updates in the backward wherever the run allows them: the choice
    between the two is a timing margin on this CPU (under load it flipped to the step), and the test is about
    which parts the run then sends early, not about that margin."""
    chosen = plan_module.with_update_timing(s, wl, hw)
    if (chosen.updates_in_backward or not wl.updates_in_backward or s.optimizer != "pipelined" or s.serial_layers
            or s.data_parallel != "none"):
        return chosen
    return dataclasses.replace(s, updates_in_backward=True)


@pytest.mark.parametrize("model", ["bloom", "llama-tied"])
def test_the_planned_early_parts_are_sent_in_the_backward(model, monkeypatch):
    """DEFECT (bloom). PipelinedSteps.planned_early_parts / _early_parts (core/optimizer_steps.py) count a part
    as early when the optimizer's layers lie wholly inside it, not when its gradients are complete before the
    blocks' backward. BLOOM's "head" part (CausalLMModule: every non-Embedding weight outside the blocks) holds
    ``word_embeddings_layernorm``, used before block 0: the run sends the part in T (EarlyParts never completes
    during the blocks' backward), the plan prices it in B{L-1} (its T too short). Held: tied Llama."""
    from test_updates_in_backward import CountingHybridAdamW, Losses

    cfg = (dict(model_type="bloom", vocab_size=V, hidden_size=32, n_layer=3, n_head=4) if model == "bloom" else
           dict(model_type="llama", **LLAMA, tie_word_embeddings=True))

    class Module(CausalLMModule):
        def configure_optimizers(self):
            return CountingHybridAdamW(self.param_groups(), lr=1e-3, eight_bit="none", skip_nonfinite=False,
                                       updates_in_backward=True)

    torch.manual_seed(0)
    module = Module(hf_config=cfg, optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
    losses = Losses()
    monkeypatch.setattr(autoplan, "with_update_timing", _updates_in_backward_where_allowed)
    trainer = L.Trainer(strategy=LazyTrainStrategy(policy="recompute_all"), accelerator="cpu", max_steps=3,
                        enable_checkpointing=False, callbacks=[losses], **QUIET)
    trainer.fit(module, train_dataloaders=data(3, V, (2, 17)))
    assert losses.plan.result.schedule.updates_in_backward
    # the plan prices the head part in B{L-1} exactly where the run sends it there: the profiled step saw
    # its gradients complete early (StepStats.early_complete_parts); BLOOM's holds a norm used before block 0
    early = model != "bloom"
    assert losses.plan.result.workload.early_parts == ((1,) if early else ())
    assert ("head" in trainer.optimizers[0].in_backward) == early, trainer.optimizers[0].in_backward


def _early_instance(seed):
    from test_planner_optimizer_mode import small_instance
    from test_planner_updates_in_backward import in_backward, with_early_parts

    rng = random.Random(1700 + seed)
    base, hw = small_instance(rng, 3)
    base = with_early_parts(base, rng, (600, 400), (1,), opt=(2.0, 6.0))
    return in_backward(dataclasses.replace(base, grad_accum=1)), hw


def test_milp_t_with_serial_layers_equals_the_simulator_with_early_parts():
    """DEFECT. MilpOptions(serial_layers=True): ScheduleModel._t_window (planner/milp_times.py) keeps the per-layer
    mode's row ``cpu_end["pipelined"] * pipe + sum(opt * y)``, the CPU lane's end of the pipelined T, which
    updates the early parts in T; with bwd = 1 (y = 0) it still binds, so a schedule with its updates in the
    backward is priced with the early parts' updates in T (the third T constant is gated by bwd, this row is
    not): tT and the objective exceed the simulator's."""
    import pyomo.environ as pyo

    from lightning_lazytrain.planner import recompute_all, simulate, solve
    from lightning_lazytrain.planner.milp import MilpOptions, ScheduleModel
    from test_planner_optimizer_mode import TIGHT

    wl, hw = _early_instance(5)
    s = dataclasses.replace(recompute_all(3), updates_in_backward=True)
    model = ScheduleModel(wl, hw, MilpOptions(serial_layers=True))
    assert model.y  # the per-layer mode is offered
    model.seed_from(s)
    sim = simulate(s, wl, hw, check=False)
    assert pyo.value(model.m.tT) == pytest.approx(sim.window_seconds["T"], rel=1e-9)
    res = solve(wl, hw, mip_gap=TIGHT, time_limit=30, serial_layers=True)
    assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-6)


@pytest.mark.parametrize("mode", ["auto", "pipelined"])
def test_milp_with_early_parts_equals_the_simulator_without_serial_layers(mode):
    """Held: without the per-layer mode, auto or forced pipelined, the bwd schedule's time is the simulator's."""
    import pyomo.environ as pyo

    from lightning_lazytrain.planner import recompute_all, simulate
    from lightning_lazytrain.planner.milp import MilpOptions, ScheduleModel

    wl, hw = _early_instance(5)
    for bwd in (True, False):
        s = dataclasses.replace(recompute_all(3), updates_in_backward=bwd)
        model = ScheduleModel(wl, hw, MilpOptions(optimizer_mode=mode))
        model.seed_from(s)
        assert pyo.value(model.iteration_time()) == pytest.approx(simulate(s, wl, hw, check=False).iteration_seconds,
                                                                  rel=1e-9)
