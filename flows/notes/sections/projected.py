"""The projection section of a projected host's page: its reference, each stored assumption in words,
and the backtests that evidence the carries it used."""

from __future__ import annotations

from typing import Sequence

from flows.analysis.assumptions import (Assumption, BandEvidence, Comm, E2eNotMeasured, E2eWithoutSplit, Kept, KernelModels,
                               ReferenceCeilings, StepModel, TargetCeilings, TensorParallel, map_strings)
from flows.analysis.carrier import HARMONIC, LITTLE, SHARE
from flows.analysis.families import label
from flows.inventory.scrub import md
from flows.notes.fmt import sig
from flows.notes.pages import ProjectionView, Table
from flows.notes.sections.backtest import BACKTEST_COLUMNS, backtest_cells
from flows.notes.views import HostView

# how the rows of one TP degree were carried (flows.analysis.assumptions.TpCarry.how), in words
TP_HOW = {"same": "measured at that degree", "fit": "re-sharded by a fixed + sharded/TP fit of two measured degrees",
          "kernels": "re-sharded by the verify kernels' shard-shape points",
          "bytes": "re-sharded assuming all of verify shards (1/TP; band up to no speed-up): no measurement "
          "at this degree", "model": "re-sharded by the step model (each family at the degree's shard shapes, "
          "the measured shard-shape kernels where the suite has them)"}


# the memory-bound carrier's forms (flows.analysis.carrier), in words
CARRIER = {HARMONIC: "the harmonic carrier (a point's time is bytes / copy ceiling + bytes / in-flight rate)",
           LITTLE: "Little's law (the in-flight rate, capped at the copy ceiling)",
           SHARE: "a fixed share of the copy ceiling"}


def band_caveat(assumptions: Sequence[Assumption], host: str) -> str | None:
    """The words a page puts next to its bands when its target is faster than every machine their evidence
    came from (None otherwise)."""
    ev = next((a for a in assumptions if isinstance(a, BandEvidence)), None)
    if ev is None or not ev.target_gbps or not ev.evidence_gbps or ev.target_gbps <= max(ev.evidence_gbps.values()):
        return None
    came = ", ".join(f"{md(h)} {sig(g)} GB/s" for h, g in sorted(ev.evidence_gbps.items(), key=lambda kv: -kv[1]))
    return (f"this page's bands rest on carries to slower machines; their evidence came from {came}, and none "
            f"reached {md(host)}'s {sig(ev.target_gbps)} GB/s, so how the carriers extrapolate to more bandwidth "
            f"is untested and the bands may be too narrow")


def assumption_text(a: Assumption) -> str:
    """One stored assumption record in words (its strings escaped for the page)."""
    a = map_strings(a, md)
    if isinstance(a, ReferenceCeilings):
        return (f"reference {a.host} run {a.run_id} on {a.gpu}: measured ceilings {sig(a.copy_gbps)} GB/s "
                f"copy ({a.copy_fraction:.1%} of its {sig(a.spec_gbps)} GB/s spec) and {sig(a.matmul_tflops)} "
                f"TFLOP/s {a.dtype} matmul ({a.matmul_fraction:.1%} of its {sig(a.spec_tflops)} spec)")
    if isinstance(a, TargetCeilings):
        return (f"target {a.host} on {a.gpu}: the same fractions of its spec sheet give "
                f"{sig(a.copy_gbps)} GB/s and {sig(a.matmul_tflops)} TFLOP/s {a.dtype}")
    if isinstance(a, KernelModels):
        carried = (f"the bandwidth term by {CARRIER.get(a.carrier, CARRIER[LITTLE])}, its in-flight rate (bytes in "
                   f"flight per SM x SMs / latency) carried from {a.sms[0]} SMs on the reference to {a.sms[1]}"
                   if all(a.sms) else
                   "the bandwidth term at the point's share of the copy ceiling (no SM count on a spec sheet)")
        latency = "" if all(a.latency_ns) else " (DRAM latency taken equal on both: not on both spec sheets)"
        held = (f"; with no latency on both spec sheets to settle the carrier's form, each band also holds what "
                f"{' and '.join(CARRIER.get(f, md(f)) for f in a.others)} give" if a.others else "")
        return (f"kernel families {', '.join(md(f) for f in a.families)}: each fitted on the reference's sweep as "
                f"latency + bytes / bandwidth + flops / compute, times each measured point's own residual "
                f"(interpolated between measured shapes); on the target the latency is kept, {carried}{latency}, "
                f"the compute term by the ratio of the matmul ceilings, and at a point the fit calls compute-bound "
                f"(flop term at least byte term) all of its time beyond the latency by that ratio; tree kernels as "
                f"measured{held}")
    if isinstance(a, Kept):
        return (f"kept as measured: a launch floor of up to {a.launch_floor_us:g} us per kernel, the host-side "
                f"points ({', '.join(md(h) for h in a.host_side)}) and latency-bound points (under "
                f"{a.latency_share:.0%} of both ceilings; band up to their roofline-scaled time)")
    if isinstance(a, StepModel):
        factors = ", ".join(f"{md(f)} {lo:.2f}" + (f"-{hi:.2f}" if hi - lo >= 0.005 else "")
                            for f, (lo, hi) in sorted(a.factors.items()))
        how = (f"each family scaled by its in-step/suite factor from the rows' per-family split: {factors or '-'}"
               if a.split else
               "no per-family split in the reference's rows: every GPU kernel the suite does not explain counts as "
               "other kernels")
        notes = "; ".join(md(n) for n in a.notes)
        return (f"e2e, by the step model: moe, attention, dense GEMMs, lm-heads and tree kernels from their kernel "
                f"models at the step's shapes, calibrated on {a.rows} measured e2e row(s) at TP "
                f"{'/'.join(map(str, a.tps)) or '-'} ({how}); other kernels and the host time outside them "
                f"({a.host_fixed_ms:.2f} ms + {a.host_per_layer_ms:.3f} ms a layer) kept as the reference "
                f"measured them" + (f"; {notes}" if notes else ""))
    if isinstance(a, TensorParallel):
        rows = "; ".join(f"{r.points} row(s) from TP-{r.from_tp}: {TP_HOW.get(r.how, md(r.how))}" for r in a.rows)
        return (f"each e2e row is one rank of a TP-{a.target_tp} deployment on the {a.gpus} GPU(s); "
                f"draft, tree and accept run replicated; {rows or 'no e2e rows'}")
    if isinstance(a, Comm):
        link = f"{a.link_gbps:.0f} GB/s {a.interconnect}" if a.link_gbps else "no link figure"
        how = "calibrated on the reference's all-reduce" if a.calibrated else "default constants"
        return (f"comm = {a.allreduces_per_layer} all-reduces per layer x layers of tokens x hidden x 2 bytes "
                f"over a ring of {a.gpus}, alpha {a.alpha_us:g} us, {a.efficiency:.0%} "
                f"({a.efficiency_low:.0%}-{a.efficiency_high:.0%}) of {link} ({how})")
    if isinstance(a, E2eNotMeasured):
        listed = "; ".join(f"TP-{int(q.tp)} C={int(q.concurrency)} B={int(q.budget)} context "
                           f"{'-' if q.context is None else format(int(q.context), ',')}: "
                           f"{md(q.reason, cap=300)}" for q in a.points)
        more = f"; and {a.count - len(a.points)} more" if a.count > len(a.points) else ""
        return f"{a.count} e2e point(s) the reference skipped (not measured there), so not projected: {listed}{more}"
    if isinstance(a, E2eWithoutSplit):
        return f"{a.rows} e2e row(s) of the reference have no step split (outside figures): not projected"
    if isinstance(a, BandEvidence):
        n = len(a.references)
        return (f"band: from the held-out errors of the carries each figure uses (the backtests: composition, tp, "
                f"size, cross-host: the carries from this page's reference to the other measured hosts and to "
                f"outside figures, a kernel family's in the point's regime) and the measurement spread, at the "
                f"split-conformal rank of the held-out configurations' errors; pooled over the carries of the same "
                f"kind and regime where a carry has fewer than {a.min_groups} held-out configurations, unknown "
                f"where even the pool has fewer" + (f" (pooled here: {md(', '.join(a.pooled), cap=400)})"
                                                   if a.pooled else "")
                + (f"; widened to the spread across {n} references" if n > 1 else ""))
    # map_strings escaped the record's string values above; its keys and other values are escaped here
    return ", ".join(f"{md(k)} {v if isinstance(v, str) else md(v)}" for k, v in sorted(a.record.items()))


def projection_view(view: HostView) -> ProjectionView:
    p = view.projection
    gpu = f" ({p.ref_spec.gpu})" if p.ref_spec else ""
    fams = {label(k) for k in p.run.rows("kernels")}
    cited = [r for r in view.backtest if (r.family.split(" vs ")[0] in fams or r.regime == "e2e")
             and (r.kind != "cross-host" or r.reference == p.ref_host)]   # the carries its bands rest on
    return ProjectionView(f"Reference: host {md(p.ref_host)}, run {md(p.ref_run_id)}{gpu}; references used for the "
                          f"band: {', '.join(md(r) for r in p.references)}.",
                          tuple(assumption_text(a) for a in p.assumptions),
                          Table.of(BACKTEST_COLUMNS, backtest_cells(cited)) if cited else None)
