"""Wall time of `kdbench` commands: start-up (`--help`, `hosts list`) and what-if answers (`project`).

A benchmark, not a test (no timed tests): `make bench-cli`, or `python tests/bench_cli_startup.py [-n N]`.
Prints the median and the best of N runs per command. Goals on a 2-core controller: start-up < 0.5 s;
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
        name = " ".join(argv) if len(argv) < 10 else " ".join(argv[:2]) + " (48-cell grid)"
        print(f"kdbench {name:<40} median {statistics.median(times):.3f} s, best {min(times):.3f} s")


if __name__ == "__main__":
    main()
