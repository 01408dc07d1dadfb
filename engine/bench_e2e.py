"""The e2e suite: DDTree decoding throughput and latency per TP degree x acceptance level x
concurrency x budget, at the model's full depth.

Acceptance is synthetic: the drafter is steered toward the target's own greedy continuation
(untimed harness work: the planted successor chain, engine.model) at a fixed level, recorded in
every row with the accept length it gave. A point whose generated tokens do not follow that chain
fails (its acceptance would not be the level's).
Every stage of every step is timed (CUDA events between the stages, one sync a step; see
engine.decode.StageTimer); `other` is the step's wall time minus the stages.
On CUDA the stages run as CUDA graphs after the first step (engine.decode.StepGraphs), and each
point is decoded once more under the kernel profiler: `kernel_ms` is the GPU's busy time per step,
split by kernel family into `moe_ms`, `attention_ms`, `dense_ms`, `lm_head_ms`, `tree_ms` and
`gpu_other_ms` (engine.gpu_busy), `outside_ms` the rest of the measured step (Python, launches,
gaps between kernels, the step's one sync). Every per-step and throughput figure is steady state: the eager first step, run while the
graphs are made, is left out (see `summarise`). That second decode must repeat the first exactly (the same tokens and accept lengths).

Tensor parallel (tp > 1): the process is rank 0 of a tp-way deployment (engine.tp) at exactly one
GPU's shapes; its all-reduces are not run (one process), so `comm_ms` carries them per step from the
alpha-beta model (engine.comm_model), `comm_source` "modelled" ("none" at tp 1). tokens_per_s and
the ITL are a deployment's figures: the measured step plus comm_ms (no overlap assumed); step_ms_*,
the stage columns, kernel_ms and outside_ms are the measured step of rank 0 alone.

One model is built per TP degree (the previous one freed first); on CUDA the MoE layers take their
weights in rotation from as many distinct sets as memory holds (`weight_sets`). The depth series
decodes one point at fewer layers of the same model (its first layers).

The context axis (`ContextAxis`) decodes prompts of 1k-128k tokens at one TP degree, level and
budget. Every point is prefilled once, in chunks (engine.decode), and its warm-up, measured and
profiled decodes start from that one prefill, rewound. Before anything of a point is allocated its
device bytes are checked (engine.footprint): a point that does not fit beside the weights is
recorded with status "skipped", the reason and the bytes it needed, as is a context point that the
axis's measured points predict would run past the axis's time budget.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch

from engine import comm_model, footprint, gpu_busy
from engine import tp as tpar
from engine.comm_model import CommModel
from engine.config import ModelConfig, make_config
from engine.decode import PREFILL_TOKENS, STAGES, DecodeResult, Decoder, Prefilled, cache_rows
from engine.drafter import BlockDrafter
from engine.model import PLANT_GAIN, TargetModel, hot_vocab
from engine.rows import E2ERow
from engine.schema import CommSource, PointStatus
from engine.timing import percentile

Columns = dict[str, Any]  # e2e columns -> values, for an E2ERow
# e2e column of each kernel family's GPU time per step (engine.gpu_busy.FAMILIES)
FAMILY_COLUMNS = {"moe": "moe_ms", "attention": "attention_ms", "dense": "dense_ms", "lm_head": "lm_head_ms",
                  "tree": "tree_ms", "other": "gpu_other_ms"}


@dataclass(frozen=True)
class ContextAxis:
    """Long prompts: every sequence holds exactly `length` prompt tokens, at one TP degree,
    acceptance level and node budget (the accept sweep stays at the short prompts). seconds: the
    axis's wall-time budget; a point predicted to run past what is left of it is skipped (recorded)."""

    points: tuple[tuple[int, tuple[int, ...]], ...]  # (prompt tokens, concurrencies)
    tp: int
    level: float = 0.8
    budget: int = 16
    max_new: int = 32
    seconds: float | None = None

    def order(self) -> list[tuple[int, int]]:
        """(length, concurrency) from the least attention work (C x L^2) to the most, so the points
        that predict the others' time run first."""
        return sorted(((n, c) for n, cs in self.points for c in cs), key=lambda p: (p[1] * p[0] ** 2, p[0]))


@dataclass(frozen=True)
class E2EProfile:
    config: str
    layers: int
    tps: tuple[int, ...]  # tensor-parallel degrees (one model each, rank 0)
    levels: tuple[float, ...]  # synthetic acceptance levels of the steered drafter
    concurrency: tuple[int, ...]
    budgets: tuple[int, ...]
    prompt_len: tuple[int, int]  # prompt lengths drawn uniformly from [lo, hi]
    max_new: int
    warmup_new: int
    depths: tuple[int, ...] = ()  # the depth series: these layer counts (< layers) at depth_point
    depth_point: tuple[int, float, int, int] = (1, 0.8, 1, 16)  # its tp, level, concurrency, budget
    context: ContextAxis | None = None
    prefill_tokens: int = PREFILL_TOKENS  # positions a prefill forward takes, all sequences together


# The CUDA axis's time budget keeps its points to about 3 minutes of an H200 whichever attention kernel
# runs: the points a slow kernel would push past it are recorded as skipped.
PROFILES: dict[tuple[str, str], E2EProfile] = {
    ("cuda", "full"): E2EProfile("k2", 61, (8, 1), (0.8, 0.85, 0.9), (1, 16), (16,), (256, 512), 48, 4,
                                 depths=(2, 6, 10), depth_point=(8, 0.8, 1, 16),
                                 context=ContextAxis(((1024, (1, 16)), (8192, (1, 16)), (32768, (1, 16)),
                                                      (65536, (1,)), (131072, (1,))), tp=8, seconds=180.0)),
    ("cuda", "smoke"): E2EProfile("k2", 4, (1, 8), (0.8,), (1, 4), (16,), (128, 256), 32, 8,
                                  context=ContextAxis(((1024, (1,)), (8192, (1,))), tp=8, max_new=16)),
    ("cpu", "full"): E2EProfile("k2-mini", 3, (1, 2), (0.6, 0.8, 0.9), (1, 4, 16), (16, 64), (8, 32), 32, 8,
                                depths=(1, 2), depth_point=(1, 0.8, 4, 16),
                                context=ContextAxis(((64, (1, 4)), (256, (1, 4))), tp=2, max_new=24),
                                prefill_tokens=128),
    ("cpu", "smoke"): E2EProfile("k2-mini", 3, (1, 2), (0.8,), (1, 4), (16, 64), (8, 32), 24, 0,
                                 context=ContextAxis(((64, (1,)), (256, (1,))), tp=2, max_new=16),
                                 prefill_tokens=128),
}


def prompts_for(cfg: ModelConfig, n: int, lengths: tuple[int, int], seed: int = 7) -> list[list[int]]:
    """Seeded random prompts of varied length over the hot vocab (engine.model); sequence i is the
    same at every concurrency."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(0, hot_vocab(cfg), (k,), generator=g).tolist() for k in lens]


def eager_steps(res: DecodeResult) -> int:
    """How many leading steps the steady-state figures leave out: the eager ones, when later steps exist."""
    return res.eager_steps if len(res.step_s) > res.eager_steps else 0


def summarise(res: DecodeResult, comm_s: float = 0.0) -> Columns:
    """Throughput, latency percentiles and the stage split of one measured decode, in steady state.

    Steady state: the decode's first `res.eager_steps` steps (run eagerly while the step's CUDA
    graphs are made, which a server does once) are left out of every per-step and throughput
    figure, when later steps exist. tokens/s: the tokens those steps gave (all sequences) over their
    wall time plus comm_s per step. TTFT: mean over sequences of the time to their first token (one
    batched prefill gives every sequence its first token at once). ITL: a step's time plus comm_s
    divided by the tokens it gave a sequence. Stage columns are per-step means of the measured step;
    other = mean step - the named stages.
    """
    k = eager_steps(res)
    step_s, emitted = res.step_s[k:], res.emitted[k:]
    new = sum(len(t) - 1 for t in res.tokens) - sum(map(sum, res.emitted[:k]))
    itl = [(step_s[i] + comm_s) / e for i, em in enumerate(emitted) for e in em]
    stage = {s: statistics.mean(res.stage_s[s][k:]) * 1e3 for s in STAGES}
    step_ms = statistics.mean(step_s) * 1e3
    acc = [a for per in res.accept_len[k:] for a in per]
    wall = sum(step_s) + len(step_s) * comm_s
    return {
        "steps": len(step_s), "tokens_per_s": new / wall if wall else None,
        "accept_len_mean": statistics.mean(acc),
        "step_ms_p50": percentile(step_s, 50) * 1e3, "step_ms_p99": percentile(step_s, 99) * 1e3,
        "ttft_ms": statistics.mean(res.ttft_s) * 1e3,
        "itl_ms_p50": percentile(itl, 50) * 1e3, "itl_ms_p99": percentile(itl, 99) * 1e3,
        "draft_ms": stage["draft"], "tree_build_ms": stage["tree_build"], "verify_ms": stage["verify"],
        "accept_ms": stage["accept"], "other_ms": max(step_ms - sum(stage.values()), 0.0), "comm_ms": comm_s * 1e3,
    }


def predict_seconds(done: list[tuple[int, int, float]], conc: int, length: int) -> float | None:
    """Wall time of a context point from the (concurrency, length, seconds) measured before it:
    t = f + a C L + b C L^2 (per-point, per-token and attention work), least squares, a term whose
    fit comes out negative dropped; None until three points are measured."""
    if len(done) < 3:
        return None
    feats = np.array([[1.0, c * n, c * n * n] for c, n, _ in done])
    scale = feats.max(0)
    x, y = feats / scale, np.array([t for *_, t in done])
    keep = [0, 1, 2]
    while True:
        coef = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep = [k for k, w in zip(keep, coef) if w >= 0] or [0]
    want = np.array([1.0, conc * length, conc * length * length]) / scale
    return float(max(want[keep] @ coef, 0.0))


# Share of generated tokens that must be their predecessor's planted successor (the steering hints
# are that chain: a target that leaves it accepts nothing and its row would misreport the level).
MIN_CHAIN_SHARE = 0.9


def chain_share(model: TargetModel, tokens: list[list[int]]) -> float:
    """Share of consecutive generated pairs (a, b) with b the planted successor of a."""
    succ, hot = model.successor.tolist(), model.successor.numel()
    pairs = [(a, b) for seq in tokens for a, b in zip(seq, seq[1:])]
    return sum(succ[a % hot] == b for a, b in pairs) / len(pairs) if pairs else 1.0


class E2EBench:
    """The suite's points; one model (+ drafter) at a time, built when a point needs its TP degree."""

    def __init__(self, prof: E2EProfile, device: torch.device, layers: int | None = None,
                 vocab: int | None = None, comm: CommModel = comm_model.DEFAULT, memory_limit: int | None = None):
        """memory_limit: treat the device as holding at most this many bytes in all, weights included
        (tests force a skip with it)."""
        self.p, self.dev, self.comm, self.memory_limit = prof, device, comm, memory_limit
        self.cfg = make_config(prof.config, layers=layers or prof.layers, vocab=vocab)
        ctx = prof.context
        if ctx is not None and ctx.tp not in prof.tps:
            raise ValueError(f"the context axis runs at tp {ctx.tp}, which the profile's tps {prof.tps} lack")
        for tp in set(prof.tps) | {prof.depth_point[0]}:
            tpar.check(self.cfg, tp)
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.prompts = prompts_for(self.cfg, max(prof.concurrency + (prof.depth_point[2],)), prof.prompt_len)
        self._long: dict[int, list[list[int]]] = {}
        self._ctx_done: list[tuple[int, int, float]] = []  # (concurrency, length, seconds) of measured context points
        self._tp: int | None = None
        self._model: TargetModel | None = None
        self._drafter: BlockDrafter | None = None

    def note(self) -> str:
        c, p = self.cfg, self.p
        return (f"e2e {c.name}: layers={c.layers} vocab={c.vocab} tp={','.join(map(str, p.tps))} "
                f"dtype={str(self.dtype).removeprefix('torch.')} "
                f"L={c.draft_len} k={c.draft_topk} prompts={p.prompt_len[0]}..{p.prompt_len[1]} "
                f"max_new={p.max_new} synthetic_accept={','.join(map(str, p.levels))} (steered drafter; random "
                f"target with a planted successor, gain {PLANT_GAIN}, residual branches scaled 1/(2 layers)); "
                f"accept_len_mean counts accepted draft tokens per step (tokens per step = +1); "
                f"tp > 1: rank 0 alone, comm_ms modelled per step (two all-reduces a layer of tokens x hidden x 2 "
                f"bytes + one argmax all-gather) from {self.comm.describe()}; tokens_per_s and itl include comm_ms, "
                f"step_ms and the stages are the measured step; depth series: layers "
                f"{','.join(map(str, p.depths)) or '-'} at tp={p.depth_point[0]} synthetic_accept={p.depth_point[1]} "
                f"C={p.depth_point[2]} B={p.depth_point[3]}; prefill in forwards of at most {p.prefill_tokens} "
                f"tokens (all sequences), each point prefilled once (its decodes rewind to it), TTFT timed warm"
                + self._context_note())

    def _context_note(self) -> str:
        ax = self.p.context
        if ax is None:
            return ""
        pts = ", ".join(f"{n} (C={'/'.join(map(str, cs))})" for n, cs in ax.points)
        limit = f"; a point predicted past the axis's {ax.seconds:g} s is skipped" if ax.seconds else ""
        return (f"; context axis: prompts of exactly {pts} tokens at tp={ax.tp} synthetic_accept={ax.level} "
                f"B={ax.budget} max_new={ax.max_new}; a point whose cache and working set do not fit beside "
                f"the weights is skipped with the bytes it needed{limit}")

    def points(self) -> list[tuple[str, Callable[[], E2ERow]]]:
        p, full = self.p, self.cfg.layers
        pts = []
        for tp in p.tps:
            pts += [(f"tp={tp} level={lv} C={c} B={b}", lambda tp=tp, lv=lv, c=c, b=b: self.point(tp, full, lv, c, b))
                    for lv in p.levels for c in p.concurrency for b in p.budgets]
            if tp == p.depth_point[0]:
                _, lv, c, b = p.depth_point
                pts += [(f"tp={tp} layers={n} level={lv} C={c} B={b}",
                         lambda tp=tp, n=n, lv=lv, c=c, b=b: self.point(tp, n, lv, c, b))
                        for n in p.depths if n < full]
            if p.context is not None and tp == p.context.tp:
                ax = p.context
                pts += [(f"tp={tp} context={n} level={ax.level} C={c} B={ax.budget}",
                         lambda n=n, c=c: self.context_point(n, c)) for n, c in ax.order()]
        return pts

    def _decoder(self, tp: int, layers: int) -> Decoder:
        """A decoder over the model of this TP degree (built now if the last point had another)."""
        if self._tp != tp:
            self._model = self._drafter = None  # free one model before building the next
            gc.collect()
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
            self._model = TargetModel(self.cfg, self.dev, self.dtype, seed=0, tp=tp)
            self._drafter = BlockDrafter(self._model, seed=1)
            self._tp = tp
        model = self._model if layers == self.cfg.layers else self._model.truncated(layers)
        return Decoder(model, self._drafter, self.p.prefill_tokens)

    def context_point(self, length: int, conc: int) -> E2ERow:
        """A point of the context axis; its wall time feeds the prediction of the points after it."""
        ax = self.p.context
        if length not in self._long:
            most = max(c for n, cs in ax.points if n == length for c in cs)
            self._long[length] = prompts_for(self.cfg, most, (length, length))
        late = None
        guess = predict_seconds(self._ctx_done, conc, length)
        spent = sum(t for *_, t in self._ctx_done)
        if ax.seconds is not None and guess is not None and spent + guess > ax.seconds:
            late = (f"predicted to take {guess:.0f} s (from this run's {len(self._ctx_done)} measured context "
                    f"points), past the {max(ax.seconds - spent, 0):.0f} s left of the context axis's {ax.seconds:g} s")
        t0 = time.perf_counter()
        row = self.point(ax.tp, self.cfg.layers, ax.level, conc, ax.budget, self._long[length][:conc],
                         ax.max_new, late)
        if row.status == PointStatus.OK:
            self._ctx_done.append((conc, length, time.perf_counter() - t0))
        return row

    def point(self, tp: int, layers: int, level: float, conc: int, budget: int,
              prompts: list[list[int]] | None = None, max_new: int | None = None, late: str | None = None) -> E2ERow:
        """One point (prompts: the short sweep's first `conc` by default); skipped, with the reason and
        the bytes it needed, when its cache and working set do not fit beside the weights (or `late`)."""
        dec = self._decoder(tp, layers)
        m, prompts = dec.model, prompts or self.prompts[:conc]
        max_new = max_new or self.p.max_new
        rows = cache_rows(prompts, max_new, budget, m.cfg.draft_len)
        need = footprint.point_need(dec, prompts, rows, budget)
        row = E2ERow(config=m.cfg.name, layers=layers, tp=tp,
                     weight_sets=min(m.weight_sets, layers - min(m.cfg.dense_layers, layers)),
                     vocab=m.cfg.vocab, comm_source=CommSource.MODELLED if tp > 1 else CommSource.NONE,
                     device=self.dev.type, concurrency=conc, budget=budget,
                     context=round(statistics.mean(map(len, prompts))), synthetic_accept=level,
                     memory_bytes=float(need.total))
        free = footprint.free_bytes(self.dev)
        if self.memory_limit is not None:
            free = min(free, max(self.memory_limit - need.weights, 0))
        if need.beside_weights > free:
            return replace(row, status=PointStatus.SKIPPED, skip_reason=need.reason(free, f"{conc} x {rows} rows"))
        if late:
            return replace(row, status=PointStatus.SKIPPED, skip_reason=late)
        start = dec.prefill(prompts, rows, warm=True)
        if self.p.warmup_new:
            dec.speculative(prompts, self.p.warmup_new, budget, level, start=start)
        res = dec.speculative(prompts, max_new, budget, level, start=start)
        on_chain = chain_share(m, res.tokens)
        if on_chain < MIN_CHAIN_SHARE:
            raise RuntimeError(f"the target's greedy tokens follow the planted successor at {on_chain:.0%} of places "
                               f"(non-finite values or a lost margin): acceptance would not be the synthetic level")
        comm_s = self.comm.forward_ms(conc * (budget + 1), m.cfg.hidden, layers, tp) / 1e3
        return replace(row, status=PointStatus.OK, **summarise(res, comm_s),
                       **self.kernel_split(dec, prompts, max_new, budget, level, res, start))

    def kernel_split(self, dec: Decoder, prompts: list[list[int]], max_new: int, budget: int, level: float,
                     res: DecodeResult, start: Prefilled) -> Columns:
        """GPU busy time per step and its split by family, from a second decode of the same point (from
        the same prefill, rewound) under the kernel profiler (the decode is reproducible: the same
        steps, checked); outside = the measured step minus the busy time. The profiled run's own
        wall time is not used: tracing and the family markers slow the host side."""
        if self.dev.type != "cuda":
            return {}
        again, split = gpu_busy.profiled(
            lambda: dec.speculative(prompts, max_new, budget, level, marks=True, start=start),
            lambda r: len(r.step_s))
        if again.tokens != res.tokens or again.accept_len != res.accept_len:
            raise RuntimeError("gpu_busy: the profiled decode differs from the measured one")
        k = eager_steps(res)
        fams = {FAMILY_COLUMNS[f]: statistics.mean(w[f] for w in split[k:]) * 1e3 for f in gpu_busy.FAMILIES}
        kernel = sum(fams.values())
        return {"kernel_ms": kernel, "outside_ms": max(statistics.mean(res.step_s[k:]) * 1e3 - kernel, 0.0), **fams}
