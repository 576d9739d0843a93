"""GPU check, one short script for a lent device (target: < 8 minutes on one GPU).

    python bench/gpu_check.py            # prints figures for bench/RESULTS.md; exits 1 on a failed check

1. The executor's equivalence tests on CUDA (fp32): every policy vs plain autograd.
2. Throughput: a ~1B-parameter Llama-style model, bf16, batch 8 x 1024, the MILP plan on a
   measured workload vs the megatrain policy vs plain PyTorch (if it fits); tokens/s and
   torch.cuda.max_memory_allocated against the plan's predicted peak.
"""

from __future__ import annotations

import copy
import sys
import time

import torch


def run_equivalence_tests() -> bool:
    """Every policy of tests/test_executor.py on CUDA (fp32) vs plain autograd on CUDA."""
    sys.path.insert(0, "tests")
    from test_executor import SCHEDULES, SPEC

    from lightning_lazytrain.engine.executor import Executor
    from lightning_lazytrain.models import LlamaLM

    print("## 1. equivalence on CUDA, fp32 (max relative gradient error; plain autograd on the same GPU)")
    torch.manual_seed(0)
    model = LlamaLM(SPEC)
    tokens = torch.randint(0, SPEC.vocab, (2, 33), device="cuda")
    ref = copy.deepcopy(model).cuda()
    ref.loss(tokens).backward()
    ok = True
    for name, schedule in SCHEDULES.items():
        m = copy.deepcopy(model)
        ex = Executor(m, schedule, device="cuda", nvme_dir="/tmp/lazytrain-gpu-check")
        ex.begin_microbatch()
        loss = m.loss(tokens)
        loss.backward()
        ex.end_microbatch()
        ex.close()
        err = max(((p.grad - q.grad.cpu()).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                  for p, q in zip(m.parameters(), ref.parameters()))
        good = err < 1e-5
        ok &= good
        print(f"{name}: loss {loss.item():.6f}, max rel grad err {err:.2e} {'ok' if good else 'FAIL'}", flush=True)
    return ok


def throughput() -> bool:
    from lightning_lazytrain.engine.executor import Executor
    from lightning_lazytrain.engine.profiler import measure_workload
    from lightning_lazytrain.models import LlamaLM
    from lightning_lazytrain.planner import Hardware, ModelSpec, megatrain, min_memory, simulate, solve

    print("## 2. throughput, bf16", flush=True)
    spec = ModelSpec(name="1b", num_layers=16, hidden=2048, intermediate=5632, heads=16, kv_heads=4, head_dim=128,
                     vocab=32000)
    torch.manual_seed(0)
    model = LlamaLM(spec)
    tokens = torch.randint(0, spec.vocab, (8, 1025), device="cuda")
    ok = True
    m = copy.deepcopy(model)
    ex = Executor(m, min_memory(spec.num_layers), device="cuda", compute_dtype=torch.bfloat16)
    wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=8 * 1024, warmup=1)
    ex.close()
    free, total = torch.cuda.mem_get_info()
    hw = Hardware(name="gpu", gpu_memory_bytes=total, gpu_memory_cap_bytes=0.5 * free, peak_tflops=989,
                  efficiency=0.5, h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, nvme_read_bytes_per_s=0,
                  nvme_write_bytes_per_s=0, nvme_capacity_bytes=0, cpu_memory_bytes=100e9, cpu_adam_params_per_s=1e9,
                  cpu_adam8_params_per_s=1e9)
    plan = solve(wl, hw).schedule
    for name, schedule in (("plan", plan), ("megatrain", megatrain(spec.num_layers, 4))):
        m = copy.deepcopy(model)
        ex = Executor(m, schedule, device="cuda", compute_dtype=torch.bfloat16)
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)
        times = []
        for _ in range(4):
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ex.begin_microbatch()
            m.loss(tokens).backward()
            ex.end_microbatch()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            opt.step()
            opt.zero_grad()
        pred = simulate(schedule, wl, hw.replace(gpu_memory_cap_bytes=total))
        step = sorted(times[1:])[1]
        print(f"{name}: {8 * 1024 / step:.0f} tok/s, step {step:.3f} s (predicted {pred.iteration_seconds:.3f}), "
              f"max_memory_allocated {torch.cuda.max_memory_allocated() / 1e9:.2f} GB, tracked peak "
              f"{ex.stats.peak_tracked_bytes / 1e9:.2f} GB, predicted peak {pred.peak_gpu_bytes / 1e9:.2f} GB",
              flush=True)
        ok &= ex.stats.peak_tracked_bytes <= pred.peak_gpu_bytes
        ex.close()
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0 = time.perf_counter()
    ok = run_equivalence_tests()
    ok &= throughput()
    print(f"total {time.perf_counter() - t0:.0f} s; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
