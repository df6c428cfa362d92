"""Human-readable bytes and seconds, as the cost model's reports print them."""

from __future__ import annotations


def bytes_str(n: float) -> str:
    """Human-readable bytes (KiB/MiB/GiB)."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def time_str(s: float) -> str:
    """Human-readable seconds."""
    return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.2f} us"
