"""format_bytes: byte counts in the unit that keeps three significant digits (human units)."""

from __future__ import annotations

import math

import pytest

from lightning_lazytrain.planner.units import format_bytes


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1, "1 B"), (512, "512 B"), (999, "999 B"), (999.4, "999 B"),
    (999.5, "1.00 kB"), (1000, "1.00 kB"), (1500, "1.50 kB"), (9_994, "9.99 kB"), (99_949, "99.9 kB"),
    (99_950, "100 kB"), (999_499, "999 kB"), (999_500, "1.00 MB"), (23.4e6, "23.4 MB"), (72.84e9, "72.8 GB"),
    (70e9, "70.0 GB"), (2199e9, "2.20 TB"), (5e15, "5000 TB"),
])
def test_decimal_units_keep_three_significant_digits(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1000, "1000 B"), (1023, "1023 B"), (1023.6, "1.00 KiB"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (1000 * 1024, "1000 KiB"), (2**20, "1.00 MiB"), (23.4 * 2**20, "23.4 MiB"), (2**30, "1.00 GiB"),
    (1.5 * 2**40, "1.50 TiB"), (4096 * 2**40, "4096 TiB"),
])
def test_binary_units(n, text):
    assert format_bytes(n, binary=True) == text


def test_negative_values_keep_their_sign_and_zero_has_none():
    assert format_bytes(-1.5e9) == "-1.50 GB"
    assert format_bytes(-512) == "-512 B"
    assert format_bytes(-3 * 2**20, binary=True) == "-3.00 MiB"
    assert format_bytes(-0.3) == "0 B" and format_bytes(-0.0) == "0 B"


def test_digits_and_odd_inputs():
    assert format_bytes(72.844e9, digits=4) == "72.84 GB"
    assert format_bytes(72.844e9, digits=1) == "73 GB"  # integer digits are never dropped
    assert format_bytes(1234, digits=6) == "1.23400 kB"
    assert format_bytes(math.inf) == "inf B" and format_bytes(-math.inf) == "-inf B"
    with pytest.raises(ValueError, match="digits"):
        format_bytes(1, digits=0)


def test_no_small_value_prints_as_zero_point_zero_zero():
    for n in (1, 7, 999, 1001, 12_345, 999_999, 1e7, 3.3e8, 5e9, 6e11):
        for binary in (False, True):
            text = format_bytes(n, binary=binary)
            number, unit = text.split(" ")
            assert not number.startswith("0"), text
            assert len(number.replace(".", "")) >= 3 or unit == "B", text


def test_simulator_messages_use_human_units():
    """A schedule over a small device cap says how many kB/MB it needs, not "0.00 GB"."""
    from lightning_lazytrain.planner import InfeasibleSchedule, keep_all, simulate
    from planner_helpers import hardware, workload

    wl = workload([1e-3] * 2, A=20e3, internal=80e3, param_bytes=30e3)
    with pytest.raises(InfeasibleSchedule) as err:
        simulate(keep_all(2), wl, hardware(50e3))
    text = str(err.value)
    assert "0.00" not in text and "cap is 50.0 kB" in text and "needs " in text
