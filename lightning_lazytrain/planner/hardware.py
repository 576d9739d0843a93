"""Hardware profiles as plain numbers (bytes, seconds, FLOP/s inside; GB only at the edges)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .errors import InvalidInput

GB = 1e9
GIB = 1024**3
# Bytes/s one host thread streams through memory in elementwise casts and adds (the engine's host
# lane: master -> compute-dtype cast before each weight fetch, gradient accumulation after each D2H).
# Estimate: one core's sustained streaming rate on a current x86 server (~10-20 GB/s). Measured on
# the 2-core development VM (AMD EPYC, one torch thread, 256 MB tensors, machine shared): fp32 -> bf16
# copy_ 13 GB/s, fp32 norm 17 GB/s, but the mixed-dtype fp32 += bf16 add_ only 2-3 GB/s. Torch's
# intra-op threads, if the host lane's ops get them, raise it toward the socket's memory bandwidth.
DEFAULT_HOST_BYTES_PER_S = 10e9


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One GPU plus its host.

    Bandwidths are *achieved* figures (bytes/s), not link peaks: the paper measured 12 GB/s on a
    PCIe Gen5 x16 link. ``efficiency`` is the one calibration factor: achieved dense bf16 matmul
    rate as a fraction of ``peak_tflops``. ``host_bytes_per_s`` is the rate of the engine's one
    host worker thread for elementwise work (casts, gradient accumulation); see
    ``DEFAULT_HOST_BYTES_PER_S``.
    """

    name: str
    gpu_memory_bytes: float
    gpu_memory_cap_bytes: float  # the peak the plan may use (allocator slack, CUDA context, ...)
    peak_tflops: float  # dense bf16, TFLOP/s
    efficiency: float  # achieved fraction of peak for transformer blocks
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    nvme_capacity_bytes: float
    cpu_memory_bytes: float
    cpu_adam_params_per_s: float  # 32-bit AdamW states, whole host
    cpu_adam8_params_per_s: float  # 8-bit blockwise AdamW states, whole host
    host_bytes_per_s: float = DEFAULT_HOST_BYTES_PER_S  # one host thread, elementwise streaming
    # the host lane's widening add of a 16-bit gradient into the fp32 one (bytes counted: the landed
    # gradient, the fp32 one read and written); mixed-dtype adds run far below the like-to-like rate on
    # CPUs (measured on an H200 host: 19 vs 96 GB/s with 16 threads). 0: host_bytes_per_s
    host_widen_bytes_per_s: float = 0.0
    # its like-to-like work after a gradient copy: an fp32 add into the fp32 gradient, the norms (bytes
    # counted: read and written). 0: host_bytes_per_s (which then prices the casts and these alike)
    host_add_bytes_per_s: float = 0.0
    # its per-parameter gradient norms for the exact clip (bytes counted: the fp32 gradient read once):
    # torch's CPU 2-norm is one serial loop per tensor, so a group's norms run at a few tensors' width
    # (measured on the 2-core machine: ~3.6 GB/s against ~15 for the fp32 add). 0: host_add_bytes_per_s
    host_norm_bytes_per_s: float = 0.0
    # seconds every host-lane job takes besides its bytes (a cast before a weight fetch, an accumulation
    # after a gradient copy: each one job): the hand-off to the lane's thread, the Python around its
    # kernels and their launches, the per-parameter bookkeeping, and the waits for the interpreter lock
    # the thread launching compute holds. Beside compute it dwarfs the bytes of small jobs (measured on
    # the 2-core machine: ~0.5-1 ms per job, against ~0.03 ms for the same job alone; the norms alone of
    # an 8-layer, 27.8M-parameter model's blocks take ~1 ms each). 0: per-byte pricing only
    host_job_seconds: float = 0.0
    # ---- several devices (``planner/multi.py``); the defaults are one GPU ----------------------
    gpus_per_node: int = 1  # ranks per node, sharing this node's host memory, optimizer and host-lane rates
    nodes: int = 1
    intra_node_bytes_per_s: float = 0.0  # device collective bus bandwidth inside a node (NVLink / PCIe peer)
    inter_node_bytes_per_s: float = 0.0  # network bandwidth per node (all its NICs together)
    host_link_share: float = 1.0  # fraction of h2d/d2h each rank gets when every rank copies at once
    host_collective_bytes_per_s: float = 0.0  # host-side (gloo) all-reduce bus bandwidth between ranks
    # device memory bandwidth (HBM/GDDR, datasheet): prices a partial keep's elementwise recompute
    # (workload.py, ELEMENTWISE_EFFICIENCY); 0 = unknown, a partial keep is then priced as a full re-run
    gpu_memory_bytes_per_s: float = 0.0

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency

    def validate(self) -> Hardware:
        for key in ("gpu_memory_bytes", "gpu_memory_cap_bytes", "peak_tflops", "h2d_bytes_per_s",
                    "d2h_bytes_per_s", "cpu_memory_bytes", "cpu_adam_params_per_s",
                    "cpu_adam8_params_per_s", "host_bytes_per_s"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InvalidInput(f"hardware.{key}", value, "must be a finite number > 0")
        for key in ("nvme_read_bytes_per_s", "nvme_write_bytes_per_s", "nvme_capacity_bytes"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InvalidInput(f"hardware.{key}", value, "must be a finite number >= 0 (0 = no NVMe)")
        if not 0 < self.efficiency <= 1:
            raise InvalidInput("hardware.efficiency", self.efficiency, "must be in (0, 1]")
        for key in ("gpus_per_node", "nodes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"hardware.{key}", value, "must be an integer >= 1")
        for key in ("intra_node_bytes_per_s", "inter_node_bytes_per_s", "host_collective_bytes_per_s",
                    "gpu_memory_bytes_per_s", "host_widen_bytes_per_s", "host_add_bytes_per_s",
                    "host_norm_bytes_per_s", "host_job_seconds"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InvalidInput(f"hardware.{key}", value, "must be a finite number >= 0 (0 = none)")
        if not (isinstance(self.host_link_share, (int, float)) and 0 < self.host_link_share <= 1):
            raise InvalidInput("hardware.host_link_share", self.host_link_share,
                               "must be in (0, 1]: the fraction of h2d/d2h one rank gets while every rank copies")
        if self.gpus_per_node > 1 and self.intra_node_bytes_per_s <= 0:
            raise InvalidInput("hardware.intra_node_bytes_per_s", self.intra_node_bytes_per_s,
                               f"gpus_per_node={self.gpus_per_node} needs the intra-node collective bandwidth (> 0)")
        if self.nodes > 1 and self.inter_node_bytes_per_s <= 0:
            raise InvalidInput("hardware.inter_node_bytes_per_s", self.inter_node_bytes_per_s,
                               f"nodes={self.nodes} needs the inter-node network bandwidth (> 0)")
        if self.gpu_memory_cap_bytes > self.gpu_memory_bytes:
            raise InvalidInput("hardware.gpu_memory_cap_bytes", self.gpu_memory_cap_bytes,
                               f"exceeds gpu_memory_bytes={self.gpu_memory_bytes:.3g}")
        return self

    @property
    def has_nvme(self) -> bool:
        return self.nvme_capacity_bytes > 0 and self.nvme_read_bytes_per_s > 0 and self.nvme_write_bytes_per_s > 0

    def replace(self, **changes: object) -> Hardware:
        data = asdict(self)
        data.update(changes)
        return Hardware(**data).validate()

    @classmethod
    def from_gb(cls, *, name: str, gpu_memory_gb: float, gpu_memory_cap_gb: float, peak_tflops: float,
                efficiency: float, h2d_gb_per_s: float, d2h_gb_per_s: float, nvme_read_gb_per_s: float,
                nvme_write_gb_per_s: float, nvme_capacity_gb: float, cpu_memory_gb: float,
                cpu_adam_gparams_per_s: float, cpu_adam8_gparams_per_s: float,
                host_gb_per_s: float = DEFAULT_HOST_BYTES_PER_S / GB, gpus_per_node: int = 1, nodes: int = 1,
                intra_node_gb_per_s: float = 0.0, inter_node_gb_per_s: float = 0.0, host_link_share: float = 1.0,
                host_collective_gb_per_s: float = 0.0, gpu_memory_gb_per_s: float = 0.0,
                host_widen_gb_per_s: float = 0.0, host_add_gb_per_s: float = 0.0,
                host_norm_gb_per_s: float = 0.0, host_job_seconds: float = 0.0) -> Hardware:
        """Build from the GB / GB/s / G-params/s units used in configs (1 GB = 1e9 bytes; seconds stay
        seconds)."""
        return cls(
            name=name,
            gpu_memory_bytes=gpu_memory_gb * GB,
            gpu_memory_cap_bytes=gpu_memory_cap_gb * GB,
            peak_tflops=peak_tflops,
            efficiency=efficiency,
            h2d_bytes_per_s=h2d_gb_per_s * GB,
            d2h_bytes_per_s=d2h_gb_per_s * GB,
            nvme_read_bytes_per_s=nvme_read_gb_per_s * GB,
            nvme_write_bytes_per_s=nvme_write_gb_per_s * GB,
            nvme_capacity_bytes=nvme_capacity_gb * GB,
            cpu_memory_bytes=cpu_memory_gb * GB,
            cpu_adam_params_per_s=cpu_adam_gparams_per_s * 1e9,
            cpu_adam8_params_per_s=cpu_adam8_gparams_per_s * 1e9,
            host_bytes_per_s=host_gb_per_s * GB,
            gpus_per_node=gpus_per_node,
            nodes=nodes,
            intra_node_bytes_per_s=intra_node_gb_per_s * GB,
            inter_node_bytes_per_s=inter_node_gb_per_s * GB,
            host_link_share=host_link_share,
            host_collective_bytes_per_s=host_collective_gb_per_s * GB,
            gpu_memory_bytes_per_s=gpu_memory_gb_per_s * GB,
            host_widen_bytes_per_s=host_widen_gb_per_s * GB,
            host_add_bytes_per_s=host_add_gb_per_s * GB,
            host_norm_bytes_per_s=host_norm_gb_per_s * GB,
            host_job_seconds=host_job_seconds,
        ).validate()


def available_host_bytes() -> int | None:
    """The host memory available to a new job now (``MemAvailable`` of /proc/meminfo; None where there is
    none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
