"""``lazytrain-train``: train a language model with ``Trainer(strategy="lazytrain")`` from the Hydra configs in
``conf/`` (``conf/train_app.yaml``: ``hardware`` x ``model`` x ``data`` x ``trainer`` groups).

    lazytrain-train                                   # the main job: tiny Llama, CPU, stdlib text, ~300 steps
    lazytrain-train trainer.max_steps=600 optim.lr=2e-3 model.num_layers=6
    lazytrain-train strategy.name=auto                # plain Lightning (no layer streaming), for comparison
    lazytrain-train -m optim.lr=1e-3,3e-3             # a sweep: jobs run one after another in this process

The default job trains the byte-level ``tiny`` Llama-style model (``conf/model/tiny.yaml``, built as
``models.llama.LlamaLM``) on the Python standard library's source (``data.StdlibTextDataModule``: every
20th file held out) on the CPU, fp32, with the lazytrain strategy planned for ``conf/hardware/cpu.yaml``
(the strategy prints its plan at setup). Validation runs before training (Lightning's sanity check over
the whole held-out set: the "before" loss), every ``trainer.val_check_interval`` steps and after the last
step. Into Hydra's output directory it writes ``logs/metrics.csv`` / ``logs/hparams.yaml`` (CSVLogger),
``loss_curve.png`` (train loss per step, val loss per validation), ``losses.json`` (every step's loss),
``result.json`` (final val loss, how far the losses went down, wall time, tokens/s, measured and predicted step
time), ``summary_row.json`` (the job's row of a sweep's ``sweep.csv``), ``train.log`` (what the job reported,
the plan table) and ``solver.log`` (HiGHS).

The console shows the header, the strategy's plan table (with its legend), each validation's result, a progress
bar that ends at ``trainer.max_steps`` and the summary, whose predicted step time is the iter [s] of the plan row
of the last table printed, in its rounding (``step_time_line``: after a re-plan that switched, "the plan made at
step N"; a re-plan that kept the schedule is named with what its profile re-predicted); Lightning's tips,
device banners and deprecation warnings are left out (``quiet_lightning``). ``main`` composes the command line against the typed schema (``cli/train_config.py``) before Hydra runs
(``config.check_command_line``: a key the schema does not know, ``+`` or not, a renamed key such as
``data.val_every`` -> ``data.holdout_every``, a value of the wrong type), and ``validate_config`` checks the
strategy name, the accelerator, the run length and the values ``fit`` would only find bad at start-up
(``cli/train_checks.py``; the strategy's options, ``strategy.nvme_dir`` and
``trainer.precision`` are checked before anything is written): a config that cannot run, or an infeasible plan,
prints one line on stderr, exits 2 and leaves no output directory it made (cli/run_dir.py). A multirun (``-m``) writes ``sweep.csv``
(``TrainSweepSummary``) and prints it as a table; failed jobs keep their reason in it and the app exits 2 at the end.

``train_job(cfg, out_dir)`` is the app without Hydra's runtime (tests call it with ``hydra.compose``). Each
job seeds its own RNGs and restores torch's intra-op thread count afterwards, so jobs of a multirun do not
see each other's settings. Nothing here imports ``transformers``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, TextIO

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..config import (CONF_DIR, in_config_units, to_container, to_hardware, to_model)
from ..config_checks import check_command_line
from ..data import VOCAB_SIZE, StdlibTextDataModule
from ..planner import InfeasibleBudget, InfeasibleSchedule, ModelSpec, PlannerError
from ..core.planning import TRAINER_EIGHT_BIT_FIX
from ..planner.report import format_table, format_value
from ..planner.units import DECIMAL_UNITS, format_bytes, format_bytes_at_least
from .plan import ROW_FILE, SweepSummary
from .run_dir import RunDir, check_output_dirs
from .train_callbacks import (APP_LOG, LIGHTNING_NOISE, LossHistory, PlanPredictions, QuietLightning,  # noqa: F401
                              RunRichProgressBar, RunTQDMProgressBar, StepTimer, ValidateAfterLastStep,
                              progress_bar, quiet_lightning, say)
from .train_config import TrainAppConfig, register_configs  # noqa: F401  (registers the schema)
from .train_checks import (CHECKPOINTS, STRATEGY_NAMES, TrainConfigError, app_names, check_blocks,
                           check_host_memory, check_precision, one_line, resume_path, validate_config)

EXIT_BAD_CONFIG = 2  # a config the app cannot build, or a run the planner finds infeasible (as lazytrain-plan)
#: the config groups of this app (``--help`` lists these; conf/train/ belongs to lazytrain-plan)
TRAIN_GROUPS = ("data", "hardware", "model", "trainer")
_FAILED_JOBS: list[str] = []  # jobs of the current multirun that failed (the app exits 2 after the sweep)


# ---- pieces ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def torch_threads(n: Optional[int]) -> Iterator[None]:
    """Run with ``n`` intra-op threads (None: unchanged) and put the old count back afterwards."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def model_spec(cfg: Any) -> ModelSpec:
    spec = to_model(cfg)
    if spec.vocab < VOCAB_SIZE:
        raise ValueError(f"model.vocab={spec.vocab} is smaller than the byte vocabulary ({VOCAB_SIZE})")
    return spec


def build_module(cfg: Any) -> Any:
    """``CausalLMModule`` with ``LlamaLM(to_model(cfg))`` and the ``optim`` settings."""
    from ..lit_module import CausalLMModule

    spec = model_spec(cfg)
    o = cfg.optim
    return CausalLMModule(model_name=None, model_overrides=dataclasses.asdict(spec), optimizer=o.optimizer,
                          lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                          lr_schedule=o.lr_schedule, warmup_steps=o.warmup_steps, min_lr_ratio=o.min_lr_ratio,
                          eight_bit=o.eight_bit, max_grad_norm=o.max_grad_norm,
                          updates_in_backward=o.updates_in_backward)


def hardware_name(cfg: Any) -> Optional[str]:
    """What the lazytrain strategy plans for (the profile's name, ``measure`` or a profile given by name); None
    for other strategies (they plan nothing)."""
    s = cfg.strategy
    if s.name not in STRATEGY_NAMES:
        return None
    return str(cfg.hardware.name if s.hardware == "profile" else s.hardware)


def build_strategy(cfg: Any) -> Any:
    """The ``strategy=`` argument for the Trainer: ``"auto"`` or a ``LazyTrainStrategy`` constructed with the
    ``strategy`` settings (``hardware: profile`` passes the composed hardware group as a ``Hardware``)."""
    s = cfg.strategy
    if s.name not in STRATEGY_NAMES:
        return s.name  # "auto" or any other registered Lightning strategy name
    import lightning_lazytrain.strategy  # noqa: F401  (registers the strategy names)
    from lightning.pytorch.strategies import StrategyRegistry

    if s.name not in StrategyRegistry:
        raise ValueError(f"strategy {s.name!r} is not registered: lightning_lazytrain.strategy is missing or "
                           f"failed to import (use strategy.name=auto for plain Lightning)")
    entry = StrategyRegistry[s.name]
    hardware: Any = to_hardware(cfg) if s.hardware == "profile" else s.hardware
    kwargs: Dict[str, Any] = dict(entry.get("init_params", {}))
    kwargs["hardware"] = hardware
    if s.policy != "milp" or "policy" not in kwargs:  # keep a registered alias's own policy unless asked
        kwargs["policy"] = s.policy
    for key in ("gpu_memory_budget_gb", "nvme_dir", "blocks", "emulate_link_gb_per_s", "keep_compute_copy"):
        if s[key] is not None:
            kwargs[key] = s[key]
    if s.fp32_masters:
        kwargs["fp32_masters"] = True
    if s.conversions != "plan":  # the strategy checks the value (and that it has fp32_masters to place)
        kwargs["conversions"] = s.conversions
    try:
        return entry["strategy"](**kwargs)
    except ValueError as err:  # the strategy's option checks (autoplan.validate_options), named as the config's keys
        raise ValueError(app_names(one_line(err))) from err


def plot_loss_curve(train: list[tuple[int, float]], val: list[tuple[int, float]], path: str | Path,
                    title: str = "", smooth: int = 20) -> Path:
    """Train loss per step (thin), its moving average (``smooth`` steps) and val loss per validation (dots).
    Uses matplotlib's object API (no pyplot state shared between jobs)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="#4c72b0", alpha=0.35, linewidth=0.8, label="train loss (per step)")
        if smooth > 1 and len(losses) >= smooth:
            avg = [sum(losses[max(0, i - smooth + 1): i + 1]) / len(losses[max(0, i - smooth + 1): i + 1])
                   for i in range(len(losses))]
            ax.plot(steps, avg, color="#4c72b0", linewidth=1.6, label=f"train loss ({smooth}-step mean)")
    if val:
        vs, vl = zip(*val)
        ax.plot(vs, vl, "o-", color="#c44e52", linewidth=1.4, markersize=5, label="val loss (held-out files)")
    ax.axhline(math.log(VOCAB_SIZE), color="#7f7f7f", linestyle=":", linewidth=1, label="ln 256 (uniform bytes)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy [nats / byte]")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def summarize(history: LossHistory, smooth: int) -> Dict[str, Any]:
    """First vs last losses. Train: mean of the first / last ``smooth`` steps (step 1 alone too); val: the
    sanity check before training (``initial``) vs the last validation (``final``)."""
    out: Dict[str, Any] = {"steps": history.train[-1][0] if history.train else 0}
    losses = [v for _, v in history.train]
    if losses:
        k = max(1, min(smooth, len(losses) // 2 or 1))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        out.update(first_train_loss=losses[0], first_train_loss_mean=first, last_train_loss_mean=last,
                   train_loss_mean_window=k, train_loss_drop=first - last)
    if history.val:
        initial = history.val[0][1] if history.val[0][0] == 0 else None
        final_step, final = history.val[-1]
        out.update(final_val_loss=final, final_val_step=final_step, val_history=history.val)
        if initial is not None:
            out.update(initial_val_loss=initial, val_loss_drop=initial - final,
                       val_loss_drop_fraction=(initial - final) / initial if initial else None)
    return out


def _params(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# ---- the job --------------------------------------------------------------------------------------
_BUDGET_KEYS = {"gpu": "strategy.gpu_memory_budget_gb", "cpu": "hardware.cpu_memory_gb"}


def _with_budget_key(err: InfeasibleBudget) -> InfeasibleBudget:
    """The smallest budget the planner names (``fits_bytes``, printed rounded up), also as the key that sets it
    here (``strategy.gpu_memory_budget_gb``, ``hardware.cpu_memory_gb``), in GB."""
    key = _BUDGET_KEYS.get(err.tier)
    if err.fits_bytes is None or key is None:
        return err
    shown = format_bytes_at_least(err.fits_bytes)
    number, unit = shown.split(" ")
    gb = float(number) * 1000 ** DECIMAL_UNITS.index(unit) / 1e9
    return err.reworded(shown, f"{shown} ({key}={gb:.4g})")


def train_job(cfg: Any, out_dir: str | Path, *, out: TextIO | None = None, job: Optional[int] = None,
              overrides: Optional[str] = None) -> Dict[str, Any]:
    """Train ``cfg`` (a composed ``TrainAppConfig``), write the logs, ``loss_curve.png``, ``losses.json``,
    ``result.json`` and ``summary_row.json`` (one row of a sweep's ``sweep.csv``; ``job``/``overrides`` label it)
    into ``out_dir`` and return the result dict. A config that cannot run raises ``TrainConfigError`` before
    anything is written."""
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor

    from ..engine.nvme import NvmeDirError
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    out = out or sys.stdout
    validate_config(cfg)
    resume = resume_path(cfg.resume)
    out_dir = Path(out_dir)
    t = cfg.trainer
    hw_name = hardware_name(cfg)
    with torch_threads(t.threads), quiet_lightning():
        L.seed_everything(int(cfg.seed), workers=True, verbose=False)
        try:
            dm = StdlibTextDataModule(**OmegaConf.to_container(cfg.data, resolve=True))  # type: ignore[arg-type]
            info = dm.describe()
            check_host_memory(str(cfg.model.name), model_spec(cfg).total_params)  # before the model is built
            module = build_module(cfg)
            check_blocks(cfg, module)
            strategy = build_strategy(cfg)
        except TrainConfigError:
            raise
        except (ValueError, PlannerError, FileNotFoundError) as err:
            raise TrainConfigError(app_names(one_line(err))) from err

        history = LossHistory(out)
        timer = StepTimer()
        plans = PlanPredictions()
        callbacks: list = [history, timer, plans, ValidateAfterLastStep(), LearningRateMonitor(logging_interval="step")]
        if t.enable_progress_bar:
            callbacks.append(progress_bar())
        if t.enable_checkpointing:  # checkpoints/last.ckpt, what resume=<this output dir> continues from
            from lightning.pytorch.callbacks import ModelCheckpoint

            callbacks.append(ModelCheckpoint(dirpath=str(out_dir / CHECKPOINTS), save_top_k=0, save_last=True,
                                             every_n_train_steps=t.checkpoint_every_n_steps or t.val_check_interval))
        per_epoch = max(1, info["train_windows"] // info["batch_size"])
        max_epochs = math.ceil(t.max_steps * t.accumulate_grad_batches / per_epoch)
        logger = CSVLogger(save_dir=str(out_dir), name="logs", version="",  # -> logs/metrics.csv, logs/hparams.yaml
                           flush_logs_every_n_steps=10)  # (Lightning's 100: a crash lost up to 99 steps' rows)
        try:
            trainer = L.Trainer(
                accelerator=t.accelerator, devices=t.devices, precision=t.precision, strategy=strategy,
                max_steps=t.max_steps, max_epochs=max_epochs,
                val_check_interval=min(t.val_check_interval, t.max_steps) * t.accumulate_grad_batches,  # (batches)
                check_val_every_n_epoch=None,
                limit_val_batches=t.limit_val_batches, num_sanity_val_steps=t.num_sanity_val_steps,
                log_every_n_steps=t.log_every_n_steps, gradient_clip_val=t.gradient_clip_val,
                accumulate_grad_batches=t.accumulate_grad_batches, enable_progress_bar=t.enable_progress_bar,
                enable_checkpointing=t.enable_checkpointing, enable_model_summary=t.enable_model_summary,
                default_root_dir=str(out_dir), logger=logger, callbacks=callbacks)
        except (MisconfigurationException, ValueError) as err:  # e.g. a precision Lightning does not know
            raise TrainConfigError(one_line(err)) from err
        check_precision(trainer, cfg)
        out_dir.mkdir(parents=True, exist_ok=True)

        where = ""
        if hw_name is not None:
            where = f" (policy {getattr(strategy, 'policy', cfg.strategy.policy)}, hardware {hw_name})"
        say(f"lazytrain-train: {cfg.model.name} ({_params(module.num_parameters)} params) on {t.accelerator} "
            f"x{t.devices}, {t.precision}, strategy {cfg.strategy.name}{where}, torch threads "
            f"{torch.get_num_threads()}", out)
        say(f"data: Python {sys.version_info.major}.{sys.version_info.minor} stdlib .py source, "
            f"train {info['train_files']} files / {format_bytes(info['train_bytes'])}, held-out "
            f"{info['val_files']} files / {format_bytes(info['val_bytes'])} ({info['val_windows']} val windows); "
            f"batch {info['batch_size']} x seq {info['seq_len']}, {t.max_steps} steps, validation every "
            f"{t.val_check_interval}", out)
        start = time.perf_counter()
        try:
            trainer.fit(module, datamodule=dm, ckpt_path=resume)
        except NvmeDirError as err:  # strategy.nvme_dir unusable, or too small for the plan's spill bytes
            raise TrainConfigError(re.sub(r"(?<![\w.])nvme_dir\b", "strategy.nvme_dir", one_line(err))) from err
        except InfeasibleBudget as err:  # the fix in this app's keys
            raise _with_budget_key(err.reworded(TRAINER_EIGHT_BIT_FIX, "optim.optimizer=hybrid_adamw "
                                                "optim.eight_bit=all")) from err
        wall = time.perf_counter() - start

    result = summarize(history, int(cfg.smooth_steps))
    tokens = result["steps"] * t.accumulate_grad_batches * info["batch_size"] * info["seq_len"]
    # the prediction the run ended with: a re-plan that kept the schedule re-predicts it from its profile (the
    # drift monitor's reference from then on); the summary quotes the plan table's figure and says so
    last = trainer.callback_metrics.get("lazytrain/predicted_step_seconds")
    last = float(last) if last is not None and math.isfinite(float(last)) else None
    replans = list(getattr(trainer.strategy, "replans", []))
    plan_steps = [0] + [int(r["step"]) for r in replans if r.get("switched")]  # the steps the tables were made at
    plan_predictions = [{"step": step, "predicted_s": seconds} for step, seconds in zip(plan_steps, plans.seconds)]
    predicted = plans.seconds[-1] if plans.seconds else last
    result.update(model=cfg.model.name, params=module.num_parameters, strategy=cfg.strategy.name,
                  hardware=hw_name, accelerator=t.accelerator, precision=t.precision, seed=int(cfg.seed),
                  fit_seconds=wall, train_tokens=tokens, tokens_per_s=tokens / wall if wall > 0 else None,
                  step_seconds_measured=timer.median(), step_seconds_predicted=predicted,
                  step_seconds_predicted_last=last, plan_predictions=plan_predictions,
                  step_seconds_first=timer.seconds[0] if timer.seconds else None, data=info, replans=replans,
                  output_dir=str(out_dir), pid=os.getpid())
    title = (f"{cfg.model.name} ({_params(module.num_parameters)}) on stdlib bytes, strategy {cfg.strategy.name}: "
             f"batch {info['batch_size']} x {info['seq_len']}, lr {cfg.optim.lr:g}")
    plot_loss_curve(history.train, history.val, out_dir / "loss_curve.png", title, smooth=int(cfg.smooth_steps))
    (out_dir / "losses.json").write_text(json.dumps({"train": history.train, "val": history.val}))
    (out_dir / "result.json").write_text(json.dumps({**result, "config": to_container(cfg)}, indent=1, default=str))
    (out_dir / ROW_FILE).write_text(json.dumps(summary_row(cfg, result, job=job, overrides=overrides), indent=1,
                                               default=str))

    # ---- print ------------------------------------------------------------------------------------
    lines = []
    if "final_val_loss" in result:
        line = f"final val loss {result['final_val_loss']:.4f} (held-out files, step {result['final_val_step']})"
        if "initial_val_loss" in result:
            line += (f"; before training {result['initial_val_loss']:.4f}: down {result['val_loss_drop']:.4f} "
                     f"({100 * result['val_loss_drop_fraction']:.1f}%)")
        lines.append(line)
    if "first_train_loss_mean" in result:
        k = result["train_loss_mean_window"]
        lines.append(f"train loss: first {k} steps {result['first_train_loss_mean']:.4f} -> last {k} steps "
                     f"{result['last_train_loss_mean']:.4f} (down {result['train_loss_drop']:.4f})")
    measured = result["step_seconds_measured"]
    if measured is not None:
        lines.append(step_time_line(measured, predicted, plan_predictions, replans))
    lines.append(f"wrote loss_curve.png, result.json, losses.json, logs/metrics.csv to {out_dir}")
    summary = (f"lazytrain-train: done, {result['steps']} steps in {wall:.1f} s "
               f"({result['tokens_per_s'] or 0:,.0f} tokens/s)")
    if "final_val_loss" in result:
        summary += f", final val loss {result['final_val_loss']:.4f}"
        if "initial_val_loss" in result:
            summary += f" (from {result['initial_val_loss']:.4f})"
    lines.append(summary)
    for line in lines:
        say(line, out)
    return result


def step_time_line(measured: float, predicted: float | None, plan_predictions: list[dict[str, Any]],
                   replans: list[dict[str, Any]]) -> str:
    """The summary's step-time line. ``predicted`` is the iter [s] of the plan row of the last table the
    strategy printed, in the table's rounding: the first plan's, or after a re-plan that switched "the plan
    made at step N"'s. A re-plan that kept the schedule printed no table; the line says what it re-predicted."""
    def seconds(x: float) -> str:
        return format_value("iteration_s", x)  # as the table prints iter [s]

    line = f"step time: measured {seconds(measured)} s (median after the first step)"
    if predicted is not None:
        if len(plan_predictions) > 1:
            which = (f"by the plan made at step {plan_predictions[-1]['step']} (iter [s] of its table; the first "
                     f"plan's: {seconds(plan_predictions[0]['predicted_s'])} s)")
        else:
            which = "by the plan (iter [s] of its table, from one profiled step)"
        line += f", predicted {seconds(predicted)} s {which}; measured / predicted {measured / predicted:.2f}x"
    if replans:  # re-plans (each in result.json; a switch printed its table as it happened)
        def when(r: dict[str, Any]) -> str:  # "step 6: profile check" (the reason's kind: drift, memory, ...)
            head, colon, _ = str(r.get("reason", "")).partition(":")
            return f"step {r['step']}" + (f": {head}" if colon and len(head) <= 16 else "")

        switched = [str(r["step"]) for r in replans if r.get("switched")]
        line += (f"; re-planned {len(replans)}x ({'; '.join(map(when, replans))}): "
                 + (f"switched at {', '.join(switched)}" if switched else "kept the schedule"))
        kept = replans[-1]
        again = kept.get("current_predicted_s")
        if not kept.get("switched") and again:
            line += (f" (step {kept['step']}'s profile re-predicts it at {seconds(again)} s, measured / that "
                     f"{measured / again:.2f}x: the drift monitor's reference since)")
    return line


SWEEP_TRAIN_COLUMNS = ("job", "status", "overrides", "model", "strategy", "hardware", "seed", "lr", "steps",
                       "initial_val_loss", "final_val_loss", "val_loss_drop", "tokens_per_s", "step_s_measured",
                       "step_s_predicted", "measured_over_predicted", "fit_seconds", "reason", "output_dir")


def summary_row(cfg: Any, result: Optional[Dict[str, Any]] = None, *, job: Optional[int] = None,
                overrides: Optional[str] = None, error: Optional[BaseException] = None,
                out_dir: str | Path | None = None) -> Dict[str, Any]:
    """One job's row of a training sweep's ``sweep.csv`` (``SWEEP_TRAIN_COLUMNS``)."""
    row: Dict[str, Any] = {"job": job, "status": "ok" if error is None else "failed", "overrides": overrides,
                           "model": cfg.model.name, "strategy": cfg.strategy.name, "hardware": hardware_name(cfg),
                           "seed": int(cfg.seed), "lr": float(cfg.optim.lr), "reason": "" if error is None else
                           one_line(error), "output_dir": None if out_dir is None else str(out_dir)}
    if result is not None:
        measured, predicted = result.get("step_seconds_measured"), result.get("step_seconds_predicted")
        row.update(steps=result.get("steps"), initial_val_loss=result.get("initial_val_loss"),
                   final_val_loss=result.get("final_val_loss"), val_loss_drop=result.get("val_loss_drop"),
                   tokens_per_s=result.get("tokens_per_s"), step_s_measured=measured, step_s_predicted=predicted,
                   measured_over_predicted=measured / predicted if measured and predicted else None,
                   fit_seconds=result.get("fit_seconds"), output_dir=result.get("output_dir"))
    return row


class TrainSweepSummary(SweepSummary):
    """Hydra callback (``conf/train_app.yaml``): after a multirun, one ``sweep.csv`` in the sweep directory with a
    row per job (final val loss, tokens/s, measured vs predicted step time; failed jobs with their reason), and the
    same as a table on the console. The app exits 2 if a job failed."""

    columns = SWEEP_TRAIN_COLUMNS
    table_columns = ("job", "overrides", "status", "final_val_loss", "tokens_per_s", "step_s_measured",
                     "step_s_predicted")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        super().on_multirun_start(config, **kwargs)
        _FAILED_JOBS.clear()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        rows = super().on_multirun_end(config, **kwargs)
        if rows:
            tokens = [str(r.get("overrides") or "").split() for r in rows]
            common = set.intersection(*(set(tok) for tok in tokens))  # the table shows what the sweep varies
            table = [{**{k: r.get(k) for k in self.table_columns},
                      "overrides": " ".join(tok for tok in toks if tok not in common) or "-"}
                     for r, toks in zip(rows, tokens)]
            print(format_table(table), flush=True)


def _task(cfg: DictConfig) -> Optional[float]:
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    job = int(hc.job.num) if multirun and hc.job.get("num") is not None else None
    overrides = " ".join(hc.overrides.task)
    run_dir = RunDir(out_dir, hc.job.name)  # what the directory held as the job began
    try:
        result = train_job(cfg, out_dir, job=job, overrides=overrides)
    except (TrainConfigError, PlannerError) as err:
        infeasible = isinstance(err, (InfeasibleBudget, InfeasibleSchedule))
        kind = f"infeasible ({type(err).__name__}): " if infeasible else ""
        print(f"lazytrain-train: {kind}{in_config_units(one_line(err))}", file=sys.stderr, flush=True)
        if multirun:  # record the reason in the job's row and let the sweep go on
            out_dir.mkdir(parents=True, exist_ok=True)
            row = summary_row(cfg, job=job, overrides=overrides, error=err, out_dir=out_dir)
            (out_dir / ROW_FILE).write_text(json.dumps(row, indent=1, default=str))
            _FAILED_JOBS.append(overrides)
            return None
        run_dir.remove_created()  # nothing ran: Note: [a failed run leaves what it found] (run_dir.py)
        sys.stdout.flush()
        sys.exit(EXIT_BAD_CONFIG)
    return result.get("final_val_loss")  # the value a Hydra sweeper would minimise


_hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train_app")(_task)


def main() -> None:
    """Console script ``lazytrain-train`` (Hydra app over conf/train_app.yaml). Exit status 2: a config that cannot
    run or an infeasible plan (one line on stderr, no output directory left), or a multirun with a failed job.
    The command line is composed and checked against the schema first (``config.check_command_line``), so a key it
    does not know (``+`` or not) or a value of the wrong type never reaches Hydra's run (no directory, no trace)."""
    _FAILED_JOBS.clear()
    problem = check_command_line("train_app", sys.argv[1:], TRAIN_GROUPS) or check_output_dirs(sys.argv[1:])
    if problem is not None:
        print(f"lazytrain-train: {problem}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_CONFIG)
    _hydra_main()
    if _FAILED_JOBS:
        print(f"lazytrain-train: {len(_FAILED_JOBS)} job(s) failed: {'; '.join(_FAILED_JOBS)}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)



if __name__ == "__main__":
    main()
