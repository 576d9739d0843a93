"""Baseline policies. Each returns a ``Schedule`` for ``num_layers`` layers.

- ``megatrain(L, K)``: MegaTrain's executor as published: the hidden state is kept on the GPU every
  K layers, blocks of K layers are recomputed in backward and every layer is re-run with grad
  before its backward (weights cross the link ~3 times), no backward prefetch, serial optimizer.
- ``keep_all``: every boundary on the GPU and every layer keeps its internals (no recompute).
- ``recompute_all``: every boundary on the GPU, every layer re-run before its backward
  (classic per-layer activation checkpointing) on our executor (prefetch, pipelined optimizer).
- ``min_memory``: every inner boundary goes to host memory as soon as it is produced and comes
  back one window before use; the smallest device footprint the executor can run, used to
  diagnose infeasible budgets.
"""

from __future__ import annotations

from .errors import InvalidInput
from .schedule import Schedule


def _schedule(L: int, homes: list[str], *, keep: bool = False, prefetch: bool = True, optimizer: str = "pipelined",
              policy: str, offload: list | None = None, reload: list | None = None) -> Schedule:
    return Schedule(num_layers=L, homes=tuple(homes), keep_internals=(keep,) * L, resident_weights=(False,) * L,
                    offload_window=tuple(offload or [None] * (L + 1)),
                    reload_window=tuple(reload or [None] * (L + 1)),
                    backward_prefetch=prefetch, optimizer=optimizer, policy=policy)


def megatrain(num_layers: int, K: int = 4) -> Schedule:
    if K < 1:
        raise InvalidInput("K", K, "must be >= 1")
    L = num_layers
    homes = ["gpu" if i % K == 0 or i == L else "recompute" for i in range(L + 1)]
    return _schedule(L, homes, prefetch=False, optimizer="serial", policy=f"megatrain(K={K})")


def keep_all(num_layers: int) -> Schedule:
    return _schedule(num_layers, ["gpu"] * (num_layers + 1), keep=True, policy="keep_all")


def recompute_all(num_layers: int) -> Schedule:
    return _schedule(num_layers, ["gpu"] * (num_layers + 1), policy="recompute_all")


def min_memory(num_layers: int, tier: str = "cpu") -> Schedule:
    L = num_layers
    # the last boundary is reloaded in H, the first backward window; an NVMe reload needs a window more for
    # its file read (schedule.py: reload_window <= L - 1 on nvme), so with tier="nvme" that one goes to the host
    homes = ["gpu"] + [tier] * (L - 1) + ["gpu"]
    if tier == "nvme" and L >= 2:
        homes[L - 1] = "cpu"
    offload = [None] + list(range(1, L)) + [None]
    # reload in B{i+1} (the window before first use); nvme's file read then runs in B{i+2} / H
    reload = [None] + [i + 1 for i in range(1, L)] + [None]
    return _schedule(L, homes, offload=offload, reload=reload, policy=f"min_memory({tier})")


BASELINES = ("megatrain", "keep_all", "recompute_all")


def baseline(name: str, num_layers: int, K: int = 4) -> Schedule:
    if name == "megatrain":
        return megatrain(num_layers, K)
    if name == "keep_all":
        return keep_all(num_layers)
    if name == "recompute_all":
        return recompute_all(num_layers)
    if name == "min_memory":
        return min_memory(num_layers)
    raise InvalidInput("policy", name, f"known policies: {BASELINES + ('min_memory', 'milp')}")
