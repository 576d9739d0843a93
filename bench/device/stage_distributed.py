"""Stage (h): the several-devices path on one device — an NCCL default group (gloo in a CPU
rehearsal) of world size 1, the strategy's own gloo group for host tensors (``core/grad_sync.GradSync``)
and the overlapped all-reduce thread (Note: [overlapped all-reduce]) next to the CUDA executor.

A tiny Llama trains ``--steps`` optimizer steps of ``--micro`` micro-batches through the executor
with ``GradSync`` attached (every group handed to the collective thread as its step's last
accumulation lands, averaged over the one rank, its norms taken again), and the same without it.
With one rank the average is the identity, so every loss, gradient and parameter must be bitwise
equal; every group must have been averaged on the thread (``GradSync.overlapped``), and no byte
counted on the collective lane (one rank moves none). The sharded mode's store
(``Executor(shard_group="world")``: all-gather per fetch, reduce-scatter per gradient copy, on the
default group) must train bitwise as the plain one, with fp32 and bf16 compute copies. Also checks that NCCL moves a CUDA tensor
(a broadcast and an all-reduce on the default group). What it cannot show: several GPUs.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist

from kit import Stage, compare, fixed_schedules, make_batches, run_executor, stage_main, strict_fp32, tiny_model, tiny_spec


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--schedules", default="megatrain_K2,offloaded_internals")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_synced(model, schedule, batches, device: str, workdir, sync) -> tuple:
    """``kit.run_executor`` with ``sync`` attached and averaging each step's grads (as the strategy
    does); also returns, per step, the groups averaged on the collective thread and the bytes moved."""
    overlapped, moved = [], []

    def attach(ex):
        sync.attach(ex.params)
        sync.set_late_grads_probe(lambda: ex.late_grads)
        return lambda: sync.detach(ex.params)

    def average(ex, stats):
        moved.append(sync.average_grads(ex.params, stats.grad_norms, stats.layer_sq_norms))
        overlapped.append(sorted(sync.overlapped))

    r = run_executor(model, schedule, batches, device, workdir, on_executor=attach, on_stats=average)
    return r, overlapped, moved


def body(st: Stage, args: argparse.Namespace) -> None:
    dev = args.device
    strict_fp32()
    backend = "nccl" if dev == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        st.figures["backend"] = dist.get_backend()
        x = torch.arange(4.0, device=dev)
        dist.broadcast(x, src=0)
        dist.all_reduce(x)
        st.check(torch.equal(x.cpu(), torch.arange(4.0)), f"{backend} broadcast/all-reduce changed a tensor: {x}")

        from lightning_lazytrain.core.grad_sync import GradSync

        sync = GradSync()
        model = tiny_model()
        batches = make_batches(tiny_spec(), args.steps, args.micro)
        schedules = fixed_schedules()
        layers = tiny_spec().num_layers
        for name in [s for s in args.schedules.split(",") if s]:
            want = run_executor(model, schedules[name], batches, dev, args.workdir)
            got, overlapped, moved = run_synced(model, schedules[name], batches, dev, args.workdir, sync)
            worst, problems = compare(got, want, exact=True, tol=0.0)
            for p in problems:
                st.fail(f"{name}: {p}")
            st.check(overlapped == [list(range(-1, layers))] * args.steps,
                     f"{name}: groups averaged on the collective thread per step {overlapped}")
            st.check(all(b == 0 for b in moved), f"{name}: one rank counted collective bytes {moved}")
            st.figures[name] = {"max_rel_err": worst, "overlapped_per_step": len(overlapped[0]) if overlapped else 0}
            # the sharded mode's store (engine/shard_store.py) on one rank: every block's fetch an
            # all-gather, its gradients a reduce-scatter in the masters' dtype (fp32 landing buffers):
            # with one rank the identity, so bitwise equal, in fp32 and with bf16 compute copies
            for dtype in (torch.float32, torch.bfloat16):
                plain = want if dtype == torch.float32 else run_executor(model, schedules[name], batches, dev,
                                                                         args.workdir, compute_dtype=dtype)
                sharded = run_executor(model, schedules[name], batches, dev, args.workdir, compute_dtype=dtype,
                                       shard_group="world")
                worst, problems = compare(sharded, plain, exact=True, tol=0.0)
                for p in problems:
                    st.fail(f"{name} sharded ({dtype}): {p}")
                st.figures[f"{name}_sharded_{str(dtype).split('.')[-1]}"] = {"max_rel_err": worst}
        sync.close()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(stage_main("distributed", body, add_args))
