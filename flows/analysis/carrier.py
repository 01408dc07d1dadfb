"""The cross-machine carrier of a memory-bound kernel: bytes in flight against latency x bandwidth.

A memory-bound kernel at small sizes does not reach a fixed share of a machine's bandwidth: it keeps
some bytes in flight per SM (its pipeline stages, its CTAs), and by Little's law it moves
    bytes in flight per SM x SMs / memory latency
per second, up to what the memory system delivers (the copy ceiling). The reference's measured point
gives its bytes in flight per SM (achieved bandwidth x the reference's latency / its SMs); the target's
spec sheet gives its SMs and latency, so the same kernel on the target moves
    min(copy ceiling of the target, achieved x (target SMs / reference SMs) x (reference latency / target latency)).
A machine with fewer bytes in flight needed per SM (lower bandwidth, more SMs: an RTX PRO 6000 against
an H200) reaches its copy ceiling where the reference did not; one that needs more (a B300) falls
further short of its own. Where a spec sheet lacks the SM count the carrier is the share of bandwidth
(the point's efficiency against the copy ceiling), and says so; an unknown latency is taken equal to
the reference's.

flows.analysis.kernelfit applies it to the bandwidth term of each kernel family's fitted model.
"""

from __future__ import annotations

from dataclasses import dataclass

from flows.inventory.hosts import Spec

LITTLE, SHARE = "little", "share"   # which carrier a memory-bound point went by


@dataclass(frozen=True)
class Side:
    """One machine as the carrier sees it: its attainable ceilings and the spec figures Little's law needs."""

    gbps: float                 # attainable copy bandwidth (GB/s)
    tflops: float               # attainable matmul throughput of the point's dtype (TFLOP/s)
    sms: int | None
    latency_ns: float | None

    @staticmethod
    def of(spec: Spec, gbps: float, tflops: float) -> "Side":
        return Side(gbps, tflops, spec.sms, spec.mem_latency_ns)


def how(ref: Side, tgt: Side) -> str:
    return LITTLE if ref.sms and tgt.sms else SHARE


def in_flight_scale(ref: Side, tgt: Side) -> float:
    """How much more bandwidth the same bytes in flight per SM buy on the target (Little's law)."""
    lat = ref.latency_ns / tgt.latency_ns if ref.latency_ns and tgt.latency_ns else 1.0
    return tgt.sms / ref.sms * lat  # type: ignore[operator]


def memory_gbps(achieved_gbps: float, ref: Side, tgt: Side) -> float:
    """The bandwidth a memory-bound point that achieved `achieved_gbps` on the reference gets on the target."""
    if how(ref, tgt) == SHARE:
        return achieved_gbps / ref.gbps * tgt.gbps
    return min(tgt.gbps, achieved_gbps * in_flight_scale(ref, tgt))
