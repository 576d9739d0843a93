"""Real text that ships with Python: the standard library's own ``.py`` files, as bytes.

``StdlibTextDataModule`` reads the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (installed
packages under ``site-packages`` / ``dist-packages`` are not the standard library and are skipped) in
sorted order of their relative paths, until ``max_bytes`` have been read (the last file is cut to
fit). Nothing is downloaded, and the same Python version gives the same text on every machine.

* Vocabulary: bytes, 0..255 (``VOCAB_SIZE``), matching the byte-level ``conf/model/tiny.yaml``.
* Split by file: file ``i`` (in read order) is held out for validation when
  ``i % holdout_every == holdout_every - 1`` (every 20th file by default; at least one file is held out).
  Training and validation text never share a file. (``holdout_every`` was called ``val_every``; the old name
  is refused with a message naming the new one: it is a split, not how often validation runs.)
* Samples are windows of ``seq_len + 1`` tokens (inputs ``w[:-1]``, next-token targets ``w[1:]``),
  ``torch.long`` tensors, batched to ``[batch_size, seq_len + 1]``.
  - training: ``train_windows`` windows at offsets drawn uniformly from the training text with a
    ``torch.Generator`` seeded with ``seed`` (default: as many windows as fit end to end, one epoch
    reads about the whole text once), served in an order shuffled by a generator seeded with ``seed``;
  - validation / test / predict: ``val_windows`` non-overlapping windows spread evenly over the
    held-out text (no randomness; ``None``: all of them). The test split is the validation split.

The same arguments give the same batches, in the same order, on every run.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, RandomSampler

__all__ = ["VOCAB_SIZE", "StdlibText", "StdlibTextDataModule", "WindowDataset", "read_stdlib_text",
           "stdlib_dir", "stdlib_files"]

VOCAB_SIZE = 256
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> Path:
    """The standard library's directory (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Every ``.py`` file under ``root`` (default: the stdlib), sorted by relative POSIX path, skipping
    ``site-packages``, ``dist-packages`` and ``__pycache__`` directories."""
    base = Path(root) if root is not None else stdlib_dir()
    if not base.is_dir():
        raise FileNotFoundError(f"text root {base} is not a directory")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                if path.is_file():
                    found.append((path.relative_to(base).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


@dataclass(frozen=True)
class StdlibText:
    """The text read, split by file. ``train`` / ``val`` are ``uint8`` tensors (the files concatenated)."""

    root: str
    train: torch.Tensor
    val: torch.Tensor
    train_files: tuple[str, ...]  # relative paths
    val_files: tuple[str, ...]

    def describe(self) -> dict:
        return {"root": self.root, "train_files": len(self.train_files), "val_files": len(self.val_files),
                "train_bytes": int(self.train.numel()), "val_bytes": int(self.val.numel())}


def read_stdlib_text(root: str | os.PathLike | None = None, max_bytes: int | None = 4_000_000,
                     holdout_every: int = 20, *, val_every: int | None = None) -> StdlibText:
    """Read files in ``stdlib_files(root)`` order until ``max_bytes`` (None: all), split every
    ``holdout_every``-th file off for validation (at least one file, unless only one file was read).
    ``val_every`` (the old name of ``holdout_every``) is refused."""
    _refuse_val_every(val_every)
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    if isinstance(holdout_every, bool) or not isinstance(holdout_every, int) or holdout_every < 2:
        raise ValueError(f"holdout_every must be an integer >= 2 (every n-th file is held out), got {holdout_every!r}")
    base = Path(root) if root is not None else stdlib_dir()
    chunks: list[tuple[str, bytes]] = []
    total = 0
    for path in stdlib_files(base):
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:  # unreadable file: skip it (the order of the rest is unchanged)
            continue
        if not data:
            continue
        if max_bytes is not None:
            data = data[: max_bytes - total]
        chunks.append((path.relative_to(base).as_posix(), data))
        total += len(data)
    if len(chunks) < 2:
        raise ValueError(f"need at least 2 non-empty .py files under {base} (found {len(chunks)}); "
                         f"raise max_bytes")
    val_idx = {i for i in range(len(chunks)) if i % holdout_every == holdout_every - 1} or {len(chunks) - 1}
    train = [c for i, c in enumerate(chunks) if i not in val_idx]
    val = [c for i, c in enumerate(chunks) if i in val_idx]

    def cat(parts: list[tuple[str, bytes]]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(data for _, data in parts)), dtype=torch.uint8)

    return StdlibText(root=str(base), train=cat(train), val=cat(val), train_files=tuple(n for n, _ in train),
                      val_files=tuple(n for n, _ in val))


def _refuse_val_every(value: int | None) -> None:
    if value is not None:
        raise ValueError(f"val_every={value!r} was renamed holdout_every (every n-th file is held out for "
                         f"validation; how often validation runs is the Trainer's val_check_interval): pass "
                         f"holdout_every={value!r}")


class WindowDataset(Dataset):
    """Windows ``text[o : o + window]`` at the given offsets, as ``torch.long`` (byte values 0..255)."""

    def __init__(self, text: torch.Tensor, window: int, offsets: torch.Tensor) -> None:
        if text.numel() < window:
            raise ValueError(f"text of {text.numel()} bytes is shorter than one window ({window}); "
                             f"raise max_bytes or lower seq_len")
        self.text = text
        self.window = window
        self.offsets = offsets.to(torch.long)

    def __len__(self) -> int:
        return int(self.offsets.numel())

    def __getitem__(self, i: int) -> torch.Tensor:
        o = int(self.offsets[i])
        return self.text[o: o + self.window].to(torch.long)

    @classmethod
    def random(cls, text: torch.Tensor, window: int, count: int, seed: int) -> "WindowDataset":
        """``count`` windows at uniform random offsets (seeded: the same ``seed`` gives the same offsets)."""
        high = text.numel() - window + 1
        if high < 1:
            return cls(text, window, torch.zeros(0, dtype=torch.long))  # raises: text too short
        gen = torch.Generator().manual_seed(int(seed))
        return cls(text, window, torch.randint(0, high, (count,), generator=gen))

    @classmethod
    def tiled(cls, text: torch.Tensor, window: int, count: int | None = None) -> "WindowDataset":
        """Non-overlapping windows; ``count`` of them spread evenly over the text (None: all)."""
        n = text.numel() // window
        starts = torch.arange(n, dtype=torch.long) * window
        if count is not None and count < n:
            pick = torch.linspace(0, n - 1, count).round().to(torch.long).unique()
            starts = starts[pick]
        return cls(text, window, starts)


class ResumableOrder(RandomSampler):
    """``RandomSampler``'s order, resumable. Each epoch makes the draws ``DataLoader(shuffle=True, generator=g)``
    made from ``g`` in the main process as Lightning iterates it -- the loader's base seed, then one ``randperm``
    (Lightning stops at the loader's length, before RandomSampler's trailing draw) -- on the sampler's own
    generator, so the batches are the old loader's without workers, and the same with any number of workers (with
    workers the old loader's later epochs differed: persistent workers skip the base-seed draw, and the loader
    asked past the epoch's end; review 25). ``state``: the generator as the epoch began and how many samples the
    run consumed; ``resume`` makes the next iteration go on from there (mid-epoch), or start the next epoch as the
    uninterrupted run would (from a checkpoint at an epoch's end: Lightning begins a new one then)."""

    def __init__(self, data_source: Any, generator: torch.Generator) -> None:
        super().__init__(data_source, generator=generator)
        self.epoch_start = generator.get_state()
        self._skip = 0

    def __iter__(self) -> Iterator[int]:
        assert self.generator is not None
        skip, self._skip = self._skip, 0
        self.epoch_start = self.generator.get_state()
        yield from self._draw(self.generator)[skip:]

    def _draw(self, gen: torch.Generator) -> list[int]:
        torch.empty((), dtype=torch.int64).random_(generator=gen)  # (the old loader's base-seed draw)
        return torch.randperm(len(self.data_source), generator=gen).tolist()

    def state(self, consumed: int, epoch_done: bool) -> dict:
        if not epoch_done:
            return {"generator": self.epoch_start.clone(), "consumed": int(consumed)}
        gen = torch.Generator().set_state(self.epoch_start.clone())
        self._draw(gen)  # the epoch's draws: the next epoch starts after them
        return {"generator": gen.get_state(), "consumed": 0}

    def resume(self, state: dict) -> None:
        assert self.generator is not None
        self.generator.set_state(state["generator"])
        self._skip = int(state["consumed"])


class StdlibTextDataModule(LightningDataModule):
    """Byte-level next-token data from the Python standard library's source (see the module docstring).

    Args:
        seq_len: tokens per input; each sample has ``seq_len + 1`` tokens.
        batch_size: samples per batch (all splits).
        max_bytes: cap on the bytes read (train + validation); None reads the whole stdlib (~30 MB).
        holdout_every: every ``holdout_every``-th file goes to the held-out split (not a validation interval:
            the Trainer's ``val_check_interval`` says how often validation runs).
        train_windows: training samples per epoch (None: ``len(train text) // (seq_len + 1)``).
        val_windows: held-out windows evaluated per validation / test run (None: all).
        seed: seeds the training offsets and their order.
        num_workers: DataLoader workers.
        root: read ``.py`` files from this directory instead of the stdlib.
        val_every: the old name of ``holdout_every``; refused (the error names the new one).
    """

    def __init__(self, seq_len: int = 128, batch_size: int = 8, max_bytes: int | None = 4_000_000,
                 holdout_every: int = 20, train_windows: int | None = None, val_windows: int | None = 128,
                 seed: int = 0, num_workers: int = 0, root: str | None = None, *,
                 val_every: int | None = None) -> None:
        super().__init__()
        _refuse_val_every(val_every)
        if isinstance(holdout_every, bool) or not isinstance(holdout_every, int) or holdout_every < 2:
            raise ValueError(f"holdout_every must be an integer >= 2 (every n-th file is held out), got "
                             f"{holdout_every!r}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if train_windows is not None and train_windows < 1:
            raise ValueError(f"train_windows must be >= 1 or None, got {train_windows}")
        if val_windows is not None and val_windows < 1:
            raise ValueError(f"val_windows must be >= 1 or None, got {val_windows}")
        self.save_hyperparameters(ignore=["val_every"])
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.holdout_every = holdout_every
        self.train_windows = train_windows
        self.val_windows = val_windows
        self.seed = seed
        self.num_workers = num_workers
        self.root = root
        self.text: StdlibText | None = None
        self.train_set: WindowDataset | None = None
        self.val_set: WindowDataset | None = None
        self._order: ResumableOrder | None = None  # the training loader's sampler
        self._resume: dict | None = None  # a checkpoint's state_dict, for the next training loader

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def window(self) -> int:
        return self.seq_len + 1

    def setup(self, stage: str | None = None) -> None:
        if self.text is not None:
            return
        self.text = read_stdlib_text(self.root, self.max_bytes, self.holdout_every)
        count = self.train_windows or max(1, self.text.train.numel() // self.window)
        self.train_set = WindowDataset.random(self.text.train, self.window, count, self.seed)
        self.val_set = WindowDataset.tiled(self.text.val, self.window, self.val_windows)
        if len(self.val_set) == 0:
            raise ValueError(f"the held-out text ({self.text.val.numel()} bytes) is shorter than one window "
                             f"({self.window}); raise max_bytes or lower seq_len")

    def describe(self) -> dict:
        """Sizes of what was read and of each split, in files, bytes and windows."""
        self.setup()
        assert self.text is not None and self.train_set is not None and self.val_set is not None
        return {**self.text.describe(), "seq_len": self.seq_len, "batch_size": self.batch_size,
                "train_windows": len(self.train_set), "val_windows": len(self.val_set)}

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        self.setup()
        assert dataset is not None
        order, gen = None, None
        if shuffle:  # DataLoader(shuffle=True, generator=...)'s batches, resumable
            order = self._order = ResumableOrder(dataset, torch.Generator().manual_seed(int(self.seed) + 1))
            gen = torch.Generator().manual_seed(int(self.seed) + 1)  # the workers' base seeds (not the order's)
            if self._resume is not None:
                order.resume(self._resume)
                self._resume = None
        return DataLoader(dataset, batch_size=self.batch_size, sampler=order, generator=gen,
                          num_workers=self.num_workers,
                          drop_last=shuffle and len(dataset) >= self.batch_size,
                          persistent_workers=self.num_workers > 0)

    def state_dict(self) -> dict:
        """Where the training order stands (Lightning keeps it in each checkpoint): a resume from a checkpoint
        saved mid-epoch goes on with the batches the run had not reached, in the same order."""
        trainer = self._trainer_or_none()
        if self._order is None or trainer is None:
            return {}
        batches = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        per_epoch = trainer.num_training_batches  # (limit_train_batches included)
        if not isinstance(per_epoch, int):  # (inf: not sized)
            per_epoch = max(1, len(self._order) // self.batch_size)  # (drop_last)
        return self._order.state(batches * self.batch_size, epoch_done=batches >= per_epoch)

    def load_state_dict(self, state: dict) -> None:
        self._resume = state or None

    def _trainer_or_none(self) -> Any:
        try:
            return self.trainer
        except RuntimeError:
            return None

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
