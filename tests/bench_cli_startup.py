"""Wall time of `kdbench` commands: start-up (`--help`, `hosts list`) and what-if answers (`project`).

A benchmark, not a test (no timed tests): `make bench-cli`, or `python tests/bench_cli_startup.py [-n N]`.
Prints the median and the best of N runs per command, and each command's median as a multiple of
`python -c pass` (the interpreter's own start-up, timed the same way). Goals on a 2-core controller:
`kdbench --help` at most 5x `python -c pass`; start-up < 0.5 s;
`kdbench project` from the repo's H200 reference < 2 s for one configuration within memory and for the
48 configurations of a host page's what-if grid (process start, imports, fitting the step model and
answering, all counted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

KDBENCH = str(Path(sys.executable).parent / "kdbench")
GRID = ["-c", "1,4,16,64", "--context", "1024,8192,32768,131072", "--accept", "4.0,4.6,7.1"]
COMMANDS = (["--help"], ["hosts", "list"], ["project", "b300", "-c", "16", "--context", "32768", "--accept", "4"],
            ["project", "pro6000", *GRID])


def wall_s(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def median_s(cmd: list[str], n: int) -> tuple[float, float]:
    """(median, best) of n runs after one warm-up run."""
    wall_s(cmd)
    times = [wall_s(cmd) for _ in range(n)]
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=10, help="runs per command (after one warm-up run)")
    n = ap.parse_args().n
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {n} runs each")
    base, best = median_s([sys.executable, "-c", "pass"], n)
    print(f"{'python -c pass':<48} median {base:.3f} s, best {best:.3f} s")
    for argv in COMMANDS:
        med, best = median_s([KDBENCH, *argv], n)
        name = " ".join(argv) if len(argv) < 10 else " ".join(argv[:2]) + " (48-cell grid)"
        print(f"kdbench {name:<40} median {med:.3f} s, best {best:.3f} s, {med / base:.1f}x python -c pass")


if __name__ == "__main__":
    main()
