"""The train app's callbacks and console: the loss history, the step timer, the plan predictions, the progress
bar that ends where the run ends, the report lines (``say``) and Lightning's start-up chatter left out."""

from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import time
import warnings
from typing import Any, Iterator, Optional, TextIO, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

#: the app's own lines (header, validation results, summary) also go to this logger: conf/train_app.yaml sends
#: it to <output dir>/train.log, next to Lightning's messages (the plan table); the solver's log goes to solver.log
APP_LOG = logging.getLogger("lightning_lazytrain.train")
#: Lightning's start-up chatter that the main job's console leaves out (messages starting with these)
LIGHTNING_NOISE = ("GPU available:", "TPU available:", "HPU available:", "IPU available:", "\U0001f4a1 Tip:",
                   "Loading `train_dataloader` to estimate", "`Trainer.fit` stopped:", "LOCAL_RANK:")

# ---- callbacks ----------------------------------------------------------------------------------
class LossHistory(Callback):
    """Records every optimizer step's train loss and every validation's mean loss (the sanity check as step 0).

    ``train``: ``[(step, loss)]`` (``step`` = ``trainer.global_step`` after the update, 1-based);
    ``val``: ``[(step, loss)]``, batch-size weighted mean over the validation run."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        self.out = out  # where each validation's result is reported (None: not reported)
        self._sum = 0.0
        self._n = 0
        self._step = 0  # global_step at the last optimizer step seen
        self._window: list[float] = []  # the unscaled losses of the micro-batches since

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._step, self._window = int(trainer.global_step), []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """One entry per optimizer step: the mean of its micro-batches' losses. Lightning hands automatic
        optimization's loss divided by ``accumulate_grad_batches``; the step that ran is seen as
        ``global_step`` moving (the micro-batches before it still show the previous step)."""
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self._window.append(float(loss.detach()) * scale)
        step = int(trainer.global_step)
        if step != self._step:
            if self._window:
                self.train.append((step, sum(self._window) / len(self._window)))
            self._step, self._window = step, []

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sum, self._n = 0.0, 0

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if isinstance(outputs, torch.Tensor):
            n = int(batch.shape[0]) if isinstance(batch, torch.Tensor) else 1
            self._sum += float(outputs.detach()) * n
            self._n += n

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._n:
            step = 0 if trainer.sanity_checking else int(trainer.global_step)
            self.val.append((step, self._sum / self._n))
            if self.out is not None:
                when = "before training" if trainer.sanity_checking else f"step {step}"
                say(f"validation, {when}: val loss {self._sum / self._n:.4f} ({self._n} held-out windows)",
                    self.out, trainer)


class ValidateAfterLastStep(Callback):
    """Makes the fit loop validate after the ``max_steps``-th step even when it is not a multiple of
    ``val_check_interval`` (Lightning validates on ``should_stop``; at ``max_steps`` it would just stop)."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True


class StepTimer(Callback):
    """Wall time of every optimizer step: from its first micro-batch's start to its last one's end (forward,
    backward, optimizer step; no data loading, no validation)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start: Optional[float] = None
        self._step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._step = int(trainer.global_step)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if int(trainer.global_step) > self._step and self._start is not None:
            self.seconds.append(time.perf_counter() - self._start)
            self._start, self._step = None, int(trainer.global_step)

    def median(self) -> Optional[float]:
        """Median step time without the first step (the warm-up; with the lazytrain strategy, the profile)."""
        steady = self.seconds[1:] or self.seconds
        return statistics.median(steady) if steady else None


class PlanPredictions(Callback):
    """The predicted step seconds of each plan that took effect, in order (``seconds``: the plan row of each
    table the strategy printed: the first plan's, then one per re-plan that switched the schedule; a re-plan
    that kept the schedule prints no table and adds nothing)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._plan: Any = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        plan = getattr(trainer.strategy, "plan", None)
        result = getattr(plan, "result", None)
        if result is not None and plan is not self._plan:
            self._plan = plan
            self.seconds.append(float(result.sim.iteration_seconds))


class _EndsWhereTheRunEnds:
    """Mixin for Lightning's progress bars: the training bar's total is the batches left until ``max_steps``
    (Lightning shows the epoch's length, e.g. 300/3659 with an 8-minute ETA for a 300-step run), and
    ``report`` prints a line without breaking the bar."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        total = super().total_train_batches  # type: ignore[misc]
        trainer = self.trainer  # type: ignore[attr-defined]
        if trainer.max_steps is not None and trainer.max_steps > 0:
            total = min(total, (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches)
        return total


class RunRichProgressBar(_EndsWhereTheRunEnds, RichProgressBar):
    def report(self, text: str) -> None:
        progress = getattr(self, "progress", None)
        if progress is not None and not self.is_disabled:
            progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)


class RunTQDMProgressBar(_EndsWhereTheRunEnds, TQDMProgressBar):
    def report(self, text: str) -> None:
        self.print(text)


def progress_bar() -> Callback:
    """The progress bar Lightning would pick (Rich when installed, else tqdm), ending where the run ends."""
    from lightning_utilities.core.imports import RequirementCache

    rich = RequirementCache("rich>=10.2.2")  # what Lightning's RichProgressBar requires
    return RunRichProgressBar() if rich else RunTQDMProgressBar()


def say(text: str, out: TextIO, trainer: Optional[Trainer] = None) -> None:
    """Print one line of the job's report (through the progress bar while it is live) and log it to train.log."""
    bar = getattr(trainer, "progress_bar_callback", None) if trainer is not None else None
    if bar is not None and hasattr(bar, "report") and out is sys.stdout:
        bar.report(text)
    else:
        print(text, file=out, flush=True)
    APP_LOG.info(text)


class QuietLightning(logging.Filter):
    """Drops Lightning's start-up chatter (``LIGHTNING_NOISE``); keeps everything else, the plan table included."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith(LIGHTNING_NOISE)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """For the job's duration: no Lightning tips / device banners, no deprecation warnings (Lightning's and
    torch's: nothing the user of this app can act on). Other warnings and messages stay."""
    quiet = QuietLightning()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch.utilities.rank_zero",
                                                    "lightning.fabric.utilities.rank_zero")]
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category)
            yield
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)
