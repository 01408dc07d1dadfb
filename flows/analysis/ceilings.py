"""Machines, their ceilings and their links: what every projection and the step model start from.

A machine is a spec sheet, a GPU count and an interconnect. Its attainable ceilings are the spec
peaks times the fractions a measurement reached (runs.copy_gbps / matmul_tflops against the spec),
carried to another spec sheet as the same fractions. An all-reduce over n GPUs costs
alpha + 2(n-1)/n x bytes / link bandwidth (ring), with alpha and the link efficiency calibrated on
the reference's measured all-reduce rows when it has any. Pure functions of tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, overload

import pyarrow as pa

from engine.rows import CommRow, E2ERow, KernelRow, RunRow, table_rows
from flows.inventory.hosts import Spec

# All-reduce constants used when the reference has no comm measurement of its own.
DEFAULT_ALPHA_US = {"nvlink": 8.0, "pcie": 15.0}
DEFAULT_LINK_EFF = (0.6, 0.75, 0.9)   # low, central, high fraction of the link's spec bandwidth
ALLREDUCES_PER_LAYER = 2              # after attention and after the MoE


class ProjectionError(Exception):
    """A projection that cannot be made; the message names the host, spec or reference."""


@dataclass(frozen=True)
class Machine:
    """What a projection needs of a machine: its spec sheet, GPU count and links."""

    name: str
    spec: Spec
    gpus: int
    interconnect: str


Tables = dict[str, pa.Table]


@overload
def rows_of(tables: Mapping[str, pa.Table], name: Literal["runs"]) -> list[RunRow]: ...
@overload
def rows_of(tables: Mapping[str, pa.Table], name: Literal["kernels"]) -> list[KernelRow]: ...
@overload
def rows_of(tables: Mapping[str, pa.Table], name: Literal["e2e"]) -> list[E2ERow]: ...
@overload
def rows_of(tables: Mapping[str, pa.Table], name: Literal["comm"]) -> list[CommRow]: ...
@overload
def rows_of(tables: Mapping[str, pa.Table], name: str) -> list[Any]: ...
def rows_of(tables: Mapping[str, pa.Table], name: str) -> list[Any]:
    """The typed rows (engine.rows) of one of a run's tables; none where the run lacks the table."""
    return table_rows(tables[name], name) if name in tables else []


# -- ceilings -----------------------------------------------------------------------------------

# engine.bench writes torch dtype names; spec sheets key their peaks by the short names
DTYPE_KEYS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
              "float8_e4m3fn": "fp8", "int8": "int8"}


def peak_tflops(spec: Spec, dtype: str) -> float:
    """Dense peak of the kernel's math dtype; mixed formats (w4a16) and integers run on bf16 units."""
    for key in (DTYPE_KEYS.get(dtype, dtype), "bf16", "fp16"):
        if spec.tflops.get(key):
            return spec.tflops[key]
    return max(spec.tflops.values())


@dataclass(frozen=True)
class Ceilings:
    """Attainable GB/s and TFLOP/s of a device: its spec peaks times the fractions a measurement reached."""

    spec: Spec
    bw_frac: float
    fl_frac: float
    mm_dtype: str          # the dtype of the measured matmul ceiling

    @property
    def gbps(self) -> float:
        return self.spec.mem_bw_gbps * self.bw_frac

    def tflops(self, dtype: str | None = None) -> float:
        return peak_tflops(self.spec, dtype or self.mm_dtype) * self.fl_frac

    def of(self, dtype: str) -> tuple[float, float]:
        return self.gbps, self.tflops(dtype)

    def carried_to(self, spec: Spec) -> "Ceilings":
        """The same fractions of another spec sheet: how the reference's ceilings travel."""
        return Ceilings(spec, self.bw_frac, self.fl_frac, self.mm_dtype)


def measured_ceilings(runs: pa.Table, spec: Spec) -> Ceilings:
    """runs.copy_gbps / matmul_tflops against the spec (the spec itself when not measured)."""
    rows = table_rows(runs, "runs")
    copy = max((r.copy_gbps for r in rows if r.copy_gbps), default=None)
    mm = max((r.matmul_tflops for r in rows if r.matmul_tflops), default=None)
    mm_dtype = "float32" if any(r.device == "cpu" for r in rows) else "bfloat16"   # as engine.bench times it
    return Ceilings(spec, copy / spec.mem_bw_gbps if copy else 1.0,
                    mm / peak_tflops(spec, mm_dtype) if mm else 1.0, mm_dtype)


def link_gbps(spec: Spec, interconnect: str) -> float | None:
    if interconnect == "nvlink":
        return spec.nvlink_gbps or spec.pcie_gbps
    if interconnect == "pcie":
        return spec.pcie_gbps
    return None


def allreduce_us(nbytes: float, n: int, alpha_us: float, bw_gbps: float) -> float:
    """Ring all-reduce: latency + 2(n-1)/n x bytes / link bandwidth; free on one GPU."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return alpha_us + 2 * (n - 1) / n * nbytes / (bw_gbps * 1e3)


@dataclass(frozen=True)
class CommModel:
    alpha_us: float
    effs: tuple[float, float, float]   # low, central, high fraction of the link bandwidth
    link_gbps: float | None
    n: int
    calibrated: bool

    def time_us(self, nbytes: float, which: int = 1, n: int | None = None) -> float:
        n = self.n if n is None else n
        if n <= 1 or not self.link_gbps:
            return 0.0
        return allreduce_us(nbytes, n, self.alpha_us, self.link_gbps * self.effs[which])


def comm_model(comm_rows: list[CommRow], ref: Machine, target: Machine) -> CommModel:
    """Alpha and link efficiency from the reference's all-reduce measurements, else defaults."""
    link = link_gbps(target.spec, target.interconnect)
    rows = [r for r in comm_rows
            if r.op == "all_reduce" and r.status == "ok" and r.time_us_p50 and r.busbw_gbps]
    ref_link = link_gbps(ref.spec, ref.interconnect)
    if rows and ref_link:
        small = min(r.bytes for r in rows)
        alpha = min(r.time_us_p50 for r in rows if r.bytes == small)
        effs = sorted(min(r.busbw_gbps / ref_link, 1.0) for r in rows if r.bytes >= 1 << 24) \
            or sorted(min(r.busbw_gbps / ref_link, 1.0) for r in rows)
        return CommModel(alpha, (effs[0], effs[-1], effs[-1]), link, target.gpus, True)
    alpha = DEFAULT_ALPHA_US.get(target.interconnect, DEFAULT_ALPHA_US["pcie"])
    return CommModel(alpha, DEFAULT_LINK_EFF, link, target.gpus, False)
