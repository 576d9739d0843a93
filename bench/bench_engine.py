"""Engine benchmark on CPU: plan vs actual with an emulated link, MILP plan vs MegaTrain, and the
executor's overhead over plain PyTorch.

    python bench/bench_engine.py [torch threads, default 1] [sections, default 1234]   # ~3 minutes on 2 cores

1. Emulated link (H2D/D2H/NVMe worker threads sleep to a set bandwidth) sized so a layer's weight
   transfer takes about as long as its forward: the measured step time of the MILP plan and of the
   megatrain policy vs the simulator's prediction for the same schedule on the measured workload.
2. The same run: measured time of the MILP plan vs the megatrain policy (ratio).
3. No emulation, a budget that fits everything (keep_all): executor step vs plain PyTorch step.
4. Offloaded internals (``MilpOptions.offload_internals``, the ablation switch): the MILP plan at a
   tight budget with and without the decision, measured on the emulated link (and predicted).
5. Non-block parts (Note: [non-block parts]; ``LazyTrainStrategy(nonblock_parts=)`` is the switch): a
   large-vocabulary model (the embedding's and head's grads to the host, their update, their weights
   back make up the step's tail), the pipelined HybridAdamW, the emulated link: the tail (T, from the
   end of the backward to the next step's fetches done) with the non-block group in two parts vs one,
   measured and predicted.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import statistics
import time

import torch

from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.profiler import measure_workload
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.optim.pipeline import group_by_layer
from lightning_lazytrain.planner import Hardware, ModelSpec, keep_all, megatrain, recompute_all, simulate, solve
from lightning_lazytrain.planner.milp import MilpOptions

SPEC = ModelSpec(name="bench", num_layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=4, head_dim=64,
                 vocab=4096)
BATCH, SEQ = 4, 257
STEPS = 4


def timed_steps(model, executor, tokens, opt, steps=STEPS) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if executor is not None:
            executor.begin_microbatch()
        model.loss(tokens).backward()
        if executor is not None:
            executor.end_microbatch()
        out.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()
    return out[1:]  # the first step warms up allocators and threads


def hardware_for(bandwidth: float) -> Hardware:
    return Hardware(name="cpu-emulated", gpu_memory_bytes=1e12, gpu_memory_cap_bytes=1e12, peak_tflops=1,
                    efficiency=1, h2d_bytes_per_s=bandwidth, d2h_bytes_per_s=bandwidth,
                    nvme_read_bytes_per_s=bandwidth / 2, nvme_write_bytes_per_s=bandwidth / 2,
                    nvme_capacity_bytes=1e12, cpu_memory_bytes=1e12, cpu_adam_params_per_s=1e15,
                    cpu_adam8_params_per_s=1e15)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)  # 1: the copy threads need the other core
    base = LlamaLM(SPEC)
    tokens = torch.randint(0, SPEC.vocab, (BATCH, SEQ))
    print(f"# bench_engine: {SPEC.num_layers} layers, hidden {SPEC.hidden}, batch {BATCH}x{SEQ - 1}, "
          f"{SPEC.total_params / 1e6:.1f}M params, torch {torch.__version__}, threads {torch.get_num_threads()}")

    # measure the workload once without emulation
    m = copy.deepcopy(base)
    ex = Executor(m, recompute_all(SPEC.num_layers))
    wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=BATCH * (SEQ - 1), warmup=2)
    ex.close()
    fwd = statistics.median(layer.fwd_seconds for layer in wl.layers)
    bandwidth = wl.layers[0].param_bytes / fwd  # a layer's fetch takes one forward
    print(f"measured: forward {fwd * 1e3:.1f} ms/layer, backward "
          f"{statistics.median(layer.bwd_seconds for layer in wl.layers) * 1e3:.1f} ms/layer, "
          f"weights {wl.layers[0].param_bytes / 1e6:.1f} MB/layer -> emulated link {bandwidth / 1e6:.0f} MB/s")
    hw = hardware_for(bandwidth)
    lo = simulate(recompute_all(SPEC.num_layers), wl, hw).peak_gpu_bytes
    hi = simulate(keep_all(SPEC.num_layers), wl, hw).peak_gpu_bytes
    plans = {}
    for frac in (0.5, 0.05):
        cap = lo + frac * (hi - lo)
        plans[f"milp plan @{cap / 1e6:.0f} MB"] = solve(wl, hw.replace(gpu_memory_cap_bytes=cap)).schedule
    links = {lane: LinkSpec(bw, 0.0) for lane, bw in (("h2d", bandwidth), ("d2h", bandwidth),
                                                       ("nvme_read", bandwidth / 2), ("nvme_write", bandwidth / 2))}
    print(f"device budgets between recompute_all {lo / 1e6:.0f} MB and keep_all {hi / 1e6:.0f} MB:")
    for name, plan in plans.items():
        print(f"  {name}: homes {plan.count_homes()}, kept {sum(plan.keep_internals)}, "
              f"resident {sum(plan.resident_weights)}, blocks {plan.recompute_blocks}")

    sections = sys.argv[2] if len(sys.argv) > 2 else "12345"
    if "1" in sections or "2" in sections:
        emulated_vs_predicted(base, tokens, wl, hw, plans, links)
    if "3" in sections:
        overhead(base, tokens)
    if "4" in sections:
        offloaded_internals(base, tokens, wl, lo, hi)
    if "5" in sections:
        nonblock_parts()


def emulated_vs_predicted(base, tokens, wl, hw, plans, links) -> None:
    print("\n## 1-2. emulated link: measured vs predicted, plan vs megatrain")
    measured = {}
    for name, schedule in [*plans.items(), ("megatrain K=4", megatrain(SPEC.num_layers, 4))]:
        predicted = simulate(schedule, wl, hw.replace(gpu_memory_cap_bytes=1e12)).iteration_seconds
        m = copy.deepcopy(base)
        ex = Executor(m, schedule, links=links)
        times = timed_steps(m, ex, tokens, torch.optim.SGD(m.parameters(), lr=1e-3))
        peak = ex.stats.peak_tracked_bytes
        ex.close()
        measured[name] = statistics.median(times)
        print(f"{name}: measured {measured[name]:.3f} s (steps {', '.join(f'{t:.3f}' for t in times)}), "
              f"predicted {predicted:.3f} s, measured/predicted {measured[name] / predicted:.3f}, "
              f"tracked peak {peak / 1e6:.0f} MB")
    for name in plans:
        print(f"measured megatrain / {name} = {measured['megatrain K=4'] / measured[name]:.3f}")


def overhead(base, tokens) -> None:
    print("\n## 3. no emulation, everything fits (keep_all): executor vs plain PyTorch")
    plain = copy.deepcopy(base)
    t_plain = timed_steps(plain, None, tokens, torch.optim.SGD(plain.parameters(), lr=1e-3), steps=STEPS + 2)
    m = copy.deepcopy(base)
    ex = Executor(m, keep_all(SPEC.num_layers))
    t_ex = timed_steps(m, ex, tokens, torch.optim.SGD(m.parameters(), lr=1e-3), steps=STEPS + 2)
    ex.close()
    a, b = statistics.median(t_plain), statistics.median(t_ex)
    print(f"plain {a:.3f} s, executor {b:.3f} s: overhead {b / a - 1:+.1%} (target <= +10%)")


def offloaded_internals(base, tokens, wl, lo, hi) -> None:
    # A link on which one layer's internals move in about one forward (the weights in a third of it).
    fwd = statistics.median(layer.fwd_seconds for layer in wl.layers)
    bandwidth = (wl.layers[0].internal_bytes - wl.boundary_bytes[0]) / fwd
    hw = hardware_for(bandwidth)
    links = {lane: LinkSpec(bandwidth, 0.0) for lane in ("h2d", "d2h")}
    print(f"\n## 4. offloaded internals: the MILP plan with and without the decision (emulated link "
          f"{bandwidth / 1e6:.0f} MB/s: a layer's internals, {(wl.layers[0].internal_bytes - wl.boundary_bytes[0]) / 1e6:.0f} MB, "
          f"in one forward)")
    for frac in (0.3, 0.05):
        cap = lo + frac * (hi - lo)
        row, plans = {}, {}
        for on in (False, True):
            res = solve(wl, hw.replace(gpu_memory_cap_bytes=cap), MilpOptions(offload_internals=on))
            plan = plans[on] = res.schedule
            predicted = simulate(plan, wl, hw.replace(gpu_memory_cap_bytes=1e12)).iteration_seconds
            m = copy.deepcopy(base)
            ex = Executor(m, plan, links=links)
            times = timed_steps(m, ex, tokens, torch.optim.SGD(m.parameters(), lr=1e-3))
            ex.close()
            moved = sum(w is not None for w in plan.internals_offload_window)
            row[on] = statistics.median(times)
            print(f"  cap {cap / 1e6:.0f} MB, offload_internals={on}: kept {sum(plan.keep_internals)}, internals moved "
                  f"{moved}, measured {row[on]:.3f} s, predicted {predicted:.3f} s, "
                  f"measured/predicted {row[on] / predicted:.3f}")
        if plans[True] == plans[False]:
            print(f"  cap {cap / 1e6:.0f} MB: the same plan either way (the decision does not pay here)")
        else:
            print(f"  cap {cap / 1e6:.0f} MB: measured speed-up of the decision {row[False] / row[True]:.3f}x")


VOCAB_SPEC = ModelSpec(name="bench-vocab", num_layers=2, hidden=512, intermediate=1408, heads=8, kv_heads=4,
                       head_dim=64, vocab=32768)


def nonblock_parts(steps: int = 14) -> None:
    spec = VOCAB_SPEC
    L = spec.num_layers
    torch.manual_seed(0)
    base = LlamaLM(spec)
    tokens = torch.randint(0, spec.vocab, (1, 129))
    schedule = dataclasses.replace(keep_all(L), optimizer="pipelined")
    layer_of = lambda n: "embed" if n.startswith("embed_tokens") else int(n.split(".")[1]) if n.startswith("layers.") else "head"  # noqa: E731
    order = ["embed", "head", *range(L)]

    def parts_of(m):
        return [list(m.embed_tokens.parameters()), [m.norm.weight, m.lm_head.weight]]

    # the host optimizer's speed, for the prediction: the median of three serial steps
    probe = copy.deepcopy(base)
    for p in probe.parameters():
        p.grad = torch.randn_like(p)
    opt = HybridAdamW(group_by_layer(probe.named_parameters(), layer_of, lr=1e-4))
    ts = []
    for _ in range(4):
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    adam_per_s = sum(p.numel() for p in probe.parameters()) / statistics.median(ts[1:])
    del probe, opt

    m = copy.deepcopy(base)
    ex = Executor(m, schedule)
    ex.set_rest_parts(parts_of(m))
    wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=tokens.numel(), warmup=2,
                          opt_params_per_s=adam_per_s)
    ex.close()
    # a link on which the non-block weights take about as long as the host update of them
    bandwidth = wl.nonblock_param_bytes * adam_per_s / wl.nonblock_params
    links = {lane: LinkSpec(bandwidth, 0.0) for lane in ("h2d", "d2h")}
    hw = hardware_for(bandwidth).replace(cpu_adam_params_per_s=adam_per_s, cpu_adam8_params_per_s=adam_per_s)
    print(f"\n## 5. non-block parts: {L} layers, vocab {spec.vocab} (non-block "
          f"{wl.nonblock_param_bytes / 1e6:.0f} MB in parts of {wl.nonblock_parts} elements), emulated link "
          f"{bandwidth / 1e6:.0f} MB/s, host AdamW {adam_per_s / 1e6:.0f} M params/s")
    row = {}
    for parts in (False, True):
        predicted = simulate(schedule, wl if parts else dataclasses.replace(wl, nonblock_parts=()), hw)
        m = copy.deepcopy(base)
        ex = Executor(m, schedule, links=links)
        if parts:
            ex.set_rest_parts(parts_of(m))
        opt = HybridAdamW(group_by_layer(m.named_parameters(), layer_of, lr=1e-4))
        pipe = None
        part_layers = [["embed"], ["head"]] if parts else [["embed", "head"]]

        def wait(j: int) -> None:
            for layer in (part_layers[-1 - j] if j < 0 else [j]):
                if pipe is not None:
                    pipe.wait_updated(layer)
        ex.set_wait_updated(wait)
        tails, t_end = [], 0.0
        for k in range(steps):
            ex.begin_microbatch()
            if k:  # T: from the end of the backward to every fetch of the next step done (F0 may start)
                ex.engine.synchronize()
                tails.append(time.perf_counter() - t_end)
            m.loss(tokens).backward()
            t_end = time.perf_counter()
            ex.end_microbatch()
            pipe = opt.step_pipelined(order)
            opt.zero_grad()
        pipe.wait_all()
        ex.close()
        tails = tails[1:]  # the first tail warms up the optimizer states
        row[parts] = statistics.median(tails)
        predicted_t = predicted.window_seconds["T"]
        print(f"  parts={'2' if parts else '1'}: step tail (T) measured {row[parts] * 1e3:.1f} ms (median of "
              f"{len(tails)}; min {min(tails) * 1e3:.1f}, max {max(tails) * 1e3:.1f}), predicted "
              f"{predicted_t * 1e3:.1f} ms, measured/predicted {row[parts] / predicted_t:.3f}")
    print(f"  T with one part / T with two parts: measured {row[False] / row[True]:.3f}x, predicted "
          f"{simulate(schedule, dataclasses.replace(wl, nonblock_parts=()), hw).window_seconds['T'] / simulate(schedule, wl, hw).window_seconds['T']:.3f}x")


if __name__ == "__main__":
    main()
