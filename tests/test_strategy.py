"""The Lightning strategy: same losses as strategy='auto', accumulation, precision, checkpoints,
resume in a new process, clear errors, clean teardown."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap
import threading

import lightning as L
import pytest
import torch

import lightning_lazytrain
from lightning_lazytrain.planner import InfeasibleBudget, InvalidInput, Schedule
from lightning_lazytrain.strategy import BlockDiscoveryError, LazyTrainStrategy
from models import tiny_llama

transformers = pytest.importorskip("transformers")

LAYERS = 4


class HFModule(L.LightningModule):
    """A tiny Hugging Face LlamaForCausalLM built from a config (no download)."""

    def __init__(self, lr: float = 1e-3, seed: int = 0):
        super().__init__()
        self.model = tiny_llama(seed, layers=LAYERS)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.model(input_ids=batch, labels=batch).loss)

    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch).logits.argmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def batches(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 32), generator=g) for _ in range(n)]


def offload_and_recompute_plan(path) -> str:
    """A plan with a CPU home, a recomputed boundary and a kept layer (written as plan.json)."""
    s = Schedule(num_layers=LAYERS, homes=("gpu", "cpu", "recompute", "gpu", "gpu"),
                 keep_internals=(True, False, False, False), resident_weights=(False,) * LAYERS,
                 offload_window=(None, 1, None, None, None), reload_window=(None, 3, None, None, None),
                 policy="test-cpu-recompute")
    path.write_text(json.dumps({"schedule": s.to_json()}))
    return str(path)


class Losses(L.Callback):
    reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values.append(outputs["loss"].item())


def fit(strategy, data, *, accumulate=1, steps=8, precision="32-true", **kw):
    module = HFModule()
    losses = Losses()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, accumulate_grad_batches=accumulate,
                        precision=precision, logger=False, enable_checkpointing=False, callbacks=[losses],
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, **kw)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return module, losses.values, trainer


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.slow
def test_same_losses_as_auto_with_offload_and_recompute(tmp_path, accumulate):
    data = batches(8 * accumulate)
    _, want, _ = fit("auto", data, accumulate=accumulate)
    plan = offload_and_recompute_plan(tmp_path / "plan.json")
    _, got, trainer = fit(LazyTrainStrategy(policy=plan), data, accumulate=accumulate)
    assert len(got) == len(want) == 8 * accumulate
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
    assert trainer.strategy.executor is None  # torn down


def test_registered_names_and_megatrain_preset(tmp_path):
    from lightning.pytorch.strategies import StrategyRegistry

    LazyTrainStrategy.register_strategies(StrategyRegistry)  # what a second import does: no error
    assert {"lazytrain", "lazytrain_megatrain"} <= set(StrategyRegistry.available_strategies())
    data = batches(2)
    _, got, trainer = fit("lazytrain_megatrain", data, steps=2, default_root_dir=tmp_path)
    assert isinstance(trainer.strategy, lightning_lazytrain.strategy.LazyTrainStrategy)
    assert trainer.strategy.policy == "megatrain"
    assert len(got) == 2


def test_strategy_as_hydra_target():
    from hydra.utils import instantiate

    strategy = instantiate({"_target_": "lightning_lazytrain.strategy.LazyTrainStrategy", "policy": "keep_all"})
    assert isinstance(strategy, LazyTrainStrategy) and strategy.policy == "keep_all"
    _, got, trainer = fit(strategy, batches(2), steps=2)
    assert len(got) == 2 and trainer.strategy.plan is None  # torn down after fit


@pytest.mark.slow
def test_plan_files_and_step_metrics(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    data = batches(4)
    trainer = L.Trainer(strategy="lazytrain", accelerator="cpu", max_steps=4, logger=CSVLogger(tmp_path),
                        enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                        limit_val_batches=0, log_every_n_steps=2)
    trainer.fit(HFModule(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    plan = json.loads((tmp_path / "lightning_logs" / "version_0" / "plan.json").read_text())
    assert plan["status"] in ("optimal", "time_limit") and "predicted" in plan and "setup_seconds" in plan
    for name in ("timeline.png", "timeline_measured.png", "metrics.csv"):
        assert (tmp_path / "lightning_logs" / "version_0" / name).exists(), name
    rows = list(csv.DictReader((tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open()))
    for key in ("lazytrain/step_seconds", "lazytrain/predicted_step_seconds", "lazytrain/stall_seconds",
                "lazytrain/peak_tracked_gb", "lazytrain/h2d_gb", "lazytrain/d2h_gb"):
        assert key in rows[0], key
    # logged through Lightning at its cadence (log_every_n_steps=2: steps 2 and 4), like train_loss
    logged = [r["step"] for r in rows if r["lazytrain/step_seconds"]]
    assert logged == [r["step"] for r in rows if r["train_loss"]] and len(logged) == 2


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.slow
def test_bf16_precisions_train(precision):
    data = batches(4)
    _, want, _ = fit("auto", data, steps=4, precision=precision)
    _, got, _ = fit("lazytrain", data, steps=4, precision=precision)
    assert all(torch.isfinite(torch.tensor(got)))
    assert got == want  # an HF Llama: the same as auto's bf16 training, bit for bit (CPU)


def test_validation_test_and_predict_loops(tmp_path):
    data = batches(4)
    module = HFModule()
    trainer = L.Trainer(strategy="lazytrain", accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=2, val_check_interval=2)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    ref = HFModule()
    ref.load_state_dict(module.state_dict())
    (val,) = L.Trainer(strategy="lazytrain", accelerator="cpu", logger=False, enable_progress_bar=False).validate(
        module, loader, verbose=False)
    with torch.no_grad():
        want = sum(ref.model(input_ids=b, labels=b).loss for b in data) / len(data)
        want_pred = [ref.model(input_ids=b).logits.argmax(-1) for b in data]
    assert val["val_loss"] == pytest.approx(want.item(), rel=1e-5)
    trainer = L.Trainer(strategy="lazytrain", accelerator="cpu", logger=False, enable_progress_bar=False)
    (test,) = trainer.test(module, loader, verbose=False)
    assert test["test_loss"] == pytest.approx(want.item(), rel=1e-5)
    preds = L.Trainer(strategy="lazytrain", accelerator="cpu", logger=False, enable_progress_bar=False).predict(
        module, loader)
    assert all(torch.equal(p, q) for p, q in zip(preds, want_pred))


@pytest.mark.slow
def test_fast_dev_run_and_no_leaked_threads():
    def threads():  # the planner's solver process has one thread for as long as it lives (solver_process.py)
        return sum(t.name != "lazytrain-solver-process" for t in threading.enumerate())

    before = threads()
    for _ in range(3):
        trainer = L.Trainer(strategy="lazytrain", accelerator="cpu", fast_dev_run=True, logger=False,
                            enable_progress_bar=False)
        trainer.fit(HFModule(), train_dataloaders=torch.utils.data.DataLoader(batches(2), batch_size=None))
    assert threads() <= before + 1


@pytest.mark.slow
def test_checkpoint_weights_load_without_this_package(tmp_path):
    _, _, trainer = fit("lazytrain", batches(2), steps=2, default_root_dir=tmp_path)
    trainer.save_checkpoint(tmp_path / "w.ckpt")
    code = textwrap.dedent(f"""
        import sys, torch, transformers
        sys.modules["lightning_lazytrain"] = None  # prove the weights need nothing of ours
        ckpt = torch.load({str(tmp_path / 'w.ckpt')!r}, weights_only=False)
        sd = {{k[len("model."):]: v for k, v in ckpt["state_dict"].items()}}
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        m = transformers.LlamaForCausalLM(cfg)
        missing, unexpected = m.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {{"lm_head.weight"}}, (missing, unexpected)
        assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in sd.values())
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr


RESUME = textwrap.dedent("""
    import json, sys, torch, lightning as L
    sys.path.insert(0, {tests!r})
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_strategy import HFModule, Hybrid8Module, Losses, batches
    import lightning_lazytrain.strategy  # registers strategy="lazytrain"
    for root, resume, steps, optimizer in json.loads(sys.argv[1]):  # the runs, one after another
        module = {{"adamw": HFModule, "hybrid8": Hybrid8Module}}[optimizer]()
        losses = Losses()
        ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{{step}}")
        trainer = L.Trainer(strategy="lazytrain", accelerator="cpu", max_steps=steps, logger=False,
                            callbacks=[losses, ckpt], enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(2), batch_size=None),
                    ckpt_path=resume or None)
        print("LOSSES", json.dumps(losses.values), flush=True)
""")


class Hybrid8Module(HFModule):
    def configure_optimizers(self):
        from lightning_lazytrain.optim import HybridAdamW

        return HybridAdamW(self.parameters(), lr=self.lr, eight_bit="all")


@pytest.fixture(scope="module")
def resume_runs(request, tmp_path_factory) -> dict[str, tuple[list, list, list]]:
    """{optimizer: (losses of 6 steps uninterrupted, of the first 2 steps, of steps 3-6 resumed from the
    step-2 checkpoint)} for the optimizers of the selected cases (requested once the case knows it
    can run): each run a ``RESUME`` process as a user's script; the uninterrupted and the stopped runs
    of every optimizer one after another in one process, the resumed runs in a fresh one."""
    import importlib.util
    import os

    tmp = tmp_path_factory.mktemp("resume")
    script = tmp / "run.py"
    script.write_text(RESUME.format(tests=os.path.dirname(__file__)))
    optimizers = [o for o in ("adamw", "hybrid8")
                  if (o != "hybrid8" or importlib.util.find_spec("bitsandbytes") is not None)
                  and any(getattr(item, "originalname", None) == "test_resumed_run_continues_with_the_same_losses"
                          and item.callspec.params["optimizer"] == o for item in request.session.items)]

    def run(jobs):
        out = subprocess.run([sys.executable, str(script), json.dumps(jobs)], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        losses = [json.loads(line[len("LOSSES "):]) for line in out.stdout.splitlines() if line.startswith("LOSSES ")]
        assert len(losses) == len(jobs), out.stdout[-2000:]
        return losses

    fresh = run([job for o in optimizers for job in ([str(tmp / o / "a"), "", 6, o], [str(tmp / o / "b"), "", 2, o])])
    rest = run([[str(tmp / o / "c"), str(tmp / o / "b" / "step=2.ckpt"), 6, o] for o in optimizers])
    return {o: (fresh[2 * i], fresh[2 * i + 1], rest[i]) for i, o in enumerate(optimizers)}


@pytest.mark.parametrize("optimizer", ["adamw", "hybrid8"])
@pytest.mark.slow
def test_resumed_run_continues_with_the_same_losses(request, optimizer):
    if optimizer == "hybrid8":
        pytest.importorskip("bitsandbytes")

    full, first, rest = request.getfixturevalue("resume_runs")[optimizer]
    assert len(full) == 6 and len(first) == 2 and len(rest) == 4
    assert first == full[:2]
    assert rest == full[2:]  # bit-identical continuation: weights and optimizer state (8-bit too) restored exactly


class HybridModule(HFModule):
    def configure_optimizers(self):
        from lightning_lazytrain.optim import HybridAdamW

        return HybridAdamW(self.parameters(), lr=self.lr, eight_bit="none")  # torch AdamW's defaults


def test_gradient_clip_val_is_fused_into_hybrid_adamw(monkeypatch):
    data = batches(6)
    _, want, _ = fit("auto", data, steps=6, gradient_clip_val=0.05)  # torch AdamW + clip_grad_norm_
    passes = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: passes.append(1) or real(*a, **k))
    import lightning_lazytrain.optim.grad_norms as hybrid  # where HybridAdamW takes its norms

    def no_norm_pass(*a, **k):
        raise AssertionError("the global norm must come from the executor's per-layer norms")

    monkeypatch.setattr(hybrid, "global_grad_norm", no_norm_pass)
    module, losses = HybridModule(), Losses()
    trainer = L.Trainer(strategy="lazytrain", accelerator="cpu", max_steps=6, gradient_clip_val=0.05, logger=False,
                        enable_checkpointing=False, callbacks=[losses], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    opt = trainer.optimizers[0]
    assert passes == []  # no separate clip pass over the gradients
    assert opt.last_clip == 0.05 and opt.last_grad_norm > 0.05  # the clip was active (fused, the step's own)
    assert opt.max_grad_norm is None  # the Trainer's clip is each step's, not made the optimizer's own
    assert max(abs(a - b) for a, b in zip(losses.values, want)) <= 1e-5


@pytest.mark.slow
def test_fused_clip_with_a_loss_scaler_sees_unscaled_norms():
    """16-mixed + HybridAdamW + gradient_clip_val: the executor's norms are taken before the
    plugin unscales the grads; handed over, they must be unscaled too (a CPU GradScaler here)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def run(strategy):
        module, losses = HybridModule(), Losses()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, gradient_clip_val=0.05, logger=False,
                            enable_checkpointing=False, callbacks=[losses], enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(4), batch_size=None))
        return losses.values, trainer.optimizers[0]

    want, _ = run("auto")  # Lightning unscales, then clips with clip_grad_norm_
    got, opt = run("lazytrain")
    assert opt.last_clip == 0.05 and 0.05 < opt.last_grad_norm < 100  # unscaled (scaled: ~1000x larger)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4


class NoStack(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()])

    def training_step(self, batch, batch_idx):
        return self.a(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_model_without_block_stack_lists_candidates():
    trainer = L.Trainer(strategy="lazytrain", accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(BlockDiscoveryError, match="heads"):
        trainer.fit(NoStack(), train_dataloaders=torch.utils.data.DataLoader([torch.randn(2, 4)], batch_size=None))


def test_budget_too_small_gives_the_planners_message():
    trainer = L.Trainer(strategy=LazyTrainStrategy(gpu_memory_budget_gb=1e-6), accelerator="cpu", max_steps=1,
                        logger=False, enable_progress_bar=False)
    with pytest.raises(InfeasibleBudget, match="gpu memory short by"):
        trainer.fit(HFModule(), train_dataloaders=torch.utils.data.DataLoader(batches(1), batch_size=None))


def test_unusable_accelerator_is_a_clear_error():
    from lightning.pytorch.accelerators import Accelerator

    # stands for MPS / XLA / any accelerator the engine cannot drive
    Weird = type("Weird", (Accelerator,), {m: (lambda *a, **k: None) for m in Accelerator.__abstractmethods__})
    s = LazyTrainStrategy()
    s._accelerator = Weird()
    with pytest.raises(RuntimeError, match="CUDA GPU or the CPU"):
        s.root_device


def test_gpu_accelerator_by_name_uses_cuda0():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy="lazytrain", logger=False)
    assert trainer.strategy.root_device == torch.device("cuda", 0)


@pytest.mark.slow
def test_pipelined_hybrid_adamw_step_equals_the_serial_step():
    """With HybridAdamW grouped per block, optimizer.step starts a layer-pipelined update and the
    next forward waits per block; the losses are exactly those of the serial step."""
    from lightning_lazytrain.lit_module import CausalLMModule

    def run(policy):
        torch.manual_seed(0)
        module = CausalLMModule(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
        losses = Losses()
        strategy = LazyTrainStrategy(policy=policy)
        # validation every 2 steps: Lightning zeroes the grads (set_to_none) before it, while the
        # update may still run (the update reads the grads as they were when the step started)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=5, logger=False,
                            enable_checkpointing=False, callbacks=[losses], enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
                            val_check_interval=2, gradient_clip_val=0.5)
        g = torch.Generator().manual_seed(3)
        data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(5)]
        seen = []
        steps = strategy.core.steps  # what the executor waits on before it stages a block
        original = steps.wait_updated
        steps.wait_updated = lambda j: (seen.append(j), original(j))[1]
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None),
                    val_dataloaders=torch.utils.data.DataLoader(data[:1], batch_size=None))
        # extension points only: no method of the module, the optimizer or the plugin was replaced
        assert "zero_grad" not in vars(module) and "step" not in vars(trainer.optimizers[0])
        assert "clip_gradients" not in vars(trainer.precision_plugin)
        assert "optimizer_step" not in vars(trainer.precision_plugin)
        return losses.values, seen

    serial, seen_serial = run("megatrain")  # MegaTrain's policy: serial optimizer
    pipelined, seen = run("recompute_all")  # our executor: pipelined optimizer
    assert seen_serial == [] and set(seen) >= {-1, 0, 1, 2, 3}
    assert pipelined == serial


def test_the_wait_for_a_pipelined_update_is_counted(monkeypatch):
    """StepStats.optimizer_wait_seconds: the seconds the next step waited for the pipelined HybridAdamW
    update before staging a layer (an update slower than the forward shows here; the device kit's fit
    records it). A slowed per-layer update is waited for; a serial step (megatrain) waits for none."""
    import time as _time

    from lightning_lazytrain.lit_module import CausalLMModule
    from lightning_lazytrain.optim import HybridAdamW

    original = HybridAdamW._update_layer

    def slow_update(self, layer, plan):
        _time.sleep(0.03)
        return original(self, layer, plan)

    monkeypatch.setattr(HybridAdamW, "_update_layer", slow_update)

    def run(policy):
        torch.manual_seed(0)
        module = CausalLMModule(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
        strategy = LazyTrainStrategy(policy=policy)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        g = torch.Generator().manual_seed(3)
        data = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(4)]
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        return strategy.core.last_stats, trainer.callback_metrics

    stats, metrics = run("recompute_all")
    assert stats.optimizer_wait_seconds > 0.03  # at least one layer's update was waited for
    assert float(metrics["lazytrain/optimizer_wait_seconds"]) == pytest.approx(stats.optimizer_wait_seconds)
    serial, _ = run("megatrain")
    assert serial.optimizer_wait_seconds == 0.0


def test_a_replan_inside_the_closure_that_makes_the_step_serial_steps_serially(monkeypatch):
    """A re-plan runs at the end of a step's backward, inside the optimizer's closure: when the new
    schedule's optimizer is serial, the step whose closure just re-planned cannot start a pipelined
    update (seen on an H200: a memory re-plan mid-fit raised KeyError in OptimizerSteps.start). The
    plugin then steps the optimizer itself, and training equals the serial run throughout."""
    from lightning_lazytrain.core import planning
    from lightning_lazytrain.lit_module import CausalLMModule

    original = planning.plan_from_workload
    replans = []

    def plan_from_workload(wl, hardware, *, policy="milp", start=None, **kw):
        if start is not None:  # the re-plan: MegaTrain's schedule, whose optimizer step is serial
            replans.append(1)
            policy = "megatrain"
        return original(wl, hardware, policy=policy, start=start, **kw)

    def no_current(*a, **k):  # "the current schedule no longer fits": the re-plan switches
        raise RuntimeError("does not fit")

    class ReplanAtStep2(L.Callback):
        reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                trainer.strategy.core.planner.replan_reason = "test: a forced re-plan"

    def run(policy, callbacks=()):
        torch.manual_seed(0)
        module = CausalLMModule(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
        losses = Losses()
        strategy = LazyTrainStrategy(policy=policy)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=5, logger=False,
                            enable_checkpointing=False, callbacks=[losses, *callbacks], enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, gradient_clip_val=0.5)
        g = torch.Generator().manual_seed(3)
        data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(5)]
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        return losses.values, strategy

    serial, _ = run("megatrain")
    monkeypatch.setattr(planning, "plan_from_workload", plan_from_workload)
    monkeypatch.setattr(planning, "simulate", no_current)
    switched, strategy = run("recompute_all", [ReplanAtStep2()])
    assert replans == [1] and strategy.core.planner.replans[0]["switched"]
    assert switched == serial


def test_named_hardware_profile_and_unknown_name():
    from lightning_lazytrain.config import load_hardware

    hw = LazyTrainStrategy(hardware="h800", gpu_memory_budget_gb=20).core.hardware()
    assert hw.name == "h800" and hw.gpu_memory_cap_bytes == 20e9
    assert load_hardware("rtx3090").gpu_memory_bytes == 24e9
    with pytest.raises(InvalidInput, match="known: .*h800"):
        load_hardware("h900")


@pytest.mark.parametrize("precision,masters,measured", [("32-true", False, False), ("bf16-true", True, True)])
def test_the_host_jobs_fixed_cost_is_measured_only_for_conversions_to_place(monkeypatch, precision, masters,
                                                                             measured):
    """``autoplan.host_job_seconds`` streams a probe model (~0.7 s on the CPU): the strategy runs it when
    the profiled workload has dtype conversions to place, the only pricing that uses it, not at setup
    for every fit; that plan's hardware carries it."""
    from lightning_lazytrain.core import autoplan, planning

    calls = []

    def probe(device, *, link_gb_per_s=None, steps=6):
        calls.append(device)
        return 1e-5

    monkeypatch.setattr(autoplan, "host_job_seconds", probe)
    monkeypatch.setattr(planning, "host_job_seconds", probe)
    module = HFModule()
    plans = []

    class Plan(L.Callback):
        reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            plans.append(trainer.strategy.core.plan)

    trainer = L.Trainer(strategy=LazyTrainStrategy(policy="recompute_all", fp32_masters=masters), accelerator="cpu",
                        max_steps=2, precision=precision, logger=False, enable_checkpointing=False, callbacks=[Plan()],
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches(2), batch_size=None))
    assert bool(calls) is measured
    assert (plans[-1].result.hardware.host_job_seconds > 0) is measured
