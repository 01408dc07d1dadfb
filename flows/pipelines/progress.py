"""The host's output as the run's logs show it: `KDBENCH {json}` progress lines as one short,
readable line each, and a bound on how many lines of one command reach the logs at all.

engine.bench prints one event per point (the result row's set columns, read here by engine.rows'
COLUMNS names) and one when a suite ends (its status and points, named as the runs row's); the
flow's log shows `kernels 3/40 moe_w4a16 triton M=8 N=4096 K=7168: 152.3 us, 812.1 GB/s` instead
(the raw rows stay in the result files). Everything in an event comes from the host: only numbers
are formatted, strings go through flows.inventory.scrub.plain (one line, redacted, cut short).

`Forward` bounds what one command can put in the Prefect database: its first HEAD_LINES lines as
they come (a full sweep's progress lines fit), then, when it ends, one line saying how many were
dropped and its last TAIL_LINES lines (where a failure says why).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable

from engine.rows import COLUMNS as C
from engine.table_checks import loads_untrusted
from flows.inventory.scrub import plain

EVENT = "KDBENCH "
_MAX_TEXT = 40
HEAD_LINES = 1000   # of one command's output lines, logged as they come (a full sweep prints under 100 points)
TAIL_LINES = 200    # and its last lines, logged when it ends
_KERNEL_SHAPE = (C.tp, C.M, C.N, C.K, C.E, C.top_k, C.batch, C.budget, C.context)


def _text(v: Any) -> str:
    return plain(v, cap=_MAX_TEXT)


def _num(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _int(v: Any) -> str | None:
    n = _num(v)
    return str(int(n)) if n is not None and n == int(n) else None


def _fig(v: Any, unit: str, digits: int = 1) -> str | None:
    """`digits` decimals, or three significant digits for small figures (a CPU's 0.0123 GB/s)."""
    n = _num(v)
    if n is None:
        return None
    return f"{n:.{digits}f} {unit}" if abs(n) >= 10 ** (2 - digits) or n == 0 else f"{n:.3g} {unit}"


def _time_us(v: Any) -> str | None:
    n = _num(v)
    if n is None:
        return None
    return _fig(n, "us") if n < 1e4 else _fig(n / 1e3, "ms") if n < 1e7 else _fig(n / 1e6, "s", 2)


def _bytes(v: Any) -> str:
    n = _num(v)
    if n is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def _label(suite: str, ev: dict[str, Any]) -> tuple[str, list[str | None]]:
    """The point's label and its figures (time first, then the headline), by suite."""
    if suite == "kernels":
        shape = [f"{k}={_int(ev[k])}" for k in _KERNEL_SHAPE if _int(ev.get(k)) is not None]
        label = " ".join([_text(ev.get(C.kernel, "?")), _text(ev.get(C.impl, "?")), *shape])
        head = _fig(ev.get(C.achieved_gbps), "GB/s") or _fig(ev.get(C.achieved_tflops), "TF/s", 2)
        return label, [_time_us(ev.get(C.time_us_p50)), head]
    if suite == "e2e":
        label = " ".join([_text(ev.get(C.config, "?")), f"C={_int(ev.get(C.concurrency)) or '?'}",
                          f"B={_int(ev.get(C.budget)) or '?'}"])
        accept = _fig(ev.get(C.accept_len_mean), "accepted/step", 2)
        return label, [_fig(ev.get(C.step_ms_p50), "ms/step", 2), _fig(ev.get(C.tokens_per_s), "tokens/s"), accept]
    if suite == "comm":
        label = " ".join([_text(ev.get(C.op, "?")), f"n={_int(ev.get(C.world_size)) or '?'}",
                          _bytes(ev.get(C.bytes))])
        if ev.get(C.status) == "skipped":
            return label, [f"skipped ({_text(ev.get(C.skip_reason, ''))})"]
        return label, [_time_us(ev.get(C.time_us_p50)), _fig(ev.get(C.busbw_gbps), "GB/s bus")]
    return "", []


def log_line(suite: str, line: str) -> tuple[str, dict[str, Any] | None]:
    """(what to log, the event or None) for one line of a suite's output.

    Progress events become `<suite> i/n <label>: <time>, <headline>`; any other line is logged
    as the host printed it, prefixed with `<suite>: ` (no brackets: rich would read `[e2e]` as markup).
    """
    if not line.startswith(EVENT):
        return f"{suite}: {line}", None
    ev = loads_untrusted(line[len(EVENT):])
    if not isinstance(ev, dict):
        return f"{suite}: unreadable progress line ({len(line)} characters)", None
    if ev.get("event") == "done":
        return f"{suite} done: {_text(ev.get(C.status, '?'))}, {_int(ev.get(C.points)) or 0} points", ev
    if ev.get("event") != "point":
        return f"{suite}: progress event {_text(ev.get('event', '?'))}", ev
    label, figures = _label(suite, ev)
    head = f"{suite} {_int(ev.get('i')) or '?'}/{_int(ev.get('n')) or '?'}" + (f" {label}" if label else "")
    figs = ", ".join(f for f in figures if f)
    return head + (f": {figs}" if figs else ""), ev


class Forward:
    """One command's output lines to `emit` (the run's logger), bounded: the first `head` as they
    come, then at `close` one line saying how many were dropped and the last `tail` lines. The lines
    given are already scrubbed (flows.inventory.scrub: one capped line each), so memory is bounded too."""

    def __init__(self, emit: Callable[[str], None], head: int = HEAD_LINES, tail: int = TAIL_LINES):
        self._emit, self._head = emit, head
        self._last: deque[tuple[int, str]] = deque(maxlen=tail)
        self.count = 0

    def __call__(self, line: str) -> None:
        if self.count < self._head:
            self._emit(line)
        self._last.append((self.count, line))
        self.count += 1

    @property
    def last(self) -> list[str]:
        """The command's last lines (logged or not): what a failure's artifact quotes."""
        return [line for _, line in self._last]

    def close(self) -> None:
        """Log what the head left out (once, when the command has ended): how many lines were dropped, then the tail."""
        rest = [line for i, line in self._last if i >= self._head]
        dropped = self.count - self._head - len(rest)
        if dropped > 0:
            self._emit(f"[kdbench: {dropped} lines of output dropped here; the first {self._head} and the "
                       f"last {len(rest)} are logged]")
        for line in rest:
            self._emit(line)
