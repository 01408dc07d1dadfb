"""Decode loops: the target's plain greedy decoding and DDTree speculative decoding, batched.

Both share prefill (one batched forward over right-padded prompts) and the same latent cache,
so the lossless property is a like-for-like comparison: DDTree's greedy output must equal
`greedy` token for token.
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
    ttft_s: list[float]  # per sequence, from the start of the call to its first token (batched prefill)
    decode_s: float = 0.0  # wall time of the step loop (DDTree: the sum of its steps, hint work excluded)
    step_s: list[float] = field(default_factory=list)
    stage_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    accept_len: list[list[int]] = field(default_factory=list)  # per step, per unfinished sequence
    emitted: list[list[int]] = field(default_factory=list)  # tokens each unfinished sequence got per step
    # leading steps run eagerly before the CUDA graphs replay (their capture follows the first):
    # a server pays them once, so the steady-state figures leave them out (engine.bench_e2e.summarise)
    eager_steps: int = 0


class Decoder:
    """Runs the target (and optionally the drafter) over a batch of prompts."""

    def __init__(self, model: TargetModel, drafter: BlockDrafter | None = None):
        self.model, self.drafter = model, drafter
        self.device = model.device

    def _prefill(self, prompts: list[list[int]], capacity: int, clock: Clock,
                 ttft: list[float]) -> tuple[LatentCache, Tensor, Tensor]:
        """Fill the cache in one batched forward; return (cache, first tokens [Bt], last hidden [Bt, H]).

        Prompts are right-padded to the longest: under the causal mask a real token sees only
        earlier (real) tokens, so padding changes no real row; the padded rows land past each
        sequence's length, where the first decode or verify overwrites them.
        """
        m, dev = self.model, self.device
        bt, t = len(prompts), max(map(len, prompts))
        cache = LatentCache.empty(m.cfg, bt, capacity, dev, m.dtype)
        tok = torch.zeros(bt, t, dtype=torch.int64)
        for b, p in enumerate(prompts):
            tok[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=dev)
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(bt, t, t).contiguous()
        pos = torch.arange(t, device=dev).expand(bt, t).contiguous()
        t0 = clock.t
        logits, hidden = m.forward(tok.to(dev), pos, cache, causal, pick=lens - 1)
        cache.lens += lens
        bonus, feat = m.pick(logits[:, 0]), hidden[:, 0]
        ttft.extend([clock.now() - t0] * bt)
        clock.lap()
        return cache, bonus, feat

    def _decode_one(self, cache: LatentCache, tok: Tensor) -> Tensor:
        """One plain greedy step for every sequence: tok [Bt] at row lens -> next token [Bt]."""
        one = torch.ones(tok.shape[0], 1, 1, dtype=torch.bool, device=self.device)
        logits, _ = self.model.forward(tok.unsqueeze(1), cache.lens.unsqueeze(1), cache, one)
        cache.lens += 1
        return self.model.pick(logits[:, -1])

    def greedy(self, prompts: list[list[int]], max_new: int) -> DecodeResult:
        """The target's own greedy decoding, one token per sequence per step."""
        clock = Clock(self.device)
        res = DecodeResult(tokens=[], ttft_s=[])
        cache, bonus, _ = self._prefill(prompts, max(map(len, prompts)) + max_new + 1, clock, res.ttft_s)
        out = [[t] for t in bonus.tolist()]
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
                    level: float = 0.0, marks: bool = False, graphs: bool | None = None) -> DecodeResult:
        """DDTree: draft L positions, build a B-node tree, verify it in one forward, accept, compact.

        level > 0 steers the drafter toward the target's greedy continuation (synthetic acceptance,
        see engine.drafter; the continuation is the model's planted successor chain, see
        engine.model); computing those hints is harness work, left out of every timing. The
        steering draws restart with each call, so decoding a point twice repeats its steps.
        graphs (default: on CUDA): after one eager step, each stage is captured as a CUDA graph
        and replayed (engine.decode.StepGraphs); the stages are the same code either way.
        marks (CUDA): a marker kernel opens and closes each timed step (engine.gpu_busy).
        """
        if self.drafter is None:
            raise ValueError("speculative decoding needs a drafter")
        m, dr, dev = self.model, self.drafter, self.device
        cfg = m.cfg
        graphs = dev.type == "cuda" if graphs is None else graphs
        dr.reset()
        clock = Clock(dev)
        res = DecodeResult(tokens=[], ttft_s=[])
        capacity = max(map(len, prompts)) + max_new + budget + 2 * cfg.draft_len + 2
        cache, bonus, feat = self._prefill(prompts, capacity, clock, res.ttft_s)
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
