"""Several processes on CPU (gloo): the overlapped gradient all-reduce against the serial one, measured
and predicted (Note: [overlapped all-reduce] in lightning_lazytrain/core/grad_sync.py).

    python bench/bench_distributed.py          # ~3 minutes on a 2-core machine

Two ranks (Lightning's launcher, ``accelerator="cpu", devices=2``), a Llama-style model whose
gradients are large next to its compute (hidden 512, 4 layers, vocabulary 8192, batch 1 x 64 per rank),
SGD with momentum, the MILP plan. Each configuration runs in its own processes: ``overlap_grad_sync=True``
(each group's host gradients averaged on a collective thread as soon as the backward finished them; the
plan is made for the planner's ``replicate_overlap`` mode), ``False`` (every group after the backward:
``replicate``), and ``data_parallel="shard"`` (each rank holds half of every group's host state; the plan
is the ``shard`` mode's) with each block's all-gather overlapping the previous block's compute and its
reduce-scatter off the launching thread (``shard``), or both in line (``shard_in_line``:
``overlap_grad_sync=False``). Also per rank: the host
bytes of the parameter store (masters, staging, gradients) and of the optimizer's states. Per configuration: the median step time of rank 0 over the steps after the planned one,
and the plan's prediction (the rank's measured workload with every group's all-reduce at the bandwidth
the profiled step's all-reduces achieved). Both ranks share the machine's two cores, so compute, copy
threads and the collective thread compete: a lower bound of what the overlap gives on real devices.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

STEPS = 20


def run(overlap: bool, out: str, mode: str = "replicate") -> None:
    import lightning as L
    import torch

    from lightning_lazytrain.models import LlamaLM
    from lightning_lazytrain.planner import ModelSpec
    from lightning_lazytrain.strategy import LazyTrainStrategy

    torch.set_num_threads(1)
    spec = ModelSpec(name="bench-dist", num_layers=4, hidden=512, intermediate=1408, heads=8, kv_heads=4,
                     head_dim=64, vocab=8192)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaLM(spec)

        def training_step(self, batch, batch_idx):
            return self.model.loss(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)  # a state per element

    class Times(L.Callback):
        reads_gradients_only = True  # times and sizes, reads no weight: the step may stay pipelined

        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_start(self, trainer, *args):
            self.marks.append(time.perf_counter())

        def on_train_batch_end(self, trainer, *args):
            st = trainer.strategy  # what the run planned (gone after teardown)
            if st.plan is not None:
                self.plan = st.plan.result
                self.bandwidth = st.grad_sync.bytes_per_s() if st.grad_sync is not None else None
            params = st.executor.params
            self.host_bytes = params.host_pinned_bytes + params.host_grad_bytes  # masters, staging, grads
            self.opt_bytes = sum(t.nbytes for state in trainer.optimizers[0].state.values()
                                 for t in state.values() if isinstance(t, torch.Tensor))

    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, spec.vocab, (2 * STEPS, 65), generator=g)
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    times = Times()
    strategy = LazyTrainStrategy(policy="milp", overlap_grad_sync=overlap, timeout=timedelta(seconds=120),
                                 data_parallel=mode)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[times])
    trainer.fit(Net(), train_dataloaders=loader)
    if trainer.is_global_zero:
        steps = [b - a for a, b in zip(times.marks[2:], times.marks[3:])]  # after the profiled step and one more
        from dataclasses import replace

        from lightning_lazytrain.planner import simulate

        plan = times.plan
        # both modes predicted from this run's plan (one workload, one all-reduce bandwidth)
        both = ({m: simulate(plan.schedule.in_mode(m), replace(plan.workload, data_parallel=m),
                             plan.hardware, check=False).iteration_seconds
                 for m in ("replicate", "replicate_overlap")} if mode == "replicate" else {})
        Path(out).write_text(json.dumps({
            "both": both,
            "steps": steps, "predicted": plan.sim.iteration_seconds, "mode": plan.workload.data_parallel,
            "allreduce_gb_per_s": times.bandwidth / 1e9 if times.bandwidth else None,
            "params": sum(p.numel() for p in trainer.lightning_module.parameters()),
            "host_bytes": times.host_bytes, "opt_bytes": times.opt_bytes}))


def main() -> None:
    t0 = time.time()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, (overlap, mode) in {"serial": (False, "replicate"), "overlap": (True, "replicate"),
                                     "shard_in_line": (False, "shard"), "shard": (True, "shard")}.items():
            out = os.path.join(tmp, f"{key}.json")
            proc = subprocess.run([sys.executable, __file__, "--run", str(int(overlap)), out, mode], capture_output=True,
                                  text=True, timeout=900)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                raise SystemExit(f"{key}: exit {proc.returncode}")
            rows[key] = json.loads(Path(out).read_text())
    r = rows["overlap"]
    print(f"# bench_distributed: 2 ranks (gloo, CPU), {r['params'] / 1e6:.1f}M parameters, batch 1 x 64 per rank, "
          f"{len(r['steps'])} timed steps each, SGD with momentum")
    print("configuration | planned mode | measured s/step (median; min-max) | predicted s | measured/predicted | "
          "host MB per rank (masters, staging, grads; + optimizer states)")
    med = {}
    for key, r in rows.items():
        med[key] = statistics.median(r["steps"])
        print(f"{key} | {r['mode']} | {med[key]:.3f} ({min(r['steps']):.3f}-{max(r['steps']):.3f}) | "
              f"{r['predicted']:.3f} | {med[key] / r['predicted']:.3f} | {r['host_bytes'] / 1e6:.1f} + "
              f"{r['opt_bytes'] / 1e6:.1f}")
    both = rows["serial"]["both"], rows["overlap"]["both"]
    predicted = ", ".join(f"{b['replicate'] / b['replicate_overlap']:.3f}x" for b in both)
    print(f"measured speed-up of the overlap: {med['serial'] / med['overlap']:.3f}x; predicted from one run's "
          f"workload and bandwidth: {predicted}")
    print(f"shard: overlapped all-gathers and reduce-scatters vs in line {med['shard_in_line'] / med['shard']:.3f}x")
    print(f"shard / overlapped replicate: step time {med['shard'] / med['overlap']:.3f}x, host state per rank "
          f"{(rows['shard']['host_bytes'] + rows['shard']['opt_bytes']) / (rows['overlap']['host_bytes'] + rows['overlap']['opt_bytes']):.3f}x"
          f"  ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        run(bool(int(sys.argv[2])), sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "replicate")
    else:
        main()
