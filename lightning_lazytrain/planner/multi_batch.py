"""``micro_batch_size: auto`` on several GPUs: the batch per rank, searched on the rank's own problem.

Note: [the batch search on several GPUs]
The single-GPU search (``plan.search_batch``) sizes a batch against the whole model's host state. A rank of a
data-parallel run holds its mode's share of that state (shard: ``1/n`` of the masters, gradients and optimizer
states; replicate: a full copy) on its ``1/n`` of the node's host, so the single-GPU workload on one rank's
hardware called h800x8's 27B shard run "infeasible (cpu)" at every batch, though batch 8 plans with 765 GB of
the node's 2199 GB. Here each batch is tested on ``multi.rank_problem`` -- the rank's workload in the mode, the
rank's hardware, the node's host cap -- and each candidate is planned with ``plan_cluster``, as the run will be.
"""

from __future__ import annotations

from .errors import InfeasibleBudget
from .hardware import Hardware
from .milp import MilpOptions
from .model import ModelSpec, TrainSpec
from .multi import best_fsdp, plan_cluster, rank_problem
from .plan import BatchSearch, largest_where, search_candidates
from .simulator import SimResult
from .shortage import workload_fits


def rank_fits(model: ModelSpec, train: TrainSpec, hw: Hardware, mode: str,
              host_bytes_per_node: float | None = None) -> bool:
    """Does a schedule of one rank fit at ``train``'s micro-batch (``plan.fits`` on the rank's problem)? The
    host state of replicate's ``n`` copies is no reason (``plan_cluster`` plans it and flags ``host_fits``)."""
    wl, rhw, _ = rank_problem(model, train, hw, mode, host_bytes_per_node=host_bytes_per_node)
    if mode == "fsdp":
        return (wl.host_static_bytes <= rhw.cpu_memory_bytes and wl.static_gpu_bytes <= rhw.gpu_memory_cap_bytes
                and best_fsdp(wl, rhw) is not None)
    return workload_fits(wl, rhw)


def search_cluster_batch(model: ModelSpec, train: TrainSpec, hw: Hardware, mode: str, *,
                         options: MilpOptions | None = None, candidates: list[int] | None = None,
                         host_bytes_per_node: float | None = None, upper: int = 4096) -> BatchSearch:
    """The largest feasible batch per rank and the one with the best predicted tokens/s among ``candidates``
    (default: powers of two and the largest), each planned by ``plan_cluster`` in ``mode``."""
    top = largest_where(lambda b: rank_fits(model, train.replace(micro_batch_size=b), hw, mode, host_bytes_per_node),
                        upper)
    if top == 0:  # the rank's problem at batch 1 names the short tier (diagnose inside plan_cluster)
        plan_cluster(model, train.replace(micro_batch_size=1), hw, mode, options=options,
                     host_bytes_per_node=host_bytes_per_node)
        raise InfeasibleBudget("gpu", 0.0, f"no micro-batch size fits one rank of {hw.name} in {mode}", "")

    def plan_at(b: int) -> tuple[SimResult, float, str]:
        c = plan_cluster(model, train.replace(micro_batch_size=b), hw, mode, options=options,
                         host_bytes_per_node=host_bytes_per_node)
        return c.sim, c.tokens_per_second, c.status

    return search_candidates(top, candidates, plan_at, f" one rank of {hw.name} in {mode}")
