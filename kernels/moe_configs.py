"""The CUDA MoE's launch configs: named records, tables keyed by arch, and the check against a device.

A MoE call runs two GEMM passes (gate_up, down), each one kernel that kernels/moe_w4a16.cu
instantiates plus how it is launched. The table gives, per arch (the H200's picks stand in as the
default for an arch with no table of its own), per shape class and per M bucket, one config for
each pass. Before a bucket runs on a device its configs are checked against that device's real
limits (the per-block shared-memory opt-in and registers, from the driver; kernels/moe_cuda.py
asks it): where the table's pick does not fit, the pick of the next smaller bucket that fits and
serves every M of the bucket runs, else the Triton kernel. Every choice carries its reason in
words, which `engine.build` writes to build.json.

The shared-memory layout of a pass's ring is computed here only (`StageLayout`, `PassConfig.smem_bytes`):
kernels/moe_cuda.py builds moe_w4a16.cu with a prelude made from it (`cuda_prelude`: the layout's
constants and one MOE_KERNEL line a kernel with its stage's byte counts), so the kernel's stage
strides are the bytes the host allocates, and a layout the kernel's addressing cannot read does
not build.

Pure Python (no torch): the tests check the tables, the limit check and the fallback on the CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

STEP = 256  # K per pipeline step
AROW = 512 + 64  # bytes a token's row of a stage's activations: one step of bf16, padded (no bank conflicts)
XREC = 32  # bytes of one token's group sums a step: 8 x (hi, lo) bf16
STRIP_WEIGHTS = 16 * 8 * 16  # bytes of one 16-row strip's weights a step: 16 rows x 8 group chunks of 16 bytes
STRIP_SCALES = 16 * 16  # bytes of one strip's scales a step: 16 rows x 8 bf16
REG_UNIT = 256  # registers are allocated to a warp in units of this many
DEFAULT = "default"  # the table of an arch with none of its own

_NAME = re.compile(r"nt(\d+)_w(\d+)_r(\d+)_s(\d+)_h(\d+)_a(\d+)_sc([01])")


@dataclass(frozen=True)
class StageLayout:
    """One K step of a ring stage in shared memory, in the kernel's order: weights, scales,
    activations, group sums (bytes each)."""

    weights: int
    scales: int
    activations: int
    sums: int

    @property
    def bytes(self) -> int:
        return self.weights + self.scales + self.activations + self.sums


@dataclass(frozen=True)
class PassConfig:
    """One GEMM pass: the kernel (its first seven fields, spelled as its name spells them) and its launch."""

    nt: int        # MMA column groups of 8: a block holds 8 nt token-expert slots routed to one expert
    warps: int     # warps a CTA
    strips: int    # 16-row strips a warp owns (a tile is warps x strips x 16 rows): "r" in the name
    stages: int    # depth of the cp.async ring: "s"
    steps: int     # K steps of STEP a stage: "h" (2: 256 contiguous bytes of a weight row a request)
    tokens: int    # activation rows a stage holds, at most 8 nt (fewer at decode sizes): "a"
    scaled: bool   # weights scaled before the MMA (else the group sums scaled after it): "sc"
    span: int      # row tiles a CTA walks one after the other on one ring
    k_chunk: int   # K a CTA covers (K / k_chunk splits; clipped to K)

    @classmethod
    def of(cls, kernel: str, span: int, k_chunk: int) -> "PassConfig":
        """The config of kernel `kernel` (e.g. "nt1_w4_r1_s2_h2_a1_sc0") launched with `span`, `k_chunk`."""
        m = _NAME.fullmatch(kernel)
        if m is None:
            raise ValueError(f"not a MoE kernel name: {kernel!r} (want nt<N>_w<N>_r<N>_s<N>_h<N>_a<N>_sc<0|1>)")
        nt, warps, strips, stages, steps, tokens, sc = (int(v) for v in m.groups())
        return cls(nt, warps, strips, stages, steps, tokens, bool(sc), span, k_chunk)

    @property
    def slots(self) -> int:
        return 8 * self.nt

    @property
    def rows(self) -> int:
        """Output rows of one tile (the kernel's BN)."""
        return self.warps * self.strips * 16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def kernel(self) -> str:
        """The name of the __global__ function in the cubin."""
        return (f"moe_w4a16_nt{self.nt}_w{self.warps}_r{self.strips}_s{self.stages}_h{self.steps}"
                f"_a{self.tokens}_sc{int(self.scaled)}")

    def splits(self, k: int) -> int:
        return k // min(self.k_chunk, k)

    @property
    def layout(self) -> StageLayout:
        """One K step of a stage: every strip's weights and scales, the stage's tokens' activations and
        group sums (the group sums' room is kept by the SC kernels too, which leave it unread)."""
        strips = self.warps * self.strips
        return StageLayout(strips * STRIP_WEIGHTS, strips * STRIP_SCALES, self.tokens * AROW, self.tokens * XREC)

    def smem_bytes(self, k: int) -> int:
        """Dynamic shared memory on K = k: a stage (`steps` K steps of `layout`) times the ring stages
        a CTA's steps can fill (one tile of one step needs one: more CTAs fit an SM)."""
        steps = self.span * (min(self.k_chunk, k) // (STEP * self.steps))
        return min(self.stages, steps) * self.steps * self.layout.bytes

    def tiles(self, n: int, k: int) -> bool:
        """Whether it runs on an [n, k] weight: whole spans of row tiles, whole stages and splits of K."""
        ks = min(self.k_chunk, k)
        return n % (self.rows * self.span) == 0 and ks % (STEP * self.steps) == 0 and k % ks == 0

    def holds(self, m: int) -> bool:
        """Whether a stage holds every token an expert can get at M = m (at most m, at most a block's)."""
        return self.tokens >= min(self.slots, m)


@dataclass(frozen=True)
class Bucket:
    gate_up: PassConfig
    down: PassConfig


Table = dict[str, dict[int, Bucket]]  # shape class ("full", "shard") -> the largest M of the bucket -> configs


def _b(gate_up: tuple[str, int, int], down: tuple[str, int, int]) -> Bucket:
    """A bucket from (kernel, span, k_chunk) of each pass: the table below stays one line a bucket."""
    return Bucket(PassConfig.of(*gate_up), PassConfig.of(*down))


# Picked from whole-MoE timings of candidate configs on an H200 (kernels/NOTES.md: the opening
# summary says which version picked which bucket, the lab log how). M above the last bucket takes
# the last.
H200: Table = {
    "full": {
        1: _b(("nt1_w4_r1_s2_h2_a1_sc0", 1, 7168), ("nt1_w4_r1_s2_h2_a1_sc0", 2, 2048)),
        2: _b(("nt1_w4_r1_s2_h2_a2_sc0", 2, 7168), ("nt1_w4_r1_s2_h2_a2_sc0", 2, 2048)),
        4: _b(("nt1_w4_r1_s2_h2_a4_sc0", 1, 7168), ("nt1_w4_r1_s2_h2_a8_sc0", 2, 2048)),
        32: _b(("nt1_w4_r1_s2_h2_a8_sc0", 1, 7168), ("nt1_w4_r1_s2_h2_a8_sc0", 2, 2048)),
        64: _b(("nt1_w4_r1_s2_h2_a8_sc0", 1, 7168), ("nt1_w4_r1_s4_h1_a8_sc0", 1, 2048)),
        256: _b(("nt1_w4_r2_s3_h1_a8_sc0", 1, 7168), ("nt1_w4_r2_s3_h1_a8_sc0", 2, 2048)),
        512: _b(("nt2_w4_r4_s2_h1_a16_sc0", 1, 7168), ("nt2_w4_r4_s2_h1_a16_sc0", 1, 2048)),
        1024: _b(("nt4_w4_r4_s2_h1_a32_sc1", 1, 7168), ("nt4_w4_r4_s2_h1_a32_sc1", 2, 2048)),
    },
    "shard": {
        1: _b(("nt1_w4_r1_s4_h1_a8_sc0", 1, 1792), ("nt1_w4_r1_s4_h1_a1_sc0", 2, 256)),
        2: _b(("nt1_w4_r1_s4_h1_a8_sc0", 1, 1792), ("nt1_w4_r1_s4_h1_a8_sc0", 4, 256)),
        4: _b(("nt1_w4_r1_s3_h2_a8_sc0", 1, 7168), ("nt1_w4_r1_s4_h1_a8_sc0", 8, 256)),
        8: _b(("nt1_w4_r1_s2_h2_a8_sc0", 1, 7168), ("nt1_w4_r1_s4_h1_a8_sc0", 14, 256)),
        16: _b(("nt1_w4_r1_s2_h2_a8_sc0", 1, 3584), ("nt1_w4_r2_s3_h1_a8_sc0", 8, 256)),
        256: _b(("nt1_w4_r1_s2_h2_a8_sc0", 1, 7168), ("nt1_w4_r2_s2_h1_a8_sc1", 8, 256)),
        512: _b(("nt2_w4_r2_s2_h1_a16_sc1", 1, 7168), ("nt2_w4_r2_s2_h1_a16_sc1", 8, 256)),
        1024: _b(("nt4_w4_r4_s2_h1_a32_sc1", 1, 7168), ("nt4_w4_r2_s2_h1_a32_sc1", 8, 256)),
    },
}

# By arch ("sm_90": the cubin's target); an arch missing here runs the DEFAULT table, checked
# against its own limits like every other.
CUDA_CONFIGS: dict[str, Table] = {"sm_90": H200, DEFAULT: H200}

# The per-block shared-memory opt-in of each arch the inventory may name (bytes; the CUDA C++
# Programming Guide's technical specifications per compute capability: 227 KB on 9.0 and 10.x, 99 KB
# on 12.0). `engine.build` runs, on the device it has, what each arch's table would run under its
# limit, so a config that fits only the tuning machine is caught before it ships.
ARCH_SMEM_OPTIN: dict[str, int] = {"sm_90": 232448, "sm_100": 232448, "sm_103": 232448, "sm_120": 101376}

# The kernels the shipped build of moe_w4a16.cu instantiates (cuda_prelude): exactly those the tables pick.
KERNELS = frozenset(p.kernel for table in CUDA_CONFIGS.values() for cls in table.values()
                    for b in cls.values() for p in (b.gate_up, b.down))
# The further candidates of the config sweep (engine/moe_sweep.py), which only the sweep's build
# instantiates: 8-warp tiles, a third ring stage and 64-slot blocks for the large M.
SWEEP_KERNELS = ("nt4_w8_r2_s2_h1_a32_sc1", "nt4_w8_r1_s2_h1_a32_sc1", "nt4_w4_r2_s3_h1_a32_sc1",
                 "nt8_w4_r2_s2_h1_a64_sc1", "nt8_w8_r1_s2_h1_a64_sc1", "nt2_w8_r2_s2_h1_a16_sc1")


def cuda_prelude(kernels: set[str] | frozenset[str]) -> str:
    """What moe_w4a16.cu is built with: the layout's constants and one MOE_KERNEL line a kernel of
    `kernels` (names as `PassConfig.kernel`), its instantiation parameters then its stage layout."""
    lines = [f"#define MOE_STEP {STEP}", f"#define MOE_AROW {AROW}", f"#define MOE_XREC {XREC}",
             f"#define MOE_STRIP_WEIGHTS {STRIP_WEIGHTS}", f"#define MOE_STRIP_SCALES {STRIP_SCALES}",
             "#define MOE_KERNELS \\"]
    configs = sorted((PassConfig.of(k.removeprefix("moe_w4a16_"), 1, STEP) for k in kernels),
                     key=lambda p: (p.nt, p.warps, p.strips, p.stages, p.steps, p.tokens, p.scaled))
    for p in configs:
        lay = p.layout
        lines.append(f"  MOE_KERNEL({p.nt}, {p.warps}, {p.strips}, {p.stages}, {p.steps}, {p.tokens}, {int(p.scaled)}, "
                     f"{lay.weights}, {lay.scales}, {lay.activations}, {lay.sums}) \\")
    return "\n".join(lines) + "\n\n"


def table_for(arch: str) -> tuple[str, Table]:
    """(the CUDA_CONFIGS key that serves `arch`, its table): the arch's own, else the default."""
    key = arch if arch in CUDA_CONFIGS else DEFAULT
    return key, CUDA_CONFIGS[key]


def bucket_of(table: dict[int, Bucket], m: int) -> int:
    """The smallest bucket that holds m (the last one above it)."""
    return min((b for b in table if b >= m), default=max(table))


@dataclass(frozen=True)
class DeviceLimits:
    """What one device allows a block (from the driver: cuDeviceGetAttribute)."""

    arch: str
    smem_per_block: int  # MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: dynamic + static shared memory a block may opt in to
    regs_per_block: int  # MAX_REGISTERS_PER_BLOCK
    regs_per_sm: int     # MAX_REGISTERS_PER_MULTIPROCESSOR
    lowered_from: int | None = None  # the driver's opt-in, where a caller lowered smem_per_block below it


@dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel needs (from the driver: cuFuncGetAttribute on the loaded cubin)."""

    regs: int         # NUM_REGS: registers a thread
    static_smem: int  # SHARED_SIZE_BYTES: the kernel's own __shared__ arrays
    max_threads: int  # MAX_THREADS_PER_BLOCK: the most threads a block of it can launch with on this device


def misfit(cfg: PassConfig, k: int, limits: DeviceLimits, res: KernelResources) -> str | None:
    """Why `cfg` on K = k cannot launch on this device (None when it can): shared memory or registers."""
    smem = cfg.smem_bytes(k) + res.static_smem
    if smem > limits.smem_per_block:
        lowered = f" (lowered from {limits.lowered_from:,})" if limits.lowered_from else ""
        return (f"{cfg.kernel} needs {smem:,} bytes of shared memory a block, over this device's "
                f"{limits.smem_per_block:,}{lowered}")
    warp_regs = -(-res.regs * 32 // REG_UNIT) * REG_UNIT
    regs = warp_regs * cfg.warps
    if regs > min(limits.regs_per_block, limits.regs_per_sm):
        return (f"{cfg.kernel} needs {regs:,} registers a block ({res.regs} a thread), over this device's "
                f"{min(limits.regs_per_block, limits.regs_per_sm):,}")
    if cfg.threads > res.max_threads:
        return f"{cfg.kernel} launches {cfg.threads} threads, over the {res.max_threads} the driver allows it"
    return None


@dataclass(frozen=True)
class PassChoice:
    config: PassConfig | None  # None: no config fits, the Triton kernel runs
    reason: str


@dataclass(frozen=True)
class Choice:
    """What one bucket runs on one device, and why."""

    table: str   # the CUDA_CONFIGS key
    shape: str   # shape class
    bucket: int  # the largest M it serves (the last bucket: every M above too)
    gate_up: PassChoice
    down: PassChoice

    @property
    def cuda(self) -> bool:
        return self.gate_up.config is not None and self.down.config is not None

    @property
    def configs(self) -> Bucket:
        if not self.cuda:
            raise ValueError(f"bucket M <= {self.bucket} runs the Triton kernel here: {self.why()}")
        return Bucket(self.gate_up.config, self.down.config)

    def why(self) -> str:
        return f"gate_up: {self.gate_up.reason}; down: {self.down.reason}"

    @property
    def table_pick(self) -> bool:
        """Whether both passes run the table's own pick for this bucket (no fallback)."""
        pick = CUDA_CONFIGS[self.table][self.shape][self.bucket]
        return self.gate_up.config == pick.gate_up and self.down.config == pick.down

    def record(self, k_gu: int, k_dn: int) -> dict[str, object]:
        """build.json's entry: which impl, which kernels, their shared memory, and why."""
        def one(p: PassChoice, k: int) -> dict[str, object]:
            c = p.config
            return {"reason": p.reason} if c is None else {
                "kernel": c.kernel, "span": c.span, "k_chunk": min(c.k_chunk, k), "smem_bytes": c.smem_bytes(k),
                "reason": p.reason}
        return {"shape": self.shape, "bucket_max_m": self.bucket, "table": self.table,
                "impl": "cuda" if self.cuda else "triton", "table_pick": self.table_pick, "gate_up": one(self.gate_up, k_gu),
                "down": one(self.down, k_dn)}


def choose(table_key: str, shape: str, bucket: int, n_gu: int, k_gu: int, n_dn: int, k_dn: int,
           limits: DeviceLimits, resources: Callable[[str], KernelResources]) -> Choice:
    """Each pass of `bucket`: the table's pick where it fits the device, else the pick of the next
    smaller bucket that tiles the shape, holds every M of this bucket and fits; else none (Triton).
    `resources(kernel name)` gives a compiled kernel's registers and static shared memory."""
    table = CUDA_CONFIGS[table_key][shape]
    last = max(table)
    need = bucket if bucket != last else 1 << 30  # the last bucket serves every larger M too
    below = sorted((b for b in table if b <= bucket), reverse=True)

    def one(name: str, n: int, k: int) -> PassChoice:
        first_why, seen = None, set()
        for b in below:
            cfg = getattr(table[b], name)
            if cfg in seen:
                continue
            seen.add(cfg)
            if not cfg.tiles(n, k):
                why = f"{cfg.kernel} (span {cfg.span}, K chunk {cfg.k_chunk}) does not tile [{n}, {k}]"
            elif not cfg.holds(need):
                why = f"a stage of {cfg.kernel} holds {cfg.tokens} token(s), fewer than an expert can get at M <= {bucket}"
            else:
                why = misfit(cfg, k, limits, resources(cfg.kernel))
            if why is None:
                src = f"the {table_key} table's pick" if b == bucket else f"the M <= {b} bucket's pick"
                return PassChoice(cfg, src if first_why is None else f"{first_why}: {src}")
            first_why = first_why or why
        return PassChoice(None, f"{first_why}, and no smaller bucket's pick fits: the Triton kernel runs")

    return Choice(table_key, shape, bucket, one("gate_up", n_gu, k_gu), one("down", n_dn, k_dn))
