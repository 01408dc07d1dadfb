"""Decode loops: the target's plain greedy decoding and DDTree speculative decoding, batched.

Both share prefill and the same latent cache, so the lossless property is a like-for-like
comparison: DDTree's greedy output must equal `greedy` token for token.

Prefill is chunked: right-padded prompts go through the model `prefill_tokens` positions at a time
(all sequences together), each chunk attending to the cache rows before it and causally within
itself, so its memory is linear in the prompt (a [Bt, chunk, chunk] mask, never T x T) and the MoE
sees at most that many tokens a forward. A prefilled batch (`Prefilled`) can be decoded several
times: `rewind` puts it back, so a long point pays its prefill once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
from torch import Tensor

from engine import gpu_busy
from engine.drafter import BlockDrafter
from engine.model import LatentCache, TargetModel
from kernels import ops

STAGES = ("draft", "tree_build", "verify", "accept")
# Positions a prefill forward takes at most, over all sequences: a few thousand keep the MoE's M
# bounded and the chunk's mask small while each forward still fills the GPU.
PREFILL_TOKENS = 4096


class Clock:
    """Wall-clock laps that wait for the device first (prefill's TTFT, plain greedy steps, and the
    line between harness work and a timed DDTree step)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.t = self.now()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def skip(self) -> None:
        """Start the next lap now: the time since the last one belongs to no stage (harness work)."""
        self.t = self.now()

    def lap(self) -> float:
        t, self.t = self.t, self.now()
        return self.t - t


class StageTimer:
    """Stage times of one step without stalling the host between stages: CUDA events recorded
    between the stages and read after the step's one synchronisation (the accepted tokens' copy to
    the host); perf_counter laps on the CPU. The step's wall time is taken on the host."""

    def __init__(self, device: torch.device, stages: int):
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(stages + 1)] if self.cuda else []

    def _mark(self) -> "torch.cuda.Event | float":
        if not self.cuda:
            return time.perf_counter()
        ev = self.events[len(self.marks)]  # made once: a step reuses them after its sync
        ev.record()
        return ev

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.marks = []
        self.marks.append(self._mark())

    def stage(self) -> None:
        self.marks.append(self._mark())

    def finish(self) -> tuple[list[float], float]:
        """(seconds of each stage, seconds of the whole step)."""
        if self.cuda:
            torch.cuda.synchronize()
            stages = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            stages = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return stages, time.perf_counter() - self.t0


@dataclass
class DecodeResult:
    """Generated tokens per sequence (the first comes from prefill) and the timings behind them."""

    tokens: list[list[int]]
    ttft_s: list[float]  # per sequence, from the start of its (batched) prefill to its first token
    decode_s: float = 0.0  # wall time of the step loop (DDTree: the sum of its steps, hint work excluded)
    step_s: list[float] = field(default_factory=list)
    stage_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    accept_len: list[list[int]] = field(default_factory=list)  # per step, per unfinished sequence
    emitted: list[list[int]] = field(default_factory=list)  # tokens each unfinished sequence got per step
    # leading steps run eagerly before the CUDA graphs replay (their capture follows the first):
    # a server pays them once, so the steady-state figures leave them out (engine.bench_e2e.summarise)
    eager_steps: int = 0


def chunk_len(batch: int, tokens: int) -> int:
    """Prompt positions a sequence gets in one prefill forward when the batch shares `tokens`."""
    return max(1, tokens // batch)


def cache_rows(prompts: list[list[int]], max_new: int, budget: int, draft_len: int) -> int:
    """Cache rows a speculative decode of up to max_new tokens needs: the prompt, the tokens it
    keeps and one step's tree (and the padded path) past them."""
    return max(map(len, prompts)) + max_new + budget + 2 * draft_len + 2


@dataclass
class Prefilled:
    """A batch right after prefill. A decode moves only cache.lens and rows past it (a verify writes
    its rows before it reads them), so `rewind` restores this state exactly: decoding it again
    repeats the same steps."""

    cache: LatentCache
    bonus: Tensor  # [Bt] the first generated token of each sequence
    feat: Tensor  # [Bt, H] the last prompt token's hidden state (the drafter's input)
    lens: Tensor  # [Bt] int64 prompt lengths
    ttft_s: list[float]

    def rewind(self) -> tuple[LatentCache, Tensor, Tensor]:
        """(cache back at the prompt lengths, bonus, feat): fresh copies a decode may overwrite."""
        self.cache.lens.copy_(self.lens)
        return self.cache, self.bonus.clone(), self.feat.clone()


class Decoder:
    """Runs the target (and optionally the drafter) over a batch of prompts."""

    def __init__(self, model: TargetModel, drafter: BlockDrafter | None = None,
                 prefill_tokens: int = PREFILL_TOKENS):
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.model, self.drafter = model, drafter
        self.device = model.device
        self.prefill_tokens = prefill_tokens

    def prefill(self, prompts: list[list[int]], capacity: int, warm: bool = False) -> Prefilled:
        """Fill a cache of `capacity` rows a sequence in chunks (module doc); TTFT is timed from
        after the cache is allocated to the first tokens.

        Prompts are right-padded to the longest: under the causal mask a real token sees only
        earlier (real) tokens, so padding changes no real row; the padded rows land past each
        sequence's length, where the first decode or verify overwrites them. Each sequence's
        first token and hidden state come from the chunk holding its last prompt token.
        warm: run a chunk of each length the prefill uses once, untimed, before the timed prefill (its
        kernels compile and tune there, as a server's would before its first request; Triton builds
        a variant per divisibility of the lengths); the timed pass rewrites those rows.
        """
        m, dev = self.model, self.device
        bt, t = len(prompts), max(map(len, prompts))
        if capacity < t:
            raise ValueError(f"prefill: capacity {capacity} is below the longest prompt ({t} tokens)")
        cache = LatentCache.empty(m.cfg, bt, capacity, dev, m.dtype)
        c = min(t, chunk_len(bt, self.prefill_tokens))
        tok = torch.zeros(bt, t, dtype=torch.int64)
        for b, p in enumerate(prompts):
            tok[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
        lens_cpu = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        if warm:  # each chunk length the prompts split into (the last may be shorter)
            for n in sorted({c, t - (t - 1) // c * c}):
                self._chunk(tok[:, :n].to(dev), lens_cpu.to(dev), 0, cache)
                cache.lens.zero_()
        clock = Clock(dev)
        tok, lens = tok.to(dev), lens_cpu.to(dev)
        last = None
        for s0 in range(0, t, c):
            logits, hidden = self._chunk(tok[:, s0:s0 + c], lens, s0, cache)
            if last is None:
                last = logits, hidden
            else:  # sequences whose last prompt token is at or past s0: the chunk holding it writes last
                here = ((lens - 1 - s0) >= 0).view(-1, 1, 1)
                last = torch.where(here, logits, last[0]), torch.where(here, hidden, last[1])
        cache.lens.copy_(lens)
        bonus, feat = m.pick(last[0][:, 0]), last[1][:, 0]
        return Prefilled(cache, bonus, feat, lens, [clock.lap()] * bt)

    def _chunk(self, tok: Tensor, lens: Tensor, s0: int, cache: LatentCache) -> tuple[Tensor, Tensor]:
        """One prefill forward: tok [Bt, n] at positions s0.. over the cache rows before them, causal
        among themselves; the logits and hidden of each sequence's last prompt token where the chunk
        holds it (else of a row the caller discards)."""
        bt, n = tok.shape
        pos = torch.arange(s0, s0 + n, device=tok.device).expand(bt, n)
        pick = (lens - 1 - s0).clamp(0, n - 1)
        out = self.model.forward(tok, pos, cache, None, pick=pick)
        cache.lens += n
        return out

    def _decode_one(self, cache: LatentCache, tok: Tensor) -> Tensor:
        """One plain greedy step for every sequence: tok [Bt] at row lens -> next token [Bt]."""
        one = torch.ones(tok.shape[0], 1, 1, dtype=torch.bool, device=self.device)
        logits, _ = self.model.forward(tok.unsqueeze(1), cache.lens.unsqueeze(1), cache, one)
        cache.lens += 1
        return self.model.pick(logits[:, -1])

    def greedy(self, prompts: list[list[int]], max_new: int) -> DecodeResult:
        """The target's own greedy decoding, one token per sequence per step."""
        pre = self.prefill(prompts, max(map(len, prompts)) + max_new + 1)
        cache, bonus, _ = pre.rewind()
        res = DecodeResult(tokens=[], ttft_s=pre.ttft_s)
        out = [[t] for t in bonus.tolist()]
        clock = Clock(self.device)
        start = clock.t
        for _ in range(max_new - 1):
            bonus = self._decode_one(cache, bonus)
            for b, t in enumerate(bonus.tolist()):
                out[b].append(t)
            res.step_s.append(clock.lap())
        res.decode_s = clock.t - start
        res.tokens = out
        return res

    def speculative(self, prompts: list[list[int]], max_new: int, budget: int,
                    level: float = 0.0, marks: bool = False, graphs: bool | None = None,
                    start: Prefilled | None = None) -> DecodeResult:
        """DDTree: draft L positions, build a B-node tree, verify it in one forward, accept, compact.

        level > 0 steers the drafter toward the target's greedy continuation (synthetic acceptance,
        see engine.drafter; the continuation is the model's planted successor chain, see
        engine.model); computing those hints is harness work, left out of every timing. The
        steering draws restart with each call, so decoding a point twice repeats its steps.
        graphs (default: on CUDA): after one eager step, each stage is captured as a CUDA graph
        and replayed (engine.decode.StepGraphs); the stages are the same code either way.
        marks (CUDA): a marker kernel opens and closes each timed step (engine.gpu_busy).
        start: decode from this prefill of `prompts` (rewound first; its TTFT is the result's)
        instead of prefilling them now; its cache must hold `capacity` rows.
        """
        if self.drafter is None:
            raise ValueError("speculative decoding needs a drafter")
        m, dr, dev = self.model, self.drafter, self.device
        cfg = m.cfg
        graphs = dev.type == "cuda" if graphs is None else graphs
        dr.reset()
        rows = cache_rows(prompts, max_new, budget, cfg.draft_len)
        if start is None:
            start = self.prefill(prompts, rows)
        elif start.cache.ckv.shape[2] < rows or start.lens.tolist() != [len(p) for p in prompts]:
            raise ValueError(f"speculative: the prefill given holds {start.cache.ckv.shape[2]} rows of prompts of "
                             f"{start.lens.tolist()} tokens; this decode needs {rows} rows of these prompts")
        cache, bonus, feat = start.rewind()
        clock = Clock(dev)
        res = DecodeResult(tokens=[], ttft_s=start.ttft_s)
        bt = len(prompts)
        out = [[t] for t in bonus.tolist()]
        # the step's state: inputs live in fixed buffers that the stages read and the accept stage
        # rewrites in place, so the captured graphs always see the current step
        st = SimpleNamespace(feat=feat, bonus=bonus, active=torch.ones(bt, dtype=torch.int64, device=dev),
                             hints=None, u=None)

        def draft() -> None:
            st.lp, st.tok = dr.draft(st.feat, st.bonus, st.hints, level, st.u)

        def tree_build() -> None:
            with gpu_busy.section("tree"):
                st.tree = ops.build_tree(st.lp, st.tok, st.bonus, budget, impl=m.impl)

        def verify() -> None:
            logits, st.hidden = m.forward(st.tree.tokens, cache.lens.unsqueeze(1) + st.tree.depths, cache,
                                          st.tree.mask)
            st.target_argmax = m.pick(logits)

        def accept() -> None:
            with gpu_busy.section("tree"):
                path, st.acc, bonus = ops.tree_accept(st.tree, st.target_argmax, impl=m.impl)
            cache.compact(path, st.acc, st.active)
            last = path.gather(1, st.acc.unsqueeze(1))
            st.feat.copy_(st.hidden.gather(1, last.unsqueeze(-1).expand(-1, -1, cfg.hidden)).squeeze(1))
            emitted = st.tree.tokens.gather(1, path.clamp(min=0))
            st.bonus.copy_(bonus)
            # what the host needs, in one tensor: one copy (and sync) a step
            st.report = torch.cat([st.acc.unsqueeze(1), bonus.unsqueeze(1), emitted], 1)

        stages = dict(zip(STAGES, (draft, tree_build, verify, accept)))
        replay: StepGraphs | None = None
        timer = StageTimer(dev, len(STAGES))
        active_l = [1] * bt
        while min(map(len, out)) < max_new:
            if level > 0:
                hints = m.continuation(st.bonus, cfg.draft_len)
                u = dr.noise(hints)
                if st.hints is None:
                    st.hints, st.u = hints, u
                else:
                    st.hints.copy_(hints)
                    st.u.copy_(u)
                clock.skip()
            timer.start()
            if marks:
                gpu_busy.mark()
            for name, fn in stages.items():
                if replay:
                    replay.run(name)
                else:
                    fn()
                timer.stage()
            report = st.report.tolist()  # per sequence: accept_len, bonus, the tree tokens on the path
            live = [b for b in range(bt) if len(out[b]) < max_new]
            for b in live:
                acc_b = report[b][0]
                out[b] += report[b][3: acc_b + 3] + [report[b][1]]
            now = [int(len(o) < max_new) for o in out]
            if now != active_l:  # a sequence finished: it stops moving its cache
                active_l = now
                st.active.copy_(torch.tensor(now, dtype=torch.int64))
            res.accept_len.append([report[b][0] for b in live])
            res.emitted.append([report[b][0] + 1 for b in live])
            if marks:
                gpu_busy.mark()
            stage_s, step_s = timer.finish()
            for name, sec in zip(STAGES, stage_s):
                res.stage_s[name].append(sec)
            res.step_s.append(step_s)
            if graphs and replay is None:
                res.eager_steps += 1
                if min(map(len, out)) < max_new:
                    replay = StepGraphs(stages, dev)  # after one eager step: compiled, warmed up
        res.decode_s = sum(res.step_s)
        res.tokens = [o[:max_new] for o in out]
        return res


class StepGraphs:
    """The stages of a DDTree step captured as CUDA graphs, one graph per stage (so the stage split
    stays measurable), sharing one memory pool. Capturing records without running: the state the
    stages read (cache, step buffers) is untouched until the first replay."""

    def __init__(self, stages: dict[str, Callable[[], None]], device: torch.device):
        torch.cuda.synchronize(device)
        pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        for name, fn in stages.items():
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                fn()
            self.graphs[name] = g

    def run(self, name: str) -> None:
        self.graphs[name].replay()
