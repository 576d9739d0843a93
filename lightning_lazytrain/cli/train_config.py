"""The typed schema of ``lazytrain-train`` (cli/train.py): ``conf/train_app.yaml`` lists ``train_app_schema`` first, so
Hydra checks every composed config against these dataclasses (a misspelt key or a value of the wrong type fails at
composition; ``config_checks.check_command_line`` names it before Hydra runs). The hardware and model groups are
the planner's (``config.py``); the data, trainer, strategy and optimizer groups are the app's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore

from ..config import HardwareConfig, ModelConfig

__all__ = ["DataConfig", "OptimConfig", "StrategyConfig", "TrainAppConfig", "TrainerConfig", "register_configs"]


@dataclass
class DataConfig:
    """``StdlibTextDataModule``'s arguments (``conf/data/stdlib.yaml``)."""

    seq_len: int = 128
    batch_size: int = 8
    max_bytes: Optional[int] = 4_000_000
    holdout_every: int = 20  # every n-th file is held out (validation's interval is trainer.val_check_interval)
    train_windows: Optional[int] = None
    val_windows: Optional[int] = 128
    seed: int = 0
    num_workers: int = 0
    root: Optional[str] = None


@dataclass
class TrainerConfig:
    """``lightning.Trainer`` arguments (``conf/trainer/*.yaml``), plus ``threads``."""

    accelerator: str = "cpu"
    devices: int = 1
    precision: str = "32-true"
    max_steps: int = 300
    val_check_interval: int = 100  # optimizer steps between validations (a last one runs after the last step)
    limit_val_batches: Optional[int] = None
    num_sanity_val_steps: int = -1  # -1: the whole held-out set before training (the "before" val loss)
    log_every_n_steps: int = 1
    gradient_clip_val: Optional[float] = 1.0
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True
    enable_checkpointing: bool = False  # true: checkpoints/last.ckpt in the output dir (resume=<that dir>)
    checkpoint_every_n_steps: Optional[int] = None  # with enable_checkpointing (None: every val_check_interval)
    enable_model_summary: bool = True
    threads: Optional[int] = None  # torch intra-op threads for this job (restored after); None: leave as is


@dataclass
class StrategyConfig:
    name: str = "lazytrain"  # lazytrain | lazytrain_megatrain | auto (plain Lightning, no streaming)
    hardware: str = "profile"  # profile: the composed hardware group; measure (or a profile name): as given
    policy: str = "milp"
    gpu_memory_budget_gb: Optional[float] = None
    nvme_dir: Optional[str] = None
    blocks: Optional[str] = None
    emulate_link_gb_per_s: Optional[float] = None
    fp32_masters: bool = False  # with trainer.precision=bf16-true: fp32 masters, bf16 copies streamed
    keep_compute_copy: Optional[bool] = None  # fp32_masters: keep the bf16 copies on the host (None: auto)
    conversions: str = "plan"  # fp32_masters: where fp32 <-> bf16 runs: plan | host | device


@dataclass
class OptimConfig:
    """``CausalLMModule``'s optimizer arguments."""

    optimizer: str = "adamw"  # adamw | hybrid_adamw
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    lr_schedule: str = "cosine"  # cosine | constant (both after a linear warmup)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    eight_bit: Any = "plan"  # hybrid_adamw: plan | none | all | fraction
    max_grad_norm: Optional[float] = None  # hybrid_adamw: clip inside the optimizer
    updates_in_backward: bool = False  # hybrid_adamw: update each block during the backward (no clip, no skip)


@dataclass
class TrainAppConfig:
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    resume: Optional[str] = None  # a checkpoint, or an earlier run's output dir (its checkpoints/last.ckpt)
    smooth_steps: int = 20  # window of the "first" / "last" train-loss means and of the plotted moving average


def register_configs() -> None:
    """Register the app schema (idempotent); ``conf/train_app.yaml`` lists ``train_app_schema`` first."""
    ConfigStore.instance().store(name="train_app_schema", node=TrainAppConfig)


register_configs()
