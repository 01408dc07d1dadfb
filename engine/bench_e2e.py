"""The e2e suite: DDTree decoding throughput and latency per concurrency x budget.

Acceptance is synthetic: the drafter is steered toward the target's own greedy continuation
(decoded from the live cache before each step, untimed) at a fixed level, recorded in every row.
Every stage of every step is timed (CUDA events between the stages, one sync a step; see
engine.decode.StageTimer); `other` is the step's wall time minus the stages.
On CUDA the stages run as CUDA graphs after the first step (engine.decode.StepGraphs), and each
point is decoded once more under the kernel profiler: `kernel_ms` is the GPU's busy time per step,
`outside_ms` the rest of the measured step (Python, launches, gaps between kernels, the step's one sync).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine import gpu_busy
from engine.config import ModelConfig, make_config
from engine.decode import STAGES, DecodeResult, Decoder
from engine.drafter import BlockDrafter
from engine.model import PLANT_GAIN, TargetModel
from engine.timing import percentile

Row = dict[str, Any]


@dataclass(frozen=True)
class E2EProfile:
    config: str
    layers: int
    concurrency: tuple[int, ...]
    budgets: tuple[int, ...]
    level: float  # synthetic acceptance level of the steered drafter
    prompt_len: tuple[int, int]  # prompt lengths drawn uniformly from [lo, hi]
    max_new: int
    warmup_new: int


PROFILES: dict[tuple[str, str], E2EProfile] = {
    ("cuda", "full"): E2EProfile("k2", 2, (1, 2, 4, 8, 16), (16, 64, 256), 0.8, (256, 512), 128, 16),
    ("cuda", "smoke"): E2EProfile("k2", 2, (1, 4), (16, 64), 0.8, (128, 256), 32, 8),
    ("cpu", "full"): E2EProfile("k2-mini", 3, (1, 2, 4, 8, 16), (16, 64, 256), 0.8, (8, 32), 48, 8),
    ("cpu", "smoke"): E2EProfile("k2-mini", 3, (1, 4), (16, 64), 0.8, (8, 32), 24, 0),
}


def prompts_for(cfg: ModelConfig, n: int, lengths: tuple[int, int], seed: int = 7) -> list[list[int]]:
    """Seeded random prompts of varied length; sequence i is the same at every concurrency."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(0, cfg.vocab, (k,), generator=g).tolist() for k in lens]


def summarise(res: DecodeResult) -> Row:
    """Throughput, latency percentiles and the stage split of one measured decode.

    tokens/s: tokens after each sequence's first, over the step loop's wall time (all sequences).
    TTFT: mean over sequences of the time to their first token (one batched prefill gives every
    sequence its first token at once). ITL: a step's time divided by the tokens it gave a
    sequence, over all steps and sequences. Stage columns are per-step means; other = mean step - the named stages.
    """
    steps = len(res.step_s)
    new = sum(len(t) - 1 for t in res.tokens)  # tokens after the first (which prefill produced)
    itl = [res.step_s[i] / e for i, em in enumerate(res.emitted) for e in em]
    stage = {s: statistics.mean(res.stage_s[s]) * 1e3 for s in STAGES}
    step_ms = statistics.mean(res.step_s) * 1e3
    acc = [a for per in res.accept_len for a in per]
    return {
        "steps": steps, "tokens_per_s": new / res.decode_s if res.decode_s else None,
        "accept_len_mean": statistics.mean(acc),
        "step_ms_p50": percentile(res.step_s, 50) * 1e3, "step_ms_p99": percentile(res.step_s, 99) * 1e3,
        "ttft_ms": statistics.mean(res.ttft_s) * 1e3,
        "itl_ms_p50": percentile(itl, 50) * 1e3, "itl_ms_p99": percentile(itl, 99) * 1e3,
        "draft_ms": stage["draft"], "tree_build_ms": stage["tree_build"], "verify_ms": stage["verify"],
        "accept_ms": stage["accept"], "other_ms": max(step_ms - sum(stage.values()), 0.0), "comm_ms": 0.0,
    }


class E2EBench:
    """One model + drafter for the whole suite; each point decodes C prompts at one budget."""

    def __init__(self, prof: E2EProfile, device: torch.device, layers: int | None = None,
                 vocab: int | None = None):
        self.p, self.dev = prof, device
        self.cfg = make_config(prof.config, layers=layers or prof.layers, vocab=vocab)
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = TargetModel(self.cfg, device, self.dtype, seed=0)
        self.decoder = Decoder(self.model, BlockDrafter(self.model, seed=1))
        self.prompts = prompts_for(self.cfg, max(prof.concurrency), prof.prompt_len)

    def note(self) -> str:
        c, p = self.cfg, self.p
        return (f"e2e {c.name}: layers={c.layers} vocab={c.vocab} dtype={str(self.dtype).removeprefix('torch.')} "
                f"L={c.draft_len} k={c.draft_topk} prompts={p.prompt_len[0]}..{p.prompt_len[1]} "
                f"max_new={p.max_new} synthetic_accept={p.level} (steered drafter; random target with a "
                f"planted successor, gain {PLANT_GAIN}); "
                f"accept_len_mean counts accepted draft tokens per step (tokens per step = +1)")

    def points(self) -> list[tuple[str, Callable[[], Row]]]:
        return [(f"C={c} B={b}", lambda c=c, b=b: self.point(c, b))
                for c in self.p.concurrency for b in self.p.budgets]

    def point(self, conc: int, budget: int) -> Row:
        prompts = self.prompts[:conc]
        if self.p.warmup_new:
            self.decoder.speculative(prompts, self.p.warmup_new, budget, self.p.level)
        res = self.decoder.speculative(prompts, self.p.max_new, budget, self.p.level)
        return {"config": self.cfg.name, "layers": self.cfg.layers, "device": self.dev.type,
                "concurrency": conc, "budget": budget, "synthetic_accept": self.p.level,
                **summarise(res), **self.kernel_split(prompts, budget, res)}

    def kernel_split(self, prompts: list[list[int]], budget: int, res: DecodeResult) -> Row:
        """GPU busy time per step, from a second decode of the same point under the kernel profiler
        (the decode is deterministic: the same steps); outside = the measured step minus that. The
        profiled run's own wall time is not used: tracing slows the host side."""
        if self.dev.type != "cuda":
            return {}
        again, busy = gpu_busy.profiled(
            lambda: self.decoder.speculative(prompts, self.p.max_new, budget, self.p.level, marks=True),
            lambda r: len(r.step_s))
        if again.tokens != res.tokens:
            raise RuntimeError("gpu_busy: the profiled decode differs from the measured one")
        kernel = statistics.mean(busy) * 1e3
        return {"kernel_ms": kernel, "outside_ms": max(statistics.mean(res.step_s) * 1e3 - kernel, 0.0)}
