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
