"""`kdbench project HOST`: the step model's answer for any deployment of a host, over a grid of them.

Every list flag takes comma-separated values or repeats (`--concurrency 1,4,16` or `-c 1 -c 4`), and
the grid is every combination. The step model, the projection and the store load inside the
command, so `kdbench --help` stays quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from flows.cli.emit import Format, emit
from flows.cli.notes import Artifacts, HostsDir, _expected, _fail, err, out

LIMITS = {"tp": (1, 64), "concurrency": (1, 4096), "context": (1, 10_000_000), "budget": (0, 4096),
          "accept": (0.0, 1024.0)}
SHARE_COLUMNS = ("moe", "attention", "dense", "lm_head", "tree", "gpu_other", "host", "comm")


def parse_list(flag: str, values: list[str] | None, kind: type) -> list:
    """`--flag 1,4 --flag 16` -> [1, 4, 16], each checked against LIMITS; a bad value names the flag."""
    out_: list = []
    lo, hi = LIMITS[flag]
    for v in values or []:
        for part in (p.strip() for p in v.split(",")):
            if not part:
                continue
            try:
                x = kind(part)
            except ValueError:
                raise typer.BadParameter(f"{part!r} is not a {'number' if kind is float else 'whole number'}",
                                         param_hint=f"--{flag}") from None
            if not lo <= x <= hi:
                raise typer.BadParameter(f"{part} is outside {lo}..{hi}", param_hint=f"--{flag}")
            out_.append(x)
    return list(dict.fromkeys(out_))


def _cells(r: dict) -> list[str]:
    """A table row of one answer record (flows.analysis.whatif.answer_row: the fields an e2e row also has
    are named as its columns)."""
    from engine.rows import COLUMNS as C   # pyarrow: loaded by the command, never by its --help
    low, high = r[C.tokens_per_s_low], r[C.tokens_per_s_high]
    band = f"{low:,.0f}-{high:,.0f}" if low is not None else r["band"]
    shares = " ".join(f"{t} {100 * r[f'{t}_share']:.0f}%" for t in SHARE_COLUMNS if r[f"{t}_share"] >= 0.005)
    fits = (r["tight"] or "yes") if r["fits"] else r["why_not"]
    return [str(r[C.tp]), str(r[C.concurrency]), f"{r[C.context]:,}", str(r[C.budget]), f"{r['accept']:.2f}",
            f"{r[C.tokens_per_s]:,.0f}", band, f"{r['step_ms']:.2f}", f"{r[C.comm_ms]:.2f}", shares, r["largest"],
            fits, r["interpolated"] or "-", r["extrapolated"] or "-"]


HEADER = ("tp", "C", "context", "B", "accept", "tokens/s", "band", "step ms", "comm ms", "shares of the step",
          "largest term", "fits memory", "interpolated", "extrapolated")


def project_cmd(host: str = typer.Argument(..., help="Inventory host to answer for (measured or not)."),
                tp: Optional[list[str]] = typer.Option(None, "--tp", help="TP degree(s) [default: the host's GPUs]."),
                concurrency: Optional[list[str]] = typer.Option(None, "--concurrency", "-c",
                                                                help="Concurrent sequences [default: 1,16]."),
                context: Optional[list[str]] = typer.Option(None, "--context",
                                                            help="Tokens in each sequence's cache [default: 512]."),
                budget: Optional[list[str]] = typer.Option(None, "--budget", "-b", help="Tree node budget [default: 16]."),
                accept: Optional[list[str]] = typer.Option(
                    None, "--accept", help="Accepted draft tokens a step (+1 bonus token) [default: the reference's "
                                           "measured levels]."),
                reference: Optional[str] = typer.Option(
                    None, "--reference", envvar="KDBENCH_REFERENCE", show_default=False,
                    help="Reference set or measured host the answers come from [default: HOST's own measured "
                         "data, else h200]."),
                fmt: Format = typer.Option(Format.table, "--format", help="table, csv or json."),
                store_it: bool = typer.Option(False, "--store", help="Keep the answers in the store as a projected run."),
                artifacts: Optional[str] = Artifacts, hosts: Optional[Path] = HostsDir) -> None:
    """Tokens/s of HOST at any deployment: the step composed from kernel models, calibrated on the reference.

    Prints, per configuration, tokens/s with its band (from the backtests' held-out errors of the
    carries the answer used; `unknown` where a carry has too little evidence), the step, comm, each
    family's share of the step and the largest, whether it fits the GPU's memory, and which inputs
    were interpolated or extrapolated between measured shapes. Tokens/s = C x (accept + 1) /
    (step + comm): the steady state of a full batch.
    """
    from flows.analysis.backtest_store import stored_backtest
    from flows.analysis.ceilings import rows_of
    from flows.analysis.families import E2E_CONTEXT
    from flows.analysis.stepmodel import Query, calibration_rows, step_spread
    from flows.analysis.whatif import accept_levels, answer_row, answers, as_tables, model_for, whatif_run_id
    from flows.inventory.files import default_hosts_dir, load_inventory
    from flows.store.store import Store

    try:
        store, inv = Store(artifacts), load_inventory(hosts or default_hosts_dir())
        if host not in inv.hosts:
            raise _fail(f"host {host!r} is not in the inventory ({', '.join(sorted(inv.hosts))})")
        data, model, _ = model_for(store, inv, host, reference)
        levels = parse_list("accept", accept, float)
        pairs = [(a, None) for a in levels] or [(acc, lv) for lv, acc in accept_levels(data.tables)]
        if not pairs:
            raise _fail(f"reference {data.name!r} has no full-depth e2e rows with an acceptance: give --accept")
        grid = [(Query(t, c, b, s, a), lv)
                for t in parse_list("tp", tp, int) or [max(model.target.gpus, 1)]
                for c in parse_list("concurrency", concurrency, int) or [1, 16]
                for s in parse_list("context", context, int) or [E2E_CONTEXT]
                for b in parse_list("budget", budget, int) or [16] for a, lv in pairs]
        if len(grid) > 4096:
            raise _fail(f"{len(grid)} configurations: at most 4096 at once")
        evidence = stored_backtest(store)
        items = answers(model, grid, evidence, step_spread(calibration_rows(rows_of(data.tables, "e2e"))))
        if store_it:
            run_id = whatif_run_id(host, model.ref_run_id, grid)
            store.put_tables(host, run_id, as_tables(host, model, items, run_id, "query"))
    except _expected() as e:
        raise _fail(str(e)) from None
    rows = [answer_row(a) for a in items]
    source = "its own measured run" if data.host == host and not model.cross_host else f"{data.name} ({data.run_id})"
    text = emit(rows, fmt, f"{host}: step model answers from {source}", [_cells(r) for r in rows], HEADER,
                right=("tp", "C", "context", "B", "accept", "tokens/s", "step ms", "comm ms"))
    out().file.write(text)
    if fmt == Format.table:
        if not evidence:
            err().print("no backtest stored: every band is unknown until `kdbench backtest` runs", highlight=False)
        for note in dict.fromkeys(n for a in items for n in a.step.notes):
            out().print(f"note: {note}", highlight=False, soft_wrap=True)
        if store_it:
            out().print(f"stored as projected run {run_id} of {host}", highlight=False)
