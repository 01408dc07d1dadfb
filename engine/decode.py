"""Decode loops: the target's plain greedy decoding and DDTree speculative decoding, batched.

Both share prefill (one sequence at a time, so prompts of different lengths need no padding)
and the same latent cache, so the lossless property is a like-for-like comparison: DDTree's
greedy output must equal `greedy` token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.drafter import BlockDrafter
from engine.model import LatentCache, TargetModel
from kernels import ops

STAGES = ("draft", "tree_build", "verify", "accept")


class Clock:
    """Wall-clock laps that wait for the device first, so each stage owns its GPU time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.t = self.now()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self) -> float:
        t, self.t = self.t, self.now()
        return self.t - t


@dataclass
class DecodeResult:
    """Generated tokens per sequence (the first comes from prefill) and the timings behind them."""

    tokens: list[list[int]]
    ttft_s: list[float]  # per sequence, from the start of the call to its first token
    decode_s: float = 0.0  # wall time of the step loop
    step_s: list[float] = field(default_factory=list)
    stage_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    accept_len: list[list[int]] = field(default_factory=list)  # per step, per unfinished sequence
    emitted: list[list[int]] = field(default_factory=list)  # tokens each unfinished sequence got per step


class Oracle:
    """The target's known greedy continuation per sequence, served as hints to a steered drafter."""

    def __init__(self, trajectories: list[list[int]], device: torch.device):
        n = max(len(t) for t in trajectories)
        self.traj = torch.full((len(trajectories), n), -1, dtype=torch.int64)
        for b, t in enumerate(trajectories):
            self.traj[b, : len(t)] = torch.tensor(t, dtype=torch.int64)
        self.traj = self.traj.to(device)

    def hints(self, generated: Tensor, length: int) -> Tensor:
        """[Bt] tokens generated so far (incl. the bonus) -> [Bt, L] the next L target tokens (-1 past the end)."""
        idx = generated.unsqueeze(1) + torch.arange(length, device=generated.device)
        n = self.traj.shape[1]
        hint = self.traj[: generated.shape[0]].gather(1, idx.clamp(max=n - 1))
        return torch.where(idx < n, hint, torch.full_like(hint, -1))


class Decoder:
    """Runs the target (and optionally the drafter) over a batch of prompts."""

    def __init__(self, model: TargetModel, drafter: BlockDrafter | None = None):
        self.model, self.drafter = model, drafter
        self.device = model.device

    def _prefill(self, prompts: list[list[int]], capacity: int, clock: Clock,
                 ttft: list[float]) -> tuple[LatentCache, Tensor, Tensor]:
        """Fill the cache per sequence; return (cache, first tokens [Bt], last hidden [Bt, H])."""
        m, dev = self.model, self.device
        cache = LatentCache.empty(m.cfg, len(prompts), capacity, dev, m.dtype)
        bonus = torch.zeros(len(prompts), dtype=torch.int64, device=dev)
        feat = torch.zeros(len(prompts), m.cfg.hidden, dtype=m.dtype, device=dev)
        t0 = clock.t
        for b, p in enumerate(prompts):
            tok = torch.tensor([p], dtype=torch.int64, device=dev)
            t = len(p)
            view = LatentCache(cache.ckv[:, b:b + 1], cache.kpe[:, b:b + 1], cache.lens[b:b + 1])
            causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril().unsqueeze(0)
            pos = torch.arange(t, device=dev).unsqueeze(0)
            logits, hidden = m.forward(tok, pos, view, causal, last_only=True)
            view.lens += t
            bonus[b] = logits[0, -1].argmax()
            feat[b] = hidden[0, -1]
            ttft.append(clock.now() - t0)
        clock.lap()
        return cache, bonus, feat

    def greedy(self, prompts: list[list[int]], max_new: int) -> DecodeResult:
        """The target's own greedy decoding, one token per sequence per step."""
        clock = Clock(self.device)
        res = DecodeResult(tokens=[], ttft_s=[])
        cache, bonus, _ = self._prefill(prompts, max(map(len, prompts)) + max_new + 1, clock, res.ttft_s)
        out = [[t] for t in bonus.tolist()]
        one = torch.ones(len(prompts), 1, 1, dtype=torch.bool, device=self.device)
        start = clock.t
        for _ in range(max_new - 1):
            logits, _ = self.model.forward(bonus.unsqueeze(1), cache.lens.unsqueeze(1), cache, one)
            cache.lens += 1
            bonus = logits[:, -1].argmax(-1)
            for b, t in enumerate(bonus.tolist()):
                out[b].append(t)
            res.step_s.append(clock.lap())
        res.decode_s = clock.t - start
        res.tokens = out
        return res

    def speculative(self, prompts: list[list[int]], max_new: int, budget: int,
                    oracle: Oracle | None = None, level: float = 0.0) -> DecodeResult:
        """DDTree: draft L positions, build a B-node tree, verify it in one forward, accept, compact."""
        if self.drafter is None:
            raise ValueError("speculative decoding needs a drafter")
        m, dr, dev = self.model, self.drafter, self.device
        cfg = m.cfg
        clock = Clock(dev)
        res = DecodeResult(tokens=[], ttft_s=[])
        capacity = max(map(len, prompts)) + max_new + budget + cfg.draft_len + 2
        cache, bonus, feat = self._prefill(prompts, capacity, clock, res.ttft_s)
        bt = len(prompts)
        out = [[t] for t in bonus.tolist()]
        generated = torch.ones(bt, dtype=torch.int64, device=dev)
        active = torch.ones(bt, dtype=torch.int64, device=dev)
        start = clock.t
        while min(map(len, out)) < max_new:
            hints = oracle.hints(generated, cfg.draft_len) if oracle is not None else None
            lp, tok = dr.draft(feat, bonus, hints, level)
            res.stage_s["draft"].append(clock.lap())
            tree = ops.build_tree(lp, tok, bonus, budget, impl=m.impl)
            res.stage_s["tree_build"].append(clock.lap())
            logits, hidden = m.forward(tree.tokens, cache.lens.unsqueeze(1) + tree.depths, cache, tree.mask)
            target_argmax = logits.argmax(-1)
            res.stage_s["verify"].append(clock.lap())
            path, acc, bonus = ops.tree_accept(tree, target_argmax, impl=m.impl)
            cache.compact(path, acc, active)
            last = path.gather(1, acc.unsqueeze(1))
            feat = hidden.gather(1, last.unsqueeze(-1).expand(-1, -1, cfg.hidden)).squeeze(1)
            emitted = tree.tokens.gather(1, path.clamp(min=0))
            generated += (acc + 1) * active
            acc_l, emitted_l, bonus_l = acc.tolist(), emitted.tolist(), bonus.tolist()
            res.stage_s["accept"].append(clock.lap())
            live = [b for b in range(bt) if len(out[b]) < max_new]
            for b in live:
                out[b] += emitted_l[b][1: acc_l[b] + 1] + [bonus_l[b]]
            active = torch.tensor([int(len(o) < max_new) for o in out], dtype=torch.int64, device=dev)
            res.accept_len.append([acc_l[b] for b in live])
            res.emitted.append([acc_l[b] + 1 for b in live])
            res.step_s.append(clock.lap() + sum(res.stage_s[s][-1] for s in STAGES))
        res.decode_s = clock.t - start
        res.tokens = [o[:max_new] for o in out]
        return res
