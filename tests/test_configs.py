"""Every YAML under conf/ composes against the typed schema and converts into valid planner inputs."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from lightning_lazytrain.config import (CONF_DIR, DEFAULT_DATA_PARALLEL, PlanConfig, in_config_units,
                                        micro_batch_setting, paper_micro_batch_size, resolve_micro_batch, to_hardware,
                                        to_milp_options, to_model, to_train)
from lightning_lazytrain.config_checks import (ConfigKeyError, check_command_line, check_schema,
                                               composition_error_message, config_groups_help, unknown_key_message,
                                               unknown_keys)
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
@pytest.mark.slow
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


def test_invalid_numbers_are_named_as_the_config_writes_them(cfg_of):
    """The config layer's errors name the hardware keys in GB, as written in conf/hardware/*.yaml, not the planner's
    byte fields (``gpu_memory_cap_bytes=100000000000.0``)."""
    with pytest.raises(InvalidInput, match=r"hardware\.h2d_gb_per_s=-1") as ei:
        to_hardware(cfg_of("hardware.h2d_gb_per_s=-1"))
    assert "bytes" not in str(ei.value)
    with pytest.raises(InvalidInput) as ei:
        to_hardware(cfg_of("hardware=h800", "hardware.gpu_memory_cap_gb=100"))
    msg = str(ei.value)
    assert msg.startswith("invalid hardware.gpu_memory_cap_gb=100") and "hardware.gpu_memory_gb=80" in msg, msg
    assert "bytes" not in msg and "e+10" not in msg and "100000000000" not in msg, msg
    assert ei.value.key == "hardware.gpu_memory_cap_gb"
    with pytest.raises(InvalidInput, match=r"hardware\.cpu_adam_gparams_per_s=0"):
        to_hardware(cfg_of("hardware.cpu_adam_gparams_per_s=0"))
    with pytest.raises(InvalidInput, match=r"hardware\.nvme_capacity_gb=-2"):
        to_hardware(cfg_of("hardware.nvme_capacity_gb=-2"))


def test_planner_messages_in_config_units():
    assert in_config_units("invalid hardware.gpu_memory_cap_bytes=100000000000.0: exceeds gpu_memory_bytes=8e+10") == \
        "invalid hardware.gpu_memory_cap_gb=100: exceeds gpu_memory_gb=80"
    assert in_config_units("hardware.host_collective_bytes_per_s=0.0 needs > 0") == \
        "hardware.host_collective_gb_per_s=0 needs > 0"
    assert in_config_units("peak_gpu_bytes and tokens/s=3") == "peak_gpu_bytes and tokens/s=3"


# ---- the schema refuses keys it does not know, + or not ------------------------------------------------
@pytest.mark.parametrize("override", ["+plan.time_limt=5", "++plan.foo=1", "+hardware.gpu_mem=3", "+model.layers=3",
                                      "+train.seq=4", "+extra=1", "+hardware.foo.bar=1"])
def test_plus_keys_compose_but_the_schema_refuses_them(cfg_of, override):
    cfg = cfg_of(override)  # Hydra adds a key with + to a typed node: the schema check is ours
    key = override.lstrip("+").split("=")[0]
    if key == "hardware.foo.bar":
        key = "hardware.foo"
    assert [k for k, _ in unknown_keys(cfg)] == [key]
    with pytest.raises(ConfigKeyError, match=re.escape(f"unknown key {key}:")) as ei:
        check_schema(cfg)
    assert ei.value.key == key and "\n" not in str(ei.value)


def test_unknown_key_message_suggests_the_key_meant(cfg_of):
    with pytest.raises(ConfigKeyError, match=r"did you mean plan\.time_limit\?"):
        check_schema(cfg_of("+plan.time_limt=5"))
    with pytest.raises(ConfigKeyError, match=r"did you mean hardware\.gpu_memory_gb\?"):
        check_schema(cfg_of("+hardware.gpu_mem=3"))
    check_schema(cfg_of())  # every shipped file, no override: nothing unknown
    check_schema(cfg_of("+model.paper_micro_batch_size.a100-80gb=3"))  # a Dict node takes any key
    assert "data.holdout_every" in unknown_key_message("data.val_every")


@pytest.mark.parametrize("override,expected", [
    ("plan.time_limt=5", "unknown key plan.time_limt: plan (PlanConfig) has no key 'time_limt'"),
    ("hardware.peak_tflops=fast", "hardware.peak_tflops: Value 'fast' of type 'str' could not be converted to Float"),
    ("model=gpt5", "model=gpt5: no such option in config group model; available: qwen2.5-14b"),
    ("trainer=cpu", "trainer=...: this app has no config group 'trainer' (its groups: hardware, model, train)"),
])
def test_composition_errors_are_one_line_with_the_key_as_written(cfg_of, override, expected):
    with pytest.raises(Exception) as ei:
        cfg_of(override)
    msg = composition_error_message(ei.value, ("hardware", "model", "train"))
    assert msg.startswith(expected) and "\n" not in msg, msg
    assert "To append to your config use" not in msg


def test_check_command_line_before_hydra_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    groups = ("hardware", "model", "train")
    assert check_command_line("plan", ["hardware=cpu", "model=tiny", "plan.time_limit=5"], groups) is None
    assert check_command_line("plan", ["+plan.time_limt=5"], groups).startswith("unknown key plan.time_limt")
    assert check_command_line("plan", ["plan.time_limt=5"], groups).startswith("unknown key plan.time_limt")
    assert check_command_line("plan", ["plan.time_limit=[1"], groups).startswith(
        "cannot parse the override 'plan.time_limit=[1'")
    # a multirun: every job is composed, the sweep's values too
    assert check_command_line("plan", ["-m", "hardware=cpu,h800", "plan.time_limit=5,10"], groups) is None
    assert "plan.time_limit: Value 'abc'" in check_command_line("plan", ["-m", "plan.time_limit=5,abc"], groups)
    # Hydra's own overrides and flags are left to Hydra
    assert check_command_line("plan", ["hydra.run.dir=somewhere", "hardware=cpu"], groups) is None
    assert check_command_line("plan", ["--help", "+plan.nonsense=1"], groups) is None
    assert check_command_line("plan", ["hydra.searchpath=[file:///elsewhere]", "model=mine"], groups) is None
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_help_lists_only_the_apps_groups():
    text = config_groups_help("hardware", "model", "train")
    lines = text.splitlines()
    assert [line.split(":")[0] for line in lines] == ["hardware", "model", "train"]
    assert "h800x8" in lines[0] and "tiny" in lines[1]
    for app, groups in (("plan.yaml", "hardware,model,train"), ("train_app.yaml", "data,hardware,model,trainer")):
        assert f"${{lazytrain_groups:{groups}}}" in (CONF_DIR / app).read_text()


def test_plan_data_parallel_default_is_the_strategys(cfg_of):
    import inspect

    LazyTrainStrategy = pytest.importorskip("lightning_lazytrain.strategy").LazyTrainStrategy
    default = inspect.signature(LazyTrainStrategy).parameters["data_parallel"].default
    assert cfg_of().plan.data_parallel == default == DEFAULT_DATA_PARALLEL == PlanConfig().data_parallel


def test_load_model_and_load_hardware_by_name():
    from lightning_lazytrain.config import load_hardware, load_model

    assert load_model("qwen3.6-27b").num_layers == 64 and load_model("tiny").vocab == 256
    assert load_model(str(CONF_DIR / "model" / "tiny.yaml")) == load_model("tiny")
    assert load_hardware("h800").name == "h800"
    with pytest.raises(InvalidInput, match="known: .*qwen2.5-3b.*tiny"):
        load_model("gpt-5")
