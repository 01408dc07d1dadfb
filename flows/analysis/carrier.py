"""The cross-machine carrier of a memory-bound kernel: bytes in flight against latency x bandwidth.

A memory-bound kernel at small sizes does not reach a fixed share of a machine's bandwidth: it keeps
some bytes in flight per SM (its pipeline stages, its CTAs), and by Little's law the in-flight-limited rate
    L = bytes in flight per SM x SMs / memory latency
carries with the SMs and the latency; the target's spec sheet gives both, so L on the target is the
reference's times (target SMs / reference SMs) x (reference latency / target latency). How L and the copy
ceiling C combine is the carrier's form; three candidates:
- HARMONIC (shipped where both sides have SMs): a point's time is bytes / C + bytes / L, the memory system's
  transfer and the wait for bytes in flight one after the other, so a point that achieved A on the reference
  had 1 / L = 1 / A - 1 / C (L unbounded where A reaches C) and gets 1 / (1 / C + 1 / L) on the target. Two
  machines of one die and SM count but different memory (an H100 and an H200) then differ as their copy
  ceilings do, in part, as measured;
- LITTLE: A itself is the in-flight-limited rate, capped at C: min(C, A x the SM and latency scale). The
  same SM count then predicts the same bytes/s, whatever the memory;
- SHARE: the point's share of the copy ceiling, A / C on the reference times C on the target.
The harmonic form was picked over Little's by a rule fixed before their per-point results were seen (the
fleet index says which); a spec sheet without the SM count leaves only SHARE, and says so. An unknown latency
is taken equal to the reference's; where either side's latency is unknown, the form itself is uncertain, and
`others` names the candidates whose figures a band must hold too.

flows.analysis.kernelfit applies it to the bandwidth term of each kernel family's fitted model at the points the fit
calls memory-bound (a compute-bound point carries by the compute ceilings alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from flows.inventory.hosts import Spec

LITTLE, HARMONIC, SHARE = "little", "harmonic", "share"   # which carrier a memory-bound point went by
FORMS = (HARMONIC, LITTLE, SHARE)


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
    """The shipped form between two machines."""
    return HARMONIC if ref.sms and tgt.sms else SHARE


def others(ref: Side, tgt: Side) -> tuple[str, ...]:
    """The candidate forms besides the shipped one whose figures a band must hold: every other one where
    the carry has SMs on both sides and a latency on neither or one (the form is then a guess the data
    cannot settle), none where it lacks an SM count (only SHARE applies) or knows both latencies."""
    shipped = how(ref, tgt)
    if shipped == SHARE or (ref.latency_ns and tgt.latency_ns):
        return ()
    return tuple(f for f in FORMS if f != shipped)


def in_flight_scale(ref: Side, tgt: Side) -> float:
    """How much more bandwidth the same bytes in flight per SM buy on the target (Little's law)."""
    lat = ref.latency_ns / tgt.latency_ns if ref.latency_ns and tgt.latency_ns else 1.0
    return tgt.sms / ref.sms * lat  # type: ignore[operator]


def memory_gbps(achieved_gbps: float, ref: Side, tgt: Side, form: str | None = None) -> float:
    """The bandwidth a memory-bound point that achieved `achieved_gbps` on the reference gets on the target,
    by `form` (default: the shipped one, `how`)."""
    form = form or how(ref, tgt)
    if form == SHARE:
        return achieved_gbps / ref.gbps * tgt.gbps
    if form == LITTLE:
        return min(tgt.gbps, achieved_gbps * in_flight_scale(ref, tgt))
    if form != HARMONIC:
        raise ValueError(f"no carrier form {form!r} (one of {', '.join(FORMS)})")
    wait = 1 / achieved_gbps - 1 / ref.gbps        # 1 / L on the reference: the time beyond the transfer
    if wait <= 0:
        return tgt.gbps
    return 1 / (1 / tgt.gbps + wait / in_flight_scale(ref, tgt))
