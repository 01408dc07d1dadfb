"""The comm suite: NCCL all-reduce / all-gather bus bandwidth, one process per visible GPU.

Each (op, size) is timed by engine.timing.time_op: eager (a collective is not captured), no L2
flush, the ranks aligned by a barrier before each repeat; rank 0 sends its row to the parent, which
writes it as a point. busbw = algbw * 2(n-1)/n for all-reduce and (n-1)/n for all-gather (nccl-tests'
convention), so one number compares across world sizes. NVLink multicast (NVLS) stays off.
"""

from __future__ import annotations

import os
import queue
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.rows import CommRow
from engine.schema import PointStatus
from engine.timing import time_op

SIZES = {"full": [4 << 10 << (2 * i) for i in range(9)],  # 4 KiB .. 256 MiB by 4x, then 1 GiB
         "smoke": [1 << 20, 16 << 20, 64 << 20]}
SIZES["full"].append(1 << 30)
OPS = ("all_reduce", "all_gather")


def bus_factor(op: str, n: int) -> float:
    return (2 * (n - 1) / n) if op == "all_reduce" else ((n - 1) / n)


def _collective(op: str, nbytes: int, world: int, dev: torch.device) -> Callable[[], object]:
    """One call of `op` on a bf16 message of `nbytes` (all_gather: each rank's 1/world part of it)."""
    n = nbytes // 2  # bf16 elements of the full message
    if op == "all_reduce":
        x = torch.ones(n, dtype=torch.bfloat16, device=dev)
        return lambda: dist.all_reduce(x)
    part = torch.ones(n // world, dtype=torch.bfloat16, device=dev)
    full = torch.empty(part.numel() * world, dtype=torch.bfloat16, device=dev)
    return lambda: dist.all_gather_into_tensor(full, part)


def point(op: str, nbytes: int, world: int, dev: torch.device) -> Any:
    """One (op, size) of this rank's process group, timed by engine.timing.time_op, as a comm row."""
    reps = 20 if nbytes < (256 << 20) else 5
    t = time_op(_collective(op, nbytes, world, dev), dev, reps, warmup=3, graph=False, flush=False,
                before=dist.barrier)
    alg = nbytes / (t.p50_us * 1e-6) / 1e9
    return CommRow(op=op, world_size=world, bytes=nbytes, time_us_p50=t.p50_us, algbw_gbps=alg,
                   busbw_gbps=alg * bus_factor(op, world), status=PointStatus.OK)


def _worker(rank: int, world: int, store: str, sizes: list[int], out: Any) -> None:
    """One rank: init NCCL from a file store, time every (op, size), rank 0 reports."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dev = torch.device("cuda", rank)
        for op in OPS:
            for nbytes in sizes:
                row = point(op, nbytes, world, dev)
                if rank == 0:
                    out.put(row)
    finally:
        dist.destroy_process_group()


def skip_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "no CUDA GPU visible: NCCL collectives need at least 2 GPUs"
    if torch.cuda.device_count() < 2:
        return f"{torch.cuda.device_count()} GPU visible: NCCL collectives need at least 2"
    return None


def run(profile: str, on_point: Any) -> None:
    """Spawn one rank per GPU and hand each result row to on_point as it arrives."""
    world = torch.cuda.device_count()
    sizes = SIZES[profile]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), sizes, q), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            got = 0
            while got < len(OPS) * len(sizes):
                try:
                    row = q.get(timeout=5)
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs) or all(not p.is_alive() for p in procs):
                        raise RuntimeError("a comm rank died: " + ", ".join(
                            f"rank {i} exit {p.exitcode}" for i, p in enumerate(procs)))
                    continue
                got += 1
                on_point(row)
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
