"""The train app's checks of a composed config, with the app's own key names (``cli/train.py``): a config that
cannot run is one ``TrainConfigError`` line naming the key, raised before anything is built or written -- the
schema, the strategy name, the accelerator, the run length and the values a job would otherwise only find bad
inside ``fit`` (accumulation, threads, the data loader's values, the block path: ``validate_config``,
``check_blocks``; the optimizer's are CausalLMModule's own checks), and the precision Lightning resolved
(``check_precision``), and ``resume=`` (``resume_path``). ``app_names`` rewrites a LazyTrainStrategy or CausalLMModule message's argument names into
the config's keys."""

from __future__ import annotations

import re
from typing import Any

import torch

from ..config_checks import ConfigKeyError, check_schema
from ..planner.hardware import available_host_bytes

__all__ = ["CHECKPOINTS", "LAZYTRAIN_PRECISIONS", "STRATEGY_NAMES", "TrainConfigError", "app_names",
           "available_host_bytes", "check_blocks", "check_host_memory", "check_precision", "one_line", "resume_path",
           "validate_config"]

STRATEGY_NAMES = ("lazytrain", "lazytrain_megatrain")
#: the Trainer precisions the lazytrain strategy runs (its own table when importable; the same values otherwise)
LAZYTRAIN_PRECISIONS = ("16-mixed", "16-true", "32-true", "bf16-mixed", "bf16-true")
#: LazyTrainStrategy's and CausalLMModule's arguments as the app's config names them
_STRATEGY_OPTIONS = re.compile(r"(?<![\w.])(hardware|policy|gpu_memory_budget_gb|nvme_dir|blocks|emulate_link_gb_per_s|"
                               r"fp32_masters|keep_compute_copy|conversions)=")
_OPTIM_OPTIONS = re.compile(r"(?<![\w.])(lr|weight_decay|betas|eps|eight_bit|max_grad_norm|warmup_steps|min_lr_ratio|"
                            r"lr_schedule|optimizer|updates_in_backward)=")


class TrainConfigError(ValueError):
    """The config cannot be turned into data, model and strategy."""


def one_line(err: BaseException) -> str:
    """An error's message on one line (what the apps print)."""
    return " ".join(str(err).split())


def app_names(text: str) -> str:
    """A LazyTrainStrategy / CausalLMModule message with its arguments named as this app's config keys
    (``strategy.nvme_dir=...``, ``optim.lr=...``)."""
    text = _STRATEGY_OPTIONS.sub(r"strategy.\1=", text).replace("=None", "=null")
    return _OPTIM_OPTIONS.sub(r"optim.\1=", text)


def validate_config(cfg: Any) -> None:
    """Start-up checks with the user's option names, before anything is built or written: no key the schema does
    not know (``+trainer.max_step=10`` included), the strategy name (ours, ``auto`` or one registered with
    Lightning), the accelerator (known to Lightning and present on this machine), the run length,
    accumulation, threads and the data loader's values. Raises ``TrainConfigError`` (one line)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    try:
        check_schema(cfg)
    except ConfigKeyError as err:
        raise TrainConfigError(str(err)) from None
    s, t = cfg.strategy, cfg.trainer
    if s.name not in STRATEGY_NAMES and s.name != "auto" and s.name not in StrategyRegistry:
        others = sorted(n for n in StrategyRegistry.available_strategies()
                        if n not in STRATEGY_NAMES and "find_unused_parameters" not in n)
        raise TrainConfigError(
            f"strategy.name={s.name!r} is not a strategy: use lazytrain or lazytrain_megatrain (layer streaming), "
            f"auto (plain Lightning), or one of Lightning's: {', '.join(others)} (ddp variants also with "
            f"_find_unused_parameters_true/false)")
    accelerator = str(t.accelerator).lower()
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise TrainConfigError(
                f"trainer.accelerator={t.accelerator!r} (trainer=gpu) needs a CUDA GPU and this machine has none "
                f"(torch.cuda.is_available() is False): use trainer=cpu")
        if int(t.devices) > torch.cuda.device_count():
            raise TrainConfigError(f"trainer.devices={t.devices} but this machine has {torch.cuda.device_count()} "
                                   f"CUDA GPU(s)")
    elif accelerator != "auto":
        known = sorted(set(AcceleratorRegistry.available_accelerators()) | {"auto", "gpu"})
        if accelerator not in AcceleratorRegistry:
            raise TrainConfigError(f"trainer.accelerator={t.accelerator!r} is not an accelerator: use one of "
                                   f"{', '.join(known)}")
        if not AcceleratorRegistry[accelerator]["accelerator"].is_available():
            raise TrainConfigError(f"trainer.accelerator={t.accelerator!r} is not available on this machine: use "
                                   f"trainer=cpu")
    if s.name in STRATEGY_NAMES and accelerator not in ("cpu", "gpu", "cuda", "auto"):
        raise TrainConfigError(f"strategy.name={s.name} runs on trainer.accelerator cpu or gpu, not "
                               f"{t.accelerator!r}")
    if int(t.max_steps) < 1:
        raise TrainConfigError(f"trainer.max_steps={t.max_steps}: the app trains a fixed number of steps (>= 1)")
    if int(t.val_check_interval) < 1:
        raise TrainConfigError(f"trainer.val_check_interval={t.val_check_interval}: must be >= 1 (steps)")
    if t.checkpoint_every_n_steps is not None and int(t.checkpoint_every_n_steps) < 1:
        raise TrainConfigError(f"trainer.checkpoint_every_n_steps={t.checkpoint_every_n_steps}: must be >= 1 (steps), "
                               "or null (every trainer.val_check_interval)")
    if int(t.accumulate_grad_batches) < 1:
        raise TrainConfigError(f"trainer.accumulate_grad_batches={t.accumulate_grad_batches}: must be >= 1 (batches "
                               "per optimizer step)")
    if t.threads is not None and int(t.threads) < 1:
        raise TrainConfigError(f"trainer.threads={t.threads}: must be >= 1, or null (torch's own thread count)")
    d = cfg.data
    for key in ("seq_len", "batch_size", "holdout_every"):
        if int(d[key]) < 1:
            raise TrainConfigError(f"data.{key}={d[key]}: must be >= 1")
    if int(d.num_workers) < 0:
        raise TrainConfigError(f"data.num_workers={d.num_workers}: must be >= 0 (0: load in the main process)")


def check_precision(trainer: Any, cfg: Any) -> None:
    """The precision Lightning resolved ``trainer.precision`` to must be one the lazytrain strategy runs (it refuses
    the others only in ``fit``, after the output directory exists). Raises ``TrainConfigError``."""
    if cfg.strategy.name not in STRATEGY_NAMES:
        return
    try:
        from ..strategy import COMPUTE_DTYPES

        supported = sorted(k for k in COMPUTE_DTYPES if "-" in k)
    except ImportError:  # pragma: no cover - the strategy ships with the package
        supported = list(LAZYTRAIN_PRECISIONS)
    plugin = getattr(trainer.strategy, "precision_plugin", None)
    precision = str(getattr(plugin, "precision", cfg.trainer.precision))
    if precision not in supported:
        raise TrainConfigError(
            f"trainer.precision={cfg.trainer.precision!r} is not supported by strategy.name={cfg.strategy.name}: use "
            f"one of {', '.join(supported)} (64-bit and plugin precisions would train differently from "
            f"strategy.name=auto, which runs them)")


def check_blocks(cfg: Any, module: Any) -> None:
    """``strategy.blocks`` (or the stack found without it) names a block stack of ``module``, checked before
    ``fit`` (the strategy would find out there, after the output directory exists)."""
    if cfg.strategy.name not in STRATEGY_NAMES:
        return
    from ..engine.blocks import BlockDiscoveryError, find_blocks

    try:
        find_blocks(module, cfg.strategy.blocks)
    except BlockDiscoveryError as err:
        raise TrainConfigError(app_names(one_line(err))) from None


def check_host_memory(name: str, params: int, available: int | None = None) -> None:
    """A model whose training cannot fit this machine's memory: one line before it is built (else the kernel kills
    the job, with no message, while the model is made). Counted: the least any step holds, the fp32 weights the
    model is built in and their gradients (8 B per parameter; the optimizer's states come on top)."""
    available = available_host_bytes() if available is None else available
    need = 8 * params
    if available is None or need <= available:
        return
    raise TrainConfigError(
        f"model={name} has {params / 1e9:.2f}B parameters: training it holds at least {need / 1e9:.1f} GB in host "
        f"memory (its fp32 weights and their gradients, before the optimizer's states), and this machine has "
        f"{available / 1e9:.1f} GB available. Fix: a smaller model (model=tiny, or model.num_layers=...), or a "
        f"machine with more memory (lazytrain-plan plans the large models without building them)")


#: where ``trainer.enable_checkpointing=true`` keeps ``last.ckpt`` in a run's output dir
CHECKPOINTS = "checkpoints"


def resume_path(value: Any) -> str | None:
    """``resume=``: a checkpoint (a file, or a sharded checkpoint's directory), or an earlier run's output dir (its
    ``checkpoints/last.ckpt``); checked before anything is written."""
    if value in (None, ""):
        return None
    from pathlib import Path

    p = Path(str(value)).expanduser().absolute()
    candidates = [p / CHECKPOINTS / "last.ckpt", p / "last.ckpt"] if p.is_dir() and p.suffix != ".ckpt" else [p]
    for c in candidates:
        if c.exists():
            return str(c)
    looked = " or ".join(str(c) for c in candidates)
    raise TrainConfigError(
        f"resume={value}: no checkpoint at {looked}. Fix: give a checkpoint file (.ckpt) or the output dir of a run "
        f"made with trainer.enable_checkpointing=true (it keeps {CHECKPOINTS}/last.ckpt there)")
