"""The device validation kit (bench/device/): its CPU rehearsal passes, and its race hunt works.

The rehearsal runs every stage that can run without CUDA, each in its own process, exactly as
``bash bench/device/check.sh --rehearse OUTDIR`` does on a developer's machine (~2 min on 2
cores, most of it the stages' imports), in an emulated device image: the packages the GPU image
lacks are hidden and ``check.sh`` installs the kit's wheels (fetched from the registry for this
interpreter's version, ``fetch_wheels.py --python current``, ~20 s) offline, as the first device
run will (where the registry cannot be reached, the rehearsal runs in this environment as it is).
``check.sh`` is always given the interpreter running the tests (``PYTHON=sys.executable``): the
``python3`` on ``PATH`` may be another Python. The wheels for the device's Python (3.12) are
fetched for real too (slow; skipped where the registry cannot be reached). The kit's own logic
that the rehearsal does not reach (the wheel folder's size limit, Python tag and platform, the
throughput stage's interval arithmetic) is tested here directly, on fake inputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "bench" / "device"
CUDA_STAGES = {"sanitizer", "sync_debug", "pytest_gpu"}
CPU_STAGES = {"equivalence", "delays", "lightning", "throughput", "fit", "distributed", "nvme"}


@pytest.fixture(scope="module")
def kit():
    sys.path.insert(0, str(KIT))
    try:
        import kit as kit_module

        yield kit_module
    finally:
        sys.path.remove(str(KIT))


# Modules the GPU image lacks (check.sh's NEEDED, by top-level name).
HIDDEN = ("pyomo", "highspy", "hydra", "omegaconf", "bitsandbytes", "jsonargparse", "docstring_parser",
          "typeshed_client", "antlr4", "deepspeed")
# An emulated device image: a sitecustomize that hides HIDDEN unless they come from $EMULATED_KIT_SITE,
# the folder check.sh installs the carried wheels into (every stage process inherits it).
HIDE = f"""import importlib.machinery, os, sys
HIDDEN = {set(HIDDEN)!r}
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if "." in name or name not in HIDDEN:
            return None
        site = os.environ.get("EMULATED_KIT_SITE", "")
        spec = importlib.machinery.PathFinder.find_spec(name, [site]) if os.path.isdir(site) else None
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden: emulated device image)", name=name)
        return spec
sys.meta_path.insert(0, _Hide())
"""


@pytest.fixture(scope="module")
def device_image(tmp_path_factory):
    """(env, emulated): the environment of a rehearsal in an emulated device image -- the packages
    the GPU image lacks hidden, the kit's wheels fetched from the registry for ``check.sh`` to install
    offline, as on the device -- or, where the registry cannot be reached, this environment as it is
    (``emulated`` False: the rehearsal still runs, without the install)."""
    base = tmp_path_factory.mktemp("image")
    wheels = base / "wheels"
    fetch = subprocess.run([sys.executable, str(KIT / "fetch_wheels.py"), "--python", "current", "--dest", str(wheels)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    if fetch.returncode != 0 or not list(wheels.glob("*.whl")):
        return {**os.environ, "PYTHON": sys.executable}, False
    (base / "hide").mkdir()
    (base / "hide" / "sitecustomize.py").write_text(HIDE)
    site = base / "site"
    env = {**os.environ, "PYTHON": sys.executable, "KIT_WHEELS": str(wheels), "KIT_SITE": str(site),
           "EMULATED_KIT_SITE": str(site),
           "PYTHONPATH": os.pathsep.join([str(base / "hide"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    probe = subprocess.run([sys.executable, "-c", "import pyomo"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "emulated device image" in probe.stderr, probe.stderr[-500:]
    return env, True


@pytest.mark.slow
def test_rehearsal_passes_every_cpu_stage_and_skips_the_cuda_ones(tmp_path, device_image):
    """In an emulated device image (the image's missing packages hidden): ``check.sh`` installs the
    fetched wheels offline and every CPU stage passes with them, as the first device run will."""
    env, emulated = device_image
    out = tmp_path / "kit"
    r = subprocess.run(["bash", str(KIT / "check.sh"), "--rehearse", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900, env=env)
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{log[-5000:]}"
    if emulated:
        assert "carried wheels into" in r.stdout and "installed in" in r.stdout, r.stdout[-2000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["mode"] == "rehearse" and doc["ok"] is True and doc["finished"]
    assert doc["environment"]["executable"] == sys.executable  # PYTHON, not the python3 on PATH
    stages = {s["name"]: s for s in doc["stages"]}
    assert len(stages) == len(doc["stages"]) == len(CUDA_STAGES | CPU_STAGES)
    assert set(stages) == CUDA_STAGES | CPU_STAGES
    for name, s in stages.items():
        assert s["status"] in ("pass", "fail", "skipped"), name
        assert isinstance(s["seconds"], (int, float)) and s["seconds"] >= 0, name
        assert isinstance(s["figures"], dict), name
    for name in CUDA_STAGES:
        assert stages[name]["status"] == "skipped" and stages[name]["reason"], name
    for name in CPU_STAGES:
        assert stages[name]["status"] == "pass", (name, stages[name].get("reason"))
    # the figures say what was compared
    eq = stages["equivalence"]["figures"]
    assert eq["comparison"] == eq["comparison_bf16"] == "bitwise" and eq["max_rel_err"] == 0
    assert eq["steps"] == 3 and eq["micro_batches"] == 2
    every = {"keep_all", "recompute_all", "megatrain_K1", "megatrain_K2", "megatrain_K4", "cpu_homes", "nvme_homes",
             "kept_internals_resident", "offloaded_internals", "milp"}
    assert every <= set(eq["schedules"])
    # bf16-mixed (autocast over fp32 masters) vs plain autograd under the same autocast: bitwise,
    # losses included, under every schedule
    assert every <= set(eq["bf16_mixed"]) and eq["bf16_max_rel_err"] == 0 and eq["bf16_max_abs_loss_diff"] == 0
    for name, r in eq["bf16_mixed"].items():
        assert r["autocast"] == "torch.bfloat16" and r["max_rel_err"] == 0 and not r["problems"], name
    # GPT-2 with dropout 0.1 under recomputing schedules: the re-runs replay the random state, bitwise
    assert eq["gpt2_config"]["dropout"] == 0.1 and eq["gpt2_config"]["attn_implementation"] == "eager"
    assert {"recompute_all", "megatrain_K2", "cpu_homes", "recompute_all_bf16"} <= set(eq["gpt2"])
    for name, r in eq["gpt2"].items():
        assert r["max_rel_err"] == 0 and r["max_abs_loss_diff"] == 0 and not r["problems"], name
        assert sum(r["recomputed_forwards"].values()) > 0, name
    assert eq["gpt2_max_rel_err"] == 0
    lit = stages["lightning"]["figures"]
    assert lit["clip_inactive"]["max_abs_loss_diff"] == 0
    for tag in ("clip_inactive", "clipped"):
        memory = lit[tag]["memory"]  # the hard memory check is CUDA-only: skipped, with the reason
        assert memory["status"] == "skipped" and "CUDA" in memory["reason"] and memory["budget_gb"] > 0
        summary = lit[tag]["plan"]["summary"]  # what the plan does, read from its schedule
        assert summary["text"] and sum(summary["boundaries"].values()) == len(lit[tag]["plan"]["homes"])
    assert not any("keep_all" in n for n in stages["lightning"]["notes"])
    for name in ("milp", "megatrain"):
        v = stages["throughput"]["figures"]["variants"][name]
        assert v["lane_gb_per_s"]["h2d"]["gb_per_s"] > 0 and v["lane_gb_per_s"]["h2d"]["bytes"] > 0, name
        assert v["gpu_busy"]["status"] == "skipped" and "CUDA" in v["gpu_busy"]["reason"], name
        assert v["gpu_busy"]["profiled_step_seconds"] > 0 and v["gpu_busy_fraction"] is None, name
    assert stages["throughput"]["figures"]["variants"]["plain"]["gpu_busy"]["status"] == "skipped"
    check_fit_rehearsal(stages["fit"])
    assert "6 GPU tests" in stages["pytest_gpu"]["reason"] or "GPU tests collected" in stages["pytest_gpu"]["reason"]
    assert not (out / "site").exists()  # installed packages do not travel back with the results
    assert "## equivalence" in log


def check_fit_rehearsal(stage: dict) -> None:
    """The fit stage's CPU rehearsal: each variant in its own process, lazytrain and auto measured,
    FSDP2 measured on gloo, DeepSpeed skipped with the reason; ratios and targets recorded."""
    fig = stage["figures"]
    assert fig["device"] == "cpu" and fig["timed"] == 2 and fig["warmup"] == 0 and fig["model"]["num_layers"] == 4
    assert fig["order"] == [f"{v} b2x32" for v in ("lazytrain", "auto", "fsdp2_offload", "deepspeed_offload")]
    run = fig["runs"]["b2x32"]
    v = run["variants"]
    assert set(v) == {"lazytrain", "auto", "fsdp2_offload", "deepspeed_offload"}
    for name in ("lazytrain", "auto", "fsdp2_offload"):  # FSDP2 + CPU offload work on the CPU (gloo)
        r = v[name]
        assert r["status"] == "measured", (name, r.get("reason"))
        assert len(r["step_seconds"]) == 2 and r["tokens_per_s"] == 64 / r["median_step_seconds"], name
        assert r["optimizer_seconds"] > 0 and r["parameters"] == 217_664 and r["settings"], name
        busy = r["gpu_busy"]  # the profiled step ran; the GPU figure is CUDA only
        assert busy["status"] == "skipped" and "CUDA" in busy["reason"] and busy["profiled_step_seconds"] > 0, name
        assert r["gpu_busy_fraction"] is None and "max_memory_reserved_gb" not in r, name
    lt = v["lazytrain"]
    assert lt["untimed_step_seconds"] and len(lt["untimed_step_seconds"]) == 1  # the profiled step, untimed
    assert lt["footprint_min_gb"] < lt["cap_gb"] < lt["footprint_keep_all_gb"] and lt["cap_frac"] == 0.4
    assert lt["predicted_step_seconds"] > 0 and lt["measured_over_predicted"] > 0 and lt["predicted_peak_gb"] > 0
    assert lt["plan"]["homes"] and lt["lane_busy_seconds"]["compute"] > 0 and lt["lane_gb_per_s"]["h2d"]["bytes"] > 0
    assert lt["predicted_lane_busy_seconds"]["compute"] > 0 and lt["optimizer_update_seconds_per_step"] > 0
    assert "HybridAdamW" in lt["settings"]["optimizer"] and lt["settings"]["precision"] == "32-true"
    assert "fused" in v["auto"]["settings"]["optimizer"]
    assert "CPUOffloadPolicy" in v["fsdp2_offload"]["settings"]["offload"]
    ds = v["deepspeed_offload"]
    assert ds["status"] == "skipped" and ds["reason"], ds
    if importlib.util.find_spec("deepspeed") is not None:  # installed here: carried to the emulated image (or
        # importable as it is): checked as far as the CPU goes
        assert "CUDA only" in ds["reason"] and ds["preflight"]["deepspeed"], ds
        assert "cpu_adam_compatible" in ds["preflight"], ds
    else:  # fetch_wheels.py left it out (not installed where the wheels were fetched)
        assert "not importable" in ds["reason"], ds
    ratios = run["ratios"]
    assert ratios["lazytrain_over_auto"] > 0 and ratios["lazytrain_over_fsdp2_offload"] > 0
    assert ratios["lazytrain_over_deepspeed_offload"] is None and "skipped" in ratios["why_none"][
        "lazytrain_over_deepspeed_offload"]
    targets = run["targets"]  # the speed targets are for 8/32 x 1024; measured / predicted everywhere
    assert set(targets) == {"measured_over_predicted", "note"}
    assert targets["measured_over_predicted"]["value"] == lt["measured_over_predicted"]
    assert isinstance(targets["measured_over_predicted"]["met"], bool)
    assert stage["seconds"] < 120, stage["seconds"]  # each variant a process of its own, still quick


def test_fit_ratios_and_targets(kit):
    """The speed targets as booleans: b32 >= 0.8x auto, >= 2x FSDP2 offload, GPU busy >= 0.8; b8 >=
    0.35x auto, >= 1.5x FSDP2 offload; measured / predicted within 10%; None where not measured."""
    from stage_fit import ratios_and_targets

    lt = {"status": "measured", "tokens_per_s": 50_000.0, "gpu_busy_fraction": 0.85, "measured_over_predicted": 1.08}
    peers = {"auto": {"status": "measured", "tokens_per_s": 60_000.0},
             "fsdp2_offload": {"status": "measured", "tokens_per_s": 20_000.0},
             "deepspeed_offload": {"status": "skipped", "reason": "no Python.h"}}
    ratios, targets = ratios_and_targets(32, 1024, {"lazytrain": lt, **peers})
    assert ratios["lazytrain_over_auto"] == 50 / 60 and ratios["lazytrain_over_fsdp2_offload"] == 2.5
    assert ratios["lazytrain_over_deepspeed_offload"] is None
    assert ratios["why_none"] == {"lazytrain_over_deepspeed_offload": "deepspeed_offload skipped: no Python.h"}
    assert {k: t["met"] for k, t in targets.items()} == {
        "lazytrain_over_auto": True, "lazytrain_over_fsdp2_offload": True, "gpu_busy_fraction": True,
        "measured_over_predicted": True}
    slow = {**lt, "tokens_per_s": 20_000.0, "gpu_busy_fraction": 0.5, "measured_over_predicted": 0.85}
    _, targets = ratios_and_targets(32, 1024, {"lazytrain": slow, **peers})
    assert {k: t["met"] for k, t in targets.items()} == {
        "lazytrain_over_auto": False, "lazytrain_over_fsdp2_offload": False, "gpu_busy_fraction": False,
        "measured_over_predicted": False}
    # b8: 0.35x auto and 1.5x FSDP2 offload, no GPU busy target
    _, targets = ratios_and_targets(8, 1024, {"lazytrain": {**lt, "tokens_per_s": 30_000.0}, **peers})
    assert {k: t["met"] for k, t in targets.items()} == {
        "lazytrain_over_auto": True, "lazytrain_over_fsdp2_offload": True, "measured_over_predicted": True}
    assert targets["lazytrain_over_auto"]["target"] == ">= 0.35"
    # an OOM'd auto: no ratio, the target unknown (None), the reason kept
    ratios, targets = ratios_and_targets(32, 1024, {"lazytrain": lt, **peers, "auto": {"status": "oom",
                                                                                       "reason": "CUDA OOM"}})
    assert ratios["lazytrain_over_auto"] is None and targets["lazytrain_over_auto"]["met"] is None
    assert ratios["why_none"]["lazytrain_over_auto"] == "auto oom: CUDA OOM"


@pytest.mark.slow
def test_fit_job_timeout_kills_the_run_and_what_it_started(kit, tmp_path):
    """A variant past its timeout is killed with everything it started (its own session), and what it
    wrote before is kept; a run that ends in time is left alone."""
    import time

    from stage_fit import Job

    pidfile, out = tmp_path / "grandchild.pid", tmp_path / "run.json"
    code = (f"import json, subprocess, time; p = subprocess.Popen(['sleep', '60']); open({str(pidfile)!r}, 'w')"
            f".write(str(p.pid)); open({str(out)!r}, 'w').write(json.dumps({{'phase': 'fit'}})); time.sleep(60)")
    t0 = time.perf_counter()
    job = Job([sys.executable, "-c", code], out, timeout=3, env=dict(os.environ))
    assert job.wait() and job.timed_out and job.rc != 0 and time.perf_counter() - t0 < 20
    assert job.result() == {"phase": "fit"}
    grandchild = int(pidfile.read_text())
    for _ in range(50):  # killed with its session (a zombie until init reaps it counts as gone)
        try:
            state = Path(f"/proc/{grandchild}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the run's child {grandchild} outlived the kill")
    quick = Job([sys.executable, "-c", "pass"], tmp_path / "none.json", timeout=30, env=dict(os.environ))
    assert quick.wait() and not quick.timed_out and quick.rc == 0 and quick.result() == {}


def test_fit_stage_is_opt_in_on_the_device(tmp_path):
    """A full device run records the fit stage as skipped with the command that runs it; KIT_ONLY runs it."""
    sys.path.insert(0, str(KIT))
    try:
        import run_checks
    finally:
        sys.path.remove(str(KIT))
    spec = next(s for s in run_checks.STAGES if s.name == "fit")
    names = [s.name for s in run_checks.STAGES]
    assert spec.opt_in and names.index("fit") == names.index("throughput") + 1
    runner = run_checks.Runner(tmp_path, rehearse=False, budget_s=450, only=[])
    r = runner.run_stage(spec, "cuda")
    assert r["status"] == "skipped" and "KIT_ONLY=throughput,fit" in r["reason"]


def test_delay_injection_exposes_a_planted_race_and_leaves_correct_runs_alone(kit, tmp_path):
    """Compute that does not wait for its weights (a missing wait, planted here) gives other
    numbers once the copies are late; the correct executor stays bitwise equal under delays."""
    from lightning_lazytrain.engine import copy_engine, param_store

    model = kit.tiny_model()
    batches = kit.make_batches(kit.tiny_spec(), 1, 2)
    schedule = kit.fixed_schedules()["cpu_homes"]
    base = kit.run_executor(model, schedule, batches, "cpu", tmp_path)
    binds_before = param_store.ParamStore.bind
    with kit.Delays("cpu", copy_s=1e-3, compute_s=1e-3, jitter=True).installed() as d:
        delayed = kit.run_executor(model, schedule, batches, "cpu", tmp_path)
    assert d.counts["host_copy"] > 0 and d.counts["compute"] > 0
    assert param_store.ParamStore.bind is binds_before  # unwrapped again
    assert kit.compare(delayed, base, exact=True, tol=0)[1] == []

    wait = copy_engine.ThreadHandle.sync_current_stream
    copy_engine.ThreadHandle.sync_current_stream = lambda self: None  # the planted race
    try:
        with kit.Delays("cpu", copy_s=2e-3).installed():
            raced = kit.run_executor(model, schedule, batches, "cpu", tmp_path)
    except RuntimeError as err:  # the race can also show as an error: compute read a buffer a
        raced = None  # copy was still writing (autograd sees a saved tensor change under it)
        assert "in place" in str(err) or "nan" in str(err).lower(), err
    finally:
        copy_engine.ThreadHandle.sync_current_stream = wait
    assert raced is None or kit.compare(raced, base, exact=True, tol=0)[1]


def test_pytest_summary_parsing(kit):
    from stage_pytest_gpu import summary_counts

    assert summary_counts("ssssss [100%]\n6 skipped, 443 deselected in 9.77s\n") == {"skipped": 6, "deselected": 443}
    assert summary_counts("==== 1 failed, 4 passed, 2 errors, 1 warning in 12.30s ====") == {
        "failed": 1, "passed": 4, "error": 2, "warning": 1}
    assert summary_counts("no tests ran in 0.01s") == {}


def test_wheel_list_is_what_the_gpu_image_lacks(kit, monkeypatch):
    import fetch_wheels  # bench/device is on sys.path through the kit fixture

    wanted = fetch_wheels.wanted()
    assert {"pyomo", "highspy", "hydra-core", "omegaconf", "antlr4-python3-runtime", "bitsandbytes",
            "jsonargparse"} <= set(wanted)
    assert not {"torch", "lightning", "transformers", "numpy", "pytest", "matplotlib", "pyyaml"} & set(wanted)
    # the fit stage's DeepSpeed peer: shipped with its dependencies when installed here, else left out
    present, left_out = fetch_wheels.kit_extras()
    if present:
        assert {"deepspeed", "hjson", "ninja", "py-cpuinfo", "msgpack", "pydantic", "pydantic-core"} <= set(wanted)
    else:
        assert "deepspeed" not in wanted and "pip install deepspeed==" in left_out[0]
    assert "deepspeed" not in fetch_wheels.wanted(extras=False)
    monkeypatch.setattr(fetch_wheels, "KIT_EXTRAS", ("lazytrain-kit-no-such-dist",))
    assert fetch_wheels.kit_extras() == ([], ["lazytrain-kit-no-such-dist: not installed here (pip install "
                                              "lazytrain-kit-no-such-dist, then fetch again)"])
    needed = (KIT / "check.sh").read_text()
    for module in ("pyomo", "highspy", "hydra", "omegaconf", "bitsandbytes", "jsonargparse", "antlr4"):
        assert module in needed.split("NEEDED=", 1)[1].splitlines()[0], module


def test_throughput_interval_arithmetic(kit):
    from stage_throughput import gpu_busy_from_events, interval_union, lane_rates

    from lightning_lazytrain.planner.simulator import Segment

    assert interval_union([(0, 2), (1, 3), (5, 6), (6, 6)]) == 4
    assert interval_union([]) == 0
    segs = [Segment("F0", "h2d", "weights", 0, 0.0, 1.0, 1e9), Segment("F0", "h2d", "weights", 1, 0.5, 2.0, 1e9),
            Segment("F0", "compute", "forward", 0, 0.0, 3.0)]
    rates = lane_rates(segs, {"h2d": 3e9, "d2h": 0})
    assert rates == {"h2d": {"bytes": 3_000_000_000, "busy_seconds": 2.0, "gb_per_s": 1.5}}  # bytes / union busy
    assert lane_rates(segs)["h2d"]["gb_per_s"] == 1.0  # the segments' own bytes when lane_bytes is not given
    events = [("ampere_sgemm", True, 0.0, 400.0), ("elementwise", True, 300.0, 500.0),
              ("Memcpy HtoD (Pinned -> Device)", True, 0.0, 900.0), ("aten::mm", False, 0.0, 1000.0)]
    busy = gpu_busy_from_events(events, wall_s=1e-3)
    assert busy["kernels"] == 2 and busy["kernel_seconds"] == 5e-4 and busy["kernel_seconds_summed"] == 6e-4
    assert busy["copy_seconds"] == 9e-4 and busy["gpu_busy_fraction"] == 0.5


def _wheel(path: Path, nbytes: int = 0) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pad.bin", os.urandom(nbytes))
    return path


def test_fetch_wheels_checks_the_size_before_placing_anything(kit, tmp_path):
    import fetch_wheels

    staged, dest = tmp_path / "staged", tmp_path / "wheels"
    staged.mkdir()
    dest.mkdir()
    _wheel(dest / "old-1.0-py3-none-any.whl", 10)
    manifest = [{"file": _wheel(staged / f"w{i}-1.0-py3-none-any.whl", 200_000).name} for i in range(3)]
    with pytest.raises(fetch_wheels.OverLimit, match="left as it was"):
        fetch_wheels.place(staged, manifest, dest, max_bytes=500_000)
    assert [p.name for p in dest.iterdir()] == ["old-1.0-py3-none-any.whl"]  # untouched
    total = fetch_wheels.place(staged, manifest, dest, max_bytes=1_000_000)
    assert sorted(p.name for p in dest.iterdir()) == sorted(e["file"] for e in manifest)
    assert total == sum(e["bytes"] for e in manifest) > 600_000 and all(len(e["sha256"]) == 64 for e in manifest)
    fetch_wheels.write_manifest(dest, manifest, total)  # for the device's Python by default
    doc = json.loads((dest / "MANIFEST.json").read_text())
    assert doc["python_tag"] == "cp312" and doc["python"] == "3.12" and doc["total_bytes"] == total
    assert doc["fetched_with"] == sys.version.split()[0] and "manylinux2014_x86_64" in doc["platforms"]
    fetch_wheels.write_manifest(dest, manifest, total, fetch_wheels.parse_python("current"))
    doc = json.loads((dest / "MANIFEST.json").read_text())
    assert doc["python_tag"] == f"cp{sys.version_info.major}{sys.version_info.minor}" == fetch_wheels.python_tag()
    assert doc["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert fetch_wheels.wheel_python_tags(["highspy-1.9-cp311-cp311-manylinux_2_17_x86_64.whl",
                                           "bitsandbytes-0.45-py3-none-manylinux_2_24_x86_64.whl",
                                           "foo-1.0-cp38-abi3-manylinux_2_17_x86_64.whl",
                                           "pyomo-6.8-py3-none-any.whl"]) == {"cp311"}


def test_fetch_wheels_targets_a_named_python(kit):
    """``--python 3.12`` selects CPython 3.12's wheels on manylinux x86_64 whatever Python runs the
    script: pip's target flags, the target's environment markers, and the check of what came back."""
    import fetch_wheels

    target = fetch_wheels.parse_python("3.12")
    assert target.tag == "cp312" and target.short == "3.12" and fetch_wheels.Target() == target
    args = target.pip_args()
    assert args[:7] == ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
    plats = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert plats[0] == "manylinux_2_28_x86_64" and plats[-1] == "manylinux2014_x86_64"
    assert "manylinux_2_17_x86_64" in plats and not any("2_29" in p for p in plats)
    assert fetch_wheels.parse_python("3.12.3").markers()["python_full_version"] == "3.12.3"
    assert target.markers()["python_version"] == "3.12" and target.markers()["sys_platform"] == "linux"
    here = fetch_wheels.parse_python("current")
    assert here.tag == fetch_wheels.python_tag()
    for bad in ("3", "3.x", "2.7", "cp312", ""):
        with pytest.raises(Exception, match="not a CPython 3 version"):
            fetch_wheels.parse_python(bad)
    # markers are evaluated for the target: a backport needed below 3.12 is not shipped for 3.12
    from packaging.requirements import Requirement

    backport = Requirement('some-backport; python_version < "3.12"')
    assert fetch_wheels._applies(backport, set(), fetch_wheels.parse_python("3.11"))
    assert not fetch_wheels._applies(backport, set(), target)
    # what came back must fit the target
    ok = ["highspy-1.16.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
          "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", "hydra_core-1.3.8-py3-none-any.whl",
          "foo-1.0-cp38-abi3-manylinux2014_x86_64.whl", "old-1.0-cp312-cp312-manylinux1_x86_64.whl"]
    bad = ["highspy-1.16.0-cp311-cp311-manylinux_2_17_x86_64.whl", "pyomo-6.10.1-cp312-cp312-macosx_11_0_arm64.whl",
           "new-1.0-cp312-cp312-manylinux_2_34_x86_64.whl", "arm-1.0-py3-none-manylinux_2_17_aarch64.whl"]
    assert fetch_wheels.foreign_wheels(ok + bad, target) == bad


@pytest.mark.slow  # downloads ~60 MB (bitsandbytes' full wheel) unless pip's cache has them: ~15 s
def test_fetch_wheels_for_the_device_python_fetches_cp312_manylinux_wheels(kit, tmp_path):
    """For real, from the registry: ``fetch_wheels.py --python 3.12`` run by this interpreter
    (whatever its version) gives only wheels that install on the device's CPython 3.12 on manylinux
    x86_64 (compiled ones ``cp312-cp312-manylinux_*_x86_64``, the rest pure), under the size limit."""
    import fetch_wheels

    probe = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--disable-pip-version-check", "-d", str(tmp_path / "probe"), "docstring-parser"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"the package registry cannot be reached: {probe.stderr.strip()[-300:]}")
    dest = tmp_path / "w312"
    r = subprocess.run([sys.executable, str(KIT / "fetch_wheels.py"), "--python", "3.12", "--dest", str(dest)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((dest / "MANIFEST.json").read_text())
    assert doc["python"] == "3.12" and doc["python_tag"] == "cp312"
    names = sorted(p.name for p in dest.glob("*.whl"))
    assert names == sorted(e["file"] for e in doc["wheels"]) and len(names) == len(fetch_wheels.wanted())
    assert fetch_wheels.foreign_wheels(names, fetch_wheels.Target("3.12")) == []
    compiled = [n for n in names if fetch_wheels.wheel_python_tags([n])]
    assert compiled and all("-cp312-cp312-" in n and "manylinux" in n and n.endswith("_x86_64.whl") for n in compiled)
    for n in set(names) - set(compiled):  # pure, Python-independent with a native library (bitsandbytes), or
        assert "-py3-none-" in n or "-py2.py3-none-" in n or "-abi3-" in n, n  # the stable ABI (psutil)
    assert any(n.startswith("antlr4_python3_runtime-") and n.endswith("-none-any.whl") for n in names)
    assert {"highspy", "pyomo"} <= {n.split("-")[0] for n in compiled}
    assert doc["total_bytes"] == sum(p.stat().st_size for p in dest.glob("*.whl")) < 60 * fetch_wheels.MIB


def _check_sh(tmp_path: Path, wheels: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "KIT_WHEELS": str(wheels),
           "KIT_NEEDED": "lazytrain_kit_module_that_is_missing"}
    return subprocess.run(["bash", str(KIT / "check.sh"), "--rehearse", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_check_sh_refuses_wheels_of_another_python(tmp_path):
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    other = "cp39" if here != "cp39" else "cp310"
    # by MANIFEST.json's python_tag (pure wheels only)
    by_manifest = tmp_path / "by_manifest"
    by_manifest.mkdir()
    _wheel(by_manifest / "pure-1.0-py3-none-any.whl")
    (by_manifest / "MANIFEST.json").write_text(json.dumps({"python": "3.9", "python_tag": other}))
    r = _check_sh(tmp_path, by_manifest)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"fetched for {other} (Python 3.9)" in r.stdout
    assert f"fetch_wheels.py --python {sys.version_info.major}.{sys.version_info.minor}" in r.stdout
    assert not (tmp_path / "out" / "site").exists()  # nothing installed
    # by a compiled wheel's name (no manifest)
    by_name = tmp_path / "by_name"
    by_name.mkdir()
    _wheel(by_name / f"compiled-1.0-{other}-{other}-manylinux_2_17_x86_64.whl")
    r = _check_sh(tmp_path, by_name)
    assert r.returncode == 2 and f"fetched for {other}" in r.stdout, r.stdout + r.stderr
    # by a compiled wheel's platform: this Python, another machine
    by_platform = tmp_path / "by_platform"
    by_platform.mkdir()
    _wheel(by_platform / f"compiled-1.0-{here}-{here}-macosx_11_0_arm64.whl")
    r = _check_sh(tmp_path, by_platform)
    assert r.returncode == 2 and "not for this machine" in r.stdout and "macosx_11_0_arm64" in r.stdout, r.stdout
    assert not (tmp_path / "out" / "site").exists()
    # the same Python passes the check (and goes on to install: this fake wheel has no metadata)
    same = tmp_path / "same"
    same.mkdir()
    _wheel(same / "pure-1.0-py3-none-any.whl")
    (same / "MANIFEST.json").write_text(json.dumps({"python": "x", "python_tag": here}))
    r = _check_sh(tmp_path, same)
    assert "ERROR: the carried wheels" not in r.stdout and f"this Python is {here}" in r.stdout, r.stdout
    assert r.returncode == 2 and not (tmp_path / "out" / "site").exists()  # a failed install leaves no site


def test_check_sh_refuses_an_interpreter_that_does_not_run_or_lacks_torch(tmp_path):
    """The kit starts ``$PYTHON``, else the first ``python3`` on ``PATH``: one that does not run, or
    runs without torch (another Python than the venv's), stops the kit with exit 2 and the fix
    (set ``PYTHON``), instead of every stage failing on its imports."""
    shims = tmp_path / "shims"
    shims.mkdir()
    broken = shims / "python3"
    broken.write_text("#!/bin/sh\necho 'not this python' >&2\nexit 1\n")
    broken.chmod(0o755)
    bare = tmp_path / "bare" / "python3"  # this interpreter without site-packages: no torch
    bare.parent.mkdir()
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    bare.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    for path_first, want in ((shims, "does not run"), (bare.parent, "has no torch")):
        env = {**base, "PATH": f"{path_first}{os.pathsep}{os.environ.get('PATH', '')}"}
        r = subprocess.run(["bash", str(KIT / "check.sh"), "--rehearse", str(tmp_path / "out")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and want in r.stderr and "set PYTHON" in r.stderr, r.stdout + r.stderr
        assert not (tmp_path / "out" / "results.json").exists()
    r = subprocess.run(["bash", str(KIT / "check.sh"), "--rehearse", str(tmp_path / "out")], cwd=ROOT,
                       env={**base, "PYTHON": str(broken)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{broken} (PYTHON) does not run" in r.stderr, r.stdout + r.stderr


def test_memory_trace_finds_what_is_alive_at_the_peak(kit):
    """engine/alloc_trace.peak_allocations replays an allocator trace: the peak of the traced allocations and
    what was alive then, by the first frames of this project on the stack (frees of earlier allocations
    ignored)."""
    from lightning_lazytrain.engine.alloc_trace import peak_allocations, site_of

    ours = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/r/lightning_lazytrain/engine/executor.py", "line": 7, "name": "_forward_window"},
            {"filename": "/r/lightning_lazytrain/models/llama.py", "line": 9, "name": "forward"}]
    other = [{"filename": "/x/torch/autograd/graph.py", "line": 3, "name": "backward"}]
    assert site_of(ours) == ("lightning_lazytrain/engine/executor.py:7(_forward_window) < "
                             "lightning_lazytrain/models/llama.py:9(forward)")
    assert site_of(other) == "/x/torch/autograd/graph.py:3(backward)" and site_of([]) == "(no stack)"
    trace = [{"action": "free_requested", "addr": 99, "size": 7},  # made before the trace began
             {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
             {"action": "alloc", "addr": 2, "size": 50, "frames": other},
             {"action": "alloc", "addr": 3, "size": 30, "frames": ours},
             {"action": "free_requested", "addr": 2, "size": 50},
             {"action": "free_completed", "addr": 2, "size": 50},
             {"action": "alloc", "addr": 4, "size": 10, "frames": other}]
    out = peak_allocations(trace, top=1)
    assert out["traced_peak_bytes"] == 180 and out["alive_at_peak"] == 3 and out["entries"] == 7
    assert out["sites"] == [{"site": site_of(ours), "bytes": 130, "count": 2}] and out["other_sites_bytes"] == 50


@pytest.mark.slow
def test_session_script_rehearses_and_returns_few_flat_files(tmp_path):
    """bench/device/session.sh (the next short lease's calls) on the CPU: the kit part (here only its
    pytest_gpu stage: the rehearsal above runs lightning and throughput through the same check.sh), the fit
    at two batches and the host kernels, each bounded; what it leaves is at most 8 flat files (what a lent
    machine returns), every stage passed or skipped with its reason."""
    out = tmp_path / "session"
    env = {**os.environ, "PYTHON": sys.executable, "SESSION_KIT_S": "150", "SESSION_B32_S": "60", "SESSION_B8_S": "60",
           "KIT_SITE": str(tmp_path / "site"), "SESSION_KIT_ONLY": "pytest_gpu"}
    r = subprocess.run(["bash", str(KIT / "session.sh"), "--rehearse", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["fit-b32.json", "fit-b32.log", "fit-b8.json", "fit-b8.log", "host-ops.log", "kit.json", "kit.log"]
    assert all(p.is_file() for p in out.iterdir())
    kit_doc = json.loads((out / "kit.json").read_text())
    stages = {s["name"]: s for s in kit_doc["stages"]}
    assert set(stages) == {"pytest_gpu"}
    assert stages["pytest_gpu"]["status"] == "skipped" and stages["pytest_gpu"]["reason"]
    for label in ("b32", "b8"):
        fit_doc = json.loads((out / f"fit-{label}.json").read_text())
        assert fit_doc["status"] == "pass", fit_doc.get("reason")
        (run,) = fit_doc["figures"]["runs"].values()
        assert {v: run["variants"][v]["status"] for v in ("lazytrain", "auto", "fsdp2_offload")} == dict.fromkeys(
            ("lazytrain", "auto", "fsdp2_offload"), "measured")
    assert "copy fp32" in (out / "host-ops.log").read_text()
