"""The strategies' options checked at construction (``autoplan.validate_options``, shared by the Trainer and Fabric
strategies), and the NVMe spill directory's check: what it logs, and the refusal of a plan whose spill does not fit
(``engine.nvme.check_spill_fits``). Issue 24."""

from __future__ import annotations

import logging
import math
import re
import shutil
from pathlib import Path

import pytest

from lightning_lazytrain.core.autoplan import validate_options
from lightning_lazytrain.engine import nvme
from lightning_lazytrain.engine.nvme import NvmeDirError, check_nvme_dir, check_spill_fits


def options(**kw):
    args = dict(hardware="measure", budget=None, nvme_dir=None, policy="milp", link=None)
    args.update(kw)
    return validate_options(args["hardware"], args["budget"], args["nvme_dir"], args["policy"], args["link"])


@pytest.mark.parametrize("value,why", [
    (True, r"got bool True"), (False, r"got bool False"), (float("inf"), r"inf is not a finite size"),
    (float("-inf"), r"-inf is not a finite size"), (float("nan"), r"nan is not a finite size"), (0, r"got 0"),
    (-3.0, r"got -3\.0"), ("70", r"got str '70'"), ([70], r"got list \[70\]"),
])
def test_budget_must_be_a_finite_number_above_zero(value, why):
    with pytest.raises(ValueError, match=rf"^gpu_memory_budget_gb={re.escape(repr(value))}: must be a "
                                         rf"number of GB > 0 \({why}\)\. Fix: pass e\.g\. gpu_memory_budget_gb=70, or "
                                         r"gpu_memory_budget_gb=None"):
        options(budget=value)


@pytest.mark.parametrize("value", [True, float("inf"), float("nan"), 0, -1])
def test_link_must_be_a_finite_number_above_zero(value):
    with pytest.raises(ValueError, match=r"^emulate_link_gb_per_s=.*: must be a number of GB/s > 0 .*Fix:"):
        options(link=value)


def test_good_numbers_pass():
    assert options(budget=70, link=16.0) is None
    assert options(budget=1e-6) is None  # tiny but finite: an impossible budget is the planner's to explain
    numpy = pytest.importorskip("numpy")
    assert options(budget=numpy.float64(20.0)) is None


@pytest.mark.parametrize("value", [42, 4.2, b"/tmp/spill", ["/tmp"], True])
def test_nvme_dir_must_be_a_path(value):
    with pytest.raises(ValueError, match=rf"^nvme_dir={re.escape(repr(value))}: must be a path \(str or "
                                         r"os\.PathLike\) to a directory on a local NVMe drive, not \w+\. Fix: pass "
                                         r"nvme_dir="):
        options(nvme_dir=value)


def test_nvme_dir_that_is_a_file_or_under_one_is_refused_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"nvme_dir='.*a_file': .* exists and is not a directory"):
        options(nvme_dir=str(blocker))
    with pytest.raises(ValueError, match=r"nvme_dir='.*spill': cannot be created, .*a_file is a file"):
        options(nvme_dir=str(blocker / "spill"))
    with pytest.raises(ValueError, match=r"nvme_dir='': an empty path"):
        options(nvme_dir="")
    assert options(nvme_dir=tmp_path / "not" / "yet") is None  # created later (with a warning), at setup
    assert options(nvme_dir=str(tmp_path)) is None


def test_both_strategies_refuse_at_construction():
    pytest.importorskip("lightning")
    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy
    from lightning_lazytrain.strategy import LazyTrainStrategy

    for cls in (LazyTrainStrategy, LazyTrainFabricStrategy):
        for kw, pattern in ((dict(gpu_memory_budget_gb=True), r"gpu_memory_budget_gb=True: .*got bool"),
                            (dict(gpu_memory_budget_gb=math.inf), r"gpu_memory_budget_gb=inf: .*not a finite size"),
                            (dict(nvme_dir=42), r"nvme_dir=42: must be a path")):
            with pytest.raises(ValueError, match=pattern):
                cls(**kw)


# ---- the NVMe spill directory ---------------------------------------------------------------------------------------
def test_check_logs_directory_file_system_and_free_space(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_lazytrain.engine.nvme"):
        assert check_nvme_dir(tmp_path, 4096) == tmp_path
    (record,) = [r for r in caplog.records if r.name == "lightning_lazytrain.engine.nvme"]
    text = record.getMessage()
    assert record.levelno == logging.INFO
    assert str(tmp_path) in text and "file system" in text and "mounted at /" in text and " free" in text, text
    assert "the plan needs 4.00 KiB" in text, text


def test_a_missing_directory_is_created_with_a_warning_naming_it(tmp_path, caplog):
    target = tmp_path / "nvme" / "spil"
    with caplog.at_level(logging.INFO, logger="lightning_lazytrain.engine.nvme"):
        check_nvme_dir(target)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(target) in warnings[0].getMessage(), caplog.text
    assert "creating it" in warnings[0].getMessage() and "typo" in warnings[0].getMessage()
    assert target.is_dir()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_lazytrain.engine.nvme"):
        check_nvme_dir(target)  # exists now: no warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_spill_that_does_not_fit_is_refused_naming_directory_free_and_shortfall(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda _p: usage._replace(free=10 * 2**30))
    assert check_spill_fits(tmp_path, 10 * 2**30) == 10 * 2**30  # exactly fits
    need = 12 * 2**30
    with pytest.raises(NvmeDirError) as ei:
        check_spill_fits(tmp_path, need)
    msg = str(ei.value)
    assert str(tmp_path) in msg and "has 10.0 GiB free, but the plan needs 12.0 GiB" in msg, msg
    assert f"short by 2.00 GiB ({2 * 2**30} bytes; {10 * 2**30} bytes free, file system" in msg, msg
    assert "Fix:" in msg
    with pytest.raises(NvmeDirError, match="short by 2.00 GiB"):
        check_nvme_dir(tmp_path, need)  # the directory check applies it too


def test_spill_check_on_the_real_file_system(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    assert check_spill_fits(Path(tmp_path), 1) >= 1
    with pytest.raises(NvmeDirError, match=r"short by"):
        check_spill_fits(tmp_path, free + (1 << 40))


@pytest.mark.parametrize("which, typo, closest", [("trainer", "polcy", "policy"),
                                                   ("trainer", "gpu_memory_budget", "gpu_memory_budget_gb"),
                                                   ("fabric", "nvmedir", "nvme_dir")])
def test_a_misspelt_option_is_named_with_the_closest_one(which, typo, closest):
    if which == "trainer":
        from lightning_lazytrain.strategy import LazyTrainStrategy as cls
    else:
        from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy as cls
    with pytest.raises(TypeError, match=rf"{cls.__name__} has no option '{typo}' \(did you mean '{closest}'\?\)"):
        cls(**{typo: 1})


def test_an_impossible_budget_is_the_first_thing_the_log_says(caplog):
    import lightning as L
    import torch

    from lightning_lazytrain.planner import InfeasibleBudget
    from lightning_lazytrain.strategy import LazyTrainStrategy
    from test_conformance import Net, data

    trainer = L.Trainer(strategy=LazyTrainStrategy(hardware="cpu", gpu_memory_budget_gb=1e-7), accelerator="cpu",
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with caplog.at_level(logging.ERROR), pytest.raises(InfeasibleBudget):
        trainer.fit(Net(), train_dataloaders=torch.utils.data.DataLoader(data(), batch_size=None))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and errors[0].startswith("lazytrain cannot train this within its budget:")
    assert "gpu memory short by" in errors[0]
