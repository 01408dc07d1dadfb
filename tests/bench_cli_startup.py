"""Start-up time of the `kdbench` CLI: wall time of `kdbench --help` and `kdbench hosts list`.

A benchmark, not a test (no timed tests): `make bench-cli`, or `python tests/bench_cli_startup.py [-n N]`.
Prints the median and the best of N runs per command; the goal on a 2-core controller is < 0.5 s.
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
COMMANDS = (["--help"], ["hosts", "list"])


def wall_s(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([KDBENCH, *argv], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=10, help="runs per command (after one warm-up run)")
    n = ap.parse_args().n
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {n} runs each")
    for argv in COMMANDS:
        wall_s(argv)
        times = [wall_s(argv) for _ in range(n)]
        print(f"kdbench {' '.join(argv):<12} median {statistics.median(times):.3f} s, best {min(times):.3f} s")


if __name__ == "__main__":
    main()
