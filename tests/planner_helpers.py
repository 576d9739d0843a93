"""Small hand-made workloads and hardware for planner tests (units: GB = 1e9 bytes)."""

from __future__ import annotations

from lightning_lazytrain.planner import Hardware, Workload

G = 1e9
FAST = 1e15  # bytes/s: transfers take ~nothing


def workload(fwd, bwd=None, *, A=1 * G, internal=4 * G, params=1_000_000, param_bytes=1e6, fwd_work=0.0,
             bwd_work=0.0, head=0.5, opt=1e-6, host_static=1 * G, grad_accum=1) -> Workload:
    L = len(fwd)
    bwd = bwd if bwd is not None else [2 * f for f in fwd]
    return Workload.from_measured(
        fwd_seconds=list(fwd), bwd_seconds=list(bwd), params=[params] * L, param_bytes=[param_bytes] * L,
        grad_bytes=[param_bytes] * L, boundary_bytes=[A] * (L + 1), internal_bytes=[internal] * L,
        fwd_work_bytes=[fwd_work] * L, bwd_work_bytes=[bwd_work] * L, opt_seconds=[opt] * L,
        head_seconds=head, head_work_bytes=0.0, nonblock_params=0, nonblock_gpu_bytes=0.0,
        nonblock_param_bytes=0.0, nonblock_grad_bytes=0.0, nonblock_opt_seconds=0.0, host_static_bytes=host_static, tokens=1000,
        grad_accum=grad_accum, name="hand")


def hardware(cap, *, cpu=1000 * G, h2d=FAST, d2h=FAST, nvme_cap=0.0, nvme_bw=0.0) -> Hardware:
    return Hardware(name="hand", gpu_memory_bytes=cap, gpu_memory_cap_bytes=cap, peak_tflops=1.0, efficiency=1.0,
                    h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, nvme_read_bytes_per_s=nvme_bw,
                    nvme_write_bytes_per_s=nvme_bw, nvme_capacity_bytes=nvme_cap, cpu_memory_bytes=cpu,
                    cpu_adam_params_per_s=1e12, cpu_adam8_params_per_s=1e12).validate()
