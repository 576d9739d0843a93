"""StdlibTextDataModule: deterministic, held-out files disjoint from training files, windows of the right
length and byte range. Small caps (a few hundred kB) so the file runs in seconds."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from lightning_lazytrain.data import VOCAB_SIZE, StdlibTextDataModule, WindowDataset, read_stdlib_text, stdlib_files

SMALL = dict(max_bytes=400_000, holdout_every=5, seq_len=64, batch_size=4, val_windows=20)


def make(**kw) -> StdlibTextDataModule:
    dm = StdlibTextDataModule(**{**SMALL, **kw})
    dm.setup("fit")
    return dm


def test_files_are_the_stdlib_sources_in_sorted_order():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 500
    assert all(r.endswith(".py") for r in rel)
    assert not any(part in ("site-packages", "dist-packages") for r in rel for part in r.split("/"))
    assert "os.py" in rel and "json/decoder.py" in rel


def test_cap_split_and_disjoint_files():
    text = read_stdlib_text(max_bytes=400_000, holdout_every=5)
    assert text.train.numel() + text.val.numel() == 400_000  # the last file is cut to the cap
    assert text.train.dtype == torch.uint8
    assert set(text.train_files).isdisjoint(text.val_files)
    names = [f for f in sorted(text.train_files + text.val_files)]
    order = list(text.train_files) + list(text.val_files)
    assert sorted(order) == names and len(set(order)) == len(order)
    # every 5th file (in read order) is held out
    read_order = sorted(order)
    assert list(text.val_files) == [f for i, f in enumerate(read_order) if i % 5 == 4]
    assert 0 < text.val.numel() < text.train.numel()
    # the held-out bytes really are those files' bytes (first held-out file, whole)
    root = Path(text.root)
    first = (root / text.val_files[0]).read_bytes()
    assert bytes(text.val[: len(first)].tolist()) == first


def test_default_reads_4mb_with_a_5_percent_held_out_split():
    dm = StdlibTextDataModule()
    info = dm.describe()
    assert info["train_bytes"] + info["val_bytes"] == 4_000_000
    assert info["val_files"] == (info["train_files"] + info["val_files"]) // 20
    assert info["train_windows"] == info["train_bytes"] // 129
    assert info["val_windows"] == 128


def test_windows_have_the_right_length_and_byte_range():
    dm = make()
    train = next(iter(dm.train_dataloader()))
    val = next(iter(dm.val_dataloader()))
    for batch in (train, val):
        assert batch.shape == (4, 65) and batch.dtype == torch.long
        assert int(batch.min()) >= 0 and int(batch.max()) < VOCAB_SIZE
    assert len(dm.val_set) == 20
    # validation windows do not overlap and come from the held-out text only
    starts = dm.val_set.offsets.tolist()
    assert all(b - a >= 65 for a, b in zip(starts, starts[1:]))
    assert starts[-1] + 65 <= dm.text.val.numel()
    assert dm.train_set.offsets.max() + 65 <= dm.text.train.numel()
    # text, mostly printable ASCII
    sample = bytes(val[0].tolist())
    assert sum(32 <= c < 127 or c in (9, 10) for c in sample) > 0.9 * len(sample)


def test_same_seed_same_batches_other_seed_other_batches():
    a, b, c = make(seed=3), make(seed=3), make(seed=4)
    batches = [[x for _, x in zip(range(3), dm.train_dataloader())] for dm in (a, b, c)]
    assert all(torch.equal(x, y) for x, y in zip(batches[0], batches[1]))
    assert not all(torch.equal(x, y) for x, y in zip(batches[0], batches[2]))
    # validation does not depend on the seed
    assert all(torch.equal(x, y) for x, y in zip(a.val_dataloader(), c.val_dataloader()))
    # two passes over the same loader give the same first epoch
    again = [x for _, x in zip(range(3), make(seed=3).train_dataloader())]
    assert all(torch.equal(x, y) for x, y in zip(batches[0], again))


def test_test_and_predict_use_the_held_out_split():
    dm = make()
    v, t, p = (next(iter(f())) for f in (dm.val_dataloader, dm.test_dataloader, dm.predict_dataloader))
    assert torch.equal(v, t) and torch.equal(v, p)


def test_bad_arguments_are_clear(tmp_path):
    with pytest.raises(ValueError, match="seq_len"):
        StdlibTextDataModule(seq_len=0)
    with pytest.raises(ValueError, match="holdout_every must be an integer >= 2"):
        read_stdlib_text(max_bytes=1000, holdout_every=1)
    with pytest.raises(ValueError, match="holdout_every must be an integer >= 2"):
        StdlibTextDataModule(holdout_every=True)
    with pytest.raises(FileNotFoundError):
        read_stdlib_text(root=str(tmp_path / "nope"))
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    dm = StdlibTextDataModule(root=str(tmp_path), seq_len=64)
    with pytest.raises(ValueError, match="shorter than one window"):
        dm.setup()
    with pytest.raises(ValueError, match="shorter than one window"):
        WindowDataset.random(torch.zeros(10, dtype=torch.uint8), 64, 4, 0)


def test_val_every_was_renamed_holdout_every():
    """``holdout_every`` is the held-out split (every n-th file), not a validation interval; the old name is refused
    with a message naming the new one."""
    for call in (lambda: StdlibTextDataModule(val_every=5), lambda: read_stdlib_text(max_bytes=1000, val_every=5)):
        with pytest.raises(ValueError, match=r"val_every=5 was renamed holdout_every .*pass holdout_every=5"):
            call()
    dm = StdlibTextDataModule(holdout_every=7)
    assert dm.holdout_every == 7 and dm.hparams["holdout_every"] == 7 and "val_every" not in dm.hparams
