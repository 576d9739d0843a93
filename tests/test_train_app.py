"""The lazytrain-train app: end to end in-process (hydra.compose + train_job) with a few steps, and a 2-job
multirun in one subprocess (both jobs in one process, nothing leaking from one job into the next)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_lazytrain.cli.train import LossHistory, TrainConfigError, step_time_line, summarize, train_job
from lightning_lazytrain.config import CONF_DIR
from lightning_lazytrain.planner.report import format_value

try:
    import lightning_lazytrain.strategy  # noqa: F401

    HAVE_STRATEGY = True
except ImportError:  # pragma: no cover - the strategy ships with the package
    HAVE_STRATEGY = False

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# a few steps on a small slice of the stdlib; validation before, at step 3 and after the last step
FAST = ["trainer.max_steps=5", "trainer.val_check_interval=3", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "data.max_bytes=400000", "data.holdout_every=5", "data.val_windows=16",
        "optim.warmup_steps=2"]
STRATEGIES = (["lazytrain"] if HAVE_STRATEGY else []) + ["auto"]


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train_app", overrides=list(overrides))


def test_defaults_are_the_main_job():
    cfg = compose_cfg()
    assert cfg.strategy.name == "lazytrain" and cfg.hardware.name == "cpu" and cfg.model.name == "tiny"
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("cpu", 1, "32-true")
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.trainer.max_steps, cfg.trainer.val_check_interval) == \
        (128, 8, 300, 100)
    gpu = compose_cfg("trainer=gpu")
    assert gpu.trainer.accelerator == "gpu" and gpu.trainer.precision == "bf16-mixed"


@pytest.mark.skipif(not HAVE_STRATEGY, reason="lightning_lazytrain.strategy is not importable")
def test_fp32_masters_reach_the_strategy():
    from lightning_lazytrain.cli.train import build_strategy

    plain = build_strategy(compose_cfg())
    assert plain.fp32_masters is False and plain.keep_compute_copy == "auto"
    s = build_strategy(compose_cfg("strategy.fp32_masters=true", "strategy.keep_compute_copy=false"))
    assert s.fp32_masters is True and s.keep_compute_copy is False


def test_misspelt_key_fails_at_composition():
    with pytest.raises(Exception, match="trainer.max_stepz|max_stepz"):
        compose_cfg("trainer.max_stepz=3")


@pytest.mark.parametrize("strategy", STRATEGIES)  # the main path is lazytrain; auto is plain Lightning
@pytest.mark.slow
def test_app_trains_and_writes_loss_png_and_final_val_loss(tmp_path, capsys, strategy):
    torch_threads = torch.get_num_threads()
    cfg = compose_cfg(*FAST, f"strategy.name={strategy}")
    result = train_job(cfg, tmp_path)
    printed = capsys.readouterr().out
    assert torch.get_num_threads() == torch_threads  # trainer.threads=1 is restored after the job

    assert result["steps"] == 5
    steps = [s for s, _ in result["val_history"]]
    assert steps == [0, 3, 5]  # before training (sanity check over all val windows), interval, after last step
    assert result["final_val_step"] == 5 and result["final_val_loss"] == result["val_history"][-1][1]
    assert 5.3 < result["initial_val_loss"] < 5.8  # ~ln 256 for an untrained byte model
    assert result["val_loss_drop"] > 0.3 and result["train_loss_drop"] > 0
    assert "final val loss" in printed and "before training" in printed and "train loss: first" in printed
    assert f"strategy {strategy}" in printed

    png = (tmp_path / "loss_curve.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["final_val_loss"] == pytest.approx(result["final_val_loss"])
    assert saved["config"]["strategy"]["name"] == strategy
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert [s for s, _ in losses["train"]] == [1, 2, 3, 4, 5]
    rows = list(csv.DictReader((tmp_path / "logs" / "metrics.csv").open()))
    assert sum(1 for r in rows if r.get("train_loss")) == 5 and sum(1 for r in rows if r.get("val_loss")) == 2
    if strategy == "lazytrain":  # the strategy wrote its plan next to the logs
        assert (tmp_path / "logs" / "plan.json").exists()
        # the summary's prediction is the table's plan row (iter [s]), in the table's rounding
        plan = json.loads((tmp_path / "logs" / "plan.json").read_text())
        assert result["step_seconds_predicted"] == plan["predicted"]["iteration_seconds"]
        assert result["plan_predictions"][0] == {"step": 0, "predicted_s": plan["predicted"]["iteration_seconds"]}
        table_figure = format_value("iteration_s", plan["predicted"]["iteration_seconds"])
        (line,) = [line for line in printed.splitlines() if line.startswith("step time: measured")]
        assert f"predicted {table_figure} s by the plan (iter [s] of its table, from one profiled step)" in line


def test_step_time_line_names_the_prediction_it_quotes():
    one = [{"step": 0, "predicted_s": 0.0563}]
    assert step_time_line(0.0421, 0.0563, one, []) == (
        "step time: measured 0.042 s (median after the first step), predicted 0.056 s by the plan (iter [s] of its "
        "table, from one profiled step); measured / predicted 0.75x")
    # a re-plan that kept the schedule: the table's figure, and what the re-profile predicts now
    kept = [{"step": 216, "switched": False, "current_predicted_s": 0.0653, "new_predicted_s": 0.066,
             "reason": "drift: measured/predicted step time moved from 0.70 to 0.95 (+36%; ...)"}]
    line = step_time_line(0.0421, 0.0563, one, kept)
    assert "predicted 0.056 s by the plan (iter [s] of its table" in line
    assert line.endswith("; re-planned 1x (step 216: drift): kept the schedule (step 216's profile re-predicts it "
                         "at 0.065 s, measured / that 0.64x: the drift monitor's reference since)")
    # a switch printed a new table: the line quotes it, and says which plan it is
    two = one + [{"step": 40, "predicted_s": 0.0312}]
    switched = [{"step": 6, "switched": False, "current_predicted_s": 0.05, "new_predicted_s": 0.05,
                 "reason": "profile check: the 5 steps after the plan ran 11.0x faster than ..."},
                {"step": 40, "switched": True, "current_predicted_s": 0.09, "new_predicted_s": 0.0312,
                 "reason": "a reason without a kind"}]
    line = step_time_line(0.0421, 0.0312, two, switched)
    assert line.endswith("predicted 0.031 s by the plan made at step 40 (iter [s] of its table; the first plan's: "
                         "0.056 s); measured / predicted 1.35x; re-planned 2x (step 6: profile check; step 40): "
                         "switched at 40")
    # the table's rounding for small figures, and no prediction at all (strategy=auto)
    assert "predicted 0.00062 s" in step_time_line(0.0005, 0.00062, [{"step": 0, "predicted_s": 0.00062}], [])
    assert step_time_line(0.0421, None, [], []) == "step time: measured 0.042 s (median after the first step)"


def test_summary_of_a_history():
    h = LossHistory()
    h.train = [(i + 1, 5.0 - 0.1 * i) for i in range(10)]
    h.val = [(0, 5.5), (10, 4.0)]
    s = summarize(h, smooth=2)
    assert s["first_train_loss_mean"] == pytest.approx(4.95) and s["last_train_loss_mean"] == pytest.approx(4.15)
    assert s["val_loss_drop"] == pytest.approx(1.5) and s["final_val_loss"] == 4.0 and s["steps"] == 10


def test_bad_config_is_a_config_error(tmp_path):
    """(The Hydra entry point turns TrainConfigError into a message on stderr and exit code 2.)"""
    with pytest.raises(TrainConfigError, match="vocab"):
        train_job(compose_cfg(*FAST, "model.vocab=100"), tmp_path)
    with pytest.raises(TrainConfigError, match="optimizer"):
        train_job(compose_cfg(*FAST, "optim.optimizer=sgd"), tmp_path)


@pytest.mark.slow
def test_multirun_two_jobs_in_one_process(tmp_path):
    """Two jobs with the same settings in one process: the same losses (the second job sees nothing the
    first one left behind: RNGs, thread count, strategy state). A third job cannot run (max_steps=0): the sweep
    records it in sweep.csv, goes on, and the app exits 2."""
    env = dict(os.environ, HYDRA_FULL_ERROR="1", PYTHONWARNINGS="ignore")
    strategy = STRATEGIES[0]
    proc = subprocess.run([sys.executable, "-m", "lightning_lazytrain.cli.train", "-m", *FAST,
                           f"strategy.name={strategy}", "trainer.max_steps=3,3,0",
                           f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "1 job(s) failed: trainer.max_steps=0" in proc.stderr
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep").glob("*/result.json"))]
    assert len(results) == 2
    assert results[0]["pid"] == results[1]["pid"]  # Hydra's basic launcher: one process
    assert results[0]["output_dir"] != results[1]["output_dir"]
    for r in results:
        assert (Path(r["output_dir"]) / "loss_curve.png").exists() and r["steps"] == 3
    a, b = (json.loads((Path(r["output_dir"]) / "losses.json").read_text()) for r in results)
    assert a == b
    # one combined table: sweep.csv in the sweep directory, and the same on the console
    rows = list(csv.DictReader((tmp_path / "sweep" / "sweep.csv").open()))
    assert [r["job"] for r in rows] == ["0", "1", "2"] and [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert "trainer.max_steps=0" in rows[2]["reason"] and rows[2]["final_val_loss"] == ""
    for row, r in zip(rows, results):
        assert float(row["final_val_loss"]) == pytest.approx(r["final_val_loss"])
        assert float(row["tokens_per_s"]) == pytest.approx(r["tokens_per_s"])
        assert float(row["step_s_measured"]) > 0 and "trainer.max_steps=3" in row["overrides"].split()
        assert row["strategy"] == strategy and row["output_dir"] == r["output_dir"]
        if strategy == "lazytrain":
            assert float(row["step_s_predicted"]) > 0 and row["hardware"] == "cpu"
            assert float(row["measured_over_predicted"]) == pytest.approx(
                float(row["step_s_measured"]) / float(row["step_s_predicted"]))
    assert "sweep summary:" in proc.stdout and "final val loss" in proc.stdout and "failed" in proc.stdout


# ---- the main job's output ------------------------------------------------------------
def run_app(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    env.pop("PYTHONWARNINGS", None)  # the app itself keeps deprecation noise away
    return subprocess.run([sys.executable, "-m", "lightning_lazytrain.cli.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_STRATEGY, reason="the main job uses the lazytrain strategy")
def test_main_job_output_is_what_a_user_reads(tmp_path):
    proc = run_app(tmp_path, "trainer.max_steps=6", "trainer.val_check_interval=3", "data.max_bytes=400000",
                   "data.val_windows=16", "optim.warmup_steps=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    # no Lightning tips, device banners or deprecation warnings
    for noise in ("Tip:", "GPU available", "TPU available", "deprecated", "Deprecat", "FutureWarning",
                  "Loading `train_dataloader`", "`Trainer.fit` stopped", "Warning:"):
        assert noise not in console, noise
    # the progress bar ends where the run ends (6 steps), not at the epoch's length
    bar = [line for line in proc.stdout.splitlines() if "it/s" in line]
    counts = [m for line in bar for m in re.findall(r"\b(\d+)/(\d+) ", re.sub(r"Epoch \d+(/\d+)?", "", line))]
    assert counts and all(int(total) == 6 for _, total in counts), bar
    assert ("6", "6") in counts
    # the plan table, each validation, the summary as the last line
    assert "lazytrain plan (" in console and "plan (milp)" in console
    for when in ("before training", "step 3", "step 6"):
        assert re.search(rf"validation, {when}: val loss \d\.\d{{4}}", proc.stdout), when
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("lazytrain-train: done, 6 steps in ") and "final val loss" in last
    assert "step time: measured" in proc.stdout and "predicted" in proc.stdout
    # the header and result.json agree on the hardware; train.log holds the report, solver.log the solver
    (run_dir,) = (tmp_path / "outputs" / "train").glob("*/*")
    result = json.loads((run_dir / "result.json").read_text())
    assert "hardware cpu)" in proc.stdout and result["hardware"] == "cpu"
    assert result["step_seconds_measured"] > 0 and result["step_seconds_predicted"] > 0
    log = (run_dir / "train.log").read_text()
    for text in ("lazytrain-train: tiny", "plan (milp)", "validation, step 3", "lazytrain-train: done"):
        assert text in log, text
    assert "HiGHS" not in log
    assert "HiGHS" in (run_dir / "solver.log").read_text()


def test_progress_bar_total_is_the_run_length():
    from types import SimpleNamespace

    from lightning_lazytrain.cli.train import RunRichProgressBar, RunTQDMProgressBar

    for cls in (RunTQDMProgressBar, RunRichProgressBar):
        bar = cls()
        bar._trainer = SimpleNamespace(num_training_batches=3659, max_steps=300, global_step=0, max_epochs=1,
                                       accumulate_grad_batches=1)
        assert bar.total_train_batches == 300
        bar._trainer.accumulate_grad_batches = 4
        assert bar.total_train_batches == 1200
        bar._trainer.global_step = 250
        assert bar.total_train_batches == 200
        bar._trainer.max_steps, bar._trainer.global_step = 10_000, 0
        assert bar.total_train_batches == 3659  # a run longer than an epoch: the epoch's length


# ---- start-up validation (exit code, one line, no directory: tests/test_console_scripts.py) --
def test_validate_config_names_the_option(tmp_path):
    from lightning_lazytrain.cli.train import validate_config

    with pytest.raises(TrainConfigError, match="lazytrain or lazytrain_megatrain .*auto .*ddp"):
        validate_config(compose_cfg("strategy.name=nonsense"))
    with pytest.raises(TrainConfigError, match="trainer.accelerator='banana' is not an accelerator: use .*cpu"):
        validate_config(compose_cfg("trainer.accelerator=banana"))
    with pytest.raises(TrainConfigError, match="trainer.max_steps=0"):
        validate_config(compose_cfg("trainer.max_steps=0"))
    validate_config(compose_cfg())  # the main job
    validate_config(compose_cfg("strategy.name=ddp"))  # a Lightning strategy name passes through
    with pytest.raises(TrainConfigError, match="Precision 'nonsense' is invalid"):  # Lightning's own check
        train_job(compose_cfg(*FAST, "trainer.precision=nonsense"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# ---- the schema refuses unknown keys (+ or not), config errors name the key, nothing is left behind ------
@pytest.mark.parametrize("override", ["+trainer.max_step=10", "++trainer.max_step=10", "+strategy.nvme=/x",
                                      "+model.layers=6", "+data.seq=64", "+optim.beta=0.9", "+hardware.gpu_mem=3",
                                      "+seeed=1"])
def test_keys_added_with_plus_are_refused_in_every_group(tmp_path, override):
    from lightning_lazytrain.cli.train import validate_config

    key = override.lstrip("+").split("=")[0]
    with pytest.raises(TrainConfigError, match=re.escape(f"unknown key {key}:")) as ei:
        validate_config(compose_cfg(override))
    assert "\n" not in str(ei.value)
    with pytest.raises(TrainConfigError, match="unknown key trainer.max_step: .*did you mean trainer.max_steps"):
        train_job(compose_cfg(*FAST, "+trainer.max_step=10"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_val_every_was_renamed_holdout_every():
    from lightning_lazytrain.cli.train import TRAIN_GROUPS, validate_config
    from lightning_lazytrain.config_checks import check_command_line

    assert compose_cfg().data.holdout_every == 20 and "val_every" not in compose_cfg().data
    for override in ("data.val_every=5", "+data.val_every=5"):
        msg = check_command_line("train_app", [override], TRAIN_GROUPS)
        assert msg.startswith("data.val_every was renamed data.holdout_every") and "val_check_interval" in msg, msg
    with pytest.raises(TrainConfigError, match="data.val_every was renamed data.holdout_every"):
        validate_config(compose_cfg("+data.val_every=5"))


@pytest.mark.parametrize("override,pattern", [
    ("trainer.precision=64-true", r"trainer\.precision='64-true' is not supported by strategy\.name=lazytrain: use one "
                                  r"of 16-mixed, 16-true, 32-true, bf16-mixed, bf16-true"),
    ("strategy.gpu_memory_budget_gb=inf", r"strategy\.gpu_memory_budget_gb=inf: must be a number of GB > 0"),
    ("strategy.emulate_link_gb_per_s=-1", r"strategy\.emulate_link_gb_per_s=-1\.0: must be a number of GB/s > 0"),
])
def test_bad_strategy_settings_fail_before_anything_is_written(tmp_path, override, pattern):
    with pytest.raises(TrainConfigError, match=pattern):
        train_job(compose_cfg(*FAST, override), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_nvme_dir_that_is_a_file_fails_before_anything_is_written(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for value, pattern in ((blocker, "exists and is not a directory"), (blocker / "spill", "cannot be created")):
        with pytest.raises(TrainConfigError, match=rf"strategy\.nvme_dir='{re.escape(str(value))}': .*{pattern}"):
            train_job(compose_cfg(*FAST, f"strategy.nvme_dir={value}"), tmp_path / "run")
        assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not HAVE_STRATEGY, reason="lightning_lazytrain.strategy is not importable")
def test_an_unusable_spill_directory_at_setup_is_a_config_error(tmp_path, monkeypatch):
    """An NvmeDirError from the strategy's setup (a directory that cannot hold the plan's spill, found once the
    strategy runs) is a config error naming strategy.nvme_dir (the entry point: one line, exit 2, no directory)."""
    import lightning_lazytrain.core.training_core as core_module
    from lightning_lazytrain.engine.nvme import NvmeDirError

    def refuse(path, required_bytes=0):
        raise NvmeDirError(f"NVMe spill directory {path} has 1.00 GiB free, but the plan needs 2.00 GiB. "
                           "Fix: point nvme_dir at a larger drive.")

    monkeypatch.setattr(core_module, "check_nvme_dir", refuse)
    with pytest.raises(TrainConfigError, match=r"has 1\.00 GiB free, .*Fix: point strategy\.nvme_dir at a larger"):
        train_job(compose_cfg(*FAST, f"strategy.nvme_dir={tmp_path / 'spill'}"), tmp_path / "run")


@pytest.mark.slow
def test_checkpoint_of_the_app_reloads_without_the_app(tmp_path):
    """enable_checkpointing=true: the checkpoint rebuilds the same LlamaLM from its saved hyper-parameters."""
    from lightning_lazytrain.data import StdlibTextDataModule
    from lightning_lazytrain.lit_module import CausalLMModule

    cfg = compose_cfg(*FAST, "trainer.max_steps=2", "trainer.enable_checkpointing=true",
                      f"strategy.name={STRATEGIES[0]}", "model.num_layers=2")
    result = train_job(cfg, tmp_path)
    (ckpt,) = tmp_path.glob("checkpoints/*.ckpt")  # checkpoints/last.ckpt (resume=<this dir> goes on from it)
    module = CausalLMModule.load_from_checkpoint(ckpt, map_location="cpu")
    assert module.model_spec.num_layers == 2 and module.model_spec.name == "tiny"
    dm = StdlibTextDataModule(**{k: v for k, v in cfg.data.items()})
    dm.setup()
    module.eval()
    with torch.no_grad():
        losses = [(module._nll(b).item(), b.shape[0]) for b in dm.val_dataloader()]
    val = sum(v * n for v, n in losses) / sum(n for _, n in losses)
    assert val == pytest.approx(result["final_val_loss"], rel=1e-4)


def test_app_sources_do_not_import_transformers():
    """transformers is optional: only lit_module's Hugging Face builder imports it, inside a function.
    (``import lightning`` itself may load parts of transformers through torchmetrics when it is installed.)"""
    import ast

    import lightning_lazytrain

    root = Path(lightning_lazytrain.__file__).parent
    for rel in ("data.py", "lit_module.py", "cli/train.py", "cli/lightning_cli.py"):
        tree = ast.parse((root / rel).read_text())
        for node in tree.body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "transformers" for n in names), rel
