"""Which parameters get 8-bit optimizer states, and what the states cost in bytes.

Everything here is pure: it looks at names, shapes and dtypes only, so the planner can call it
on shapes (or meta tensors) to get the optimizer's CPU-memory figure without allocating anything,
and ``HybridAdamW`` calls the very same functions, so the estimate and the real optimizer agree
byte for byte (a test checks this).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch

logger = logging.getLogger("lightning_lazytrain.optim")

#: bitsandbytes 0.50's blockwise 8-bit optimizer kernels hard-code a block of 256 elements on CPU
#: (``blocksize = 256`` in ``backends/cpu/ops.py``) and on CUDA (the 8-bit blockwise kernels'
#: block size); the absmax buffers must have exactly ceil(n / 256) entries.
BNB_BLOCK_SIZE = 256
#: Entries of one quantisation map (signed dynamic map for exp_avg, unsigned for exp_avg_sq).
QMAP_ENTRIES = 256
#: bitsandbytes' own default ``min_8bit_size``: below this, quantisation saves too little to be
#: worth the block scales and the extra kernel call.
DEFAULT_MIN_8BIT_NUMEL = 4096
#: ``state["step"]`` is a float32 0-d CPU tensor, like torch AdamW's.
STEP_BYTES = 4

#: Predicate form of the policy: gets the parameter's name and shape.
StatePredicate: TypeAlias = Callable[[str, tuple[int, ...]], bool]
#: "none" | "all" | fraction of all parameter elements (0 < f <= 1) | predicate.
EightBitPolicy: TypeAlias = Literal["none", "all"] | float | StatePredicate
#: What the pure functions accept per parameter: a tensor (real or meta) or a shape.
ParamLike: TypeAlias = torch.Tensor | Sequence[int] | torch.Size

# A name component that denotes a normalisation layer: "norm", "layernorm", "input_layernorm",
# "rms_norm", "ln", "ln_f", "ln_1", "bn".
_NORM_COMPONENT = re.compile(r"(norm|^ln(_\w+)?$|^ln\d*$|^bn\d*$)")


def _shape_of(p: ParamLike) -> tuple[int, ...]:
    if isinstance(p, torch.Tensor):
        return tuple(p.shape)
    return tuple(int(d) for d in p)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def is_norm_name(name: str) -> bool:
    """True if any dotted component of ``name`` names a normalisation layer."""
    return any(_NORM_COMPONENT.search(part.lower()) for part in name.split("."))


def eligible_for_8bit(name: str, shape: tuple[int, ...], *, min_8bit_numel: int) -> bool:
    """Small tensors, 1-d tensors (biases, norm gains) and norm layers always stay 32-bit.

    They hold a negligible share of the state bytes, and their updates are the most sensitive to
    quantisation noise (a norm gain multiplies every activation of the layer).
    """
    return len(shape) >= 2 and _numel(shape) >= min_8bit_numel and not is_norm_name(name)


def assign_state_bits(
    named_params: Iterable[tuple[str, ParamLike]],
    policy: EightBitPolicy,
    *,
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
) -> dict[str, int]:
    """Decide per parameter whether its AdamW states are 8-bit or 32-bit: ``{name: 8 or 32}``.

    ``policy``:
      * ``"none"`` -- every state 32-bit (exactly torch AdamW);
      * ``"all"`` -- every eligible parameter 8-bit;
      * a float ``f`` in (0, 1] -- 8-bit for eligible tensors, largest first, as long as the 8-bit
        elements stay within ``f`` of *all* parameter elements (greedy fill, never above the
        target; largest-first keeps the number of separate bitsandbytes calls small);
      * a callable ``(name, shape) -> bool`` -- 8-bit where it returns True.
    Whatever the policy, ineligible tensors (see :func:`eligible_for_8bit`) stay 32-bit.
    Deterministic: depends on names and shapes only (ties broken by name).
    """
    items = [(name, _shape_of(p)) for name, p in named_params]
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("assign_state_bits: parameter names must be unique")
    eligible = {n for n, s in items if eligible_for_8bit(n, s, min_8bit_numel=min_8bit_numel)}
    bits = {n: 32 for n in names}

    if isinstance(policy, str):
        if policy == "none":
            return bits
        if policy == "all":
            return {n: (8 if n in eligible else 32) for n in names}
        raise ValueError(f"unknown eight_bit policy {policy!r}: use 'none', 'all', a fraction or a predicate")
    if isinstance(policy, bool):  # bool is an int: refuse it rather than read True as 100 %
        raise TypeError("eight_bit policy must be 'none', 'all', a float fraction or a predicate, not a bool")
    if isinstance(policy, (int, float)):
        frac = float(policy)
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"eight_bit fraction must be in (0, 1], got {frac}")
        target = frac * sum(_numel(s) for _, s in items)
        covered = 0
        candidates = sorted((s for s in items if s[0] in eligible), key=lambda it: (-_numel(it[1]), it[0]))
        for name, shape in candidates:
            if covered + _numel(shape) <= target:
                bits[name] = 8
                covered += _numel(shape)
        return bits
    if callable(policy):
        return {n: (8 if n in eligible and policy(n, s) else 32) for n, s in items}
    raise TypeError(f"eight_bit policy must be 'none', 'all', a float or a callable, got {type(policy).__name__}")


def param_state_bytes(
    numel: int, bits: int, *, state_itemsize: int = 4, block_size: int = BNB_BLOCK_SIZE
) -> int:
    """Bytes of one parameter's AdamW states, not counting the shared quantisation maps.

    32-bit: exp_avg + exp_avg_sq in the parameter's dtype + the step tensor.
    8-bit: two uint8 states + two float32 absmax per block + the step tensor.
    """
    if bits == 32:
        return 2 * numel * state_itemsize + STEP_BYTES
    if bits == 8:
        blocks = -(-numel // block_size)
        return 2 * numel + 2 * blocks * 4 + STEP_BYTES
    raise ValueError(f"bits must be 8 or 32, got {bits}")


#: The two quantisation maps (float32, 256 entries each), shared by all 8-bit states of a device.
QMAP_PAIR_BYTES = 2 * QMAP_ENTRIES * 4


@dataclass(kw_only=True, slots=True)
class StateBytes:
    """Optimizer-state memory, estimated or measured."""

    total: int
    per_param: dict[str, int] = field(default_factory=dict)
    eight_bit_bytes: int = 0  # 8-bit states incl. block scales (not the qmaps)
    full_bytes: int = 0  # 32-bit (param-dtype) states
    qmap_bytes: int = 0
    numel: int = 0  # parameter elements covered
    eight_bit_numel: int = 0

    @property
    def bytes_per_param(self) -> float:
        return self.total / self.numel if self.numel else 0.0

    @property
    def eight_bit_fraction(self) -> float:
        return self.eight_bit_numel / self.numel if self.numel else 0.0

    def summary(self) -> str:
        from lightning_lazytrain.planner.units import format_bytes  # torch-free; keeps optim's imports as they are

        return (
            f"{self.eight_bit_numel:,}/{self.numel:,} elements 8-bit ({100 * self.eight_bit_fraction:.2f}%), "
            f"state {format_bytes(self.total, binary=True, digits=4)} = {self.bytes_per_param:.3f} B/param"
        )


def estimate_state_bytes(
    named_params: Iterable[tuple[str, ParamLike]],
    policy: EightBitPolicy | Mapping[str, int],
    *,
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
    dtype: torch.dtype = torch.float32,
    n_devices_with_8bit: int = 1,
) -> StateBytes:
    """State bytes HybridAdamW will allocate, computed without allocating.

    ``policy`` may be a policy (it is run through :func:`assign_state_bits`) or an assignment
    ``{name: bits}`` already made. Shapes use ``dtype`` for 32-bit states; tensors (real or meta)
    use their own dtype. One qmap pair is counted per device that holds 8-bit states.
    """
    items = list(named_params)
    if isinstance(policy, Mapping):
        bits = dict(policy)
    else:
        bits = assign_state_bits(items, policy, min_8bit_numel=min_8bit_numel)
    out = StateBytes(total=0)
    for name, p in items:
        shape = _shape_of(p)
        n = _numel(shape)
        itemsize = p.element_size() if isinstance(p, torch.Tensor) else torch.empty((), dtype=dtype).element_size()
        b = param_state_bytes(n, bits[name], state_itemsize=itemsize)
        out.per_param[name] = b
        out.numel += n
        if bits[name] == 8:
            out.eight_bit_bytes += b
            out.eight_bit_numel += n
        else:
            out.full_bytes += b
    if out.eight_bit_numel:
        out.qmap_bytes = QMAP_PAIR_BYTES * n_devices_with_8bit
    out.total = out.eight_bit_bytes + out.full_bytes + out.qmap_bytes
    return out


def log_assignment(bits: Mapping[str, int], sizes: StateBytes, *, policy: object) -> None:
    """INFO: one summary line (what the planner needs); DEBUG: the full per-tensor table."""
    n8 = sum(1 for b in bits.values() if b == 8)
    logger.info(
        "HybridAdamW state bits (policy=%r): %d/%d tensors 8-bit; %s (fp32 AdamW: 8.000 B/param)",
        policy if not callable(policy) else getattr(policy, "__name__", "predicate"),
        n8,
        len(bits),
        sizes.summary(),
    )
    if logger.isEnabledFor(logging.DEBUG):
        for name, b in bits.items():
            logger.debug("  %-60s %2d-bit  %d bytes", name, b, sizes.per_param.get(name, 0))
    if isinstance(policy, float) and n8 == 0:
        logger.warning(
            "eight_bit=%g selected no tensor: every eligible tensor is larger than that fraction of the model",
            policy,
        )
