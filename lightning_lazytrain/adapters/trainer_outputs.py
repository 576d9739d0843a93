"""What the Trainer strategy gives the run's loggers: each step's ``lazytrain/*`` figures, and the
directory its plan files and timelines go to."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import DummyLogger

from lightning_lazytrain.core import TrainingCore

__all__ = ["StepMetrics", "artifact_dir"]


def artifact_dir(trainer: Any) -> str | None:
    """The logger's directory; None without a real logger (no files in the working directory)."""
    if not trainer.loggers or all(isinstance(lg, DummyLogger) for lg in trainer.loggers):
        return None
    return trainer.log_dir


class StepMetrics(Callback):
    """Logs the strategy's per-step figures (``lazytrain/*``, ``TrainingCore.take_metrics``) through
    ``LightningModule.log``, so they follow ``log_every_n_steps`` and reach every logger like the
    user's own metrics."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        core = getattr(trainer.strategy, "core", None)
        if isinstance(core, TrainingCore):
            metrics = core.take_metrics()
            if metrics:
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
