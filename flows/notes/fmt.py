"""How the notes print a figure: fixed formats, and "-" wherever a stored figure makes one meaningless.

Every division by a stored figure goes through `per` (a zero, NaN or missing denominator gives NaN),
and every format below shows NaN or None as "-", so one odd host number never breaks a page.
"""

from __future__ import annotations

import math


def per(num: float | None, den: float | None) -> float:
    """num / den, or NaN where a stored figure makes it meaningless (a zero, negative, missing or
    non-finite denominator, a missing numerator): no page divides by a host's number unguarded, and
    NaN shows as "-" (fmt, sig, share) and is skipped by the plots."""
    if num is None or den is None or not math.isfinite(den) or den <= 0:
        return math.nan
    return num / den


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def band_text(lo: float | None, hi: float | None, digits: int = 1) -> str:
    """`lo-hi`, or `unknown` for a band the evidence cannot give (flows.analysis.bands)."""
    return "unknown" if lo is None or hi is None else f"{fmt(lo, digits)}-{fmt(hi, digits)}"


def sig(x: float | None) -> str:
    """Four significant digits: ceilings span CPU sandboxes (GB/s) to B300s (TB/s)."""
    return "-" if x is None or not math.isfinite(x) else f"{x:.4g}"


def share(x: float | None, spec: str = ".0%") -> str:
    """A fraction as a percentage (`spec`), "-" where it could not be computed."""
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def bandwidth(gbps: float, *more: float) -> str:
    """`3.78 TB/s`, or `11.2 GB/s` below 1 TB/s; extra values (a band) share the first one's unit."""
    scale, unit, spec = (1e3, "TB/s", ".2f") if gbps >= 1e3 else (1.0, "GB/s", ".3g")
    band = f" ({'-'.join(format(x / scale, spec) for x in more)})" if more else ""
    return f"{gbps / scale:{spec}} {unit}{band}"
