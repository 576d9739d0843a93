"""CPU benchmark: HybridAdamW vs torch AdamW + clip_grad_norm_ vs bitsandbytes AdamW8bit + clip.

For each model size (a synthetic Llama-shaped parameter set, fp32) it measures per optimizer
variant:

* step time -- the fastest of the timed steps, median beside it -- split into the separate clip
  call (``clip_grad_norm_``) and the update (for HybridAdamW the update includes the norm pass and
  the fused clip);
* optimizer-state bytes per parameter, measured from the state tensors (shared maps counted once);
* both as ratios to ``torch.optim.AdamW`` + ``clip_grad_norm_`` measured in the same run.

Memory: variants run in *sets*; a set's optimizers are built, stepped and freed before the next
set, so 1B parameters fit in 24 GiB (4 GB params + 4 GB grads + at most 8 GB states + temporaries).
Within a set the variants' steps are interleaved (A, B, C, A, B, C, ...), so load from other
processes on a shared machine hits them alike; the fastest step is the least disturbed estimate.

Clipping is active on every clipping step: before each step the gradients are rescaled (untimed)
to their initial norm ``n0`` and ``max_norm = n0 / 2`` (clip factor 0.5). The clip cost is shown
before (torch: ``clip_grad_norm_`` = norm pass + rescale pass, also timed apart) and after
(HybridAdamW: update with fast clip minus the same optimizer's update without clipping; and with
per-layer squared norms handed over, as the executor does while gradients arrive).

    python bench/bench_optim.py --sizes 100M,1B --threads 1 --json optim_bench.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from lightning_lazytrain.optim import HybridAdamW, group_by_layer

SIZES: dict[str, tuple[int, int, int]] = {  # name -> (hidden, layers, vocab)
    "100M": (768, 12, 32000),  # 109.5M parameters
    "1B": (2048, 19, 32000),  # 1.022B parameters
}
BASELINE = "torch AdamW + clip_grad_norm_"
LR, WD = 1e-4, 0.01

Params = list[tuple[str, torch.nn.Parameter]]


@dataclass(kw_only=True, slots=True, frozen=True)
class Spec:
    row: str
    opt: str  # key of the optimizer factory within the set
    clip: str  # "none" | "torch" (clip_grad_norm_ call) | "fused" | "handed"
    notes: str = ""


@dataclass(kw_only=True, slots=True)
class Row:
    variant: str
    clip_s: float
    step_s: float
    clip_median_s: float
    step_median_s: float
    total_s: float
    state_bytes: int
    bytes_per_param: float
    timed_steps: int
    notes: str


def make_params(hidden: int, layers: int, vocab: int) -> Params:
    """Llama-like shapes (no biases): embedding, per layer qkv/o/up/down + 2 norms, final norm."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (vocab, hidden))]
    for i in range(layers):
        shapes += [
            (f"layers.{i}.attn_norm.weight", (hidden,)),
            (f"layers.{i}.attn.qkv.weight", (3 * hidden, hidden)),
            (f"layers.{i}.attn.o.weight", (hidden, hidden)),
            (f"layers.{i}.mlp_norm.weight", (hidden,)),
            (f"layers.{i}.mlp.up.weight", (4 * hidden, hidden)),
            (f"layers.{i}.mlp.down.weight", (hidden, 4 * hidden)),
        ]
    shapes.append(("final_norm.weight", (hidden,)))
    out = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape).uniform_(-0.02, 0.02))
        p.grad = torch.empty(shape).uniform_(-1e-3, 1e-3)
        out.append((name, p))
    return out


def layer_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if parts[0] == "layers" else parts[0]


def state_nbytes(opt: torch.optim.Optimizer) -> int:
    seen: set[int] = set()
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                ptr = v.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    total += v.untyped_storage().nbytes()
    return total


def grads_of(params: Params) -> list[torch.Tensor]:
    return [p.grad for _, p in params]  # type: ignore[misc]


def grad_norm(params: Params) -> float:
    return torch.nn.utils.get_total_norm(grads_of(params)).item()


def factories(params: Params) -> dict[str, Callable[[], torch.optim.Optimizer]]:
    plist = [p for _, p in params]

    def groups() -> list[dict[str, object]]:
        return group_by_layer(params, layer_of)

    def bnb_adamw8bit() -> torch.optim.Optimizer:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(plist, lr=LR, weight_decay=WD)

    return {
        "torch": lambda: torch.optim.AdamW(plist, lr=LR, weight_decay=WD),
        "torch_fused": lambda: torch.optim.AdamW(plist, lr=LR, weight_decay=WD, fused=True),
        "hybrid_none": lambda: HybridAdamW(groups(), lr=LR, weight_decay=WD),
        "hybrid_2pct": lambda: HybridAdamW(groups(), lr=LR, weight_decay=WD, eight_bit=0.02),
        "hybrid_all": lambda: HybridAdamW(groups(), lr=LR, weight_decay=WD, eight_bit="all"),
        "bnb": bnb_adamw8bit,
    }


SETS: list[list[Spec]] = [
    [Spec(row=BASELINE, opt="torch", clip="torch", notes="default CPU implementation (single-tensor)")],
    [Spec(row="torch AdamW fused + clip_grad_norm_", opt="torch_fused", clip="torch", notes="fused=True")],
    [
        Spec(row="HybridAdamW none, no clip", opt="hybrid_none", clip="none",
             notes="pure update: reference for the clip cost"),
        Spec(row="HybridAdamW none, fast clip", opt="hybrid_none", clip="fused",
             notes="foreach norm pass + clip fused into the update"),
        Spec(row="HybridAdamW none, handed-over norms", opt="hybrid_none", clip="handed",
             notes="per-layer squared norms from the executor"),
    ],
    [Spec(row="HybridAdamW 2% 8-bit, fast clip", opt="hybrid_2pct", clip="fused")],
    [
        Spec(row="HybridAdamW all 8-bit, fast clip", opt="hybrid_all", clip="fused"),
        Spec(row="bnb AdamW8bit + clip_grad_norm_", opt="bnb", clip="torch", notes="bitsandbytes.optim.AdamW8bit"),
    ],
]


def run_set(params: Params, specs: list[Spec], *, steps: int, warmup: int, norm0: float) -> list[Row]:
    """Build the set's optimizers, interleave their steps, measure, free them."""
    gc.collect()
    make = factories(params)
    opts = {key: make[key]() for key in dict.fromkeys(s.opt for s in specs)}
    plist = [p for _, p in params]
    max_norm = 0.5 * norm0
    times: dict[str, tuple[list[float], list[float]]] = {s.row: ([], []) for s in specs}
    for i in range(warmup + steps):
        for spec in specs:
            # Untimed: same gradient scale for every step (earlier clips scaled .grad in place).
            torch._foreach_mul_(grads_of(params), norm0 / grad_norm(params))
            opt = opts[spec.opt]
            if isinstance(opt, HybridAdamW):
                opt.max_grad_norm = None if spec.clip == "none" else max_norm
                opt.skip_nonfinite = spec.clip != "none"
                if spec.clip == "handed":
                    # What the executor computes as each layer's gradients arrive (outside the step).
                    sq: dict[str, torch.Tensor] = {}
                    for n, p in params:
                        sq[layer_of(n)] = sq.get(layer_of(n), torch.zeros(())) + p.grad.pow(2).sum()  # type: ignore[union-attr]
                    opt.set_grad_sq_norms(sq)
            t0 = time.perf_counter()
            if spec.clip == "torch":
                torch.nn.utils.clip_grad_norm_(plist, max_norm)
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if isinstance(opt, HybridAdamW) and spec.clip != "none":
                assert opt.last_grad_norm > 1.5 * max_norm, "clipping must be active"
            if i >= warmup:  # warm-up: lazy state allocation, first touch of fresh pages
                times[spec.row][0].append(t1 - t0)
                times[spec.row][1].append(t2 - t1)
    n = sum(p.numel() for p in plist)
    rows = []
    for spec in specs:
        clip_t, step_t = times[spec.row]
        nbytes = state_nbytes(opts[spec.opt])
        row = Row(
            variant=spec.row,
            clip_s=min(clip_t),
            step_s=min(step_t),
            clip_median_s=statistics.median(clip_t),
            step_median_s=statistics.median(step_t),
            total_s=min(c + s for c, s in zip(clip_t, step_t)),
            state_bytes=nbytes,
            bytes_per_param=nbytes / n,
            timed_steps=steps,
            notes=spec.notes,
        )
        rows.append(row)
        print(
            f"  {row.variant:<36} clip {row.clip_s:7.3f}s (median {row.clip_median_s:.3f})  step {row.step_s:8.3f}s "
            f"(median {row.step_median_s:.3f})  state {row.bytes_per_param:6.3f} B/param",
            flush=True,
        )
    del opts
    gc.collect()
    return rows


def time_norm_and_rescale(params: Params, *, steps: int, warmup: int) -> tuple[float, float]:
    """clip_grad_norm_'s two passes timed apart (fastest of ``steps``): norm pass, rescale pass."""
    norm_t, scale_t = [], []
    grads = grads_of(params)
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        total = torch.nn.utils.get_total_norm(grads)
        t1 = time.perf_counter()
        torch.nn.utils.clip_grads_with_norm_([p for _, p in params], 0.5 * total.item(), total)
        t2 = time.perf_counter()
        norm_t.append(t1 - t0)
        scale_t.append(t2 - t1)
        torch._foreach_mul_(grads, 2.0)
    return min(norm_t[warmup:]), min(scale_t[warmup:])


def bench_size(size: str, *, steps: int, warmup: int, only: set[str] | None) -> dict[str, object]:
    hidden, layers, vocab = SIZES[size]
    t0 = time.perf_counter()
    params = make_params(hidden, layers, vocab)
    n = sum(p.numel() for _, p in params)
    norm0 = grad_norm(params)
    print(f"\n== {size}: {n / 1e6:.1f}M parameters in {len(params)} tensors (setup {time.perf_counter() - t0:.1f}s)", flush=True)
    rows: list[Row] = []
    for specs in SETS:
        specs = [s for s in specs if not only or any(o in s.row for o in only)]
        if specs:
            rows += run_set(params, specs, steps=steps, warmup=warmup, norm0=norm0)
    norm_s, rescale_s = time_norm_and_rescale(params, steps=steps, warmup=warmup)
    print(f"  clip_grad_norm_ split: norm pass {norm_s:.3f}s, rescale pass {rescale_s:.3f}s", flush=True)
    del params
    gc.collect()
    return {"size": size, "n_params": n, "rows": [asdict(r) for r in rows], "norm_pass_s": norm_s, "rescale_pass_s": rescale_s}


def markdown(result: dict[str, object]) -> str:
    rows: list[dict[str, object]] = result["rows"]  # type: ignore[assignment]
    by = {r["variant"]: r for r in rows}
    base = by.get(BASELINE)
    if base is None:
        return "(baseline not run: no ratios)"
    lines = [
        f"**{result['size']}** ({result['n_params'] / 1e6:.1f}M fp32 parameters)",  # type: ignore[operator]
        "",
        "| variant | clip call (s) | update (s) | step total (s) | time vs torch AdamW + clip "
        "| state B/param | state vs torch AdamW |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['clip_s']:.3f} | {r['step_s']:.3f} | {r['total_s']:.3f} | "
            f"{r['total_s'] / base['total_s']:.2f}x | {r['bytes_per_param']:.3f} | "  # type: ignore[operator]
            f"{r['state_bytes'] / base['state_bytes']:.3f}x |"  # type: ignore[operator]
        )
    lines += [
        "",
        f"Clip cost before (torch `clip_grad_norm_`, fastest call): {base['clip_s']:.3f} s; timed apart: norm pass "
        f"{result['norm_pass_s']:.3f} s + rescale pass {result['rescale_pass_s']:.3f} s.",
    ]
    pure = by.get("HybridAdamW none, no clip")
    if pure:
        for row, label in (("HybridAdamW none, fast clip", "fast clip (norm pass, factor fused)"),
                           ("HybridAdamW none, handed-over norms", "per-layer norms handed over")):
            if row in by:
                extra = by[row]["step_s"] - pure["step_s"]  # type: ignore[operator]
                lines.append(f"Clip cost after, {label}: {extra:+.3f} s over the no-clip update.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--sizes", default="100M,1B")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per variant (default: 7 at 100M, 3 at 1B)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps per variant (default: 2 at 100M, 1 at 1B)")
    ap.add_argument("--only", default="", help="comma-separated substrings of variant names to run")
    ap.add_argument("--json", default="", help="write raw results here")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (default: torch's). 1 is the stable choice on a shared box: with 2 "
                         "threads every parallel op waits for whichever thread another process has descheduled")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import bitsandbytes

    env = {
        "date": _dt.date.today().isoformat(),
        "torch": torch.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(env), flush=True)
    only = {v for v in args.only.split(",") if v} or None
    results = []
    for size in args.sizes.split(","):
        steps = args.steps or (7 if size != "1B" else 3)
        warmup = args.warmup or (2 if size != "1B" else 1)
        results.append(bench_size(size, steps=steps, warmup=warmup, only=only))
        print()
        print(markdown(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"env": env, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
