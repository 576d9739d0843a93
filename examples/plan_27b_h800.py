"""Plan the LazyTrain paper's main run from Python: Qwen3.6-27B on one H800 (80 GB, PCIe 12 GB/s measured),
micro-batch 72 x 1024 tokens, bf16, and compare the MILP plan with MegaTrain and the other baselines.
Nothing is trained and no GPU is needed: the planner is pure Python (a few seconds on a laptop CPU).

    python examples/plan_27b_h800.py
    python examples/plan_27b_h800.py --batch 48 --time-limit 10
    python examples/plan_27b_h800.py --model qwen2.5-7b --hardware rtx3090 --batch 8

The command-line equivalent is ``lazytrain-plan hardware=h800 model=qwen3.6-27b train.micro_batch_size=72``.
"""

from __future__ import annotations

import argparse

from omegaconf import OmegaConf

from lightning_lazytrain.config import CONF_DIR, load_hardware, to_model, to_train
from lightning_lazytrain.planner import MilpOptions, SimResult, make_plan
from lightning_lazytrain.planner.report import format_table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Plan a LazyTrain run from Python and print the comparison table.")
    p.add_argument("--model", default="qwen3.6-27b", help="conf/model/<name>.yaml")
    p.add_argument("--hardware", default="h800", help="conf/hardware/<name>.yaml")
    p.add_argument("--batch", type=int, default=72, help="micro-batch size (the paper's 27B/H800 batch: 72)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit, seconds")
    args = p.parse_args(argv)

    # The same YAML files lazytrain-plan composes; to_* turn them into the planner's validated types.
    model = to_model(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml"))
    hardware = load_hardware(args.hardware)
    train = to_train(OmegaConf.load(CONF_DIR / "train" / "default.yaml"), micro_batch_size=args.batch)
    train = train.replace(seq_len=args.seq_len)

    plan = make_plan(model, train, hardware, policy="milp", options=MilpOptions(time_limit=args.time_limit))

    print(f"{model.name} ({model.total_params / 1e9:.2f}B params) on {hardware.name}: micro-batch "
          f"{train.micro_batch_size} x {train.seq_len} tokens, {train.dtype}")
    print(f"solver: {plan.solver.get('name')} status {plan.status}, solve {plan.solver.get('solve_seconds', 0):.2f} s")
    print(format_table(plan.rows()))
    mega = plan.baselines.get("megatrain")
    if isinstance(mega, SimResult):
        print(f"speedup over megatrain: {plan.sim.tokens_per_second / mega.tokens_per_second:.3f}x tokens/s "
              f"(predicted, same simulator)")
    else:
        print(f"megatrain does not fit: {mega}")
    homes = plan.schedule.count_homes()
    print("boundary homes (gpu/cpu/nvme/recompute): "
          + "/".join(str(homes.get(h, 0)) for h in ("gpu", "cpu", "nvme", "recompute")))


if __name__ == "__main__":
    main()
