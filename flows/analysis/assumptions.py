"""What a projection assumed, as typed records: written by flows.projection, worded by the notes.

A projection stores its assumptions as a list of JSON objects in every table's provenance (key
`assumptions`), each naming its kind in `what`; `record` writes one and `parse` reads one back. A
kind this version does not know reads as `Other` (the notes list its keys and values); a known kind
that lacks a field it needs is refused with a SchemaError naming the kind and the field.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Callable, ClassVar, Mapping, Union

from engine.schema import SchemaError


@dataclass(frozen=True)
class ReferenceCeilings:
    """The reference's measured ceilings and their fractions of its spec sheet."""

    WHAT: ClassVar[str] = "reference_ceilings"
    host: str
    run_id: str
    gpu: str
    copy_gbps: float
    copy_fraction: float
    spec_gbps: float
    matmul_tflops: float
    matmul_fraction: float
    spec_tflops: float
    dtype: str


@dataclass(frozen=True)
class TargetCeilings:
    """The target's ceilings: the reference's fractions of the target's spec sheet."""

    WHAT: ClassVar[str] = "target_ceilings"
    host: str
    gpu: str
    copy_gbps: float
    matmul_tflops: float
    dtype: str


@dataclass(frozen=True)
class KernelModels:
    """The kernel families carried by their fitted models; SM counts and DRAM latencies (reference,
    target) where the spec sheets have them; the carrier's form and the other forms the bands hold."""

    WHAT: ClassVar[str] = "kernel_models"
    families: list[str]
    sms: list[int | None] = field(default_factory=lambda: [None, None])
    latency_ns: list[float | None] = field(default_factory=lambda: [None, None])
    carrier: str = ""                                # the memory-bound carrier's form (flows.analysis.carrier)
    others: list[str] = field(default_factory=list)  # the other forms each band also holds


@dataclass(frozen=True)
class Kept:
    """What is kept as measured: the launch floor, host-side points, latency-bound points."""

    WHAT: ClassVar[str] = "kept"
    launch_floor_us: float
    latency_share: float
    host_side: list[str]


@dataclass(frozen=True)
class StepModel:
    """How the step model was calibrated on the reference's e2e rows."""

    WHAT: ClassVar[str] = "step_model"
    rows: int
    split: bool
    tps: list[int]
    host_fixed_ms: float
    host_per_layer_ms: float
    factors: dict[str, list[float]] = field(default_factory=dict)   # family -> [lowest, highest] factor
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TpCarry:
    """How the reference's e2e rows of one TP degree were carried to the target's degree."""

    from_tp: int
    how: str        # same, fit, kernels, bytes or model
    points: int


@dataclass(frozen=True)
class TensorParallel:
    WHAT: ClassVar[str] = "tensor_parallel"
    target_tp: int
    gpus: int
    rows: list[TpCarry]


@dataclass(frozen=True)
class Comm:
    """The all-reduce model on the target's links."""

    WHAT: ClassVar[str] = "comm"
    gpus: int
    interconnect: str
    link_gbps: float | None
    alpha_us: float
    efficiency: float
    efficiency_low: float
    efficiency_high: float
    calibrated: bool
    allreduces_per_layer: int


@dataclass(frozen=True)
class E2eWithoutSplit:
    """The reference's e2e rows without a step split (outside figures): not projected."""

    WHAT: ClassVar[str] = "e2e_without_split"
    rows: int


@dataclass(frozen=True)
class SkippedPoint:
    """One e2e point the reference skipped, and why (cut to a bounded length by the projection)."""

    tp: int
    concurrency: int
    budget: int
    context: int | None
    reason: str
    synthetic_accept: float | None = None


@dataclass(frozen=True)
class E2eNotMeasured:
    """The reference's skipped e2e points (the first few listed): nothing to carry."""

    WHAT: ClassVar[str] = "e2e_not_measured"
    count: int
    points: list[SkippedPoint]


@dataclass(frozen=True)
class BandEvidence:
    """Where the bands come from: the backtests' held-out errors, over these references; the spec copy
    bandwidth (GB/s) of each machine that evidence came from (the reference and the targets of its cross-host
    carries) and of the target, so a page can say when its target is faster than all of them."""

    WHAT: ClassVar[str] = "band"
    references: list[str]
    min_groups: int = 9   # the fewest held-out groups a carry's own band needs (flows.analysis.bands)
    evidence_gbps: dict[str, float] = field(default_factory=dict)
    target_gbps: float | None = None
    pooled: list[str] = field(default_factory=list)   # the carries whose band was pooled over their kind and regime


@dataclass(frozen=True)
class Other:
    """A record of a kind this version does not know, as stored."""

    record: dict[str, Any]


Assumption = Union[ReferenceCeilings, TargetCeilings, KernelModels, Kept, StepModel, TensorParallel, Comm,
                   E2eWithoutSplit, E2eNotMeasured, BandEvidence, Other]
KINDS: dict[str, type] = {c.WHAT: c for c in (ReferenceCeilings, TargetCeilings, KernelModels, Kept, StepModel,
                                              TensorParallel, Comm, E2eWithoutSplit, E2eNotMeasured, BandEvidence)}
NESTED: dict[tuple[type, str], type] = {(TensorParallel, "rows"): TpCarry, (E2eNotMeasured, "points"): SkippedPoint}


def record(a: Assumption) -> dict[str, Any]:
    """The stored form: a JSON object naming its kind in `what`."""
    return dict(a.record) if isinstance(a, Other) else {"what": a.WHAT, **asdict(a)}


def _build(cls: type, d: object, where: str) -> Any:
    if not isinstance(d, Mapping):
        raise SchemaError(f"assumption record {where}: not an object")
    missing = [f.name for f in fields(cls)
               if f.name not in d and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise SchemaError(f"assumption record {where}: no {', '.join(missing)}")
    kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
    for (owner, name), sub in NESTED.items():
        if owner is cls:
            if not isinstance(kw[name], list):
                raise SchemaError(f"assumption record {where}: {name} is not a list")
            kw[name] = [_build(sub, x, f"{where}.{name}") for x in kw[name]]
    return cls(**kw)


def parse(d: Mapping[str, Any]) -> Assumption:
    """One stored record, typed by its `what` (fields a kind does not declare are left out)."""
    cls = KINDS.get(d.get("what"))  # type: ignore[arg-type]
    return Other(dict(d)) if cls is None else _build(cls, d, str(d["what"]))


def map_strings(a: Assumption, fn: Callable[[str], str]) -> Assumption:
    """The record with fn applied to each of its own string values (not to those in its lists)."""
    if isinstance(a, Other):
        return Other({k: fn(v) if isinstance(v, str) else v for k, v in a.record.items()})
    return replace(a, **{f.name: fn(v) for f in fields(a) if isinstance(v := getattr(a, f.name), str)})
