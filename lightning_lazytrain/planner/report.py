"""Plain-text tables, timeline plots and sweep CSVs for planner (and, later, measured) results.

No torch here. ``plot_timeline`` takes anything with a ``timeline`` (a list of ``Segment``-like objects
with ``lane``, ``kind``, ``start``, ``end``; ``bytes`` optional) and optionally a ``memory_curve`` (a list of
``(start, end, bytes)``), so the same function draws the simulator's prediction and a measured trace.
"""

from __future__ import annotations

import csv
import math
import os
import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .units import format_bytes

GB = 1e9

# column key -> (header with unit, format)
COLUMNS: dict[str, tuple[str, str]] = {
    "schedule": ("schedule", "{}"),
    "micro_batch_size": ("batch", "{}"),
    "iteration_s": ("iter [s]", "{:.3f}"),
    "tokens_per_s": ("tokens/s", "{:,.0f}"),
    "tflops": ("TFLOPS", "{:.1f}"),
    "peak_gpu_gb": ("peak GPU [GB]", "{:.2f}"),
    "peak_cpu_gb": ("peak CPU [GB]", "{:.1f}"),
    "exposed_s": ("exposed [s]", "{:.3f}"),
    "homes": ("boundaries g/c/n/r", "{}"),  # planner.plan: boundaries by home (gpu/cpu/nvme/recompute)
    "reruns": ("re-runs", "{}"),  # planner.plan: extra layer forwards per micro-batch
    "status": ("status", "{}"),
    "speedup": ("speedup [x]", "{:.3f}"),
    "infeasible": ("note", "{}"),
    "note": ("note", "{}"),
    # training sweeps (lazytrain-train -m)
    "final_val_loss": ("final val loss", "{:.4f}"),
    "step_s_measured": ("step [s] measured", "{:.3f}"),
    "step_s_predicted": ("step [s] predicted", "{:.3f}"),
}

LANE_ORDER = ("compute", "h2d", "d2h", "nvme_read", "nvme_write", "cpu")

KIND_COLORS: dict[str, str] = {
    # compute lane
    "forward": "#4c72b0",
    "head": "#8172b3",
    "backward": "#c44e52",
    "recompute": "#dd8452",
    "local_recompute": "#f0b27a",
    "partial_recompute": "#f5d3a8",
    # transfers
    "weights": "#55a868",
    "recompute_weights": "#a6d99b",
    "reload": "#2a9d8f",
    "grads": "#937860",
    "offload": "#da8bc3",
    "nvme_write": "#8c613c",
    "nvme_read": "#64b5cd",
    # host
    "optimizer": "#7f7f7f",
}
_EXTRA_COLORS = ("#bcbd22", "#17becf", "#e377c2", "#9467bd", "#ff7f0e", "#1f77b4")


# ---- tables ------------------------------------------------------------------------------------------
def _cell(key: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    fmt = COLUMNS.get(key, (key, "{}"))[1]
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and fmt == "{}":
        return f"{value:.4g}"
    try:
        text = fmt.format(value)
    except (ValueError, TypeError):
        return str(value)
    digits = re.fullmatch(r"\{:[,]?\.(\d+)f\}", fmt)
    if isinstance(value, float) and value != 0 and digits and abs(value) < 10.0 ** (1 - int(digits[1])):
        # a small nonzero value that the fixed format would print with one significant digit or none
        # (0.001, 0.000): three, as 0.00062
        return f"{value:.3g}"
    return text


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", "").rstrip("x"))
        return True
    except ValueError:
        return False


def format_value(key: str, value: Any) -> str:
    """``value`` as the table prints it in column ``key`` (e.g. a summary line that quotes a table's figure)."""
    return _cell(key, value)


#: width the legend under a table wraps at (or the table's own width, when wider)
LEGEND_WIDTH = 100


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, *,
                 legend: Sequence[str] | None = None) -> str:
    """Aligned plain-text table of ``rows`` (dicts). Columns: ``columns`` or the union of the rows' keys in
    first-seen order. The last column, ``note``, holds an ``infeasible`` key's reason (as "infeasible: ...",
    the row's numbers shown as ``-``) or a ``note`` key's free text (e.g. a plan over its memory cap). Known
    keys get a header with its unit (see ``COLUMNS``); numbers are right-aligned, missing values shown as
    ``-``. ``legend``: lines that explain the columns, printed under the table (wrapped, each indented by two
    spaces); by default the rows' own ``legend`` attribute if they have one (``PlanResult.rows()``), ``()``
    for none."""
    if legend is None:
        legend = getattr(rows, "legend", None) or ()
    if not rows:
        return "(no rows)"
    note_keys = ("infeasible", "note")
    if columns is None:
        columns = []
        for row in rows:
            for key in row:
                if key not in columns:
                    columns.append(key)
    has_note = any(key in columns for key in note_keys)
    columns = [key for key in columns if key not in note_keys] + (["note"] if has_note else [])
    headers = [COLUMNS.get(key, (key, ""))[0] for key in columns]

    def note(row: Mapping[str, Any]) -> str:
        if "infeasible" in row:
            return "infeasible: " + str(row["infeasible"])
        return "" if row.get("note") in (None, "") else str(row["note"])

    body = [[note(row) if key == "note" else (_cell(key, row.get(key)) if key in row else "-") for key in columns]
            for row in rows]
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(headers)]
    numeric = [all(_is_number(line[i]) or line[i] == "-" for line in body) and columns[i] != "note"
               for i in range(len(columns))]

    def fmt(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)]
        return "  ".join(parts).rstrip()

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(line) for line in body]
    width = max(LEGEND_WIDTH, len(lines[1]))
    for text in legend:
        lines += textwrap.wrap(text, width=width, initial_indent="  ", subsequent_indent="    ",
                               break_on_hyphens=False)
    return "\n".join(lines)


# ---- timeline plot -------------------------------------------------------------------------------------
def _field(seg: Any, name: str, default: Any = None) -> Any:
    if isinstance(seg, Mapping):
        return seg.get(name, default)
    return getattr(seg, name, default)


def plot_timeline(sim: Any, path: str | os.PathLike, title: str = "", cap_bytes: float | None = None, *,
                  memory_curve: Iterable[tuple[float, float, float]] | None = None) -> Path:
    """Draw one iteration: a horizontal bar per op on its lane (compute, h2d, d2h, nvme_read, nvme_write,
    cpu; other lanes after them), colored by kind, and under it the device-memory curve with ``cap_bytes``
    as a dashed line. ``sim``: a ``SimResult`` (or anything with ``.timeline`` / ``.memory_curve``), or a
    plain list of segments (then pass ``memory_curve`` if there is one). Segments may be objects or dicts.
    Writes ``path`` (PNG by extension) with the Agg backend and returns it."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    segments = list(getattr(sim, "timeline", sim) or [])
    curve = list(memory_curve if memory_curve is not None else (getattr(sim, "memory_curve", None) or []))
    lanes = [lane for lane in LANE_ORDER]
    for seg in segments:
        lane = _field(seg, "lane", "?")
        if lane not in lanes:
            lanes.append(lane)
    colors = dict(KIND_COLORS)
    extra = iter(_EXTRA_COLORS * 10)
    by_lane_kind: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for seg in segments:
        start, end = float(_field(seg, "start", 0.0)), float(_field(seg, "end", 0.0))
        if end <= start:
            continue
        kind = str(_field(seg, "kind", "?"))
        if kind not in colors:
            colors[kind] = next(extra)
        by_lane_kind.setdefault((_field(seg, "lane", "?"), kind), []).append((start, end - start))

    has_curve = bool(curve)
    fig, axes = plt.subplots(2 if has_curve else 1, 1, sharex=True, squeeze=False,
                             figsize=(14, 6.5 if has_curve else 4.0),
                             gridspec_kw={"height_ratios": [3, 2] if has_curve else [1]})
    ax = axes[0][0]
    ypos = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    for (lane, kind), spans in by_lane_kind.items():
        ax.broken_barh(spans, (ypos[lane] - 0.4, 0.8), facecolors=colors[kind], edgecolor="none")
    ax.set_yticks([ypos[lane] for lane in lanes], lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    used = [k for k in colors if any(kind == k for _, kind in by_lane_kind)]
    if used:
        ax.legend(handles=[Patch(facecolor=colors[k], label=k) for k in used], loc="upper left",
                  bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "timeline")
    ax.grid(axis="x", alpha=0.3)
    if has_curve:
        mx = axes[1][0]
        xs: list[float] = []
        ys: list[float] = []
        for start, end, nbytes in curve:
            xs += [start, end]
            ys += [nbytes / GB, nbytes / GB]
        mx.fill_between(xs, ys, step=None, alpha=0.3, color="#4c72b0")
        mx.plot(xs, ys, color="#4c72b0", linewidth=1.0, label="device memory")
        top = max(ys) if ys else 0.0
        if cap_bytes:
            mx.axhline(cap_bytes / GB, color="#c44e52", linestyle="--", linewidth=1.2,
                       label=f"cap {format_bytes(cap_bytes)}")
            top = max(top, cap_bytes / GB)
        mx.set_ylim(0, top * 1.1 if top > 0 else 1)
        mx.set_ylabel("GPU memory [GB]")
        mx.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
        mx.grid(alpha=0.3)
        mx.set_xlabel("time [s]")
    else:
        ax.set_xlabel("time [s]")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- sweep CSV --------------------------------------------------------------------------------------
SWEEP_COLUMNS = (
    "job", "hardware", "model", "params_b", "micro_batch_size", "batch_source", "seq_len", "status", "reason",
    "plan_iteration_s", "plan_tokens_per_s", "plan_tflops", "plan_peak_gpu_gb", "plan_exposed_s", "plan_homes",
    "megatrain_iteration_s", "megatrain_tokens_per_s", "megatrain_tflops", "megatrain_peak_gpu_gb",
    "megatrain_exposed_s", "megatrain_reason", "speedup", "solver_status", "mip_gap", "solve_seconds",
    "output_dir",
)


def write_sweep_csv(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]],
                    columns: Sequence[str] = SWEEP_COLUMNS) -> Path:
    """Write one CSV row per sweep job (``columns`` first, then any extra keys in first-seen order).
    Missing values are empty cells; floats keep full precision. Returns the path."""
    rows = list(rows)
    header = list(columns)
    for row in rows:
        for key in row:
            if key not in header:
                header.append(key)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=header, extrasaction="ignore", restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return path
