"""Arrow schemas of the result tables: the contract between the host payload and the controller.

Every table is written by `engine.bench` on a GPU host, checked by the controller when pulled,
and extended (never redefined) by the projection, which fills the nullable projection columns and
sets `source` to "projected". The schema version travels in each file's metadata, so a reader can
refuse files it does not understand instead of misreading them.

This module is the contract only: the tables' columns, the values each may hold, the states, the
provenance keys and what an older version means by a column it lacks. engine.table_files writes and
reads the files, engine.table_checks holds a table to this contract.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = "4"
READABLE_VERSIONS = ("2", "3", "4")   # older files read with the later columns at their defaults (_ADDED)
TABLES = ("runs", "kernels", "e2e", "comm")
SOURCES = ("measured", "projected")

_f = pa.field
_s, _i, _d = pa.string(), pa.int64(), pa.float64()

# Provenance: the same keys in the runs table and in every file's metadata.
PROVENANCE_KEYS = (
    "run_id", "host", "gpu_name", "gpu_count", "driver", "cuda", "torch", "triton",
    "python", "payload_hash", "arch", "device", "started_at", "ended_at",
)
# Keys the controller adds to the provenance of the files it writes: a projection's or what-if grid's
# reference (and the projection's target spec figures and assumptions, the grid's question and answers);
# an import's origin, the outside machine, date, source, implementation, notes, spec sheet and link.
ADDED_PROVENANCE_KEYS = (
    "reference_run_id", "reference_host", "references", "spec", "assumptions", "what", "answers",
    "origin", "machine", "date", "source", "impl", "notes", "interconnect",
)

SCHEMAS: dict[str, pa.Schema] = {
    "runs": pa.schema([
        _f("run_id", _s, False), _f("host", _s, False), _f("suite", _s, False),
        _f("profile", _s, False), _f("status", _s, False),  # RunStatus
        _f("gpu_name", _s), _f("gpu_count", _i), _f("driver", _s), _f("cuda", _s),
        _f("torch", _s), _f("triton", _s), _f("python", _s), _f("payload_hash", _s),
        _f("arch", _s), _f("device", _s),  # device: cuda | cpu
        _f("started_at", _s), _f("ended_at", _s),
        _f("copy_gbps", _d), _f("matmul_tflops", _d),  # this device's own ceilings
        _f("points", _i), _f("note", _s), _f("source", _s, False),
    ]),
    "kernels": pa.schema([
        _f("run_id", _s, False), _f("kernel", _s, False), _f("impl", _s, False),
        _f("dtype", _s, False), _f("device", _s, False),
        _f("op", _s),  # dense_gemm: which op of a step it times (engine.costs.dense_ops); null elsewhere
        _f("M", _i), _f("N", _i), _f("K", _i), _f("E", _i), _f("top_k", _i),
        _f("tp", _i),  # 1 for full shapes, N for the shapes one rank of a TP-N deployment runs
        _f("unique_experts", _i), _f("expected_experts", _d),
        _f("budget", _i), _f("context", _i), _f("batch", _i),
        _f("time_us_p10", _d), _f("time_us_p50", _d, False), _f("time_us_p90", _d),
        _f("host_us", _d),  # host time of one eager call, called back to back (null where not measured)
        _f("repeats", _i), _f("bytes", _d, False), _f("flops", _d, False),
        _f("achieved_gbps", _d), _f("achieved_tflops", _d),
        _f("source", _s, False),
        # projection only (null when measured)
        _f("reference_run_id", _s), _f("regime", _s), _f("reference_regime", _s),
        _f("time_us_low", _d), _f("time_us_high", _d),
    ]),
    "e2e": pa.schema([
        _f("run_id", _s, False), _f("config", _s, False), _f("layers", _i),
        _f("tp", _i), _f("weight_sets", _i), _f("vocab", _i),
        _f("comm_source", _s),  # CommSource: where comm_ms came from
        _f("device", _s, False), _f("concurrency", _i, False), _f("budget", _i, False),
        _f("context", _i),  # prompt tokens a sequence holds in its cache when decoding starts (mean)
        _f("synthetic_accept", _d),  # the drafter's steering level: acceptance is synthetic
        # PointStatus; a skipped point keeps its key, the reason and the device bytes it needed
        _f("status", _s, False), _f("skip_reason", _s), _f("memory_bytes", _d),
        _f("accept_len_mean", _d), _f("tokens_per_s", _d), _f("steps", _i),
        _f("step_ms_p50", _d), _f("step_ms_p99", _d), _f("ttft_ms", _d),
        _f("itl_ms_p50", _d), _f("itl_ms_p99", _d),
        # the measured step split, and comm_ms: the step's collectives (see comm_source; 0 at tp 1);
        # tokens_per_s and itl include comm_ms, step_ms_* and the stages do not
        _f("draft_ms", _d), _f("tree_build_ms", _d), _f("verify_ms", _d),
        _f("accept_ms", _d), _f("other_ms", _d), _f("comm_ms", _d),
        # per step, from a profiled decode of the same point (CUDA only): GPU busy, and the rest
        _f("kernel_ms", _d), _f("outside_ms", _d),
        # kernel_ms by family (they sum to it): routed MoE, attention, dense bf16 GEMMs of the layers,
        # the lm-head, tree build + accept, and every other kernel
        _f("moe_ms", _d), _f("attention_ms", _d), _f("dense_ms", _d), _f("lm_head_ms", _d),
        _f("tree_ms", _d), _f("gpu_other_ms", _d),
        _f("source", _s, False),
        _f("reference_run_id", _s), _f("tokens_per_s_low", _d), _f("tokens_per_s_high", _d),
    ]),
    "comm": pa.schema([
        _f("run_id", _s, False), _f("op", _s, False), _f("world_size", _i, False),
        _f("bytes", _i, False), _f("time_us_p50", _d), _f("algbw_gbps", _d),
        _f("busbw_gbps", _d), _f("status", _s, False),  # PointStatus
        _f("skip_reason", _s), _f("source", _s, False),
    ]),
}


# Bounds of one result table, from what a full sweep can write: the full profiles write under a hundred
# points per table, and the axes still growing (the MoE sweep to M = 4096, an e2e context axis) multiply
# that by a few; MAX_ROWS leaves tenfold room beyond. A table over it is refused whole, before any use.
MAX_ROWS = 5_000
MAX_TEXT = 4096        # characters of one string cell (a run's note is the longest a host writes)
_AXIS = (1, 1 << 20)   # a shape or count axis: tokens, experts, heads, batch, concurrency
_T_US = (1e-3, 1e10)   # a time in us: 1 ns to about three hours
_T_MS = (1e-6, 1e7)    # a time in ms that cannot be zero (a step, a latency, a GPU-busy total)
_PART_MS = (0.0, 1e7)  # a share of a step, which can be (comm_ms is 0 at tp 1)
_RATE = (0.0, 1e12)    # an achieved rate (GB/s, TFLOP/s, tokens/s band)
# What a number may be: every float finite, and within [low, high] where listed (a null passes: the
# nullable columns say "not measured"). Anything else is refused naming its row and column, at pull,
# at ingest and at import (`check_values`), so the notes never divide by a host's zero or NaN.
# flops may be 0 (a kernel that only moves and compares data); bytes may not (every kernel reads).
BOUNDS: dict[str, dict[str, tuple[float, float]]] = {
    "runs": {"gpu_count": (0, 1 << 12), "copy_gbps": (1e-6, 1e9), "matmul_tflops": (1e-9, 1e9),
             "points": (0, MAX_ROWS)},
    "kernels": {"M": _AXIS, "N": _AXIS, "K": _AXIS, "E": _AXIS, "top_k": _AXIS, "tp": (1, 1 << 12),
                "unique_experts": (0, 1 << 20), "expected_experts": (0, 1 << 20), "budget": (0, 1 << 20),
                "context": (0, 1 << 24), "batch": _AXIS, "time_us_p10": _T_US, "time_us_p50": _T_US,
                "time_us_p90": _T_US, "host_us": _T_US, "repeats": (1, 1 << 30), "bytes": (1.0, 1e18),
                "flops": (0.0, 1e21), "achieved_gbps": _RATE, "achieved_tflops": _RATE,
                "time_us_low": _T_US, "time_us_high": _T_US},
    "e2e": {"layers": (1, 1 << 12), "tp": (1, 1 << 12), "weight_sets": (1, 1 << 12), "vocab": (1, 1 << 24),
            "concurrency": _AXIS, "budget": (0, 1 << 20), "context": (0, 1 << 24), "synthetic_accept": (0.0, 1.0),
            "memory_bytes": (0.0, 1e18), "accept_len_mean": (0.0, 1 << 20), "tokens_per_s": (1e-9, 1e12),
            "steps": (0, 1 << 40), "step_ms_p50": _T_MS, "step_ms_p99": _T_MS, "ttft_ms": _T_MS,
            "itl_ms_p50": _T_MS, "itl_ms_p99": _T_MS, "draft_ms": _PART_MS, "tree_build_ms": _PART_MS,
            "verify_ms": _PART_MS, "accept_ms": _PART_MS, "other_ms": _PART_MS, "comm_ms": _PART_MS,
            "kernel_ms": _T_MS, "outside_ms": _PART_MS, "moe_ms": _PART_MS, "attention_ms": _PART_MS,
            "dense_ms": _PART_MS, "lm_head_ms": _PART_MS, "tree_ms": _PART_MS, "gpu_other_ms": _PART_MS,
            "tokens_per_s_low": (1e-9, 1e12), "tokens_per_s_high": (1e-9, 1e12)},
    # a skipped collective keeps world_size 0 and bytes 0 (the device had none to run)
    "comm": {"world_size": (0, 1 << 12), "bytes": (0, 1 << 50), "time_us_p50": _T_US, "algbw_gbps": _RATE,
             "busbw_gbps": _RATE},
}


class RunStatus(StrEnum):
    """A suite's state in the runs table: all its points, some (interrupted, or points failed), none."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    SKIPPED = "skipped"


class PointStatus(StrEnum):
    """An e2e or comm point's state: measured, or skipped (its key and the reason kept)."""

    OK = "ok"
    SKIPPED = "skipped"


class CommSource(StrEnum):
    """Where an e2e row's comm_ms comes from: the row's own N-GPU run (its whole step, collectives
    included), the alpha-beta model beside one rank timed on one GPU, or none (tp 1: no collectives)."""

    MEASURED = "measured"
    MODELLED = "modelled"
    NONE = "none"


# The columns that name a state: one of these values (suite "whatif": the controller's stored what-if
# answers, projected only; a host's runs name the three suites engine.bench runs).
STATES: dict[str, dict[str, tuple[str, ...]]] = {
    "runs": {"suite": ("kernels", "e2e", "comm", "whatif"), "status": tuple(s.value for s in RunStatus)},
    "e2e": {"status": tuple(s.value for s in PointStatus)},
    "comm": {"status": tuple(s.value for s in PointStatus)},
}


class SchemaError(ValueError):
    """A result file that does not match the contract; the message names the file and field."""


# Columns added after version 2, per table, and the value an older file means by leaving them out
# (version 3: tp, weight_sets, vocab, comm_source; version 4: kernels' op and host_us, e2e's context,
# status, skip_reason, memory_bytes and the per-family split of kernel_ms). A row built without them gets the same value.
_ADDED: dict[str, dict[str, Any]] = {
    "kernels": {"tp": 1, "host_us": None, "op": None},
    "e2e": {"tp": 1, "weight_sets": 1, "vocab": None, "comm_source": None, "context": None, "status": "ok",
            "skip_reason": None, "memory_bytes": None, "moe_ms": None, "attention_ms": None, "dense_ms": None,
            "lm_head_ms": None, "tree_ms": None, "gpu_other_ms": None},
}


def column_defaults(name: str) -> dict[str, Any]:
    """The columns of table `name` added since version 2, and the value a row or file without them means."""
    return dict(_ADDED.get(name, {}))

