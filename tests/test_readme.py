"""The README says what the code does: its H800 table is what ``lazytrain-plan`` prints with the shipped
profile, and that profile holds the calibrated efficiency."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_lazytrain.cli.plan import plan_job
from lightning_lazytrain.config import CONF_DIR

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    """The README text under the ``## <title...>`` heading, up to the next ``## ``."""
    start = README.index("\n## " + title)
    end = README.find("\n## ", start + 1)
    return README[start: end if end >= 0 else None]


# ---- the H800 table -----------------------------------------------------------------
def h800_table() -> list[dict]:
    rows = []
    for line in section("Predicted vs measured (H800").splitlines():
        m = re.match(r"\| (Qwen[\w.\-]+), batch (\d+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", line.strip())
        if m:
            name, batch, _paper_mt, predicted_mt, _paper_lt, ours = (c.strip() for c in m.groups())
            rows.append({"model": name.lower(), "batch": int(batch), "megatrain": int(predicted_mt.split()[0]),
                         "plan": int(ours.split()[0])})
    return rows


def printed_tokens_per_s(printed: str, schedule: str) -> int:
    lines = printed.splitlines()
    header = next(line for line in lines if line.startswith("schedule ") and "tokens/s" in line)
    column = re.split(r"\s{2,}", header.strip()).index("tokens/s")
    row = next(line for line in lines if line.startswith(schedule + " "))
    return int(re.split(r"\s{2,}", row.strip())[column].replace(",", ""))


def test_h800_profile_holds_the_calibrated_efficiency():
    spec = importlib.util.spec_from_file_location("bench_planner", REPO / "bench" / "bench_planner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hw, model, train = bench.load("h800", "qwen3.6-27b")
    batch, megatrain_tokens_per_s, _ = bench.PAPER_H800["qwen3.6-27b"]
    fitted = bench.calibrate(hw, model, train, batch * 1024 / megatrain_tokens_per_s)
    profile = OmegaConf.load(CONF_DIR / "hardware" / "h800.yaml")
    assert profile.efficiency == round(fitted, 4) == 0.2821
    text = (CONF_DIR / "hardware" / "h800.yaml").read_text()
    assert "bench/bench_planner.py" in text.split("efficiency:")[1].split("h2d_gb_per_s")[0]  # provenance
    assert "`efficiency: 0.2821`" in section("Predicted vs measured (H800")


@pytest.mark.slow
def test_readme_h800_table_is_what_lazytrain_plan_prints(tmp_path, capsys):
    rows = h800_table()
    assert [r["model"] for r in rows] == ["qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen3.6-27b"]
    speedup_27b = None
    for r in rows:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="plan", overrides=["hardware=h800", f"model={r['model']}", "plan.plot=false"])
        summary = plan_job(cfg, tmp_path / r["model"])  # the app's own code path, as `lazytrain-plan` runs it
        printed = capsys.readouterr().out
        assert summary["micro_batch_size"] == r["batch"] and summary["batch_source"] == "paper"
        assert printed_tokens_per_s(printed, "megatrain") == r["megatrain"], (r, printed)
        # the MILP stops at a proven gap (plan.mip_gap = 0.1%): another machine may stop at another incumbent
        # within it, so the plan's figure may differ by that much (and by the last digit's rounding)
        plan = printed_tokens_per_s(printed, "plan (milp)")
        assert abs(plan - r["plan"]) <= max(1, r["plan"] * (summary["mip_gap"] or 0.0) + 1), (r, printed)
        if r["model"] == "qwen3.6-27b":
            speedup_27b = float(re.search(r"speedup over megatrain: ([\d.]+)x", printed).group(1))
    claim = re.search(r"At 27B our plan is predicted ([\d.]+)x faster", README)
    assert claim and float(claim.group(1)) == pytest.approx(speedup_27b, abs=0.005)


# ---- every Python block runs as written ----------------------------------------------
# Blocks in sections whose text this test must not change run with these substitutions (tiny sizes, a
# temporary spill directory); each `old` must appear in its block, so the README cannot drift from them.
SUBSTITUTIONS = {
    "import lightning as L": [("max_steps=300", "max_steps=3"),
                              ("StdlibTextDataModule(seq_len=128, batch_size=8)",
                               "StdlibTextDataModule(seq_len=128, batch_size=8, max_bytes=300_000, val_windows=8)")],
    "from lightning_lazytrain.strategy import LazyTrainStrategy": [('"/nvme/spill"', "SPILL_DIR")],
}


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)


def test_the_readme_has_the_expected_python_blocks():
    firsts = [block.splitlines()[0] for block in python_blocks()]
    assert firsts == ["import lightning as L", "from lightning_lazytrain.strategy import LazyTrainStrategy",
                      "from lightning_lazytrain.config import load_hardware, load_model", "import torch"]


@pytest.mark.parametrize("index", range(4))
@pytest.mark.slow
def test_readme_python_block_runs(index, tmp_path, monkeypatch, capsys):
    block = python_blocks()[index]
    for old, new in SUBSTITUTIONS.get(block.splitlines()[0], []):
        assert old in block, f"README block {index} no longer contains {old!r}: update SUBSTITUTIONS"
        block = block.replace(old, new)
    monkeypatch.chdir(tmp_path)  # Lightning's default logger writes lightning_logs/ into the working directory
    namespace = {"__name__": f"readme_block_{index}", "SPILL_DIR": str(tmp_path / "spill")}
    exec(compile(block, f"README.md python block {index}", "exec"), namespace)
    if index == 0:
        assert namespace["model"].trainer.global_step == 3
    if index == 2:
        plan = namespace["plan"]
        assert plan.schedule.num_layers == 64 and not plan.over_cap
        assert "tokens/s, peak" in capsys.readouterr().out
    if index == 3:
        assert namespace["ex"].device.type in ("cpu", "cuda")
        assert namespace["loss"].item() < 5.6  # a byte-level model, three steps from ln 256


# ---- the test commands -----------------------------------------------------------------
def test_readme_gives_the_test_time_and_a_quick_subset_that_ci_keeps_in_step():
    two = section("Two commands")
    assert "```bash\npython -m pytest -q -n auto --dist loadfile\n```" in two
    assert re.search(r"Run the tests \(about \d+ minutes on a quiet 2-core machine", two)
    assert re.search(r"`python -m pytest -q` alone runs\s+them one after another, about \d+ minutes", two)
    assert re.search(r'`python -m pytest -q (-n auto --dist loadfile )?-m "not slow"` \(about (a|[\d.]+) minutes?[;)]', two)
    # CI runs exactly the README's command
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == "python -m pytest -q -n auto --dist loadfile"
    # the marks of the quick subset stand beside the tests they mark (a renamed test keeps its mark):
    # every ``@pytest.mark.slow`` decorates a test, and the marker is declared
    marked = 0
    for path in sorted((REPO / "tests").glob("test_*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line == "@pytest.mark.slow":
                j = i + 1
                while lines[j].startswith(("@", " ", ")", "]")):  # the other decorators (and their lines)
                    j += 1
                assert lines[j].startswith("def test_"), f"{path.name}:{i + 1}"
                marked += 1
    assert marked
    assert re.search(r'^\s*"slow: ', (REPO / "pyproject.toml").read_text(), re.M)
