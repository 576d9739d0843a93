"""Every YAML under conf/ composes against the typed schema and converts into valid planner inputs."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from lightning_lazytrain.config import (CONF_DIR, PlanConfig, micro_batch_setting, paper_micro_batch_size,
                                        resolve_micro_batch, to_hardware, to_milp_options, to_model, to_train)
from lightning_lazytrain.planner import InvalidInput, MilpOptions, block_cost

GROUPS = ("hardware", "model", "train")
NAMES = {g: sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml")) for g in GROUPS}

# published parameter counts (billions): Qwen model cards; the 27B figure is the paper's "trainable" count
PUBLISHED = {"qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62, "qwen2.5-14b": 14.77, "qwen3.6-27b": 23.68}


@pytest.fixture(scope="module")
def cfg_of():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda *overrides: compose(config_name="plan", overrides=list(overrides))


def test_expected_files_exist():
    assert {"h800", "rtx3090", "h200", "a100-80gb", "cpu"} <= set(NAMES["hardware"])
    assert {"qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen3.6-27b", "tiny"} <= set(NAMES["model"])
    assert "default" in NAMES["train"]
    assert (CONF_DIR / "plan.yaml").exists()


def test_plan_yaml_defaults(cfg_of):
    cfg = cfg_of()
    assert cfg.hardware.name == "h800" and cfg.model.name == "qwen3.6-27b"
    assert cfg.plan.time_limit == 60 and cfg.plan.mip_gap == pytest.approx(1e-3)
    assert cfg.plan.policy == "milp"
    to_hardware(cfg).validate()
    to_model(cfg).validate()
    assert to_train(cfg).micro_batch_size == 72  # "paper": the paper's 27B/H800 batch
    assert to_milp_options(cfg).time_limit == 60


@pytest.mark.parametrize("name", NAMES["hardware"])
def test_hardware_yaml(cfg_of, name):
    cfg = cfg_of(f"hardware={name}")
    hw = to_hardware(cfg).validate()
    assert hw.name == cfg.hardware.name == name
    assert hw.gpu_memory_cap_bytes <= hw.gpu_memory_bytes
    assert to_hardware(cfg.hardware) == hw  # the node alone converts too


@pytest.mark.parametrize("name", NAMES["hardware"])
def test_every_hardware_number_has_a_source_comment(name):
    text = (CONF_DIR / "hardware" / f"{name}.yaml").read_text()
    for line in text.splitlines():
        if re.match(r"^\w+:\s*[-\d.]+\s*(#.*)?$", line):
            assert "#" in line, f"{name}.yaml: number without a source comment: {line!r}"


@pytest.mark.parametrize("name", NAMES["model"])
def test_model_yaml(cfg_of, name):
    cfg = cfg_of(f"model={name}")
    model = to_model(cfg).validate()
    assert model.name == name
    assert model.head_dim * model.heads >= 1 and model.heads % model.kv_heads == 0
    for hw, batch in cfg.model.paper_micro_batch_size.items():
        assert hw in NAMES["hardware"] and batch >= 1


@pytest.mark.parametrize("name", NAMES["train"])
def test_train_yaml(cfg_of, name):
    cfg = cfg_of(f"train={name}", "hardware=cpu", "model=tiny")
    setting = micro_batch_setting(cfg)
    spec = to_train(cfg, micro_batch_size=2) if isinstance(setting, str) else to_train(cfg)
    spec.validate()
    assert spec.seq_len == cfg.train.seq_len


@pytest.mark.parametrize("name,billions", sorted(PUBLISHED.items()))
def test_parameter_counts_match_published(cfg_of, name, billions):
    cfg = cfg_of(f"model={name}")
    total = to_model(cfg).total_params / 1e9
    assert total == pytest.approx(billions, rel=0.02)
    assert cfg.model.published_params_b == pytest.approx(billions)


def test_27b_boundary_is_the_papers_0_703_gib(cfg_of):
    cfg = cfg_of("model=qwen3.6-27b", "train.micro_batch_size=72")
    cost = block_cost(to_model(cfg), to_train(cfg))
    assert cost.boundary_bytes / 2**30 == pytest.approx(0.703, abs=0.001)


def test_plan_config_mirrors_milp_options():
    milp = {f.name: f.default for f in dataclasses.fields(MilpOptions)}
    plan = {f.name: f.default for f in dataclasses.fields(PlanConfig)}
    assert set(milp) <= set(plan), f"PlanConfig lacks {set(milp) - set(plan)}"
    for key, default in milp.items():
        assert plan[key] == default, f"PlanConfig.{key} default {plan[key]!r} != MilpOptions {default!r}"


def test_ablation_switches_reach_milp_options(cfg_of):
    cfg = cfg_of("plan.window_memory=false", "plan.time_objective=false", "plan.nvme=false", "plan.max_block=4",
                 "plan.time_limit=5", "plan.threads=1")
    opt = to_milp_options(cfg)
    assert (opt.window_memory, opt.time_objective, opt.nvme, opt.max_block, opt.time_limit, opt.threads) == (
        False, False, False, 4, 5.0, 1)


@pytest.mark.parametrize("hardware,model,expected", [
    ("h800", "qwen2.5-3b", 192), ("h800", "qwen2.5-7b", 144), ("h800", "qwen2.5-14b", 96),
    ("h800", "qwen3.6-27b", 72), ("rtx3090", "qwen2.5-3b", 8), ("rtx3090", "qwen2.5-7b", 6),
    ("rtx3090", "qwen2.5-14b", 4), ("rtx3090", "qwen3.6-27b", 2), ("h200", "qwen3.6-27b", "auto"),
    ("cpu", "tiny", "auto"),
])
def test_paper_batch(cfg_of, hardware, model, expected):
    cfg = cfg_of(f"hardware={hardware}", f"model={model}", "train.micro_batch_size=paper")
    assert resolve_micro_batch(cfg)[0] == expected
    if expected != "auto":
        assert paper_micro_batch_size(cfg.model, hardware) == expected
        assert to_train(cfg).micro_batch_size == expected


@pytest.mark.parametrize("value,expected", [("72", 72), ("auto", "auto"), ("paper", "paper"), ("AUTO", "auto")])
def test_micro_batch_setting_accepts(cfg_of, value, expected):
    cfg = cfg_of(f"train.micro_batch_size={value}")
    assert micro_batch_setting(cfg) == expected


@pytest.mark.parametrize("value", ["0", "-3", "big", "true", "1.5"])
def test_micro_batch_setting_rejects(cfg_of, value):
    cfg = cfg_of(f"train.micro_batch_size={value}")
    with pytest.raises(InvalidInput, match="train.micro_batch_size"):
        micro_batch_setting(cfg)


def test_symbolic_batch_needs_resolving(cfg_of):
    cfg = cfg_of("train.micro_batch_size=auto")
    with pytest.raises(InvalidInput):
        to_train(cfg)
    assert to_train(cfg, micro_batch_size=3).micro_batch_size == 3


def test_schema_rejects_misspelt_keys_and_wrong_types(cfg_of):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)):
        cfg_of("hardware.gpu_memroy_gb=3")  # not in HardwareConfig
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)):
        cfg_of("hardware.peak_tflops=fast")  # not a float


def test_invalid_numbers_are_named(cfg_of):
    cfg = cfg_of("hardware.h2d_gb_per_s=-1")
    with pytest.raises(InvalidInput, match="h2d_bytes_per_s"):
        to_hardware(cfg)
    cfg = cfg_of("hardware.gpu_memory_cap_gb=90")
    with pytest.raises(InvalidInput, match="gpu_memory_cap_bytes"):
        to_hardware(cfg)


def test_load_model_and_load_hardware_by_name():
    from lightning_lazytrain.config import load_hardware, load_model

    assert load_model("qwen3.6-27b").num_layers == 64 and load_model("tiny").vocab == 256
    assert load_model(str(CONF_DIR / "model" / "tiny.yaml")) == load_model("tiny")
    assert load_hardware("h800").name == "h800"
    with pytest.raises(InvalidInput, match="known: .*qwen2.5-3b.*tiny"):
        load_model("gpt-5")
