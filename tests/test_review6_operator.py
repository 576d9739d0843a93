"""Review 6: newcomer and operator edges — the apps' command lines and output directories, bad input that
must be a clear error naming the problem and the fix, and nothing lost (checkpoints, spill files, resume).

The review found 10 defects, all fixed with these tests as their checks: a failed run deleted an existing
output directory (Note: [a failed run leaves what it found], cli/run_dir.py); an output directory that cannot be
made was a traceback; values found bad only inside fit (optimizer hyper-parameters, workers, threads, the block
path) and accumulate_grad_batches=0 were not config errors naming the key, and a multirun stopped at such a job;
the host-memory fix named a key the train app refuses; LazyTrainStrategy took strings for bools, a bool shard_size
and a non-string blocks; a misspelt model override was dropped.
Everything runs on the CPU in fp32 with the tiny model (``conf/model/tiny.yaml``) or the small modules of the
other review tests."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_lazytrain.cli.train import TRAIN_GROUPS, TrainConfigError, train_job
from lightning_lazytrain.config import CONF_DIR
from lightning_lazytrain.config_checks import check_command_line
from lightning_lazytrain.strategy import LazyTrainStrategy

from test_review_replan_nvme import (Record, all_nvme_schedule, batches, fit, make_module, params_of, same,
                                     spill_leftovers, write_plan)

# a few steps on a small slice of the stdlib (as tests/test_train_app.py)
FAST = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "trainer.num_sanity_val_steps=0", "data.max_bytes=200000",
        "data.holdout_every=5", "data.val_windows=4", "optim.warmup_steps=1"]


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train_app", overrides=list(overrides))


def run_module(module: str, *args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def precious_dir(root: Path) -> Path:
    """A directory the user already has (an earlier run's results)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "notes.txt").write_text("results of last week's run\n")
    (root / "model.ckpt").write_bytes(b"not really a checkpoint")
    return root


# ---- (1) output directories: a failed run must not delete what it did not create ----------------------------
@pytest.mark.parametrize("where", ["existing", "cwd"])
def test_an_infeasible_plan_does_not_delete_an_existing_output_directory(tmp_path, where):
    work = tmp_path / "work"
    work.mkdir()
    keep = precious_dir(work if where == "cwd" else tmp_path / "results")
    run_dir = "." if where == "cwd" else str(keep)
    proc = run_module("lightning_lazytrain.cli.plan", f"hydra.run.dir={run_dir}", "hardware=cpu", "model=tiny",
                      "train=cpu", "plan.plot=false", "hardware.gpu_memory_cap_gb=0.0001",
                      "hardware.gpu_memory_gb=0.0001", cwd=work, timeout=120)
    # was: the whole directory removed by cli.plan.remove_run_dir (shutil.rmtree of hydra.run.dir); with
    # hydra.run.dir=. the working directory itself, then a traceback (os.getcwd fails) and exit 1
    assert (keep / "notes.txt").is_file() and (keep / "model.ckpt").is_file(), proc.stderr[-1500:]
    assert proc.returncode == 2 and "gpu memory short by" in proc.stderr, proc.stderr  # the error itself


def test_an_output_directory_that_cannot_be_created_is_one_line_exit_2(tmp_path):
    (tmp_path / "a_file").write_text("x")
    target = tmp_path / "a_file" / "run"
    proc = run_module("lightning_lazytrain.cli.plan", f"hydra.run.dir={target}", "hardware=cpu", "model=tiny",
                      "train=cpu", "plan.plot=false", cwd=tmp_path, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert len(lines) == 1 and str(target) in lines[0], lines


@pytest.mark.slow
def test_a_config_error_does_not_delete_an_existing_output_directory(tmp_path):
    keep = precious_dir(tmp_path / "results")
    work = tmp_path / "work"
    work.mkdir()
    proc = run_module("lightning_lazytrain.cli.train", f"hydra.run.dir={keep}", "strategy.name=lazytrian", cwd=work)
    assert (keep / "notes.txt").is_file() and (keep / "model.ckpt").is_file(), proc.stderr[-1500:]
    assert proc.returncode == 2 and "strategy.name='lazytrian' is not a strategy" in proc.stderr, proc.stderr


# ---- (2) the train app: a value it only finds bad inside fit is still a config error -------------------------
@pytest.mark.parametrize("overrides,key", [
    (["optim.lr=-1"], "optim.lr"),
    (["optim.betas=[2,3]"], "optim.betas"),
    (["data.num_workers=-1"], "data.num_workers"),
    (["trainer.threads=-1"], "trainer.threads"),
    (["strategy.blocks=model.nope"], "strategy.blocks"),
    (["optim.optimizer=hybrid_adamw", "optim.eight_bit=banana"], "optim.eight_bit"),
])
def test_a_bad_value_found_inside_fit_is_a_config_error_naming_the_key(tmp_path, overrides, key):
    with pytest.raises(Exception) as info:
        train_job(compose_cfg(*FAST, *overrides), tmp_path / "run")
    err = info.value
    # the Hydra entry point (_task) turns TrainConfigError / PlannerError into one line, exit 2, no directory
    assert isinstance(err, TrainConfigError), f"{type(err).__name__}: {err}"
    assert key in str(err), str(err)
    if key == "strategy.blocks":
        assert "model.layers" in str(err)  # the candidate found
    assert not (tmp_path / "run").exists()


def test_accumulate_grad_batches_0_is_refused(tmp_path):
    from lightning_lazytrain.cli.train import validate_config

    try:
        validate_config(compose_cfg(*FAST, "trainer.accumulate_grad_batches=0"))
    except TrainConfigError as err:
        assert "trainer.accumulate_grad_batches" in str(err)
        return
    result = train_job(compose_cfg(*FAST, "trainer.accumulate_grad_batches=0"), tmp_path / "run")
    assert result["steps"] == 2, f"the app reported success after {result['steps']} steps"


def test_a_host_memory_shortfall_names_a_fix_this_app_takes(tmp_path):
    from lightning_lazytrain.planner import InfeasibleBudget

    with pytest.raises(InfeasibleBudget) as info:
        train_job(compose_cfg(*FAST, "hardware.cpu_memory_gb=0.000001"), tmp_path / "run")
    msg = " ".join(str(info.value).split())
    assert "cpu memory short by" in msg  # which tier, by how much: right
    fixes = re.findall(r"\b([a-z_]+\.[a-z_0-9]+)=", msg)
    refused = [f for f in fixes if check_command_line("train_app", [f"{f}=1"], TRAIN_GROUPS) is not None]
    assert not refused, f"the message suggests {refused}, which lazytrain-train refuses: {msg}"


@pytest.mark.slow
def test_a_sweep_goes_on_after_a_job_with_a_wrong_block_path(tmp_path):
    proc = run_module("lightning_lazytrain.cli.train", "-m", *FAST, "trainer.max_steps=1",
                      "strategy.blocks=model.nope,model.layers", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    rows = list(csv.DictReader((tmp_path / "sweep" / "sweep.csv").open()))
    assert [r["status"] for r in rows] == ["failed", "ok"] and "model.nope" in rows[0]["reason"]


# regressions: the command line names unknown group options, in single runs and in each job of a sweep
@pytest.mark.parametrize("app,groups,argv,expected", [
    ("train_app", TRAIN_GROUPS, ["hardware=h900"], "hardware=h900: no such option in config group hardware; "
                                                   "available: a100-80gb, cpu, h200"),
    ("train_app", TRAIN_GROUPS, ["-m", "model=tiny,tiny2"], "model=tiny2: no such option in config group model; "
                                                           "available: qwen2.5-14b"),
    ("train_app", TRAIN_GROUPS, ["-m", "optim.lr=1e-3,fast"], "optim.lr: Value 'fast'"),
    ("plan", ("hardware", "model", "train"), ["model=qwen9"], "model=qwen9: no such option in config group model"),
])
def test_unknown_group_options_are_named_with_the_choices(app, groups, argv, expected):
    msg = check_command_line(app, argv, groups)
    assert msg is not None and expected in msg and "\n" not in msg, msg


# ---- (3) LazyTrainStrategy / CausalLMModule: nonsense options refused at construction -----------------------
@pytest.mark.parametrize("kw", [dict(overlap_grad_sync="no"), dict(nonblock_parts="false"),
                                dict(verify_checkpoints="no"), dict(shard_size=True), dict(blocks=123)],
                         ids=["overlap_grad_sync", "nonblock_parts", "verify_checkpoints", "shard_size", "blocks"])
def test_nonsense_option_values_are_refused_at_construction(kw):
    (name,) = kw
    with pytest.raises((ValueError, TypeError), match=name):
        LazyTrainStrategy(**kw)


def test_options_that_are_checked_name_themselves():
    """(regressions) fp32_masters is checked strictly; replan, hardware and an empty nvme_dir name the value."""
    for kw, pattern in ((dict(fp32_masters="no"), r"fp32_masters='no': must be True or False"),
                        (dict(replan="yes"), r"replan='yes': use True, False or a dict"),
                        (dict(replan={"patiense": 3}), r"unknown option\(s\) \['patiense'\]"),
                        (dict(hardware=""), r"known: a100-80gb, cpu"),
                        (dict(nvme_dir=""), r"nvme_dir='': an empty path")):
        with pytest.raises(ValueError, match=pattern):
            LazyTrainStrategy(**kw)


def test_a_misspelt_model_override_is_refused():
    from lightning_lazytrain.lit_module import CausalLMModule

    with pytest.raises((ValueError, TypeError), match="num_layerz"):
        module = CausalLMModule(model_name="tiny", model_overrides={"num_layerz": 6})
        assert module.model_spec.num_layers == 6, module.model_spec.num_layers  # (else: silently 4)


def test_an_unknown_model_name_lists_the_known_ones():
    from lightning_lazytrain.lit_module import CausalLMModule

    with pytest.raises(ValueError, match=r"unknown model 'tinyy': .*known: .*tiny"):
        CausalLMModule(model_name="tinyy")


# ---- (4) nothing lost: checkpoints, spill files, resume ----------------------------------------------------
def test_a_save_interrupted_mid_write_leaves_the_old_checkpoint_loadable(tmp_path, monkeypatch):
    """A KeyboardInterrupt while torch.save is half-way through the file: the old checkpoint at the path stays
    bit-identical and loadable, and no temporary file is left beside it."""
    rec, module, trainer = fit(LazyTrainStrategy(policy="recompute_all"), steps=2)
    path = tmp_path / "ckpt" / "last.ckpt"
    trainer.save_checkpoint(path)
    before = path.read_bytes()
    real_save = torch.save

    def half_then_interrupt(obj, f, *a, **k):
        f.write(b"PK\x03\x04" + b"\0" * 4096)  # a partial zip
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(path)
    monkeypatch.setattr(torch, "save", real_save)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    state = trainer.strategy.load_checkpoint(path)
    assert set(state["state_dict"]) == set(module.state_dict())


def _crash_then_resume(tmp_path, first, then, *, steps=6, fail_at=3):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def ckpt():
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True, save_top_k=-1)

    with pytest.raises(RuntimeError, match="crash"):
        fit(first(), checkpoint=ckpt(), steps=steps, root=tmp_path,
            module=make_module(fail_at=fail_at, exc=RuntimeError("crash"), lr_schedule="cosine", by_step=1))
    first_losses = Record.last_losses
    rec, module, _ = fit(then(), checkpoint=ckpt(), ckpt_path="last", steps=steps, root=tmp_path,
                         module=make_module(lr_schedule="cosine", by_step=1))
    return first_losses, rec.losses, module


@pytest.mark.parametrize("first,then", [("lazytrain", "auto"), ("auto", "lazytrain")])
def test_a_crashed_run_resumes_under_the_other_strategy_bit_for_bit(tmp_path, first, then):
    """A run that crashed under one strategy resumes from its last checkpoint under the other and ends where
    the uninterrupted strategy="auto" run ends (losses and weights bit for bit)."""
    make = {"lazytrain": lambda: LazyTrainStrategy(policy="recompute_all"), "auto": lambda: "auto"}
    want, want_module = (lambda r: (r[0].losses, r[1]))(
        fit("auto", steps=6, module=make_module(lr_schedule="cosine", by_step=1)))
    got_first, resumed, module = _crash_then_resume(tmp_path, make[first], make[then])
    assert got_first == want[:len(got_first)]
    assert resumed == want[3:], (got_first, resumed, want)
    assert same(params_of(module), params_of(want_module))


def test_no_spill_file_is_left_after_a_failure_in_the_first_step(tmp_path):
    spill = tmp_path / "spill"
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule())
    strategy = LazyTrainStrategy(policy=plan, nvme_dir=str(spill))
    with pytest.raises(RuntimeError, match="boom at step 0"):
        fit(strategy, steps=3, fail_at=0, exc=RuntimeError("boom at step 0"))
    assert spill_leftovers(spill) == [] and strategy.core.executor is None


@pytest.mark.parametrize("exc", [RuntimeError("boom in validation"), KeyboardInterrupt()],
                         ids=["exception", "interrupt"])
def test_no_spill_file_is_left_after_a_failure_in_validation(tmp_path, exc):
    """Validation mid-fit (after step 2) raises: the strategy is torn down and the spill directory is empty."""
    from lightning_lazytrain.lit_module import CausalLMModule

    class Module(CausalLMModule):
        def validation_step(self, batch, batch_idx):
            if self.trainer.global_step >= 2:
                raise exc
            return super().validation_step(batch, batch_idx)

    torch.manual_seed(0)
    module = Module(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
    spill = tmp_path / "spill"
    plan = write_plan(tmp_path / "nvme.json", all_nvme_schedule())
    strategy = LazyTrainStrategy(policy=plan, nvme_dir=str(spill))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, val_check_interval=2, limit_val_batches=1,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(batches(4), batch_size=None)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit if isinstance(exc, KeyboardInterrupt) else RuntimeError):
            trainer.fit(module, train_dataloaders=loader, val_dataloaders=torch.utils.data.DataLoader(batches(1), batch_size=None))
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after an interrupt
    assert trainer.global_step == 2
    assert spill_leftovers(spill) == [] and strategy.core.executor is None
