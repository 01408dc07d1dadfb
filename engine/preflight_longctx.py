"""`python -m engine.preflight_longctx`: the e2e context axis's longest points on one GPU at reduced
depth, to check them before a full re-record (a few minutes of an H200 at the defaults).

    python -m engine.preflight_longctx [--layers 3] [--points 131072x1,65536x1,32768x16,32768x1]
                                       [--exact 32768] [--max-new 16] [--out DIR]

Per point (prompt tokens x concurrency, TP-8 rank of K2 by default, level 0.8, budget 16): the
memory check the suite makes (estimated need against what is free), then one warm chunked prefill
and a DDTree decode from it, printing TTFT, the steady decode step, tokens/s, the measured peak
memory beside the estimate, and the full-depth figures scaled by layers (a rough guide to the suite's
time, not a measurement). Exactness: two prompts of --exact and 3/4 of it tokens prefilled in chunks
and in one forward (a T x T mask) must give the same first tokens and the same greedy and DDTree
tokens after; the cache rows' largest difference is printed. Every decode must follow the planted
successor chain. Exit 0 when every point ran and every check held, 1 otherwise; a JSON summary is the
last line (and DIR/preflight.json with --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine import footprint
from engine.bench_e2e import MIN_CHAIN_SHARE, chain_share, prompts_for, summarise
from engine.config import CONFIGS, make_config
from engine.decode import PREFILL_TOKENS, Decoder, cache_rows
from engine.drafter import BlockDrafter
from engine.model import TargetModel

GB = 1e9


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m engine.preflight_longctx", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="k2", choices=sorted(CONFIGS))
    ap.add_argument("--layers", type=int, default=3, help="target layers (the suite runs the config's all)")
    ap.add_argument("--tp", type=int, default=8, help="rank 0 of a TP-N deployment, as the context axis runs")
    ap.add_argument("--points", default="131072x1,65536x1,32768x16,32768x1",
                    help="prompt tokens x concurrency, comma-separated")
    ap.add_argument("--exact", type=int, default=32768, help="longest prompt of the chunked-vs-one-forward check")
    ap.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--level", type=float, default=0.8)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", type=Path, help="also write the summary to DIR/preflight.json")
    a = ap.parse_args(argv)
    try:
        a.points = [tuple(int(x) for x in p.split("x")) for p in a.points.split(",")]
    except ValueError:
        ap.error(f"--points {a.points!r}: use LENGTHxCONCURRENCY, comma-separated (e.g. 32768x16)")
    if any(len(p) != 2 or min(p) < 1 for p in a.points):
        ap.error("--points: every point needs a length and a concurrency of at least 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here")
    return a


def say(line: str) -> None:
    print(line, flush=True)


def point(dec: Decoder, a: argparse.Namespace, length: int, conc: int, full_layers: int) -> dict[str, Any]:
    """One context point as the suite runs it (memory check, warm prefill, decode from it)."""
    m, dev = dec.model, dec.device
    prompts = prompts_for(m.cfg, conc, (length, length))
    rows = cache_rows(prompts, a.max_new, a.budget, m.cfg.draft_len)
    need = footprint.point_need(dec, prompts, rows, a.budget)
    free = footprint.free_bytes(dev)
    out: dict[str, Any] = {"context": length, "concurrency": conc, "need_gb": need.total / GB, "free_gb": free / GB}
    if need.beside_weights > free:
        return {**out, "status": "skipped", "skip_reason": need.reason(free, f"{conc} x {rows} rows")}
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    pre = dec.prefill(prompts, rows, warm=True)
    res = dec.speculative(prompts, a.max_new, a.budget, a.level, start=pre)
    fig = summarise(res)
    scale = full_layers / m.cfg.layers
    out.update(status="ok", ttft_s=pre.ttft_s[0], step_ms=fig["step_ms_p50"], tokens_per_s=fig["tokens_per_s"],
               chain_share=chain_share(m, res.tokens), wall_s=time.perf_counter() - t0,
               full_depth_ttft_s=pre.ttft_s[0] * scale, full_depth_step_ms=fig["step_ms_p50"] * scale)
    if dev.type == "cuda":
        out["peak_gb"] = torch.cuda.max_memory_allocated(dev) / GB
    return out


def exactness(dec: Decoder, a: argparse.Namespace) -> dict[str, Any]:
    """Chunked prefill against one forward over the whole prompt (padded batch of two lengths)."""
    m = dec.model
    n = a.exact
    prompts = [p[:k] for p, k in zip(prompts_for(m.cfg, 2, (n, n)), (n, max(1, 3 * n // 4)))]
    rows = cache_rows(prompts, a.max_new, a.budget, m.cfg.draft_len)
    whole = Decoder(m, dec.drafter, prefill_tokens=2 * n)
    one, parts = whole.prefill(prompts, rows), dec.prefill(prompts, rows)
    diff = max(float((parts.cache.ckv[:, b, :len(p)].float() - one.cache.ckv[:, b, :len(p)].float()).abs().max()
                     / one.cache.ckv[:, b, :len(p)].float().abs().max()) for b, p in enumerate(prompts))
    same_first = parts.bonus.tolist() == one.bonus.tolist()
    del one, parts
    g_chunked, g_whole = dec.greedy(prompts, a.max_new).tokens, whole.greedy(prompts, a.max_new).tokens
    spec = dec.speculative(prompts, a.max_new, a.budget, a.level).tokens
    ok = same_first and g_chunked == g_whole == spec
    return {"lengths": [len(p) for p in prompts], "same_first_tokens": same_first, "greedy_equal": g_chunked == g_whole,
            "ddtree_equal": spec == g_whole, "cache_rel_diff": diff, "ok": ok}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = make_config(a.config, layers=a.layers)
    t0 = time.perf_counter()
    model = TargetModel(cfg, dev, dtype, seed=0, tp=a.tp)
    dec = Decoder(model, BlockDrafter(model, seed=1), a.prefill_tokens)
    say(f"preflight {cfg.name} layers={cfg.layers} tp={a.tp} {str(dtype).removeprefix('torch.')} on "
        f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}: model built in "
        f"{time.perf_counter() - t0:.1f} s; prefill forwards of at most {a.prefill_tokens} tokens")
    full_layers = CONFIGS[a.config].layers
    points = []
    for length, conc in a.points:
        r = point(dec, a, length, conc, full_layers)
        points.append(r)
        if r["status"] != "ok":
            say(f"{length:>7} x {conc:<2} skipped: {r['skip_reason']}")
            continue
        peak = f", measured peak {r['peak_gb']:.3g} GB" if "peak_gb" in r else ""
        say(f"{length:>7} x {conc:<2} TTFT {r['ttft_s'] * 1e3:,.0f} ms, step {r['step_ms']:.2f} ms, "
            f"{r['tokens_per_s']:,.0f} tok/s, chain {r['chain_share']:.0%}; memory need {r['need_gb']:.3g} GB "
            f"(estimate){peak}; at {full_layers} layers about TTFT {r['full_depth_ttft_s']:.1f} s, step "
            f"{r['full_depth_step_ms']:.0f} ms")
    ex = exactness(dec, a)
    say(f"exactness at {ex['lengths']} tokens: first tokens {'equal' if ex['same_first_tokens'] else 'DIFFER'}, "
        f"greedy {'equal' if ex['greedy_equal'] else 'DIFFERS'}, DDTree {'equal' if ex['ddtree_equal'] else 'DIFFERS'}; "
        f"cache rows differ by at most {ex['cache_rel_diff']:.2e} of their largest value")
    ran = [r for r in points if r["status"] == "ok"]
    under = [r for r in ran if "peak_gb" in r and r["peak_gb"] > r["need_gb"]]
    ok = (len(ran) == len(points) and ex["ok"] and not under
          and all(r["chain_share"] >= MIN_CHAIN_SHARE for r in ran))
    if under:
        say("the memory estimate is below the measured peak at " +
            ", ".join(f"{r['context']} x {r['concurrency']}" for r in under))
    summary = {"ok": ok, "config": cfg.name, "layers": cfg.layers, "tp": a.tp, "points": points, "exactness": ex,
               "total_s": time.perf_counter() - t0}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "preflight.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    say(json.dumps(summary, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
