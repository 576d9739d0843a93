"""Fail early, fail clean: bad options and plan files are refused at construction, naming the
option or the file; the budget applies on every path; crashed runs' spill directories go; a
corrupted checkpoint is refused before it is resumed from; checkpoints are written atomically."""

from __future__ import annotations

import errno
import json
import os
import re
import zipfile

import lightning as L
import pytest
import torch

from lightning_lazytrain.planner import InfeasibleBudget, Schedule
from lightning_lazytrain.strategy import CheckpointWriteError, CorruptCheckpoint, LazyTrainStrategy

from test_conformance import LAYERS, Net, data, mixed_plan


def trainer(strategy, tmp_path, **kw):
    return L.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                     default_root_dir=tmp_path, **kw)


def loader():
    return torch.utils.data.DataLoader(data(), batch_size=None)


@pytest.mark.parametrize("kw, pattern", [
    (dict(gpu_memory_budget_gb=0), r"gpu_memory_budget_gb=0: must be a number of GB > 0"),
    (dict(gpu_memory_budget_gb=-3.0), r"gpu_memory_budget_gb=-3.0"),
    (dict(emulate_link_gb_per_s=0), r"emulate_link_gb_per_s=0: must be a number of GB/s > 0"),
    (dict(hardware="h900"), r"hardware='h900': .*known: .*h800"),
    (dict(policy="fastest"), r"policy 'fastest' is neither one of"),
])
def test_bad_options_fail_at_construction_with_the_users_names(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        LazyTrainStrategy(**kw)


@pytest.mark.parametrize("content, pattern", [
    ("{not json", r"plan file .*bad\.json is not readable JSON"),
    ("{}", r"plan file .*bad\.json has no schedule"),
    ("[1, 2]", r"plan file .*bad\.json holds a list"),
    ('{"schedule": {"homes": ["gpu"], "num_layers": 3}}', r"plan file .*bad\.json holds an invalid schedule"),
])
def test_bad_plan_files_fail_at_construction_naming_the_file(tmp_path, content, pattern):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=pattern):
        LazyTrainStrategy(policy=str(path))


def test_plan_file_for_another_depth_and_nvme_plan_without_dir(tmp_path):
    s = Schedule(num_layers=3, homes=("gpu", "nvme", "gpu", "gpu"), keep_internals=(False,) * 3,
                 resident_weights=(False,) * 3, offload_window=(None, 1, None, None),
                 reload_window=(None, 2, None, None))
    path = tmp_path / "nvme.json"
    path.write_text(json.dumps({"schedule": s.to_json()}))
    with pytest.raises(ValueError, match=r"nvme\.json puts activations on NVMe: pass nvme_dir="):
        LazyTrainStrategy(policy=str(path))
    with pytest.raises(ValueError, match=rf"is for 3 layers, but the block stack 'layers' has {LAYERS}"):
        trainer(LazyTrainStrategy(policy=str(path), nvme_dir=tmp_path / "spill"), tmp_path, max_steps=1).fit(
            Net(), train_dataloaders=loader())


def test_budget_applies_when_hardware_is_a_hardware_object(tmp_path):
    from lightning_lazytrain.config import load_hardware

    module = Net()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    strategy = LazyTrainStrategy(hardware=load_hardware("cpu"), gpu_memory_budget_gb=1e-6)
    with pytest.raises(InfeasibleBudget):
        trainer(strategy, tmp_path, max_steps=2).fit(module, train_dataloaders=loader())
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # before the first update


def test_named_profile_without_nvme_dir_plans_no_nvme(tmp_path):
    strategy = LazyTrainStrategy(hardware="h800")
    assert strategy.core.hardware().nvme_capacity_bytes == 0
    assert LazyTrainStrategy(hardware="h800", nvme_dir=str(tmp_path)).core.hardware().nvme_capacity_bytes > 0


def test_stale_spill_directories_go_whenever_nvme_dir_is_given(tmp_path):
    stale = tmp_path / "spill" / "lazytrain-spill-999999999-deadbeef"
    stale.mkdir(parents=True)
    (stale / "0.spill").write_bytes(b"x" * 10)
    trainer(LazyTrainStrategy(policy="recompute_all", nvme_dir=str(tmp_path / "spill")), tmp_path,
            max_steps=1).fit(Net(), train_dataloaders=loader())
    assert not stale.exists()


def test_corrupted_checkpoint_is_refused_and_saves_are_atomic(tmp_path):
    t = trainer(LazyTrainStrategy(policy=mixed_plan(tmp_path / "plan.json")), tmp_path, max_steps=2)
    t.fit(Net(), train_dataloaders=loader())
    ckpt = tmp_path / "two.ckpt"
    t.save_checkpoint(ckpt)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".two.ckpt")] == []  # no temp file left
    # a full disk: the error names the file, the bytes and the fix; the earlier save stays, no temp file
    saved = ckpt.read_bytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
        with pytest.raises(CheckpointWriteError, match=rf"could not write checkpoint {re.escape(str(ckpt))}: No space "
                                                       r"left on device \(ENOSPC\) while writing about .* \(its "
                                                       r"tensors\).*Fix: free space on the file system of"):
            t.save_checkpoint(ckpt)
    assert ckpt.read_bytes() == saved
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".two.ckpt")] == []
    # the intact checkpoint resumes
    trainer(LazyTrainStrategy(), tmp_path, max_steps=3).fit(Net(), train_dataloaders=loader(), ckpt_path=ckpt)
    raw = bytearray(ckpt.read_bytes())
    with zipfile.ZipFile(ckpt) as z:  # flip bytes inside the largest tensor's data
        info = max(z.infolist(), key=lambda i: i.compress_size)
        h = info.header_offset  # local header: 30 bytes, then the name and the extra field
        start = h + 30 + int.from_bytes(raw[h + 26:h + 28], "little") + int.from_bytes(raw[h + 28:h + 30], "little")
    at = start + info.compress_size // 2
    raw[at:at + 8] = bytes(b ^ 0xFF for b in raw[at:at + 8])
    ckpt.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint, match=r"two\.ckpt .*(CRC|damaged|intact).*earlier checkpoint"):
        trainer(LazyTrainStrategy(), tmp_path, max_steps=3).fit(Net(), train_dataloaders=loader(), ckpt_path=ckpt)
    assert os.path.getsize(ckpt) == len(raw)


@pytest.mark.parametrize("keep, pattern", [
    (("crc32.json", "lightning.pt", "__0_0.distcp"), r"is incomplete: its file\(s\) \.metadata are missing"),
    (("lightning.pt", "__0_0.distcp", ".metadata"), r"has no crc32\.json"),
    ((), r"has no crc32\.json: .*holds nothing"),
], ids=["metadata-deleted", "no-manifest", "empty"])
def test_a_damaged_sharded_checkpoint_directory_is_refused_by_fit(tmp_path, keep, pattern):
    """Resuming from a sharded checkpoint directory with a file deleted (``.metadata`` used to give
    IsADirectoryError) or from an empty directory: CorruptCheckpoint naming it and the fix."""
    import zlib

    ckpt = tmp_path / "sharded.ckpt"
    ckpt.mkdir()
    files = {"lightning.pt": b"", ".metadata": b"\x80\x02metadata", "__0_0.distcp": b"PK\x03\x04shard"}
    for name, content in files.items():
        (ckpt / name).write_bytes(content)
    manifest = {name: [len(content), zlib.crc32(content)] for name, content in files.items()}
    (ckpt / "crc32.json").write_text(json.dumps({"format": "lazytrain-dcp-1", "files": manifest}))
    for f in ckpt.iterdir():
        if f.name not in keep:
            f.unlink()
    with pytest.raises(CorruptCheckpoint, match=rf"sharded checkpoint {re.escape(str(ckpt))}.*{pattern}.*Fix: resume "
                                                r"from an earlier checkpoint"):
        trainer(LazyTrainStrategy(), tmp_path, max_steps=1).fit(Net(), train_dataloaders=loader(), ckpt_path=ckpt)


def test_one_fixed_device_and_several_devices_are_refused_at_construction(tmp_path):
    """devices=2 trains data parallel (tests/test_distributed.py); a strategy pinned to one device
    cannot."""
    with pytest.raises(ValueError, match=r"device=cpu\) picks one device, but the Trainer asks for 2 device"):
        trainer(LazyTrainStrategy(device="cpu"), tmp_path, max_steps=1, devices=2)


def test_the_chosen_gpu_is_the_root_device():
    """Trainer(devices=[1]) fills parallel_devices; the strategy must not fall back to cuda:0."""
    from lightning.pytorch.accelerators import CUDAAccelerator

    strategy = LazyTrainStrategy()
    strategy.accelerator = CUDAAccelerator()
    strategy.parallel_devices = [torch.device("cuda", 1)]
    assert strategy.root_device == torch.device("cuda", 1)


def test_free_memory_is_measured_before_the_executor_allocates(tmp_path, monkeypatch):
    """``hardware="measure"``: free device memory is read before the executor's slots exist, once
    per fit, and the plan is made from that reading."""
    import lightning_lazytrain.core.planning as planning
    import lightning_lazytrain.core.training_core as core

    order = []
    real_measure, real_executor = planning.measure_hardware, core.Executor
    monkeypatch.setattr(planning, "measure_hardware", lambda *a, **k: order.append("measure") or real_measure(*a, **k))
    monkeypatch.setattr(core, "Executor", lambda *a, **k: order.append("executor") or real_executor(*a, **k))
    trainer(LazyTrainStrategy(hardware="measure"), tmp_path, max_steps=2).fit(Net(), loader())
    assert order == ["measure", "executor"]
