"""The modelled all-reduce of a tensor-parallel rank run alone on one GPU (alpha-beta).

One all-reduce of `nbytes` over n ranks takes alpha + 2(n-1)/n * nbytes / busbw (nccl-tests'
bus-bandwidth convention, the comm suite's busbw_gbps). A forward of T tokens runs two per layer
(after attention, after the FFN) of T x hidden x 2 bytes (bf16), plus one all-gather of each rank's
(max, argmax) for the greedy pick over the vocab shards, counted at latency alone.

The default is a fit of the committed H200 reference's 2-GPU all-reduce rows (the controller can
pass its own from measured comm rows: `--comm-model`, see `parse`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

# Message sizes the fit covers: up to the largest the e2e suite sends (C=16, B=256: 59 MB).
FIT_MAX_BYTES = 64 << 20
_SOURCE = re.compile(r"^[A-Za-z0-9 ._:/+=,()-]{1,200}$")


@dataclass(frozen=True)
class CommModel:
    alpha_us: float  # per all-reduce latency
    busbw_gbps: float  # bus bandwidth, nccl-tests convention
    source: str  # where the two figures came from (recorded in the run's note)

    def all_reduce_us(self, nbytes: float, n: int) -> float:
        return self.alpha_us + 2 * (n - 1) / n * nbytes / (self.busbw_gbps * 1e3)

    def forward_ms(self, tokens: int, hidden: int, layers: int, n: int) -> float:
        """Collectives of one forward of `tokens` tokens at TP n (0 at n = 1)."""
        if n == 1:
            return 0.0
        return (2 * layers * self.all_reduce_us(tokens * hidden * 2, n) + self.alpha_us) / 1e3

    def describe(self) -> str:
        return f"alpha {self.alpha_us:.1f} us, busbw {self.busbw_gbps:.0f} GB/s ({self.source})"


def fit(rows: Iterable[Mapping]) -> tuple[float, float]:
    """(alpha_us, busbw_gbps) of measured all-reduce rows (bytes, time_us_p50, world_size): least
    squares in relative error over the sizes up to FIT_MAX_BYTES."""
    pts = [(r["bytes"] * 2 * (r["world_size"] - 1) / r["world_size"], r["time_us_p50"]) for r in rows
           if r.get("op", "all_reduce") == "all_reduce" and r["bytes"] <= FIT_MAX_BYTES
           and r.get("time_us_p50") and r["world_size"] >= 2]
    if len(pts) < 2:
        raise ValueError("comm model fit needs at least two all-reduce sizes")
    x, t = np.array(pts, dtype=np.float64).T
    a = np.stack([np.ones_like(x), x], 1) / t[:, None]
    alpha, per_byte = np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0]
    if per_byte <= 0:
        raise ValueError("comm model fit: time does not grow with size")
    return float(max(alpha, 0.0)), float(1.0 / per_byte / 1e3)


# fit(...) of artifacts/reference/h200/comm.arrow, all_reduce at world 2, 4 KiB .. 64 MiB
# (run 20261130T080310Z-h200ref, 2x H200 over NVLink)
DEFAULT = CommModel(34.4, 239.9, "fit of the h200 reference 2-GPU all-reduce, run 20261130T080310Z-h200ref")


def parse(text: str) -> CommModel:
    """`--comm-model` JSON: {"alpha_us": float, "busbw_gbps": float, "source": str}."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg})") from None
    if not isinstance(raw, dict) or set(raw) != {"alpha_us", "busbw_gbps", "source"}:
        raise ValueError('want an object with exactly "alpha_us", "busbw_gbps" and "source"')
    alpha, bw, src = raw["alpha_us"], raw["busbw_gbps"], raw["source"]
    for name, v in (("alpha_us", alpha), ("busbw_gbps", bw)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if bw <= 0:
        raise ValueError("busbw_gbps must be > 0")
    if not isinstance(src, str) or not _SOURCE.match(src):
        raise ValueError("source must be 1..200 letters, digits, spaces or ._:/+=,()-")
    return CommModel(float(alpha), float(bw), src)
