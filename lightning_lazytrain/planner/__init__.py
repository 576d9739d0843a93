"""The planner: workload numbers, hardware profiles, the Schedule type, baseline policies, the
simulator and the MILP. Pure Python (stdlib, pyomo, highspy) - it never imports torch."""

from .errors import InfeasibleBudget, InfeasibleSchedule, InvalidInput, PlannerError
from .hardware import Hardware
from .hf import model_spec_from_hf
from .model import BlockCost, ModelSpec, TrainSpec, block_cost
from .milp import MilpOptions
from .solve import SolveResult, solve
from .plan import BatchSearch, PlanResult, diagnose, largest_batch, make_plan, search_batch
from .policies import BASELINES, baseline, keep_all, megatrain, min_memory, recompute_all
from .schedule import Op, Schedule, Window, window_index
from .simulator import SimResult, simulate
from .workload import LayerWork, Workload
from .multi import MODES as DATA_PARALLEL_MODES, ClusterResult, plan_cluster, rank_hardware, rank_workload

__all__ = [
    "BASELINES", "BatchSearch", "BlockCost", "MilpOptions", "PlanResult", "SolveResult", "diagnose", "largest_batch", "make_plan", "search_batch", "solve", "Hardware", "InfeasibleBudget", "InfeasibleSchedule", "InvalidInput", "LayerWork",
    "ModelSpec", "Op", "PlannerError", "Schedule", "SimResult", "TrainSpec", "Window", "Workload", "baseline",
    "block_cost", "ClusterResult", "DATA_PARALLEL_MODES", "plan_cluster", "rank_hardware", "rank_workload", "keep_all", "megatrain", "min_memory", "model_spec_from_hf", "recompute_all", "simulate", "window_index",
]
