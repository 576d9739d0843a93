"""Review: schedule switches mid-run, the NVMe tier and crash/resume under the Trainer.

Every fit is fp32 (or bf16-true with fp32 masters) on the CPU, and must train bit for bit as the
reference: ``strategy="auto"`` (32-true), or the same lazytrain fit without the switch (bf16-true with
``fp32_masters``, which ``tests/test_fp32_masters.py`` ties to plain master-weight training).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import ClassVar

import lightning as L
import pytest
import torch

from lightning_lazytrain.planner import Schedule
from lightning_lazytrain.strategy import LazyTrainStrategy

LAYERS = 4


# ---- schedules ----------------------------------------------------------------------------------
def _schedule(**kw) -> Schedule:
    base = dict(num_layers=LAYERS, homes=("gpu",) + ("recompute",) * (LAYERS - 1) + ("gpu",),
                keep_internals=(False,) * LAYERS, resident_weights=(False,) * LAYERS,
                offload_window=(None,) * (LAYERS + 1), reload_window=(None,) * (LAYERS + 1),
                optimizer="pipelined", policy="test")
    base.update(kw)
    return Schedule(**base)


def nvme_schedule(**kw) -> Schedule:
    """Boundary 1 on NVMe, 3 in host memory, 2 on the device (layer 2 keeps its internals), layer 1's
    weights resident (a fourth slot: the ParamStore is rebuilt by a switch to or from it)."""
    return _schedule(homes=("gpu", "nvme", "gpu", "cpu", "gpu"), keep_internals=(False, False, True, False),
                     resident_weights=(False, True, False, False),
                     offload_window=(None, 1, None, 3, None), reload_window=(None, 2, None, 4, None),
                     policy="test-nvme", **kw)


def all_nvme_schedule(**kw) -> Schedule:
    """Boundaries 1 and 2 on NVMe (3 cannot be: its reload would have to run in H's window)."""
    return _schedule(homes=("gpu", "nvme", "nvme", "gpu", "gpu"),
                     offload_window=(None, 1, 2, None, None), reload_window=(None, 2, 3, None, None),
                     policy="test-all-nvme", **kw)


def write_plan(path: Path, schedule: Schedule) -> str:
    path.write_text(json.dumps({"schedule": schedule.to_json()}))
    return str(path)


# ---- fits ---------------------------------------------------------------------------------------
class Record(L.Callback):
    reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

    def __init__(self):
        self.losses: list[float] = []
        self.policies: list[str] = []

    last_losses: ClassVar[list[float]] = []  # the most recent Record's, also after a fit that raised

    def on_train_start(self, trainer, module):
        Record.last_losses = self.losses

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        core = getattr(trainer.strategy, "core", None)
        if core is not None and core.executor is not None:
            self.policies.append(core.executor.schedule.policy)


class ForceReplan(L.Callback):
    """Asks for a re-plan at the start of batch ``at`` (the drift monitor's way: ``replan_reason``)."""
    reads_gradients_only = True

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.at:
            trainer.strategy.core.planner.replan_reason = "drift: forced by the review test"


def make_module(*, in_backward: bool = False, fail_at: int | None = None, exc: BaseException | None = None,
                lr_schedule: str = "constant", by_step: int | None = None, eight_bit: str = "none"):
    """CausalLMModule with HybridAdamW; ``fail_at``: the training step at that global step raises ``exc``
    after its forward; ``by_step`` (the accumulation): the batch is chosen by the global step, not by
    the loader's position (so a resumed fit sees the batches the uninterrupted one saw)."""
    from lightning_lazytrain.lit_module import CausalLMModule

    class Module(CausalLMModule):
        def training_step(self, batch, batch_idx):
            if by_step is not None:
                batch = DATA[self.trainer.global_step * by_step + batch_idx % by_step]
            loss = super().training_step(batch, batch_idx)
            if fail_at is not None and self.trainer.global_step == fail_at:
                raise exc
            return loss

    torch.manual_seed(0)
    return Module(model_name="tiny", optimizer="hybrid_adamw", lr_schedule=lr_schedule, warmup_steps=0,
                  eight_bit=eight_bit, updates_in_backward=in_backward)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (4, 33), generator=g) for _ in range(n)]


DATA = batches(32)


def fit(strategy, *, steps: int = 6, accumulate: int = 1, precision: str = "32-true", callbacks=(),
        module=None, root=None, ckpt_path=None, checkpoint=None, clip=None, **module_kw):
    module = module or make_module(**module_kw)
    rec = Record()
    cbs = [rec, *callbacks] + ([checkpoint] if checkpoint is not None else [])
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, accumulate_grad_batches=accumulate,
                        logger=False, enable_checkpointing=checkpoint is not None, callbacks=cbs,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, precision=precision, default_root_dir=root,
                        gradient_clip_val=clip)
    loader = torch.utils.data.DataLoader(batches(steps * accumulate), batch_size=None)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return rec, module, trainer


def params_of(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def switch_to(monkeypatch):
    """``switch_to(path)``: every re-plan picks the plan file ``path`` and switches to it (the current
    schedule "no longer fits"), as a drift or memory re-plan that moves boundaries would."""
    from lightning_lazytrain.core import planning

    original = planning.plan_from_workload
    seen: list[str] = []
    target: dict[str, str] = {}

    def plan_from_workload(wl, hardware, *, policy="milp", start=None, **kw):
        if start is not None:
            seen.append(target["path"])
            policy = target["path"]
        return original(wl, hardware, policy=policy, start=start, **kw)

    def no_current(*a, **k):
        raise RuntimeError("the current schedule does not fit")

    monkeypatch.setattr(planning, "plan_from_workload", plan_from_workload)
    monkeypatch.setattr(planning, "simulate", no_current)

    def choose(path: str) -> list[str]:
        target["path"] = path
        return seen

    return choose


def spill_leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# ---- (1) a schedule switch mid-run ----------------------------------------------------------------
@pytest.mark.parametrize("accumulate,in_backward", [(1, False), (2, False), (1, True), (2, True)])
def test_a_switch_mid_run_trains_as_auto(tmp_path, switch_to, accumulate, in_backward):
    """recompute_all (pipelined) -> a re-plan at step 3 switching to an NVMe/CPU/resident schedule
    (the ParamStore is rebuilt): the losses and weights are auto's, bit for bit."""
    seen = switch_to(write_plan(tmp_path / "b.json", nvme_schedule(updates_in_backward=in_backward)))
    ref_rec, ref, _ = fit("auto", accumulate=accumulate, in_backward=False)
    strategy = LazyTrainStrategy(policy="recompute_all", nvme_dir=str(tmp_path / "spill"))
    rec, got, _ = fit(strategy, accumulate=accumulate, in_backward=in_backward,
                      callbacks=[ForceReplan(at=3 * accumulate)])
    assert seen and strategy.replans and strategy.replans[0]["switched"], strategy.replans
    assert rec.policies[-1] == "test-nvme", rec.policies
    assert rec.losses == ref_rec.losses
    assert same(params_of(got), params_of(ref))
    assert spill_leftovers(tmp_path / "spill") == []


@pytest.mark.parametrize("at", [6, 7])  # the first / the second micro-batch of step 3
@pytest.mark.parametrize("in_backward,clip", [(False, None), (True, None), (False, 0.05)])
def test_a_switch_mid_run_with_fp32_masters_and_accumulation_is_exact(tmp_path, switch_to, at, in_backward, clip):
    """bf16-true + fp32_masters, accumulate 2: every micro-batch is a full one, so the re-profile may be
    an accumulated step's first or its last micro-batch (the switch then lands between them). The run
    equals the same fit without a switch bit for bit."""
    seen = switch_to(write_plan(tmp_path / "b.json", nvme_schedule(updates_in_backward=in_backward)))
    kw = dict(accumulate=2, precision="bf16-true", in_backward=in_backward, clip=clip)
    # (conversions on the host: with every conversion on the device a re-plan crashes, see
    # test_a_replan_with_conversions_on_the_device_does_not_crash)
    ref_rec, ref, _ = fit(LazyTrainStrategy(policy="recompute_all", fp32_masters=True, conversions="host"), **kw)
    strategy = LazyTrainStrategy(policy="recompute_all", fp32_masters=True, conversions="host",
                                 nvme_dir=str(tmp_path / "spill"))
    rec, got, _ = fit(strategy, callbacks=[ForceReplan(at=at)], **kw)
    assert seen and strategy.replans[0]["switched"] and rec.policies[-1] == "test-nvme"
    assert rec.losses == ref_rec.losses
    assert same(params_of(got), params_of(ref))
    assert spill_leftovers(tmp_path / "spill") == []


def test_a_replan_with_conversions_on_the_device_does_not_crash():
    """bf16-true + fp32_masters with the conversions on the device (``conversions="device"``, or what
    ``"plan"`` picks on a fast link) and a plain AdamW: the first re-plan (drift, memory, profile check)
    must not crash the fit; it trains as the run without one."""
    from lightning_lazytrain.lit_module import CausalLMModule

    def module():
        torch.manual_seed(0)
        return CausalLMModule(model_name="tiny", optimizer="adamw", lr_schedule="constant", warmup_steps=0)

    kw = dict(precision="bf16-true", steps=5)
    ref_rec, ref, _ = fit(LazyTrainStrategy(policy="milp", fp32_masters=True, conversions="device", replan=False),
                          module=module(), **kw)
    strategy = LazyTrainStrategy(policy="milp", fp32_masters=True, conversions="device")
    rec, got, _ = fit(strategy, module=module(), callbacks=[ForceReplan(at=3)], **kw)
    assert len(strategy.replans) == 1
    assert rec.losses == ref_rec.losses and same(params_of(got), params_of(ref))


# ---- (2) the NVMe tier ----------------------------------------------------------------------------
@pytest.mark.parametrize("accumulate,in_backward", [(1, False), (2, True)])
def test_nvme_homes_train_as_auto_and_leave_nothing(tmp_path, accumulate, in_backward):
    spill = tmp_path / "spill"
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule(updates_in_backward=in_backward))
    ref_rec, ref, _ = fit("auto", accumulate=accumulate, steps=4)
    strategy = LazyTrainStrategy(policy=plan, nvme_dir=str(spill))
    rec, got, _ = fit(strategy, accumulate=accumulate, steps=4, in_backward=in_backward)
    assert strategy.core.last_stats is not None
    assert rec.losses == ref_rec.losses and same(params_of(got), params_of(ref))
    assert spill_leftovers(spill) == []


def test_nvme_homes_with_fp32_masters_train_as_without(tmp_path):
    spill = tmp_path / "spill"
    kw = dict(accumulate=2, steps=4, precision="bf16-true")
    ref_rec, ref, _ = fit(LazyTrainStrategy(policy="recompute_all", fp32_masters=True, conversions="host"), **kw)
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule())
    rec, got, _ = fit(LazyTrainStrategy(policy=plan, nvme_dir=str(spill), fp32_masters=True, conversions="host"),
                      **kw)
    assert rec.losses == ref_rec.losses and same(params_of(got), params_of(ref))
    assert spill_leftovers(spill) == []


@pytest.mark.parametrize("exc", [RuntimeError("boom in the step"), KeyboardInterrupt()],
                         ids=["exception", "interrupt"])
def test_no_spill_file_is_left_after_a_failure_in_the_step(tmp_path, exc, monkeypatch):
    """The step of batch 2 raises after its forward (the boundaries are in spill files then). The tier's use is
    seen where a spill file is named (``SpillDir.file``): a listing at ``on_before_backward`` depended on the
    copies' timing (under load, no file was there yet or any more: .ci/run on 2026-12-05)."""
    from lightning_lazytrain.engine.nvme import SpillDir

    spill = tmp_path / "spill"
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule())
    named: list[str] = []
    file_of = SpillDir.file
    monkeypatch.setattr(SpillDir, "file", lambda self, key: named.append(file_of(self, key).name) or file_of(self, key))
    strategy = LazyTrainStrategy(policy=plan, nvme_dir=str(spill))
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit if isinstance(exc, KeyboardInterrupt) else RuntimeError):
            fit(strategy, steps=4, fail_at=2, exc=exc)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after an interrupt
    assert any(n.endswith(".spill") for n in named), named  # the tier was in use
    assert spill_leftovers(spill) == []
    assert strategy.core.executor is None  # torn down


@pytest.mark.parametrize("where", ["under-a-file", "read-only"])
def test_an_unusable_nvme_dir_is_refused_before_training(tmp_path, where):
    """A directory that cannot be created (under a file) or written (``/proc``: read-only even for root):
    refused with NvmeDirError/ValueError naming it, before the first training batch."""
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule())
    stepped: list[int] = []

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            stepped.append(batch_idx)

    if where == "under-a-file":
        (tmp_path / "file").write_text("x")
        target = str(tmp_path / "file" / "spill")
    else:
        target = "/proc"
    with pytest.raises((ValueError, RuntimeError), match=r"nvme_dir|NVMe spill directory") as info:
        fit(LazyTrainStrategy(policy=plan, nvme_dir=target), steps=2, callbacks=[Count()])
    assert target in str(info.value) and "Fix" in str(info.value) or "cannot be created" in str(info.value)
    assert stepped == []


def test_a_too_small_nvme_dir_is_refused_before_the_first_update(tmp_path, monkeypatch):
    """The plan needs more spill space than the drive has: refused naming it, before any weight changes."""
    import shutil
    from collections import namedtuple

    from lightning_lazytrain.engine import nvme

    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    spill = tmp_path / "spill"

    def tiny(path):
        return usage(1 << 20, (1 << 20) - 4096, 4096) if str(path).startswith(str(spill)) else real(path)

    monkeypatch.setattr(nvme.shutil, "disk_usage", tiny)
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule())
    module = make_module()
    before = params_of(module)
    with pytest.raises(Exception) as info:
        fit(LazyTrainStrategy(policy=plan, nvme_dir=str(spill)), module=module, steps=2)
    assert same(params_of(module), before)  # refused before the first update
    assert spill_leftovers(spill) == []
    # the message names the directory that is too small, and the fix (as NvmeDirError's do); it was
    # "InfeasibleSchedule: nvme_capacity: needs 65.5 kB on NVMe, have 4.10 kB"
    message = f"{type(info.value).__name__}: {info.value}"
    assert str(spill) in message and "Fix" in message, message


# ---- (3) a crash mid-fit, then a resume from the last checkpoint ----------------------------------------
def crash_and_resume(tmp_path, make_strategy, *, steps=6, fail_at=3, accumulate=1, precision="32-true",
                     in_backward=False, lr_schedule="cosine", first_callbacks=(), eight_bit="none"):
    """A fit that raises in the training step of global step ``fail_at`` (checkpoints every step, and
    ``last``), then a fresh fit with ``ckpt_path="last"`` to ``steps``. Returns the losses of both and the
    resumed module."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def ckpt():
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True, save_top_k=-1)

    kw = dict(steps=steps, accumulate=accumulate, precision=precision, root=tmp_path)
    with pytest.raises(RuntimeError, match="crash"):
        fit(make_strategy(), checkpoint=ckpt(), callbacks=list(first_callbacks),
            module=make_module(in_backward=in_backward, fail_at=fail_at, exc=RuntimeError("crash"),
                               lr_schedule=lr_schedule, by_step=accumulate, eight_bit=eight_bit), **kw)
    first_losses = Record.last_losses
    rec, module, trainer = fit(make_strategy(), checkpoint=ckpt(), ckpt_path="last",
                               module=make_module(in_backward=in_backward, lr_schedule=lr_schedule,
                                                  by_step=accumulate, eight_bit=eight_bit), **kw)
    return first_losses, rec.losses, module, trainer


def uninterrupted(make_strategy, *, steps=6, accumulate=1, precision="32-true", in_backward=False,
                  lr_schedule="cosine", eight_bit="none"):
    rec, module, _ = fit(make_strategy(), steps=steps, accumulate=accumulate, precision=precision,
                         module=make_module(in_backward=in_backward, lr_schedule=lr_schedule, by_step=accumulate,
                                            eight_bit=eight_bit))
    return rec.losses, module


@pytest.mark.parametrize("case", ["auto", "pipelined", "in_backward-acc2", "nvme", "fp32_masters-acc2", "plan-bits"])
def test_a_crash_then_resume_from_last_continues_as_the_uninterrupted_run(tmp_path, case):
    spill = tmp_path / "spill"
    nvme_plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule())
    in_backward_plan = write_plan(tmp_path / "in_backward.json", _schedule(updates_in_backward=True))
    kw = {"auto": {}, "pipelined": {}, "in_backward-acc2": dict(accumulate=2, in_backward=True), "nvme": {},
          "fp32_masters-acc2": dict(accumulate=2, precision="bf16-true"),
          "plan-bits": dict(eight_bit="plan")}[case]
    strategies = {
        "auto": lambda: "auto",
        "pipelined": lambda: LazyTrainStrategy(policy="recompute_all"),
        "in_backward-acc2": lambda: LazyTrainStrategy(policy=in_backward_plan),
        "nvme": lambda: LazyTrainStrategy(policy=nvme_plan, nvme_dir=str(spill)),
        "fp32_masters-acc2": lambda: LazyTrainStrategy(policy="recompute_all", fp32_masters=True,
                                                       conversions="host"),
        "plan-bits": lambda: LazyTrainStrategy(policy="recompute_all"),
    }
    reference = strategies["fp32_masters-acc2"] if case == "fp32_masters-acc2" else strategies["auto"]
    want, want_module = uninterrupted(reference, **kw)
    first, resumed, module, _ = crash_and_resume(tmp_path, strategies[case], **kw)
    acc = kw.get("accumulate", 1)
    assert first == want[:len(first)]
    assert resumed == want[3 * acc:], (first, resumed, want)
    assert same(params_of(module), params_of(want_module))
    assert spill_leftovers(spill) == []


def test_no_spill_file_is_left_after_a_failure_in_the_backward(tmp_path):
    """Block 1's backward raises at step 2 (its NVMe input was read back; boundary 2's file exists):
    the fit fails with that error, the spill directory is empty, and the next fit in this process on
    the same directory trains as auto."""
    spill = tmp_path / "spill"
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule())
    module = make_module()
    calls = {"n": 0}

    class Boom(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            calls["step"] = trainer.global_step

    def hook(mod, grad_in, grad_out):
        if calls.get("step") == 2:
            raise RuntimeError("boom in block 1's backward")

    module.model.layers[1].down_proj.register_full_backward_hook(hook)
    with pytest.raises(RuntimeError, match="boom in block 1"):
        fit(LazyTrainStrategy(policy=plan, nvme_dir=str(spill)), module=module, steps=4, callbacks=[Boom()])
    assert spill_leftovers(spill) == []
    ref_rec, _, _ = fit("auto", steps=3)
    rec, _, _ = fit(LazyTrainStrategy(policy=plan, nvme_dir=str(spill)), steps=3)
    assert rec.losses == ref_rec.losses
    assert spill_leftovers(spill) == []


@pytest.mark.parametrize("exc", [RuntimeError("boom in block 1's backward"), KeyboardInterrupt()],
                         ids=["exception", "interrupt"])
def test_a_failure_in_the_backward_with_updates_in_it_and_an_exception_checkpoint_still_tears_down(tmp_path, exc):
    """Lightning's own OnExceptionCheckpoint saves in ``on_exception``, before the Trainer tears the
    strategy down. With HybridAdamW(updates_in_backward=True) a failure in the backward (blocks 3 and the
    head already updated) must still end as it ends without that callback: the original error (an
    interrupt: Lightning's graceful SystemExit), the strategy torn down, no spill file left."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    spill = tmp_path / "spill"
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule(updates_in_backward=True))
    module = make_module(in_backward=True)
    state: dict[str, int] = {}

    class Step(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            state["step"] = trainer.global_step

    def hook(mod, grad_in, grad_out):
        if state.get("step") == 2:
            raise exc

    module.model.layers[1].down_proj.register_full_backward_hook(hook)
    strategy = LazyTrainStrategy(policy=plan, nvme_dir=str(spill))
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(BaseException) as info:
            fit(strategy, module=module, steps=4, callbacks=[Step()],
                checkpoint=OnExceptionCheckpoint(dirpath=tmp_path / "ckpt"))
    finally:
        signal.signal(signal.SIGINT, handler)
        leftovers = spill_leftovers(spill)
        torn_down = strategy.core.executor is None
        if not torn_down:
            strategy.teardown()  # (what the Trainer's teardown should have done)
    raised = info.value
    want = "SystemExit: 1" if isinstance(exc, KeyboardInterrupt) else f"RuntimeError: {exc}"
    got = f"{type(raised).__name__}: {raised}"
    # was: the checkpoint's refusal ("RuntimeError: a checkpoint between a backward and its optimizer step,
    # ...") in place of the error, no teardown, and 1.spill left in the spill directory
    assert (got[:80], torn_down, leftovers) == (want[:80], True, [])


def test_a_failed_pipelined_update_still_tears_down(tmp_path, monkeypatch):
    """Block 0's pipelined update of step 2 fails on the optimizer's worker (a host error): the next
    forward raises it (waiting for block 0), and the Trainer's teardown must still close the executor:
    the blocks' forward restored, the spill directory gone. Before, teardown re-raised the same error
    from ``PipelinedSteps.finish`` (its first call) and closed nothing."""
    from lightning_lazytrain.optim import HybridAdamW

    spill = tmp_path / "spill"
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule())
    state: dict[str, int] = {}
    original = HybridAdamW._update_layer

    def update_layer(self, layer, layer_plan):
        if layer == 0:
            state["layer 0"] = state.get("layer 0", 0) + 1
        if layer == 0 and state["layer 0"] == 3:  # step 2's
            time.sleep(0.3)  # still running when step 3 begins: its forward waits for it, and sees it fail
            raise RuntimeError("host update failed")
        return original(self, layer, layer_plan)

    monkeypatch.setattr(HybridAdamW, "_update_layer", update_layer)
    module = make_module()
    strategy = LazyTrainStrategy(policy=plan, nvme_dir=str(spill))
    with pytest.raises(RuntimeError, match="pipelined optimizer step failed") as info:
        fit(strategy, module=module, steps=5)
    assert "host update failed" in repr(info.value.__cause__)
    torn_down = strategy.core.executor is None
    patched = [j for j, block in enumerate(module.model.layers) if "forward" in vars(block)]
    leftovers = spill_leftovers(spill)
    if not torn_down:
        strategy.core.steps._pending = []  # (so this test's own clean-up can close it)
        strategy.teardown()
    # was: (False, [0, 1, 2, 3], ['lazytrain-spill-<pid>-<token>', 'lazytrain-spill-<pid>-<token>/.lock'])
    assert (torn_down, patched, leftovers) == (True, [], [])


@pytest.mark.parametrize("fail_at,at", [(3, 4), (2, 4)])  # after the switch / in the re-profiled step
def test_a_crash_after_a_switch_resumes_exactly(tmp_path, switch_to, fail_at, at):
    """accumulate 2, updates in the backward, a re-plan at step 2 to the NVMe schedule, then a crash; the
    resumed fit (which profiles and plans again) ends where the uninterrupted auto run does."""
    switch_to(write_plan(tmp_path / "b.json", nvme_schedule(updates_in_backward=True)))
    spill = tmp_path / "spill"
    kw = dict(accumulate=2, in_backward=True)
    want, want_module = uninterrupted(lambda: "auto", **kw)
    first, resumed, module, _ = crash_and_resume(
        tmp_path, lambda: LazyTrainStrategy(policy="recompute_all", nvme_dir=str(spill)), fail_at=fail_at,
        first_callbacks=[ForceReplan(at=at)], **kw)
    assert first == want[:len(first)] and resumed == want[2 * fail_at:]
    assert same(params_of(module), params_of(want_module))
    assert spill_leftovers(spill) == []
