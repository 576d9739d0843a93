"""A plain config for HybridAdamW (Hydra/OmegaConf friendly) and the planner's memory figure."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from .assign import DEFAULT_MIN_8BIT_NUMEL, ParamLike, StateBytes, estimate_state_bytes
from .hybrid_adamw import HybridAdamW


@dataclass(kw_only=True, slots=True)
class HybridAdamWConfig:
    """Constructor arguments of :class:`HybridAdamW`. ``eight_bit`` is "none", "all" or a fraction
    here (a predicate is not representable in a config file: pass it to HybridAdamW directly)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    eight_bit: str | float = "none"
    block_size: int = 256
    max_grad_norm: float | None = None
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL
    impl: Literal["fused", "foreach"] = "fused"
    skip_nonfinite: bool = True

    def build(self, params: Iterable[Any]) -> HybridAdamW:
        kwargs = asdict(self)
        kwargs["betas"] = tuple(kwargs["betas"])
        return HybridAdamW(params, **kwargs)

    def state_bytes(self, named_params: Iterable[tuple[str, ParamLike]]) -> StateBytes:
        """Optimizer-state bytes :meth:`build` would allocate for these parameters (shapes or meta
        tensors are enough), without allocating: the planner's CPU-memory figure."""
        return estimate_state_bytes(named_params, self.eight_bit, min_8bit_numel=self.min_8bit_numel)  # type: ignore[arg-type]
