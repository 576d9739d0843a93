"""Review 9b (a newcomer following the README, 2026-12-05): the one-line errors it found missing or misleading,
fixed the same day: an output directory under /proc (os.access says writable; mkdir fails), a negative GPU memory
(the message suggested a cap <= -5), and a model file path with its suffix (reported as ``x.yaml.yaml``)."""

from __future__ import annotations

import os

import pytest

from lightning_lazytrain.cli.run_dir import check_output_dirs
from lightning_lazytrain.config import CONF_DIR
from lightning_lazytrain.lit_module import load_model_spec
from lightning_lazytrain.planner.errors import InvalidInput


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system")
def test_an_output_directory_under_proc_is_one_line():
    line = check_output_dirs(["hydra.run.dir=/proc/lazytrain-nope"])
    assert line is not None and "hydra.run.dir=/proc/lazytrain-nope cannot be made in /proc" in line
    assert "Fix:" in line


def test_a_writable_output_directory_passes_and_leaves_nothing(tmp_path):
    assert check_output_dirs([f"hydra.run.dir={tmp_path}/a/b"]) is None
    assert list(tmp_path.iterdir()) == []


def test_a_negative_gpu_memory_names_the_key():
    from hydra import compose, initialize_config_dir

    from lightning_lazytrain.config import to_hardware

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("plan", overrides=["hardware.gpu_memory_gb=-5"])
    with pytest.raises(InvalidInput, match=r"hardware\.gpu_memory_gb.*must be > 0"):
        to_hardware(cfg)


def test_a_missing_model_file_is_named_as_given():
    with pytest.raises(ValueError, match=r"model file '/nope/x\.yaml' not found") as err:
        load_model_spec("/nope/x.yaml")
    assert "x.yaml.yaml" not in str(err.value)
    assert load_model_spec("tiny").name


def test_a_model_the_host_memory_cannot_train_is_one_line_before_it_is_built():
    from lightning_lazytrain.cli.train_checks import TrainConfigError, check_host_memory

    check_host_memory("tiny", 10**6, available=10**9)  # fits: nothing
    check_host_memory("tiny", 10**6, available=None)  # unknown: nothing
    with pytest.raises(TrainConfigError, match=r"model=qwen2\.5-3b has 3\.09B parameters: .* at least 24\.7 GB .* "
                                               r"this machine has 16\.0 GB available\. Fix: a smaller model"):
        check_host_memory("qwen2.5-3b", 3_085_938_688, available=16 * 10**9)


def test_the_train_app_refuses_it_before_writing_anything(tmp_path, monkeypatch):
    from test_train_app import compose_cfg

    from lightning_lazytrain.cli import train as train_app
    from lightning_lazytrain.cli import train_checks
    from lightning_lazytrain.cli.train_checks import TrainConfigError

    monkeypatch.setattr(train_checks, "available_host_bytes", lambda: 1000)  # less than the tiny model needs
    built = []
    monkeypatch.setattr(train_app, "build_module", lambda cfg: built.append(cfg))
    with pytest.raises(TrainConfigError, match=r"model=tiny has .* this machine has 0\.0 GB available"):
        train_app.train_job(compose_cfg("trainer.max_steps=1"), tmp_path / "out")
    assert built == [] and not (tmp_path / "out").exists()


def test_the_train_apps_budget_error_names_the_key_and_its_value_trains(tmp_path):
    """It named the smallest budget in bytes only (review 9b); the value it now names for the key is enough."""
    import re

    from test_train_app import compose_cfg

    from lightning_lazytrain.cli.train import train_job
    from lightning_lazytrain.planner import InfeasibleBudget

    base = ("trainer.max_steps=1", "trainer.enable_progress_bar=false", "trainer.val_check_interval=1",
            "trainer.limit_val_batches=1")
    with pytest.raises(InfeasibleBudget, match=r"strategy\.gpu_memory_budget_gb=[\d.]+\)") as err:
        train_job(compose_cfg("strategy.gpu_memory_budget_gb=0.005", *base), tmp_path / "a", out=open(os.devnull, "w"))
    value = re.search(r"strategy\.gpu_memory_budget_gb=([\d.]+)\)", str(err.value)).group(1)
    result = train_job(compose_cfg(f"strategy.gpu_memory_budget_gb={value}", *base), tmp_path / "b",
                       out=open(os.devnull, "w"))
    assert result["steps"] == 1


def test_an_nvme_dir_on_a_read_only_file_system_says_to_choose_another(tmp_path, monkeypatch):
    """The fix had said ``chmod u+w``, which a read-only mount ignores (review 9b)."""
    import errno
    import tempfile

    from lightning_lazytrain.engine.nvme import NvmeDirError, check_nvme_dir

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(NvmeDirError, match=r"is not writable: Read-only file system\. Fix: choose another nvme_dir: .* "
                                           r"is on a read-only file system") as err:
        check_nvme_dir(tmp_path)
    assert "chmod" not in str(err.value)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system")
def test_an_nvme_dir_under_proc_does_not_suggest_mkdir():
    from lightning_lazytrain.engine.nvme import NvmeDirError, check_nvme_dir

    with pytest.raises(NvmeDirError, match=r"cannot be created: No such file or directory\. Fix: choose another "
                                           r"nvme_dir") as err:
        check_nvme_dir("/proc/lazytrain-nope")
    assert "mkdir -p" not in str(err.value)
