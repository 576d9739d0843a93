"""The lazytrain-plan app: in-process (hydra.compose + plan_job) and as a subprocess (exit codes, multirun CSV).

Small inputs only (the tiny model on the cpu profile, short solver time limits) so the file runs in well
under a minute on 2 cores.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_lazytrain.cli.plan import ROW_FILE, plan_job
from lightning_lazytrain.config import CONF_DIR
from lightning_lazytrain.planner import InfeasibleBudget, PlannerError
from lightning_lazytrain.planner.simulator import Segment
from lightning_lazytrain.planner.units import format_bytes
from lightning_lazytrain.planner.report import format_table, plot_timeline, write_sweep_csv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["hardware=cpu", "model=tiny", "train=cpu", "plan.time_limit=10"]


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="plan", overrides=list(overrides))


def run_cli(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "lightning_lazytrain.cli.plan", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---- in-process -------------------------------------------------------------------------------------
def test_plan_job_writes_plan_json_and_timeline(tmp_path, capsys):
    cfg = compose_cfg(*SMALL)
    row = plan_job(cfg, tmp_path)
    printed = capsys.readouterr().out
    for name in ("plan (milp)", "megatrain", "keep_all", "recompute_all", "tokens/s", "TFLOPS",
                 "peak GPU [GB]", "exposed [s]", "boundaries g/c/n/r", "re-runs", "iter [s]"):
        assert name in printed
    # the legend under the table explains the columns (and where the figures come from)
    legend = " ".join(line.strip() for line in printed.splitlines() if line.startswith("  "))
    for text in ("exposed [s]: window time not covered by compute", "boundaries g/c/n/r: the 5 boundary activations",
                 "re-runs: extra layer forwards per micro-batch", "1 GB = 1e9 bytes", "tokens/s: ",
                 "predicted from the model's shapes and the cpu hardware profile"):
        assert text in legend, legend

    data = json.loads((tmp_path / "plan.json").read_text())
    assert {"status", "solver", "schedule", "predicted", "baselines", "config", "micro_batch"} <= set(data)
    assert data["status"] in ("optimal", "time_limit", "fallback")
    assert {"name", "version", "mip_gap", "build_seconds", "solve_seconds"} <= set(data["solver"])
    assert data["solver"]["name"] == "highs"
    pred = data["predicted"]
    for key in ("iteration_seconds", "tokens_per_second", "tflops", "peak_gpu_bytes", "exposed_transfer_seconds"):
        assert pred[key] >= 0
    assert pred["peak_gpu_bytes"] <= 3.5e9  # the cpu profile's cap
    assert set(data["baselines"]) == {"megatrain", "keep_all", "recompute_all"}
    assert data["schedule"]["num_layers"] == 4
    assert data["config"]["hardware"]["name"] == "cpu"
    assert data["micro_batch"] == {"setting": "4", "source": "config", "value": 4}

    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000

    assert row["status"] == "ok" and row["hardware"] == "cpu" and row["model"] == "tiny"
    assert row["plan_tokens_per_s"] == pytest.approx(pred["tokens_per_second"])
    assert row["speedup"] == pytest.approx(pred["tokens_per_second"] / data["baselines"]["megatrain"]["tokens_per_second"])
    assert json.loads((tmp_path / ROW_FILE).read_text())["status"] == "ok"


def test_auto_batch_searches_then_plans_the_best(tmp_path, capsys):
    cfg = compose_cfg(*SMALL, "train.micro_batch_size=auto", "plan.batch_candidates=[1,2,4]", "plan.plot=false")
    row = plan_job(cfg, tmp_path)
    printed = capsys.readouterr().out
    assert "micro-batch search" in printed and "batch" in printed
    data = json.loads((tmp_path / "plan.json").read_text())
    search = data["batch_search"]
    assert [r["micro_batch_size"] for r in search["table"]] == [1, 2, 4]
    assert row["micro_batch_size"] == search["best_throughput"] == data["micro_batch"]["value"]
    assert data["micro_batch"]["source"] == "auto"
    assert not (tmp_path / "timeline.png").exists()  # plan.plot=false


def test_policy_run_and_baseline_plots(tmp_path):
    cfg = compose_cfg(*SMALL, "plan.policy=megatrain", "plan.plot_baselines=true")
    row = plan_job(cfg, tmp_path)
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["status"] == "policy" and row["solver_status"] == "policy"
    assert data["schedule"]["policy"].startswith("megatrain")
    assert row["speedup"] == pytest.approx(1.0)
    for name in ("timeline.png", "timeline_megatrain.png", "timeline_keep_all.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_infeasible_input_raises_planner_error(tmp_path):
    cfg = compose_cfg("hardware=cpu", "model=qwen2.5-3b", "train=cpu")  # 3B host state > 16 GB
    with pytest.raises(InfeasibleBudget, match="host memory"):
        plan_job(cfg, tmp_path)


# ---- subprocess: exit codes and the multirun CSV --------------------------------------------------------
def test_cli_infeasible_exits_2_with_message(tmp_path):
    proc = run_cli(tmp_path, "hardware=cpu", "model=qwen2.5-3b", "train=cpu", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2, proc.stderr
    assert "infeasible" in proc.stderr and "host memory" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_cli_invalid_batch_exits_2(tmp_path):
    proc = run_cli(tmp_path, *SMALL, "train.micro_batch_size=lots", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2
    assert "train.micro_batch_size" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_multirun_writes_one_csv(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(tmp_path, "-m", "hardware=cpu,rtx3090", "model=tiny,qwen2.5-3b", "train=cpu", "plan.time_limit=10",
                   "plan.plot=false", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(sweep.rglob("*.csv"))
    assert files == [sweep / "sweep.csv"]
    with open(sweep / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    pairs = {(r["hardware"], r["model"]): r for r in rows}
    assert set(pairs) == {("cpu", "tiny"), ("cpu", "qwen2.5-3b"), ("rtx3090", "tiny"), ("rtx3090", "qwen2.5-3b")}
    bad = pairs[("cpu", "qwen2.5-3b")]  # 3B's host state does not fit the cpu profile's 16 GB
    assert bad["status"] == "infeasible" and "host memory" in bad["reason"]
    for key in pairs.keys() - {("cpu", "qwen2.5-3b")}:
        row = pairs[key]
        assert row["status"] == "ok", row
        assert float(row["plan_tokens_per_s"]) > 0 and float(row["megatrain_tokens_per_s"]) > 0
        assert float(row["speedup"]) == pytest.approx(
            float(row["plan_tokens_per_s"]) / float(row["megatrain_tokens_per_s"]))
        assert row["micro_batch_size"] == "4"


# ---- report helpers ----------------------------------------------------------------------------------
def test_format_table_units_alignment_and_notes():
    rows = [{"schedule": "plan (milp)", "iteration_s": 30.289, "tokens_per_s": 2434.1, "tflops": 345.8,
             "peak_gpu_gb": 69.75, "exposed_s": 3.7, "homes": "4/61/0/0"},
            {"schedule": "keep_all", "infeasible": "gpu_memory: window H needs 983 GB"}]
    text = format_table(rows)
    lines = text.splitlines()
    assert lines[0].split("  ")[0].strip() == "schedule"
    for header in ("iter [s]", "tokens/s", "TFLOPS", "peak GPU [GB]", "exposed [s]", "boundaries g/c/n/r", "note"):
        assert header in lines[0]
    assert "2,434" in lines[2] and "30.289" in lines[2]
    assert "infeasible: gpu_memory" in lines[3]
    # right-aligned numbers: each value column ends where its header ends
    end = lines[0].index("TFLOPS") + len("TFLOPS")
    assert lines[2][:end].endswith("345.8")
    assert format_table([]) == "(no rows)"
    # a small value keeps three significant digits (not 0.001 next to 0.000456)
    small = format_table([{"exposed_s": 0.000456}, {"exposed_s": 0.00062}, {"exposed_s": 0.0123}]).splitlines()
    assert [line.strip() for line in small[2:]] == ["0.000456", "0.00062", "0.012"]


def test_format_table_prints_a_legend_under_the_table():
    rows = [{"schedule": "a", "iteration_s": 1.0}]
    text = format_table(rows, legend=["iter [s]: " + "word " * 40, "second"])
    lines = text.splitlines()
    assert len(lines) > 4 and lines[3].startswith("  iter [s]: word") and lines[4].startswith("    word")
    assert lines[-1] == "  second" and all(len(line) <= 100 for line in lines)
    assert format_table(rows) == "\n".join(lines[:3])  # plain rows: no legend


def _tiny_plan(policy: str = "milp", **workload_changes):
    from dataclasses import replace

    from lightning_lazytrain.config import to_hardware, to_model, to_train
    from lightning_lazytrain.planner import make_plan
    from lightning_lazytrain.planner.workload import Workload

    cfg = compose_cfg(*SMALL)
    model, train, hw = to_model(cfg), to_train(cfg, micro_batch_size=4), to_hardware(cfg)
    wl = replace(Workload.analytic(model, train, hw), **workload_changes)
    return make_plan(model, train, hw, policy=policy, workload=wl)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_rows_say_where_boundaries_live_and_how_many_layers_re_run(grad_accum):
    plan = _tiny_plan(grad_accum=grad_accum)
    rows = {row["schedule"]: row for row in plan.rows()}
    L = plan.workload.num_layers
    # recompute_all keeps every boundary on the GPU and re-runs each layer before its backward (local
    # recompute): L + 1 boundaries on the GPU, L re-runs; keep_all keeps everything, re-runs nothing;
    # megatrain (K=4) recomputes boundaries 1..3 by re-running layers 0..2, and re-runs every layer too
    assert (rows["recompute_all"]["homes"], rows["recompute_all"]["reruns"]) == (f"{L + 1}/0/0/0", L)
    assert (rows["keep_all"]["homes"], rows["keep_all"]["reruns"]) == (f"{L + 1}/0/0/0", 0)
    assert rows["megatrain"]["homes"] == "2/0/0/3" and rows["megatrain"]["reruns"] == 3 + L
    # the column is the simulator's count of re-run forwards (per micro-batch), for every schedule
    sims = {"plan (milp)": plan.sim, **plan.baselines}
    for name, row in rows.items():
        assert row["reruns"] * grad_accum == sum(sims[name].recomputed_forwards.values()), name
    assert any(f"{grad_accum * plan.workload.tokens:,} tokens per step" in line for line in plan.rows().legend)


def test_a_workload_without_tokens_has_no_tokens_per_s_column():
    plan = _tiny_plan(tokens=1)
    text = format_table(plan.rows())
    header = text.splitlines()[0]
    assert "tokens/s" not in header and "TFLOPS" not in header and "iter [s]" in header
    assert "no tokens/s or TFLOPS: the batch carries no token count" in text
    assert all("tokens_per_s" not in row for row in plan.rows())
    assert "tokens_per_s" in _tiny_plan().rows()[0]


def test_plot_timeline_takes_measured_segments(tmp_path):
    segs = [Segment("F0", "compute", "forward", 0, 0.0, 1.0), Segment("F0", "h2d", "weights", 1, 0.0, 0.5, 1e9),
            {"lane": "compute", "kind": "backward", "start": 1.0, "end": 2.5},
            {"lane": "gpu_to_disk", "kind": "spill", "start": 1.2, "end": 1.4}]  # unknown lane and kind
    path = plot_timeline(segs, tmp_path / "m.png", "measured", cap_bytes=2e9,
                         memory_curve=[(0.0, 1.0, 1e9), (1.0, 2.5, 1.5e9)])
    assert path.read_bytes()[:8] == PNG_MAGIC
    path = plot_timeline(segs[:2], tmp_path / "no_curve.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_write_sweep_csv_roundtrip(tmp_path):
    rows = [{"job": 0, "hardware": "h800", "model": "m", "status": "ok", "plan_tokens_per_s": 1.5, "extra": "x"},
            {"job": 1, "hardware": "rtx3090", "model": "m", "status": "infeasible", "reason": "short, by 2 GB"}]
    path = write_sweep_csv(tmp_path / "s.csv", rows)
    with open(path) as fh:
        back = list(csv.DictReader(fh))
    assert [r["status"] for r in back] == ["ok", "infeasible"]
    assert back[1]["reason"] == "short, by 2 GB" and back[0]["extra"] == "x" and back[1]["plan_tokens_per_s"] == ""
    assert list(back[0])[:3] == ["job", "hardware", "model"]


def test_planner_error_is_a_value_error():
    # the CLI catches PlannerError; keep it a ValueError subclass so callers can catch either
    assert issubclass(PlannerError, ValueError)


# ---- a plan over its cap (plan.window_memory=false) -------------------------------------------------------
def test_plan_over_the_cap_is_marked_in_table_and_plan_json(tmp_path, capsys):
    cfg = compose_cfg("hardware=h800", "model=qwen3.6-27b", "train.micro_batch_size=72", "plan.window_memory=false",
                      "plan.plot=false")
    row = plan_job(cfg, tmp_path)
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "plan.json").read_text())
    peak, cap = data["predicted"]["peak_gpu_bytes"], 70e9
    assert peak > cap  # the aggregate memory sum lets one window exceed the cap
    assert data["over_cap"] is True
    gpu = data["over_cap_by"]["gpu_memory"]
    assert gpu["excess_bytes"] == pytest.approx(peak - cap) and gpu["cap_bytes"] == cap and gpu["window"]
    plan_line = next(line for line in printed.splitlines() if line.startswith("plan (milp)"))
    assert f"OVER CAP: gpu_memory {format_bytes(peak)} in window {gpu['window']} > cap 70.0 GB" in plan_line
    assert f"(+{format_bytes(peak - cap)})" in plan_line
    assert re.search(r"OVER CAP: gpu_memory \d\d\.\d GB in window", plan_line), plan_line  # 3 significant digits
    assert "warning: replayed window by window, the plan exceeds its budget" in printed
    assert "plan.window_memory=true" in printed
    assert row["over_cap"] is True and row["over_cap_gb"] == pytest.approx((peak - cap) / 1e9)


def test_plan_within_the_cap_is_not_marked(tmp_path, capsys):
    row = plan_job(compose_cfg(*SMALL, "plan.plot=false"), tmp_path)
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["over_cap"] is False and data["over_cap_by"] == {}
    assert "OVER CAP" not in printed and "warning" not in printed
    assert row["over_cap"] is False and row["over_cap_gb"] == 0.0


# ---- several GPUs: plan.data_parallel --------------------------------------------------------------------
MULTI = ["hardware=h800x8", "model=qwen2.5-3b", "train.micro_batch_size=8", "plan.time_limit=20"]
SHARD = [*MULTI, "plan.data_parallel=shard"]  # shard is asked for explicitly (the default is replicate)


@pytest.mark.slow
def test_multi_gpu_plans_per_rank_and_records_the_cluster(tmp_path):
    proc = run_cli(tmp_path, *SHARD, f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("data parallel:"))
    assert "data parallel: shard, world size 8 (8 GPUs x 1 node); figures per rank (micro-batch 8 each)" in header
    assert "whole cluster:" in header and "tokens/s" in header and "GB per node" in header
    assert lines.index(header) + 1 == next(i for i, line in enumerate(lines) if line.startswith("schedule "))
    data = json.loads((tmp_path / "run" / "plan.json").read_text())
    dp = data["data_parallel"]
    assert dp["mode"] == "shard" and dp["world_size"] == 8 and dp["gpus_per_node"] == 8 and dp["nodes"] == 1
    rank, cluster = dp["per_rank"], dp["cluster"]
    assert rank["tokens_per_second"] == pytest.approx(data["predicted"]["tokens_per_second"])
    assert cluster["tokens_per_second"] == pytest.approx(8 * rank["tokens_per_second"])
    assert cluster["micro_batch_size"] == 64 and rank["micro_batch_size"] == 8
    assert 0 < cluster["host_bytes_per_node"] <= 2199e9 and dp["host_fits"] is True
    assert f"{cluster['tokens_per_second']:.1f} tokens/s" in header
    assert f"{cluster['host_bytes_per_node'] / 1e9:.1f} GB per node" in header
    assert data["schedule"].get("data_parallel") == "shard"
    assert set(data["baselines"]) == {"megatrain", "keep_all", "recompute_all"}
    row = json.loads((tmp_path / "run" / ROW_FILE).read_text())
    assert row["world_size"] == 8 and row["cluster_tokens_per_s"] == pytest.approx(cluster["tokens_per_second"])


@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_multi_gpu_other_modes(tmp_path, capsys, mode):
    row = plan_job(compose_cfg(*MULTI, f"plan.data_parallel={mode}", "plan.plot=false"), tmp_path)
    printed = capsys.readouterr().out
    assert f"data parallel: {mode}" in printed and ", world size 8" in printed
    dp = json.loads((tmp_path / "plan.json").read_text())["data_parallel"]
    assert dp["mode"] == mode and row["data_parallel"] == mode
    if mode == "fsdp":
        assert "policy: fsdp(" in printed and "solver:" not in printed


def test_multi_gpu_default_mode_is_the_strategys_replicate_and_says_so(tmp_path, capsys):
    """LazyTrainStrategy(data_parallel="replicate") is the strategy's default: the planner app plans the same unless
    told otherwise, and the line above the table says which mode it assumed and how to plan the others."""
    row = plan_job(compose_cfg(*MULTI, "plan.plot=false"), tmp_path)
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("data parallel:"))
    assert header.startswith("data parallel: replicate (the default, as LazyTrainStrategy's; "
                             "plan.data_parallel=shard|replicate_overlap|fsdp for the others), world size 8"), header
    assert lines.index(header) + 1 == next(i for i, line in enumerate(lines) if line.startswith("schedule "))
    assert row["data_parallel"] == "replicate"
    assert json.loads((tmp_path / "plan.json").read_text())["data_parallel"]["mode"] == "replicate"


@pytest.mark.slow
def test_multi_gpu_host_cap(tmp_path, capsys):
    plan_job(compose_cfg(*SHARD, "plan.host_gb_per_node_cap=60", "plan.plot=false"), tmp_path)
    assert "(of cap 60.0 GB)" in capsys.readouterr().out
    dp = json.loads((tmp_path / "plan.json").read_text())["data_parallel"]
    assert dp["host_bytes_per_node_cap"] == pytest.approx(60e9) and dp["cluster"]["host_bytes_per_node"] <= 60e9 + 1


def test_invalid_data_parallel_names_the_choices(tmp_path):
    with pytest.raises(PlannerError, match="plan.data_parallel.*shard, replicate, replicate_overlap, fsdp"):
        plan_job(compose_cfg(*MULTI, "plan.data_parallel=ddp"), tmp_path)
    with pytest.raises(PlannerError, match="plan.host_gb_per_node_cap"):
        plan_job(compose_cfg(*MULTI, "plan.host_gb_per_node_cap=lots"), tmp_path)
    proc = run_cli(tmp_path, *MULTI, "plan.data_parallel=ddp", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "plan.data_parallel" in proc.stderr and "shard, replicate, replicate_overlap, fsdp" in proc.stderr


def test_one_gpu_ignores_data_parallel(tmp_path, capsys):
    outputs, plans = [], []
    for i, mode in enumerate(("shard", "replicate", "fsdp")):
        d = tmp_path / str(i)
        plan_job(compose_cfg(*SMALL, f"plan.data_parallel={mode}", "plan.plot=false"), d)
        text = capsys.readouterr().out
        assert "data parallel" not in text
        outputs.append(re.sub(r"build [\d.]+ s, solve [\d.]+ s|to \S+", "", text))
        data = json.loads((d / "plan.json").read_text())
        assert "data_parallel" not in data and "data_parallel" not in data["schedule"]
        plans.append(data["predicted"])
    assert outputs[0] == outputs[1] == outputs[2] and plans[0] == plans[1] == plans[2]


# ---- a config that cannot run: one line, exit 2, no output directory ----------------------------------
@pytest.mark.parametrize("args,expected", [
    (["+plan.time_limt=5"],
     "lazytrain-plan: unknown key plan.time_limt: plan (PlanConfig) has no key 'time_limt'"),
    (["plan.time_limt=5"], "lazytrain-plan: unknown key plan.time_limt:"),
    (["++hardware.gpu_mem=3"], "lazytrain-plan: unknown key hardware.gpu_mem:"),
    (["+model.layers=3"], "lazytrain-plan: unknown key model.layers:"),
    (["+train.seq=8"], "lazytrain-plan: unknown key train.seq:"),
    (["trainer=cpu"], "lazytrain-plan: trainer=...: this app has no config group 'trainer'"),
    (["hardware=h800", "hardware.gpu_memory_cap_gb=100"],
     "lazytrain-plan: invalid hardware.gpu_memory_cap_gb=100.0: exceeds hardware.gpu_memory_gb=80"),
    (["-m", "hardware=cpu,h800", "+plan.foo=1"], "lazytrain-plan: unknown key plan.foo:"),
])
def test_cli_config_errors_are_one_line_exit_2_and_leave_nothing(tmp_path, args, expected):
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr
    assert "bytes" not in lines[0] and "Traceback" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))  # no outputs/ or multirun/ directory


def test_cli_infeasible_plan_leaves_no_directory(tmp_path):
    proc = run_cli(tmp_path, "hardware=cpu", "model=qwen2.5-3b", "train=cpu")
    assert proc.returncode == 2 and "infeasible (InfeasibleBudget)" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_lists_only_the_groups_of_the_planner(tmp_path):
    proc = run_cli(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    named = [line.split(":")[0] for line in groups.splitlines() if ": " in line and "(group=option)" not in line]
    assert named == ["hardware", "model", "train"], groups


def test_the_27b_count_is_explained_where_it_is_printed(tmp_path, capsys):
    plan_job(compose_cfg("model=qwen3.6-27b", "hardware=h800", "train.micro_batch_size=72", "plan.policy=megatrain",
                         "plan.plot=false"), tmp_path)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("lazytrain-plan: qwen3.6-27b (23.68B params: the LazyTrain paper's trainable count, the "
                            "hybrid 27B text model as 64 dense blocks with a fitted MLP width) on h800"), first
