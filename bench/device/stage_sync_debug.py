"""Stage (c3): how many implicit host-device synchronisations one executor step makes.

``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA call inside torch ops
(``.item()``, ``.cpu()`` of a device tensor, pageable copies, ``nonzero``...) emit a warning;
explicit waits (events, ``torch.cuda.synchronize``) are not counted. One warm-up step, then one
step per schedule under the mode, warnings counted by source line. The figure is reported, not
judged: a sync inside the step stalls the copy pipeline, so a growing count is a regression to
look at. Plain autograd's step (with its ``loss.item()``) is counted for comparison.
"""

from __future__ import annotations

import argparse
import collections
import copy
import warnings

import torch

from kit import Stage, StageSkipped, fixed_schedules, make_batches, stage_main, tiny_model, tiny_spec


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--schedules", default="megatrain_K2,cpu_homes,nvme_homes,kept_internals_resident")


def count_syncs(fn) -> tuple[int, dict[str, int]]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = collections.Counter(f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in syncs)
    return len(syncs), dict(where.most_common(10))


def body(st: Stage, args: argparse.Namespace) -> None:
    if args.device != "cuda":
        raise StageSkipped("needs CUDA: set_sync_debug_mode watches CUDA synchronisations")
    from lightning_lazytrain.engine.executor import Executor

    model = tiny_model()
    (step,) = make_batches(tiny_spec(), 1, 2)
    tokens = [t.cuda() for t in step]
    results = {}

    def executor_step(ex, m):
        for k, t in enumerate(tokens):
            ex.begin_microbatch(first=k == 0, last=k == len(tokens) - 1)
            m.loss(t).backward()
            ex.end_microbatch()

    schedules = fixed_schedules()
    for name in [s for s in args.schedules.split(",") if s]:
        m = copy.deepcopy(model)
        ex = Executor(m, schedules[name], device="cuda", nvme_dir=args.workdir)
        try:
            executor_step(ex, m)  # warm-up: allocations, pinned pools, spill files
            n, where = count_syncs(lambda: executor_step(ex, m))
        finally:
            ex.close()
        results[name] = {"syncs_per_step": n, "where": where}
        print(f"{name:<26} {n} implicit syncs per step  {where}", flush=True)

    plain = copy.deepcopy(model).cuda()

    def plain_step():
        for t in tokens:
            loss = plain.loss(t)
            loss.backward()
            loss.item()

    plain_step()
    n, where = count_syncs(plain_step)
    results["plain_autograd_with_item"] = {"syncs_per_step": n, "where": where}
    st.figures["schedules"] = results


if __name__ == "__main__":
    raise SystemExit(stage_main("sync_debug", body, add_args))
