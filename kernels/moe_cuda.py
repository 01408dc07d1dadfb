"""W4A16 MoE on mma.sync tensor cores in CUDA C++ (kernels/moe_w4a16.cu and the two headers it includes:
moe_w4a16_ptx.cuh, the inline PTX; moe_w4a16_gemm.cuh, the GEMM pass), built by the host's nvcc.

The passes of kernels/moe_gemm.py's grouped path, the block table and both projections in CUDA:
moe_align (slots grouped by expert, one launch instead of torch's sort and scans), then per
projection one GEMM pass writing partials per K split (fp32 for gate_up, bf16 for down: its
weighted per-slot outputs, as vLLM's fused MoE keeps them), on activations permuted to the
dequant's pairs and their group sums (prepared by the align launch for gate_up, by moe_silu_prep,
which also applies SiLU x up, for down); moe_sum adds the down partials over the splits and top-k
in fp32, in a fixed order. Weights stay in K2's own layout (kernels/int4.py): nothing is repacked. On sm_90
and later the five launches are programmatic dependent launches (moe_w4a16.cu's top says how they
wait), so each kernel's CTAs start while the one before drains.

`unavailable_reason(device)` says why this host cannot run it (no nvcc, the cubin does not build),
None when it can. The configs come from kernels/moe_configs.py's table for the device's arch, each
checked against the device's limits (`device_limits`: the driver's shared-memory opt-in and
registers; `kernel_resources`: the loaded kernel's own); `supports` says whether the inputs' M
bucket runs here. ops runs the Triton kernel otherwise, and engine.build records, per bucket, which
one runs and why.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from functools import cache

import numpy as np
import torch
import triton
from torch import Tensor

from kernels import cuda_build
from kernels.moe_configs import (ARCH_SMEM_OPTIN, KERNELS, SWEEP_KERNELS, Bucket, Choice, DeviceLimits, KernelResources, PassConfig,
                                 bucket_of, choose, cuda_prelude, misfit, table_for)
from kernels.moe_gemm_configs import shape_class

SOURCE = "moe_w4a16.cu"
MAX_EXPERTS = 1024  # moe_align's one-CTA table
# Lowers the shared memory a block may use below the driver's opt-in (bytes): runs a smaller
# device's configs here, e.g. sm_120's 101,376 on an H200. It can only lower the limit.
SMEM_LIMIT_ENV = "KDBENCH_CUDA_SMEM_LIMIT"
# The build with the sweep's candidate kernels too: a config naming a kernel outside the tables' KERNELS
# runs from it (engine/moe_sweep.py's candidates).
SWEEP_BUILD = KERNELS | {f"moe_w4a16_{k}" for k in SWEEP_KERNELS}


@cache
def device_limits(index: int) -> DeviceLimits:
    """The driver's limits of CUDA device `index`, the shared memory lowered by $KDBENCH_CUDA_SMEM_LIMIT."""
    optin = cuda_build.device_attribute(index, cuda_build.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
    smem, lowered = optin, None
    cap = os.environ.get(SMEM_LIMIT_ENV, "").strip()
    if cap:
        if not cap.isdigit():
            raise ValueError(f"${SMEM_LIMIT_ENV} must be a number of bytes, got {cap[:40]!r}")
        if int(cap) < optin:
            smem, lowered = int(cap), optin
    return DeviceLimits(cuda_build.arch_of(torch.device("cuda", index)), smem,
                        cuda_build.device_attribute(index, cuda_build.MAX_REGISTERS_PER_BLOCK),
                        cuda_build.device_attribute(index, cuda_build.MAX_REGISTERS_PER_MULTIPROCESSOR), lowered)


def kernel_resources(index: int, name: str) -> KernelResources:
    """Registers, static shared memory and the thread limit of kernel `name` as loaded on device `index`."""
    k = _module(torch.device("cuda", index), name not in KERNELS).kernel(name)
    return KernelResources(k.attribute(cuda_build.FUNC_NUM_REGS), k.attribute(cuda_build.FUNC_SHARED_SIZE_BYTES),
                           k.attribute(cuda_build.FUNC_MAX_THREADS_PER_BLOCK))


@cache
def bucket_choice(index: int, inter: int, hidden: int, bucket: int, arch: str | None = None) -> Choice:
    """What M bucket `bucket` runs on device `index` for experts [2 inter, hidden] / [hidden, inter].
    With `arch`: what it would run on a device of that arch (its table, its shared-memory opt-in from
    ARCH_SMEM_OPTIN), judged with this device's registers and compiled kernels, so that another arch's
    choice can run here before a host of that arch runs it."""
    limits = device_limits(index)
    if arch is not None:
        limits = dataclasses.replace(limits, arch=arch, smem_per_block=ARCH_SMEM_OPTIN[arch], lowered_from=None)
    key, _ = table_for(limits.arch)
    return choose(key, shape_class(inter), bucket, 2 * inter, hidden, hidden, inter, limits,
                  lambda name: kernel_resources(index, name))


def choice(m: int, inter: int, hidden: int, index: int, arch: str | None = None) -> Choice:
    """What M = m runs on device `index` (its bucket's choice), or would run on an `arch` device."""
    _, table = table_for(arch or device_limits(index).arch)
    return bucket_choice(index, inter, hidden, bucket_of(table[shape_class(inter)], m), arch)


def bucket_records(device: torch.device, inter: int, hidden: int) -> list[dict[str, object]]:
    """build.json's per-bucket records of one expert shape on `device`: impl, kernels, why."""
    index = _cuda(device).index
    _, table = table_for(device_limits(index).arch)
    return [bucket_choice(index, inter, hidden, b).record(hidden, inter) for b in sorted(table[shape_class(inter)])]


@cache
def _unavailable(index: int) -> str | None:
    try:
        _module(torch.device("cuda", index))
    except cuda_build.CudaUnavailable as e:
        return str(e)
    return None


def unavailable_reason(device: torch.device) -> str | None:
    """None when the CUDA kernel runs on `device`; else why not (no nvcc, build failed, not CUDA)."""
    if device.type != "cuda":
        return f"not a CUDA device ({device.type})"
    return _unavailable(_cuda(device).index)


# The key of one call shape: x's shape, dtype, on CUDA, device index; w13_q's and w2_q's shapes. What a
# call reads cheaply (each is one attribute), so a call pays little to find its set-up.
Key = tuple[torch.Size, torch.dtype, bool, int, torch.Size, torch.Size]


def _key(x: Tensor, w13_q: Tensor, w2_q: Tensor) -> Key:
    return x.shape, x.dtype, x.is_cuda, x.get_device(), w13_q.shape, w2_q.shape


@cache
def _why_not(key: Key, configs: Bucket | None) -> str | None:
    """Why these inputs cannot run here (None when they can): not bf16 on a CUDA device with a built
    kernel, too many experts, mismatched weights, or configs (`configs`, else the M bucket's choice on
    this device) that do not tile the shapes, hold every token an expert can get, or fit the device."""
    (m, h), dtype, on_cuda, index, (e, two_i, _), w2 = key
    inter = two_i // 2
    if not on_cuda or dtype != torch.bfloat16:
        return f"the CUDA kernel takes bf16 activations on a CUDA device, not {dtype} on {'cuda' if on_cuda else 'cpu'}"
    why = _unavailable(index)
    if why is not None:
        return why
    if e > MAX_EXPERTS or tuple(w2) != (e, h, inter // 8):
        return f"E = {e} (at most {MAX_EXPERTS}), w2 [{', '.join(map(str, w2))}] (want [{e}, {h}, {inter // 8}])"
    if configs is None:
        c = choice(m, inter, h, index)
        return None if c.cuda else f"M = {m} runs the Triton kernel here: {c.why()}"
    limits = device_limits(index)
    for name, c, n, k in (("gate_up", configs.gate_up, two_i, h), ("down", configs.down, h, inter)):
        why = (None if c.tiles(n, k) else f"does not tile [{n}, {k}]") or \
              (None if c.holds(m) else f"holds {c.tokens} token(s) a stage, fewer than M = {m} can route to an expert") or \
              misfit(c, k, limits, kernel_resources(index, c.kernel))
        if why is not None:
            return f"{name} {c.kernel}: {why}"
    return None


def supports(x: Tensor, w13_q: Tensor, w2_q: Tensor, configs: Bucket | None = None) -> bool:
    """Whether moe_w4a16 runs these inputs here (`configs`, else the M bucket's choice): _why_not's rules."""
    return _why_not(_key(x, w13_q, w2_q), configs) is None


def _cuda(device: torch.device) -> torch.device:
    """cuda:N with N spelled out, so "cuda" and "cuda:0" share one loaded module."""
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def _module(device: torch.device, sweep: bool = False) -> cuda_build.Module:
    """The shipped build of moe_w4a16.cu on `device` (the tables' kernels), or (`sweep`) the one with the
    sweep's candidates too; each with the stage layout of kernels/moe_configs.py."""
    return cuda_build.module(SOURCE, _cuda(device), cuda_prelude(SWEEP_BUILD if sweep else KERNELS))


# Base pointers of a call, in the order _Call's argument slots name them (0: no base, a plain value)
_BASES = ("", "workspace", "x", "w13_q", "w13_s", "w2_q", "w2_s", "ids", "tw", "out")
_ALIGN = 256  # bytes: each workspace buffer starts on its own 256-byte boundary
_TOGETHER_MAX = 16 << 20  # bytes: a workspace up to this size is allocated behind the output, in one allocation


class _Call:
    """One call shape set up once: the workspace's layout, every launch with its arguments (a
    cuda_build.Chain). A call then allocates the output and the workspace (one allocation up to
    _TOGETHER_MAX of workspace: the output keeps it alive, so not a large one), writes nine base
    pointers and makes the launches, through the host launcher where it built: moe_align (the block
    table; its CTAs past the first prepare x), a second moe_align when the passes' block sizes differ,
    gate_up, moe_silu_prep (SiLU x up, prepared for down), down, moe_sum."""

    def __init__(self, index: int, m: int, h: int, e: int, inter: int, topk: int, cfg: Bucket) -> None:
        dev = torch.device("cuda", index)
        mod = _module(dev, not {cfg.gate_up.kernel, cfg.down.kernel} <= KERNELS)
        pdl = torch.cuda.get_device_capability(index)[0] >= 9
        s = m * topk
        self.index, self.device, self.shape, self.ws_bytes = index, dev, (m, h), 0

        def buf(nbytes: int) -> tuple[int, int]:  # (base, offset) of a new workspace buffer
            at = self.ws_bytes
            self.ws_bytes += -(-nbytes // _ALIGN) * _ALIGN
            return 1, at

        def table(bm: int) -> tuple[int, list[tuple[int, int]]]:
            ub = triton.cdiv(s, bm) + min(e, s)
            return ub, [buf(4 * s), buf(4 * e), buf(4 * e), buf(4 * ub), buf(4 * ub)]

        def val(v: int) -> tuple[int, int]:
            return 0, int(v)

        base = {name: (i, 0) for i, name in enumerate(_BASES)}
        gu_cfg, dn_cfg = cfg.gate_up, cfg.down
        ub_gu, tab_gu = table(gu_cfg.slots)
        ub_dn, tab_dn = (ub_gu, tab_gu) if dn_cfg.slots == gu_cfg.slots else table(dn_cfg.slots)
        xp, xs = buf(2 * m * h), buf(2 * m * h // 16)
        gu_splits, dn_splits = gu_cfg.splits(h), dn_cfg.splits(inter)
        gu, hp, hs = buf(4 * gu_splits * s * 2 * inter), buf(2 * s * inter), buf(2 * s * inter // 16)
        dn = buf(2 * dn_splits * s * h)
        null = val(0)

        def gemm(c: PassConfig, a: list, wq: str, ws: str, part: tuple[int, int], tab: list, ub: int,
                 n: int, k: int, rows_per_slot: int, down: bool) -> tuple:
            grid = (n // (c.rows * c.span), ub, c.splits(k))
            args = [*a, base[wq], base[ws], part, base["tw"], *tab, val(s), val(n), val(k), val(min(c.k_chunk, k)),
                    val(c.span), val(rows_per_slot), val(e), val(down), val(down)]  # weighted, early: the down pass
            return c.kernel, grid, c.threads, c.smem_bytes(k), args

        specs = [("moe_align", (1 + triton.cdiv(m * h // 8, 1024),), 1024, 0,
                  [base["ids"], val(s), val(e), val(gu_cfg.slots), val(ub_gu), *tab_gu, base["x"], val(m), val(h),
                   xp, xs])]
        if tab_dn is not tab_gu:
            specs.append(("moe_align", (1,), 1024, 0, [base["ids"], val(s), val(e), val(dn_cfg.slots), val(ub_dn),
                                                       *tab_dn, null, val(0), val(0), null, null]))
        specs += [gemm(gu_cfg, [xp, xs], "w13_q", "w13_s", gu, tab_gu, ub_gu, 2 * inter, h, topk, False),
                  ("moe_silu_prep", (triton.cdiv(s * inter // 8, 256),), 256, 0,
                   [gu, val(gu_splits), val(s), val(inter), hp, hs]),
                  gemm(dn_cfg, [hp, hs], "w2_q", "w2_s", dn, tab_dn, ub_dn, h, inter, 1, True),
                  ("moe_sum", (triton.cdiv(m * h // 4, 256),), 256, 0,
                   [dn, val(dn_splits), val(s), val(m), val(h), val(topk), base["out"]])]
        slots = [a for *_, args in specs for a in args]
        args = np.zeros(len(slots), dtype=np.int64)
        launches, at = [], 0
        for name, grid, block, smem, a in specs:
            launches.append(cuda_build.Launch(mod.kernel(name), grid, block, smem, args[at:at + len(a)], pdl))
            at += len(a)
        self.chain = cuda_build.Chain(launches, args, np.array([b for b, _ in slots]),
                                      np.array([o for _, o in slots]), len(_BASES), cuda_build.host_launcher()[0])
        self.launches, self._bases, self._launch = launches, self.chain.bases, self.chain.launch
        self.out_bytes = -(-2 * m * h // _ALIGN) * _ALIGN
        self.together = (self.out_bytes + self.ws_bytes) // 2 if self.ws_bytes <= _TOGETHER_MAX else 0  # bf16s

    def __call__(self, pointers: tuple[int, ...]) -> None:
        """Fill in the call's base pointers (in _BASES order, the first 0) and launch on torch's current stream."""
        self._bases[:] = pointers
        self._launch(cuda_build.current_stream(self.index))

    def run(self, x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor, topk_ids: Tensor,
            topk_weights: Tensor) -> Tensor:
        """Check what can differ between calls of one shape (the weights' layout; the routing's dtype
        and layout, converted where they differ), allocate, fill in the pointers, launch. Returns the output."""
        if not (w13_q.is_contiguous() and w13_s.is_contiguous() and w2_q.is_contiguous() and w2_s.is_contiguous()):
            raise ValueError("moe_cuda: the expert weights and scales must be contiguous")
        x = x.contiguous()
        ids = topk_ids if topk_ids.dtype == torch.int64 and topk_ids.is_contiguous() else \
            topk_ids.to(torch.int64).contiguous()
        tw = topk_weights if topk_weights.dtype == torch.float32 and topk_weights.is_contiguous() else \
            topk_weights.float().contiguous()
        if self.together:
            buf = torch.empty(self.together, dtype=torch.bfloat16, device=self.device)
            out, at = buf.as_strided(self.shape, (self.shape[1], 1)), buf.data_ptr()
            ws = at + self.out_bytes
        else:
            out = torch.empty(self.shape, dtype=torch.bfloat16, device=self.device)
            buf = torch.empty(self.ws_bytes, dtype=torch.uint8, device=self.device)  # alive until launched
            at, ws = out.data_ptr(), buf.data_ptr()
        self((0, ws, x.data_ptr(), w13_q.data_ptr(), w13_s.data_ptr(), w2_q.data_ptr(), w2_s.data_ptr(),
              ids.data_ptr(), tw.data_ptr(), at))
        return out


_calls = threading.local()  # per thread: a _Call's argument buffer is written by each call
CALLS_MAX = 256  # call shapes a thread keeps set up; the oldest goes first past this


def prepared(x: Tensor, w13_q: Tensor, w2_q: Tensor, topk_ids: Tensor, topk_weights: Tensor,
             configs: Bucket | None = None) -> _Call | None:
    """The call set up for these inputs' shape on x's device (one dictionary lookup once set up), or
    None where the kernel does not run them (`supports`' rules). The routing's shapes are checked when
    a shape is first set up: they are part of the key, so a cached call never sees other ones."""
    table = getattr(_calls, "table", None)
    if table is None:
        table = _calls.table = {}
    key = _key(x, w13_q, w2_q)
    full = (key, topk_ids.shape, topk_weights.shape, configs)
    call = table.get(full)
    if call is not None:
        return call
    if _why_not(key, configs) is not None:
        return None
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_cuda: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [M = {x.shape[0]}, top-k]")
    (m, h), _, _, index, (e, two_i, _), _ = key
    cfg = configs or choice(m, two_i // 2, h, index).configs
    if len(table) >= CALLS_MAX:
        del table[next(iter(table))]
    call = table[full] = _Call(index, m, h, e, two_i // 2, topk_ids.shape[1], cfg)
    return call


def moe_w4a16(x: Tensor, w13_q: Tensor, w13_s: Tensor, w2_q: Tensor, w2_s: Tensor,
              topk_ids: Tensor, topk_weights: Tensor, configs: Bucket | None = None) -> Tensor:
    """Routed-expert MoE: [M, H] bf16 -> [M, H]; `configs` overrides the M bucket's (the GPU sweep uses it)."""
    call = prepared(x, w13_q, w2_q, topk_ids, topk_weights, configs)
    if call is None:
        raise ValueError(f"moe_cuda: cannot run these inputs here: {_why_not(_key(x, w13_q, w2_q), configs)}")
    return call.run(x, w13_q, w13_s, w2_q, w2_s, topk_ids, topk_weights)
