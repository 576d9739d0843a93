"""The analytic memory model against real layers, and what it implies.

    python bench/bench_memory_model.py       # ~20 s on a 2-core machine (CPU only, no download)

1. Per HF layer family, dtype and attention implementation: planner / measured for saved bytes and
   the forward and backward working sets (the measurement of tests/test_memory_model_hf.py).
2. 27B / H800 / batch 72: the per-layer figures and the head's.
3. RTX 3090 largest micro-batch with the chunked loss the engine runs, and with an unchunked
   Hugging Face-style cross-entropy instead (12 bytes per logit at the peak, measured below:
   bf16 logits, their fp32 copy, log-softmax output and its gradient) - the papers' executors.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_memory_model_hf import CASES, DTYPES, SHAPES, _hf_layer, measure  # noqa: E402

from lightning_lazytrain.config import load_hardware, load_model  # noqa: E402
from lightning_lazytrain.engine.live_bytes import LiveBytes  # noqa: E402
from lightning_lazytrain.planner import TrainSpec, block_cost, megatrain  # noqa: E402
import lightning_lazytrain.planner.workload as workload  # noqa: E402
from lightning_lazytrain.planner.hf import model_spec_from_hf  # noqa: E402
from lightning_lazytrain.planner.plan import largest_batch, largest_batch_for  # noqa: E402


def unchunked_ce_bytes_per_logit() -> float:
    n, v, h = 256, 4096, 64
    hidden = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.bfloat16, requires_grad=True)
    weight.grad = torch.zeros_like(weight)
    targets = torch.randint(0, v, (n,))
    with LiveBytes() as live:
        logits = hidden @ weight.t()
        loss = F.cross_entropy(logits.float(), targets)
        del logits
        loss.backward()
    return (live.peak - n * h * 2) / (n * v)  # less d(hidden)


def main() -> int:
    print("## 1. planner / measured, one decoder layer on CPU (saved bytes incl. input; forward; backward work)")
    print("family | dtype | attention | shape | saved | forward work | backward work")
    for case in CASES:
        family, dtype, attn, shape = case.values
        batch, seq = SHAPES[shape]
        config, layer, x, args, kwargs = _hf_layer(family, DTYPES[dtype], attn, batch, seq)
        got = measure(layer, x, args, kwargs)
        cost = block_cost(model_spec_from_hf(config, attn_implementation=attn),
                          TrainSpec(micro_batch_size=batch, seq_len=seq, dtype=dtype))
        print(f"{family} | {dtype} | {attn} | {shape} | {cost.internal_bytes / got['internal']:.3f} | "
              f"{cost.fwd_work_bytes / got['fwd']:.3f} | {cost.bwd_work_bytes / got['bwd']:.3f}")

    print("\n## 2. 27B / H800 / batch 72 / seq 1024, bf16, per layer")
    m27, t27 = load_model("qwen3.6-27b"), TrainSpec(micro_batch_size=72, seq_len=1024)
    cost = block_cost(m27, t27)
    wl = workload.Workload.analytic(m27, t27, load_hardware("h800"))
    print(f"boundary {cost.boundary_bytes / 1e9:.2f} GB, saved internals {cost.internal_bytes / 1e9:.2f} GB, "
          f"forward work {cost.fwd_work_bytes / 1e9:.2f} GB, backward work {cost.bwd_work_bytes / 1e9:.2f} GB, "
          f"head window {wl.head_work_bytes / 1e9:.2f} GB, B0 with the embedding's backward "
          f"{wl.layers[0].bwd_work_bytes / 1e9:.2f} GB")

    per_logit = unchunked_ce_bytes_per_logit()
    print(f"\n## 3. RTX 3090 largest micro-batch: chunked loss vs an unchunked HF-style cross-entropy "
          f"({per_logit:.1f} B per logit measured)")
    spec = importlib.util.spec_from_file_location("bench_planner", REPO / "bench" / "bench_planner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    chunked = workload.loss_head_bytes
    print("model | megatrain / plan, chunked (ours) | megatrain / plan, unchunked CE | paper megatrain / lazytrain")
    for name in bench.MODELS:
        hw, model, train = bench.load("rtx3090", name)
        row = []
        for head in (chunked, lambda m, t: per_logit * t.tokens * m.vocab + chunked(m, t.replace(loss_chunk_tokens=1))):
            workload.loss_head_bytes = head
            try:
                row.append((largest_batch_for(lambda L: megatrain(L, 4), model, train, hw),
                            largest_batch(model, train, hw)))
            finally:
                workload.loss_head_bytes = chunked
        pm, pl = bench.PAPER_3090_BATCH[name]
        print(f"{name} | {row[0][0]} / {row[0][1]} | {row[1][0]} / {row[1][1]} | {pm} / {pl}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")
    raise SystemExit(code)
