"""Stage (a): the test suite's GPU tests, ``pytest -m gpu -q``.

CUDA: must exit 0 with at least one test passed and none failed or in error; tests skipped on the
device are listed (a GPU test skipped on a GPU usually means a missing package).
CPU rehearsal: the same command; every GPU test must be collected (so every test module imports
with the carried wheels) and skip cleanly. The stage is then recorded as ``skipped``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from kit import ROOT, Stage, StageSkipped, stage_main


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--timeout", type=float, default=140)


def summary_counts(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line ('3 passed, 2 skipped, 440 deselected in 9.8s')."""
    lines = [ln for ln in text.splitlines() if re.search(r"\b(passed|failed|skipped|error|errors|deselected)\b", ln)
             and re.search(r" in [\d.]+s", ln)]
    counts: dict[str, int] = {}
    if lines:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)",
                                  lines[-1]):
            counts[what.rstrip("s") if what.startswith(("error", "warning")) else what] = int(n)
    return counts


def body(st: Stage, args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rsfE", "-p", "no:cacheprovider", "tests"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    out = r.stdout + r.stderr
    print(out[-6000:], flush=True)
    counts = summary_counts(out)
    skipped_lines = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    st.figures.update({"command": " ".join(cmd[1:]), "exit_status": r.returncode, "counts": counts,
                       "skipped": skipped_lines[:20]})
    failed = counts.get("failed", 0) + counts.get("error", 0)
    if args.device == "cpu":
        ran = counts.get("skipped", 0)
        st.check(r.returncode == 0 and failed == 0 and counts.get("passed", 0) == 0 and ran > 0,
                 f"on the CPU every GPU test should be collected and skipped; got exit {r.returncode}, {counts}")
        if not st.failures:
            raise StageSkipped(f"no CUDA device: {ran} GPU tests collected, all skipped by their CUDA checks")
        return
    st.check(r.returncode == 0, f"pytest exited with status {r.returncode} ({counts})")
    st.check(counts.get("passed", 0) > 0, f"no GPU test passed ({counts})")
    st.check(failed == 0, f"{failed} GPU tests failed or errored")
    if counts.get("skipped"):
        st.note(f"{counts['skipped']} GPU tests skipped on the device: {skipped_lines[:3]}")


if __name__ == "__main__":
    raise SystemExit(stage_main("pytest_gpu", body, add_args))
