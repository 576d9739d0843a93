"""Review: checkpoints and resume while pipelined updates are in flight, bit for bit ``strategy="auto"``.

A tiny ``CausalLMModule`` (LlamaLM) with a slow ``HybridAdamW`` (each layer's host update sleeps, so a
pipelined step is still running when Lightning's hooks come) under a plan file that forces a pipelined
step (``keep_all`` + ``optimizer="pipelined"``), with or without ``updates_in_backward``. Every case compares
what a checkpoint holds (weights, optimizer states, schedulers, loops) and how a resumed run goes on
against ``strategy="auto"`` run the same way, and against the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_lazytrain.lit_module import CausalLMModule
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.planner import keep_all
from lightning_lazytrain.strategy import LazyTrainStrategy
from test_updates_in_backward import plan_file

KINDS = ("pipelined", "in_backward")


class SlowHybridAdamW(HybridAdamW):
    """Each layer's host update takes 5 ms: a pipelined step is still running when the step returns."""

    def _update_layer(self, layer, plan):
        time.sleep(0.005)
        super()._update_layer(layer, plan)


@functools.cache
def pipelined_plan(in_backward: bool) -> str:
    return plan_file(dataclasses.replace(keep_all(4), optimizer="pipelined", updates_in_backward=in_backward,
                                         policy="review-checkpoints"))


def make_strategy(kind: str, **kw):
    if kind == "auto":
        return "auto"
    if kind == "milp":
        return LazyTrainStrategy(**kw)
    return LazyTrainStrategy(policy=pipelined_plan(kind == "in_backward"), **kw)


class Losses(L.Callback):
    reads_gradients_only = True  # reads no weight (Note: [weights read after the step])

    def __init__(self):
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(outputs["loss"].item())


def fit(kind: str, *, steps: int, batches: int, accumulate: int = 1, precision: str = "32-true", callbacks=(),
        ckpt_path=None, val_check_interval=None, save_in_step=None, **strategy_kw):
    """``steps`` optimizer steps over an epoch of ``batches`` batches (repeated); an LR scheduler that
    changes the lr every step. ``save_in_step=(epoch, batch_idx, path)``: ``trainer.save_checkpoint``
    from ``training_step`` there. Returns the final parameters, the losses and the trainer."""
    in_backward = kind == "in_backward"

    class Module(CausalLMModule):
        def configure_optimizers(self):
            opt = SlowHybridAdamW(self.param_groups(), lr=self.lr, eight_bit="none", skip_nonfinite=False,
                                  updates_in_backward=in_backward)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if save_in_step is not None and (self.current_epoch, batch_idx) == save_in_step[:2]:
                self.trainer.save_checkpoint(save_in_step[2])
            return loss

    torch.manual_seed(0)
    module = Module(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
    losses = Losses()
    val = dict(val_check_interval=val_check_interval, limit_val_batches=1) if val_check_interval else \
        dict(limit_val_batches=0)
    checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)  # no default ModelCheckpoint in the cwd
    trainer = L.Trainer(strategy=make_strategy(kind, **strategy_kw), accelerator="cpu", max_steps=steps, max_epochs=-1,
                        logger=False, enable_checkpointing=checkpointing, callbacks=[losses, *callbacks],
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        accumulate_grad_batches=accumulate, precision=precision, **val)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(batches)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None),
                val_dataloaders=torch.utils.data.DataLoader(data[:1], batch_size=None) if val_check_interval else None,
                ckpt_path=ckpt_path)
    return [p.detach().clone() for p in module.parameters()], losses.values, trainer


def load(path) -> dict:
    return torch.load(path, weights_only=False, map_location="cpu")


def differences(a: dict, b: dict) -> list:
    """Where two checkpoints differ: weights (dtype or bits), optimizer states and groups, schedulers, loops."""
    out = []
    for k, v in a["state_dict"].items():
        w = b["state_dict"][k]
        if v.dtype != w.dtype or not torch.equal(v, w):
            out.append((k, str(v.dtype), str(w.dtype), (v.float() - w.float()).abs().max().item()))
    for oa, ob in zip(a.get("optimizer_states", []), b.get("optimizer_states", [])):
        for i, st in oa["state"].items():
            out += [("optimizer", i, key) for key, v in st.items() if not torch.equal(v, ob["state"][i][key])]
        if oa["param_groups"] != ob["param_groups"]:
            out.append(("optimizer param_groups",))
    out += [(key,) for key in ("lr_schedulers", "loops", "global_step", "epoch") if a.get(key) != b.get(key)]
    return out


def equal_params(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def max_diff(a: list, b: list) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


# ---- what held: regression tests -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("review_checkpoints")


@functools.cache
def every_step_checkpoints(kind: str, accumulate: int, root: str) -> dict[str, dict]:
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, save_last=True, filename="{step}")
    fit(kind, steps=4, batches=4 * accumulate, accumulate=accumulate, callbacks=[ckpt])
    return {p.name: load(p) for p in sorted(Path(root).glob("*.ckpt"))}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_checkpoints_written_while_updates_run_equal_autos(kind, accumulate, shared_root):
    """ModelCheckpoint(every_n_train_steps=1, save_last=True) saves right after each step, while its
    pipelined updates (or those queued by a step begun in the backward) still run: every file holds what
    auto's holds, bit for bit -- no half-updated weight or optimizer state."""
    want = every_step_checkpoints("auto", accumulate, str(shared_root / f"auto{accumulate}"))
    got = every_step_checkpoints(kind, accumulate, str(shared_root / f"{kind}{accumulate}"))
    assert sorted(got) == sorted(want) == ["last.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt", "step=4.ckpt"]
    for name in want:
        assert differences(got[name], want[name]) == [], name


@pytest.mark.parametrize("kind", ["auto", *KINDS])
@pytest.mark.parametrize("accumulate,precision", [(1, "32-true"), (2, "32-true"), (2, "bf16-true")])
def test_resume_at_an_epoch_end_continues_bit_equal(kind, accumulate, precision, tmp_path):
    """Checkpoints every 2 steps (one epoch); the run resumed from step 2 goes on with the losses and final
    weights of the uninterrupted run, which equals auto's."""
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    kw = dict(steps=5, batches=2 * accumulate, accumulate=accumulate, precision=precision)
    full, full_losses, _ = fit(kind, callbacks=[ckpt], **kw)
    resumed, resumed_losses, _ = fit(kind, ckpt_path=str(tmp_path / "step=2.ckpt"), **kw)
    assert resumed_losses == full_losses[-len(resumed_losses):] and len(resumed_losses) == 3 * accumulate
    assert equal_params(resumed, full), max_diff(resumed, full)
    if kind != "auto":
        auto, auto_losses, _ = fit("auto", **kw)
        assert full_losses == auto_losses and equal_params(full, auto)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_fp32_masters_resume_continues_bit_equal(kind, accumulate, tmp_path):
    """bf16-true with fp32 masters (restored after setup): a step-2 checkpoint (every_n_train_steps) holds the
    fp32 masters and the resumed run trains on exactly as the uninterrupted one."""
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    kw = dict(steps=5, batches=2 * accumulate, accumulate=accumulate, precision="bf16-true", fp32_masters=True)
    full, full_losses, _ = fit(kind, callbacks=[ckpt], **kw)
    assert all(v.dtype == torch.float32 for v in load(tmp_path / "step=2.ckpt")["state_dict"].values())
    resumed, resumed_losses, _ = fit(kind, ckpt_path=str(tmp_path / "step=2.ckpt"), **kw)
    assert resumed_losses == full_losses[-len(resumed_losses):]
    assert equal_params(resumed, full), max_diff(resumed, full)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("accumulate,batch_idx", [(1, 2), (2, 2), (2, 3)])
def test_save_checkpoint_in_training_step_equals_autos_and_resumes_like_it(kind, accumulate, batch_idx, tmp_path):
    """``trainer.save_checkpoint`` from ``training_step`` (the previous step's updates may still run; with
    accumulation in the step's first or last micro-batch): the file equals auto's, and a run resumed from it
    goes on as auto's resumed run."""
    kw = dict(steps=4, batches=4 * accumulate, accumulate=accumulate)
    runs = {}
    for k in ("auto", kind):
        path = tmp_path / f"{k}.ckpt"
        fit(k, save_in_step=(0, batch_idx, str(path)), **kw)
        runs[k] = (load(path), *fit(k, ckpt_path=str(path), **kw)[:2])
    assert differences(runs[kind][0], runs["auto"][0]) == []
    assert runs[kind][2] == runs["auto"][2] and equal_params(runs[kind][1], runs["auto"][1])


@pytest.mark.parametrize("kind", KINDS)
def test_mid_epoch_validation_checkpoint_equals_autos_and_resumes_like_it(kind, tmp_path):
    """val_check_interval=3 in an epoch of 4: ModelCheckpoint saves at the validation's end (mid-epoch);
    the file equals auto's and a resume from it goes on as auto's."""
    kw = dict(steps=6, batches=4, val_check_interval=3)
    runs = {}
    for k in ("auto", kind):
        ckpt = ModelCheckpoint(dirpath=tmp_path / k, save_top_k=-1, filename="{step}")
        fit(k, callbacks=[ckpt], **kw)
        path = tmp_path / k / "step=3.ckpt"
        runs[k] = (load(path), *fit(k, ckpt_path=str(path), **kw)[:2])
    assert differences(runs[kind][0], runs["auto"][0]) == []
    assert runs[kind][2] == runs["auto"][2] and equal_params(runs[kind][1], runs["auto"][1])


def test_save_checkpoint_after_fit_equals_autos(tmp_path):
    """``trainer.save_checkpoint`` after ``fit`` returned (its last step's updates were in flight at the end)."""
    saved = {}
    for k in ("auto", "in_backward"):
        _, _, trainer = fit(k, steps=3, batches=3)
        trainer.save_checkpoint(tmp_path / f"{k}.ckpt")
        saved[k] = load(tmp_path / f"{k}.ckpt")
    assert differences(saved["in_backward"], saved["auto"]) == []


# ---- defects ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["validation_end", "training_step"])
def test_fp32_masters_checkpoint_holds_the_fp32_masters_wherever_it_is_written(where, tmp_path):
    """bf16-true with fp32 masters: a checkpoint written at step 2 by ModelCheckpoint on validation end
    (val_check_interval=2), or by ``trainer.save_checkpoint`` in the next ``training_step``, holds what the
    every_n_train_steps checkpoint of the same step holds: the fp32 masters (not the bf16 compute copies of
    the non-block weights that are bound in the module while validation or a micro-batch runs)."""
    steps = ModelCheckpoint(dirpath=tmp_path / "steps", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    if where == "validation_end":
        other = ModelCheckpoint(dirpath=tmp_path / "val", save_top_k=-1, filename="{step}")
        fit("pipelined", steps=2, batches=4, val_check_interval=2, callbacks=[steps, other], precision="bf16-true",
            fp32_masters=True)
        path = tmp_path / "val" / "step=2.ckpt"
    else:
        path = tmp_path / "in_step.ckpt"
        fit("pipelined", steps=3, batches=4, callbacks=[steps], precision="bf16-true", fp32_masters=True,
            save_in_step=(0, 2, str(path)))
    want, got = load(tmp_path / "steps" / "step=2.ckpt"), load(path)
    assert got["global_step"] == want["global_step"] == 2
    # (the loops differ: one is written inside step 3's training_step; weights and optimizer states may not)
    weights_and_states = [d[:3] for d in differences(got, want) if d[0] == "optimizer" or d[0] in want["state_dict"]]
    assert weights_and_states == []


def test_fp32_masters_resume_from_a_validation_end_checkpoint_continues_bit_equal(tmp_path):
    """The same checkpoint (ModelCheckpoint at validation end, here the epoch's end: val_check_interval=2 in
    an epoch of 2) resumed: the run must go on as the uninterrupted one."""
    kw = dict(steps=5, batches=2, val_check_interval=2, precision="bf16-true", fp32_masters=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{step}")
    full, full_losses, _ = fit("pipelined", callbacks=[ckpt], **kw)
    resumed, resumed_losses, _ = fit("pipelined", ckpt_path=str(tmp_path / "step=2.ckpt"), **kw)
    assert resumed_losses == full_losses[-len(resumed_losses):]
    assert equal_params(resumed, full), max_diff(resumed, full)


@pytest.mark.parametrize("kind", ["milp", "pipelined"])
def test_validation_in_the_middle_of_an_accumulated_step_trains_like_auto(kind):
    """val_check_interval=1 with accumulate_grad_batches=2 (Lightning allows it: validation after a
    micro-batch that is not a step's last; it keeps the accumulated gradients): the run equals auto's."""
    kw = dict(steps=3, batches=6, accumulate=2, val_check_interval=1)
    want, want_losses, _ = fit("auto", **kw)
    got, got_losses, _ = fit(kind, **kw)
    assert got_losses == want_losses and equal_params(got, want)


def test_a_checkpoint_between_the_backward_and_the_step_with_updates_in_backward(tmp_path):
    """A callback that declares ``reads_gradients_only`` (it edits nothing) saves a checkpoint in
    ``on_before_optimizer_step`` while blocks are being updated in the backward: refused loudly, never a
    half-updated checkpoint and a step applied twice (before: the open step was given up silently)."""

    class SaveBeforeStep(L.Callback):
        reads_gradients_only = True

        def __init__(self, path):
            self.path = path

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2:
                trainer.save_checkpoint(self.path)

    fit("auto", steps=4, batches=4, callbacks=[SaveBeforeStep(tmp_path / "auto.ckpt")])  # auto saves fine
    assert (tmp_path / "auto.ckpt").exists()
    # refused loudly (core/optimizer_steps.PipelinedSteps.finish): the blocks updated cannot be taken back
    with pytest.raises(RuntimeError, match=r"a checkpoint between a backward and its optimizer step.*updates_in_backward"):
        fit("in_backward", steps=4, batches=4, callbacks=[SaveBeforeStep(tmp_path / "lt.ckpt")])
    assert not (tmp_path / "lt.ckpt").exists()
