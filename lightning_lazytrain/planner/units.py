"""Byte counts: the planner's dtype sizes (``DTYPE_BYTES``), and for people: ``format_bytes(23_400_000) == "23.4 MB"`` (torch-free, stdlib only).

Messages use this instead of a fixed divisor, so a small size reads "512 B" or "1.50 kB", not "0.00 GB".
Machine-read figures (table columns headed "[GB]", sweep.csv, plan.json) stay plain numbers.
"""

from __future__ import annotations

import math

# bytes per element of the dtypes a plan names (``TrainSpec.dtype``/``grad_dtype``)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

DECIMAL_UNITS = ("B", "kB", "MB", "GB", "TB")
BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def _significant(v: float, digits: int) -> str:
    """``v`` (>= 0) with ``digits`` significant digits, never dropping integer digits."""
    if v == 0:
        return "0"
    exp = math.floor(math.log10(v))
    decimals = max(digits - 1 - exp, 0)
    text = f"{v:.{decimals}f}"
    if decimals and float(text) >= 10 ** (exp + 1):  # rounding carried into a new digit (9.996 -> 10.00)
        text = f"{v:.{decimals - 1}f}"
    return text


def format_bytes(n: float, *, binary: bool = False, digits: int = 3) -> str:
    """``n`` bytes in the unit that keeps ``digits`` significant digits in view: B, kB, MB, GB, TB
    (powers of 1000), or B, KiB, MiB, GiB, TiB with ``binary`` (powers of 1024).

    The number shown is below the unit step (1000 or 1024) unless the unit is TB/TiB; bytes print
    as a whole number. A negative ``n`` (a deficit) keeps its sign; a value that rounds to zero
    prints "0 B". Examples: 0 -> "0 B", 512 -> "512 B", 1500 -> "1.50 kB", 23.4e6 -> "23.4 MB",
    -1.5e9 -> "-1.50 GB", 2**30 (binary) -> "1.00 GiB".
    """
    if digits < 1:
        raise ValueError(f"digits={digits!r}: must be >= 1")
    n = float(n)
    if not math.isfinite(n):
        return f"{n} B"
    units = BINARY_UNITS if binary else DECIMAL_UNITS
    step = 1024 if binary else 1000
    mag = abs(n)
    k = 0
    while k < len(units) - 1 and mag >= step ** (k + 1):
        k += 1
    while True:
        text = str(round(mag)) if k == 0 else _significant(mag / step**k, digits)
        if float(text) >= step and k < len(units) - 1:  # 999.7 B -> "1000" -> 1.00 kB
            k += 1
            continue
        break
    if float(text) == 0:
        return "0 B"
    return f"{'-' if n < 0 else ''}{text} {units[k]}"


def format_bytes_at_least(n: float, *, digits: int = 4, binary: bool = False) -> str:
    """``format_bytes`` rounded up at the shown precision: the figure printed is never below ``n`` (a smallest
    budget that works, which a user types back in)."""
    text = format_bytes(n, digits=digits, binary=binary)
    number, _, unit = text.partition(" ")
    units = BINARY_UNITS if binary else DECIMAL_UNITS
    if unit not in units:
        return text
    scale = (1024 if binary else 1000) ** units.index(unit)
    if float(number) * scale >= n:
        return text
    decimals = len(number.split(".")[1]) if "." in number else 0
    up = (math.floor(n / scale * 10 ** decimals) + 1) / 10 ** decimals
    return f"{up:.{decimals}f} {unit}"

