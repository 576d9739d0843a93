"""Typed Hydra configs for the planner app (and, later, the trainer), and their conversion into the
planner's types.

The YAML files live in ``conf/`` at the repository root (a wheel ships them as ``lightning_lazytrain/conf``;
``CONF_DIR`` is whichever is installed)::

    conf/plan.yaml            the ``lazytrain-plan`` app (defaults + solver options)
    conf/hardware/*.yaml      -> HardwareConfig -> planner.Hardware   (to_hardware)
    conf/model/*.yaml         -> ModelConfig    -> planner.ModelSpec  (to_model)
    conf/train/*.yaml         -> TrainConfig    -> planner.TrainSpec  (to_train)

Every dataclass here is registered in Hydra's ConfigStore (``register_configs``, run on import), so a
composed config is type-checked: a misspelt key or a string where a number belongs fails at
composition time, before the planner runs. Units in configs are GB (1e9 bytes), GB/s, TFLOP/s and
G-params/s; the planner works in bytes and seconds (``Hardware.from_gb`` converts).

``train.micro_batch_size`` is an integer, ``"auto"`` (search the batch with ``planner.search_batch``
and plan the best-throughput one) or ``"paper"`` (the batch the LazyTrain paper used for this
(hardware, model) pair, stored in the model YAML under ``paper_micro_batch_size``; ``"auto"`` when
the pair is not in the paper).

No torch here: this module is imported by the planner CLI and tests on machines without torch.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from .planner import Hardware, MilpOptions, ModelSpec, TrainSpec
from .planner.errors import InvalidInput

def _find_conf_dir() -> Path:
    """The Hydra config directory: ``lightning_lazytrain/conf`` inside an installed wheel (pyproject maps the
    repository's ``conf/`` there), else ``conf/`` next to the package (a source checkout, ``pip install -e .``)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "plan.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"lightning_lazytrain: no Hydra configs in {here / 'conf'} or {here.parent / 'conf'} "
                            "(a broken install: reinstall the package)")


#: The directory holding ``plan.yaml``, ``train_app.yaml`` and the config groups (see ``_find_conf_dir``).
CONF_DIR = _find_conf_dir()

BATCH_MODES = ("auto", "paper")
#: ``plan.data_parallel`` when not given: the mode ``LazyTrainStrategy(data_parallel=...)`` runs by default
DEFAULT_DATA_PARALLEL = "replicate"


@dataclass
class HardwareConfig:
    """One GPU and its host, in config units. Field names match ``Hardware.from_gb``'s arguments;
    the fields after ``cpu_adam8_gparams_per_s`` are descriptive only (not used by the planner)."""

    name: str = MISSING
    gpu_memory_gb: float = MISSING
    gpu_memory_cap_gb: float = MISSING  # the peak a plan may use
    peak_tflops: float = MISSING  # dense bf16 (fp32 accumulate), TFLOP/s
    efficiency: float = MISSING  # achieved fraction of peak_tflops in transformer blocks
    h2d_gb_per_s: float = MISSING  # achieved pinned host -> device
    d2h_gb_per_s: float = MISSING  # achieved pinned device -> host
    nvme_read_gb_per_s: float = 0.0  # 0 = no NVMe tier
    nvme_write_gb_per_s: float = 0.0
    nvme_capacity_gb: float = 0.0  # the NVMe budget for activations, not the drive size
    cpu_memory_gb: float = MISSING  # host memory the run may use
    cpu_adam_gparams_per_s: float = MISSING  # 32-bit AdamW update rate, whole host
    cpu_adam8_gparams_per_s: float = MISSING  # 8-bit blockwise AdamW update rate, whole host
    host_gb_per_s: float = 10.0  # the engine's host lane (casts, grad accumulation), elementwise streaming
    host_widen_gb_per_s: float = 0.0  # its widening add of 16-bit gradients into fp32 ones; 0 = host_gb_per_s
    host_add_gb_per_s: float = 0.0  # its fp32 adds and norms after a gradient copy; 0 = host_gb_per_s
    # several devices (planner/multi.py); defaults: one GPU
    gpus_per_node: int = 1
    nodes: int = 1
    intra_node_gb_per_s: float = 0.0  # device collective bus bandwidth in a node (NVLink / PCIe peer)
    inter_node_gb_per_s: float = 0.0  # network per node
    host_link_share: float = 1.0  # fraction of h2d/d2h one rank gets while every rank copies
    host_collective_gb_per_s: float = 0.0  # host (gloo) all-reduce bus bandwidth
    gpu_memory_gb_per_s: float = 0.0  # device memory bandwidth (datasheet); 0 = unknown (prices partial keeps)
    # ---- descriptive -----------------------------------------------------------------------
    description: str = ""
    nvme_drives: int = 0
    cpu_logical_cores: Optional[int] = None


@dataclass
class ModelConfig:
    """A decoder-only model as the planner sees it (``planner.ModelSpec``: pre-norm GQA + SwiGLU blocks by
    default; the layout fields describe other layers, see ``planner/model.py``)."""

    name: str = MISSING
    num_layers: int = MISSING
    hidden: int = MISSING
    intermediate: int = MISSING
    heads: int = MISSING
    kv_heads: int = MISSING
    head_dim: int = MISSING
    vocab: int = MISSING
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # ---- layer layout (planner.ModelSpec; what the memory model replays, defaults = HF Llama/Qwen) ------
    attn_implementation: str = "sdpa"  # sdpa | eager
    norm: str = "rms"  # rms | rms_fp32 (Gemma) | layer (LayerNorm, GPT-2)
    post_norms: bool = False  # Gemma2's norms after attention and MLP
    mlp: str = "gated"  # gated | plain
    activation: str = "silu"  # silu | gelu | gelu_pytorch_tanh | relu | gelu_new
    bias: bool = False  # every projection has a bias (GPT-2)
    softmax_fp32: bool = True  # eager attention's softmax in fp32
    attn_softcap: bool = False  # Gemma2 attention logit soft-capping
    num_experts: int = 0  # > 0: routed mixture of experts
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    router_weights_fp32: bool = False
    source: str = ""
    # ---- descriptive / lookup ------------------------------------------------------------------
    hf_id: Optional[str] = None  # Hugging Face model id the shapes come from
    published_params_b: Optional[float] = None  # published (trainable) parameter count, billions
    params_note: str = ""  # what the planner's parameter count stands for, when it is not the model card's
    # micro-batch the LazyTrain paper used for this model, by hardware name (train.micro_batch_size=paper)
    paper_micro_batch_size: Dict[str, int] = field(default_factory=dict)


@dataclass
class TrainConfig:
    # int, "auto" or "paper" (OmegaConf 2.3 has no Union of int and str: validated in to_train)
    micro_batch_size: Any = "paper"
    seq_len: int = 1024
    grad_accum: int = 1
    dtype: str = "bf16"
    grad_dtype: str = "bf16"
    eight_bit_fraction: float = 0.02
    loss_chunk_tokens: int = 4096
    causal: bool = True


@dataclass
class PlanConfig:
    """Solver settings. The fields from ``window_memory`` to ``seed`` mirror ``planner.MilpOptions``
    one to one (``to_milp_options``); a test checks that they stay in step."""

    policy: str = "milp"  # milp | megatrain | keep_all | recompute_all
    K: int = 4  # MegaTrain's checkpoint interval (megatrain baseline)
    # ---- MilpOptions -------------------------------------------------------------------------
    window_memory: bool = True
    time_objective: bool = True
    pipelined_optimizer: bool = True  # false: serial optimizer only
    optimizer_mode: str = "auto"  # auto (the MILP chooses) | serial | pipelined
    serial_layers: bool = False  # pipelined: the MILP may update chosen layers in T (per-layer mode; slower solves)
    keep_internals: bool = True
    resident_weights: bool = True
    nvme: bool = True
    offload_internals: bool = True  # a kept layer's internals may go to host memory and back
    partial_keep: bool = False  # a layer may keep only its matmul outputs (recompute the elementwise ops)
    max_block: int = 8
    reload_slack: int = 2
    offload_horizon: int = 1
    internals_offload_horizon: int = 2
    internals_reload_slack: int = 2
    mip_gap: float = 1e-3
    time_limit: float = 60.0
    threads: Optional[int] = None
    seed: bool = True
    conversions: str = "plan"  # plan | host | device: where the fp32 <-> 16-bit conversions run
    solver_process: bool = True  # HiGHS in a process of its own, stopped if it overruns its time limit
    # ---- app ---------------------------------------------------------------------------------
    batch_candidates: Optional[List[int]] = None  # micro_batch_size=auto: batches to solve (None: powers of 2)
    plot: bool = True  # write timeline.png
    plot_baselines: bool = False  # also timeline_<baseline>.png for the feasible baselines
    # ---- several GPUs (hardware.gpus_per_node x hardware.nodes > 1; ignored for one GPU) --------------
    # shard | replicate | replicate_overlap | fsdp (planner/multi.py MODES). The default is LazyTrainStrategy's
    # default (data_parallel="replicate"), so that a plan describes what the strategy runs unless told otherwise
    data_parallel: str = DEFAULT_DATA_PARALLEL
    # cap on each node's host memory below hardware.cpu_memory_gb: null (none), GB (a number) or "<f>x"
    # (f times the single-GPU plan's host memory, as bench/bench_scaling.py's "shard<=1.1x")
    host_gb_per_node_cap: Any = None


@dataclass
class PlanAppConfig:
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


def register_configs() -> None:
    """Register the app schema (idempotent). ``conf/plan.yaml`` lists ``plan_app_schema`` first in its
    defaults, so every hardware/model/train file is merged into a typed node (no per-group schema entries:
    they would show up as bogus options such as ``hardware=hardware_schema``)."""
    ConfigStore.instance().store(name="plan_app_schema", node=PlanAppConfig)


register_configs()


# ---- conversions -------------------------------------------------------------------------------
def _get(cfg: Any, key: str) -> Any:
    return cfg[key] if isinstance(cfg, (dict, DictConfig)) else getattr(cfg, key)


def _node(cfg: Any, key: str) -> Any:
    """``cfg.key`` when ``cfg`` is the whole app config, else ``cfg`` itself."""
    if isinstance(cfg, (dict, DictConfig)):
        return cfg[key] if key in cfg else cfg
    return getattr(cfg, key, cfg)


_FROM_GB_KEYS = ("name", "gpu_memory_gb", "gpu_memory_cap_gb", "peak_tflops", "efficiency", "h2d_gb_per_s",
                 "d2h_gb_per_s", "nvme_read_gb_per_s", "nvme_write_gb_per_s", "nvme_capacity_gb",
                 "cpu_memory_gb", "cpu_adam_gparams_per_s", "cpu_adam8_gparams_per_s", "host_gb_per_s",
                 "gpus_per_node", "nodes", "intra_node_gb_per_s", "inter_node_gb_per_s", "host_link_share",
                 "host_collective_gb_per_s", "gpu_memory_gb_per_s", "host_widen_gb_per_s", "host_add_gb_per_s")


def _config_key(field_name: str) -> tuple[str, float]:
    """A ``planner.Hardware`` field -> (the hardware config's key for it, bytes per config unit):
    ``gpu_memory_cap_bytes`` -> (``gpu_memory_cap_gb``, 1e9), ``h2d_bytes_per_s`` -> (``h2d_gb_per_s``, 1e9),
    ``cpu_adam_params_per_s`` -> (``cpu_adam_gparams_per_s``, 1e9); other fields are named alike (1)."""
    for suffix, unit in (("_bytes_per_s", "_gb_per_s"), ("_bytes", "_gb"), ("_params_per_s", "_gparams_per_s")):
        if field_name.endswith(suffix):
            return field_name[: -len(suffix)] + unit, 1e9
    return field_name, 1.0


_HARDWARE_FIELD_VALUE = re.compile(r"\b(hardware\.)?([a-z][a-z0-9_]*?(?:_bytes_per_s|_bytes|_params_per_s))"
                                   r"=([-+]?(?:[0-9][0-9.]*(?:[eE][-+]?[0-9]+)?|inf|nan))")


def in_config_units(text: str) -> str:
    """``text`` (a planner message) with ``planner.Hardware``'s byte fields and values written as the hardware
    config's keys in GB: ``hardware.gpu_memory_cap_bytes=100000000000.0`` -> ``hardware.gpu_memory_cap_gb=100``."""
    def config_units(m: re.Match) -> str:
        key, scale = _config_key(m.group(2))
        if scale == 1.0 or key == m.group(2):
            return m.group(0)
        return f"{m.group(1) or ''}{key}={float(m.group(3)) / scale:g}"

    return _HARDWARE_FIELD_VALUE.sub(config_units, text)


def _check_hardware_gb(values: Dict[str, Any]) -> None:
    """The checks of ``Hardware.validate`` that compare two keys, in the config's GB (so the message names the keys
    as written in ``conf/hardware/*.yaml``)."""
    cap, total = values.get("gpu_memory_cap_gb"), values.get("gpu_memory_gb")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (cap, total))
    if numbers and total <= 0:
        raise InvalidInput("hardware.gpu_memory_gb", total, "must be > 0 (the GPU's memory in GB)")
    if numbers and cap > total:
        raise InvalidInput("hardware.gpu_memory_cap_gb", cap,
                           f"exceeds hardware.gpu_memory_gb={total:g} (the cap is the part of the GPU's memory a plan "
                           f"may use): set hardware.gpu_memory_cap_gb <= {total:g}, or raise hardware.gpu_memory_gb "
                           "if the GPU has more")


def to_hardware(cfg: Any) -> Hardware:
    """``HardwareConfig`` (or the app config) -> validated ``planner.Hardware``. An ``InvalidInput`` names the
    config's key in the config's units (``hardware.gpu_memory_cap_gb=100``, not the planner's bytes)."""
    hw = _node(cfg, "hardware")
    present = (lambda k: k in hw) if isinstance(hw, (dict, DictConfig)) else (lambda k: hasattr(hw, k))
    values = {key: _get(hw, key) for key in _FROM_GB_KEYS if present(key)}
    _check_hardware_gb(values)
    try:
        return Hardware.from_gb(**values)
    except InvalidInput as err:
        raise _in_config_units(err) from None


def _in_config_units(err: InvalidInput) -> InvalidInput:
    """``err`` (from ``Hardware.validate``) with the key, value and reason in the hardware config's units."""
    prefix = f"invalid {err.key}={err.value!r}: "
    text = str(err)
    why = in_config_units(text[len(prefix):] if text.startswith(prefix) else text)
    head, dot, name = err.key.rpartition(".")
    key, scale = _config_key(name)
    value = err.value
    if scale != 1.0 and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = value / scale
    return InvalidInput(f"{head}{dot}{key}", value, why)


def load_hardware(name: str) -> Hardware:
    """The profile ``conf/hardware/<name>.yaml`` as a ``Hardware`` (no Hydra composition, so it also
    works inside a running Hydra app)."""
    path = CONF_DIR / "hardware" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "hardware").glob("*.yaml"))
        raise InvalidInput("hardware", name, f"no profile {path}; known: {', '.join(known)}, or 'measure'")
    return to_hardware(OmegaConf.load(path))


def load_model(name: str) -> ModelSpec:
    """The model ``conf/model/<name>.yaml`` (or the model YAML file ``name``) as a ``ModelSpec`` (no Hydra
    composition, no torch)."""
    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise InvalidInput("model", name, f"no model {path}; known: {', '.join(known)}, or a path to a model .yaml")
    return to_model(OmegaConf.load(path))


def to_model(cfg: Any) -> ModelSpec:
    """``ModelConfig`` (or the app config) -> validated ``planner.ModelSpec``."""
    m = _node(cfg, "model")
    keys = [f.name for f in dataclasses.fields(ModelSpec)]
    present = m.keys() if isinstance(m, (dict, DictConfig)) else [k for k in keys if hasattr(m, k)]
    return ModelSpec(**{k: _get(m, k) for k in keys if k in present}).validate()


def micro_batch_setting(cfg: Any) -> int | str:
    """The raw ``train.micro_batch_size``: an int >= 1, ``"auto"`` or ``"paper"`` (else InvalidInput)."""
    value = _get(_node(cfg, "train"), "micro_batch_size")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in BATCH_MODES:
            return text
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput("train.micro_batch_size", value, "must be an integer >= 1, 'auto' or 'paper'")
    return value


def paper_micro_batch_size(model_cfg: Any, hardware_name: str) -> int | None:
    """The micro-batch the LazyTrain paper used for this model on ``hardware_name`` (None if absent)."""
    table = _get(model_cfg, "paper_micro_batch_size") or {}
    value = table.get(hardware_name) if hasattr(table, "get") else None
    return None if value is None else int(value)


def resolve_micro_batch(cfg: Any) -> tuple[int | str, str]:
    """(micro-batch or ``"auto"``, where it came from) for the whole app config.

    ``"paper"`` becomes the paper's batch for (hardware.name, model) or, if the paper has none,
    ``"auto"``."""
    setting = micro_batch_setting(cfg)
    if setting == "paper":
        hw_name = _get(_get(cfg, "hardware"), "name")
        batch = paper_micro_batch_size(_get(cfg, "model"), hw_name)
        if batch is None:
            return "auto", f"paper (no paper batch for {hw_name}: searched)"
        return batch, "paper"
    if setting == "auto":
        return "auto", "auto"
    return setting, "config"


def to_train(cfg: Any, micro_batch_size: int | None = None) -> TrainSpec:
    """``TrainConfig`` (or the app config) -> validated ``planner.TrainSpec``.

    ``micro_batch_size`` overrides the config's value; it is required when the config says
    ``"auto"``, and when it says ``"paper"`` unless ``cfg`` is the whole app config (then the
    paper's batch for the pair is used)."""
    t = _node(cfg, "train")
    if micro_batch_size is None:
        setting = micro_batch_setting(t)
        if setting == "paper" and t is not cfg:
            setting, _ = resolve_micro_batch(cfg)
        if isinstance(setting, str):
            raise InvalidInput("train.micro_batch_size", setting,
                               "a symbolic batch needs resolving first (resolve_micro_batch / search_batch)")
        micro_batch_size = setting
    keys = [f.name for f in dataclasses.fields(TrainSpec) if f.name != "micro_batch_size"]
    present = t.keys() if isinstance(t, (dict, DictConfig)) else [k for k in keys if hasattr(t, k)]
    values = {k: _get(t, k) for k in keys if k in present}
    return TrainSpec(micro_batch_size=int(micro_batch_size), **values).validate()


def to_milp_options(cfg: Any) -> MilpOptions:
    """``PlanConfig`` (or the app config) -> ``planner.MilpOptions`` (same field names)."""
    p = _node(cfg, "plan")
    return MilpOptions(**{f.name: _get(p, f.name) for f in dataclasses.fields(MilpOptions)})


def data_parallel_mode(cfg: Any) -> str:
    """``plan.data_parallel`` checked against ``planner.multi.MODES`` (else InvalidInput naming them)."""
    from .planner.multi import MODES

    mode = _get(_node(cfg, "plan"), "data_parallel")
    if not isinstance(mode, str) or mode.strip().lower() not in MODES:
        raise InvalidInput("plan.data_parallel", mode, f"must be one of {', '.join(MODES)}")
    return mode.strip().lower()


def host_cap_setting(cfg: Any) -> tuple[str, float] | None:
    """``plan.host_gb_per_node_cap``: None, ``("bytes", b)`` (a number in GB) or ``("single", f)`` (``"<f>x"``:
    f times the single-GPU plan's host memory). InvalidInput otherwise."""
    value = _get(_node(cfg, "plan"), "host_gb_per_node_cap")
    if value is None:
        return None
    why = "must be null, a number of GB > 0 or '<f>x' (f > 0 times the single-GPU plan's host memory)"
    text = str(value).strip().lower()
    try:
        kind, number = ("single", float(text[:-1])) if text.endswith("x") else ("bytes", float(text) * 1e9)
    except ValueError:
        raise InvalidInput("plan.host_gb_per_node_cap", value, why) from None
    if isinstance(value, bool) or not number > 0:
        raise InvalidInput("plan.host_gb_per_node_cap", value, why)
    return kind, number


def to_container(cfg: Any) -> dict:
    """Plain-dict copy of a config (for plan.json)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return dict(cfg)
