"""Numbers with their units: bytes (GB, or GiB for powers of two) and FLOP or FLOP/s."""

from __future__ import annotations


def fmt_bytes(n: float, binary: bool = False) -> str:
    """Bytes with a unit: decimal by default (``fmt_bytes(3.2e9) == '3.20 GB'``), or binary for sizes that
    are powers of two (``fmt_bytes(64 * 2**20, binary=True) == '64 MiB'``)."""
    if binary:
        for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
            if abs(n) >= scale:
                return f"{n / scale:g} {unit}"
        return f"{int(n)} B"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_flops(n: float, per_s: bool = True) -> str:
    """FLOP or FLOP/s with a unit, e.g. ``fmt_flops(2.5e12) == '2.50 TFLOP/s'``."""
    suffix = "FLOP/s" if per_s else "FLOP"
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}{suffix}"
    return f"{n:.0f} {suffix}"
