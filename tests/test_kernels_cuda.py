"""The CUDA C++ MoE's host side: finding nvcc, building and caching the cubin, the configs, the launches.

The kernel itself runs only on a GPU (engine.build runs it there at every bench M and compares it with
the reference at each sweep's smallest and largest M and at COMPARE_M; engine/moe_sweep.py compares
every candidate config); here: what a host without nvcc, or with a
broken one, is told; that the tables only name kernels the source instantiates, at shapes they tile;
how the limit check and the fallback choose on sm_90, sm_120 and an unknown arch (the driver's
answers faked); and how a call shape's launches are laid out.
"""

from __future__ import annotations

import ctypes
import re
import stat
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from kernels import cuda_build, moe_configs, moe_cuda, ops

SOURCE = cuda_build.HERE / moe_cuda.SOURCE
HEADERS = (cuda_build.HERE / "moe_w4a16_ptx.cuh", cuda_build.HERE / "moe_w4a16_gemm.cuh")  # as SOURCE includes them
SHAPES = {"full": (2048, 7168), "shard": (256, 7168)}  # K2 and one TP-8 rank: (intermediate, hidden)


@pytest.fixture
def no_nvcc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(cuda_build, "DEFAULT_NVCC", tmp_path / "none" / "nvcc")
    monkeypatch.setenv("KDBENCH_CUDA_CACHE", str(tmp_path / "cache"))


def fake_nvcc(home: Path, script: str) -> None:
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n" + script)
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)


def test_missing_nvcc_is_a_clear_message(no_nvcc: None) -> None:
    with pytest.raises(cuda_build.CudaUnavailable, match=r"nvcc not found .*CUDA_HOME"):
        cuda_build.compile_cubin(SOURCE, "sm_90")


def test_failing_nvcc_names_the_source_without_host_paths(no_nvcc: None, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    home = tmp_path / "toolkit"
    fake_nvcc(home, 'case "$1" in --version) echo "Cuda compilation tools, release 99.1, V99.1.0";;\n'
                    f'*) echo "{SOURCE}(12): error: no such arch" >&2; exit 3;; esac\n')
    monkeypatch.setenv("CUDA_HOME", str(home))
    cuda_build.nvcc_version.cache_clear()
    with pytest.raises(cuda_build.CudaUnavailable) as err:
        cuda_build.compile_cubin(SOURCE, "sm_90")
    msg = str(err.value)
    assert "moe_w4a16.cu" in msg and "exit 3" in msg and "no such arch" in msg
    assert str(SOURCE.parent) not in msg and str(tmp_path) not in msg
    assert not list((tmp_path / "cache").glob("*")), "a failed build leaves nothing in the cache"


def test_cubin_is_cached_by_content(no_nvcc: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = tmp_path / "toolkit"
    log = tmp_path / "calls"
    fake_nvcc(home, 'case "$1" in --version) echo "release 99.1, V99.1.0";;\n'
                    f'*) echo run >> {log}; while [ "$1" != "-o" ]; do shift; done; echo cubin > "$2";; esac\n')
    monkeypatch.setenv("CUDA_HOME", str(home))
    cuda_build.nvcc_version.cache_clear()
    assert [h.name for h in HEADERS] == re.findall(r'^#include "([^"]+)"', SOURCE.read_text(), re.MULTILINE)
    first = cuda_build.compile_cubin(SOURCE, "sm_90")
    again = cuda_build.compile_cubin(SOURCE, "sm_90")
    other = cuda_build.compile_cubin(SOURCE, "sm_120")
    assert first == again != other and first.read_text() == "cubin\n"
    assert log.read_text().count("run") == 2, "the second sm_90 build came from the cache"
    assert cuda_build.compile_cubin(SOURCE, "sm_90", "#define X 1\n") not in (first, other), "another prelude, another cubin"
    src = tmp_path / "moe_w4a16.cu"
    src.write_text(SOURCE.read_text() + "\n// changed\n")
    with pytest.raises(cuda_build.CudaUnavailable, match="includes 'moe_w4a16_ptx.cuh', which is not beside it"):
        cuda_build.compile_cubin(src, "sm_90")
    for header in HEADERS:
        (tmp_path / header.name).write_text(header.read_text())
    changed = cuda_build.compile_cubin(src, "sm_90")
    assert changed != first, "changed source, new cubin"
    (tmp_path / HEADERS[-1].name).write_text(HEADERS[-1].read_text() + "\n// changed\n")
    assert cuda_build.compile_cubin(src, "sm_90") not in (first, changed), "changed header, new cubin"


def _prelude_kernels(kernels: frozenset[str]) -> dict[str, tuple[int, ...]]:
    """Kernel name -> the stage layout (weights, scales, activations, sums) of each MOE_KERNEL line the
    build's prelude (kernels/moe_configs.py: cuda_prelude) gives moe_w4a16.cu."""
    lines = re.finditer(r"MOE_KERNEL\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+), ([01]), (\d+), (\d+), (\d+), (\d+)\)",
                        moe_configs.cuda_prelude(kernels))
    return {"moe_w4a16_nt{}_w{}_r{}_s{}_h{}_a{}_sc{}".format(*m.groups()[:7]): tuple(map(int, m.groups()[7:]))
            for m in lines}


def test_config_table_names_instantiated_kernels_that_tile_k2() -> None:
    shipped = _prelude_kernels(moe_configs.KERNELS)
    assert set(shipped) == moe_configs.KERNELS
    assert set(_prelude_kernels(moe_cuda.SWEEP_BUILD)) - moe_configs.KERNELS == \
        {f"moe_w4a16_{k}" for k in moe_configs.SWEEP_KERNELS}
    assert "#define MOE_STEP 256" in moe_configs.cuda_prelude(moe_configs.KERNELS)
    for arch, table in moe_configs.CUDA_CONFIGS.items():
        for cls, buckets in table.items():
            inter, hidden = SHAPES[cls]
            last = max(buckets)
            for bucket, b in buckets.items():
                for p, n, k in ((b.gate_up, 2 * inter, hidden), (b.down, hidden, inter)):
                    assert p.tiles(n, k), (arch, cls, bucket, p)
                    assert p.holds(bucket if bucket != last else 1 << 30), (arch, cls, bucket, p)
                    assert p.smem_bytes(k) + 12 * p.slots <= SM90.smem_per_block, (arch, cls, bucket)
    full = moe_configs.H200["full"]
    assert [moe_configs.bucket_of(full, m) for m in (1, 2, 3, 4, 5, 32, 33, 1024, 4096)] == \
        [1, 2, 4, 4, 32, 32, 64, 1024, 1024]  # above the last bucket: the last one's
    p = moe_configs.PassConfig.of("nt1_w4_r1_s4_h1_a8_sc0", 3, 256)
    assert (p.nt, p.warps, p.strips, p.stages, p.steps, p.tokens, p.scaled) == (1, 4, 1, 4, 1, 8, False)
    assert p.kernel == "moe_w4a16_nt1_w4_r1_s4_h1_a8_sc0" and p.rows == 64 and p.threads == 128
    assert not p.tiles(7168, 256), "3 tiles of 64 rows do not tile N = 7168"
    assert not moe_configs.PassConfig.of("nt1_w4_r1_s2_h2_a8_sc0", 1, 256).tiles(7168, 256), "H = 2 needs K chunks of 512"
    assert moe_configs.PassConfig.of("nt1_w4_r1_s4_h1_a8_sc0", 1, 256).tiles(7168, 256)
    with pytest.raises(ValueError, match="not a MoE kernel name"):
        moe_configs.PassConfig.of("nt1_w4_r1_s4_h1_a8", 1, 256)


SM90 = moe_configs.DeviceLimits("sm_90", 232448, 65536, 65536)    # H200: the driver's opt-in and registers
SM120 = moe_configs.DeviceLimits("sm_120", 101376, 65536, 65536)  # RTX PRO 6000 Blackwell


def resources(regs: int = 128, over: dict[str, int] | None = None):  # noqa: ANN201 - a fake of the driver's answer
    """Per-kernel resources as cuFuncGetAttribute gives them: `regs` a thread (or `over`'s), and the
    kernel's static slot tables (12 bytes a slot)."""
    def of(name: str) -> moe_configs.KernelResources:
        nt = int(re.search(r"_nt(\d+)_", name).group(1))
        r = (over or {}).get(name, regs)
        return moe_configs.KernelResources(r, 96 * nt, min(1024, 65536 // (-(-r // 8) * 8)))
    return of


def _choices(limits: moe_configs.DeviceLimits, res=None) -> dict[tuple[str, int], moe_configs.Choice]:  # noqa: ANN001
    key, table = moe_configs.table_for(limits.arch)
    out = {}
    for cls, buckets in table.items():
        inter, hidden = SHAPES[cls]
        for b in buckets:
            out[cls, b] = moe_configs.choose(key, cls, b, 2 * inter, hidden, hidden, inter, limits, res or resources())
    return out


def test_configs_are_keyed_by_arch_with_a_default() -> None:
    assert moe_configs.table_for("sm_90") == ("sm_90", moe_configs.H200)
    for arch in ("sm_100", "sm_103", "sm_120", "sm_999"):
        assert moe_configs.table_for(arch) == ("default", moe_configs.CUDA_CONFIGS["default"]), arch


def test_sm_90_runs_every_pick_of_its_own_table() -> None:
    for (cls, b), c in _choices(SM90).items():
        assert c.cuda and c.table_pick and c.table == "sm_90", (cls, b, c.why())
        assert c.configs == moe_configs.H200[cls][b]
        assert c.gate_up.reason == c.down.reason == "the sm_90 table's pick"


def test_sm_120_falls_back_where_the_picks_exceed_its_shared_memory() -> None:
    """sm_120's opt-in is 101,376 bytes a block: the M = 1024 bucket's 32-slot picks (112,640 bytes of
    ring plus 384 of slot tables) do not fit, so that pass runs the next smaller bucket's pick."""
    got = _choices(SM120)
    assert all(c.cuda and c.table == "default" for c in got.values()), "no bucket is left to Triton"
    moved = {k: c for k, c in got.items() if not c.table_pick}
    assert set(moved) == {("full", 1024), ("shard", 1024)}
    full, shard = moved["full", 1024], moved["shard", 1024]
    assert full.gate_up.config == moe_configs.H200["full"][512].gate_up
    assert full.down.config == moe_configs.H200["full"][512].down
    assert full.gate_up.reason == ("moe_w4a16_nt4_w4_r4_s2_h1_a32_sc1 needs 113,024 bytes of shared memory a block, "
                                   "over this device's 101,376: the M <= 512 bucket's pick")
    assert shard.gate_up.config == moe_configs.H200["shard"][512].gate_up
    assert shard.down.config == moe_configs.H200["shard"][1024].down, "75,776 + 384 bytes fit: the table's pick"
    for c in got.values():
        for p, k in ((c.gate_up.config, SHAPES[c.shape][1]), (c.down.config, SHAPES[c.shape][0])):
            assert p.smem_bytes(k) + 12 * p.slots <= SM120.smem_per_block


def test_an_unknown_arch_with_little_shared_memory_runs_triton_where_nothing_fits() -> None:
    """A fallback must serve every M of its bucket: at M <= 2 a one-token stage (the M = 1 pick) would
    drop the second token of an expert, so with 40,000 bytes nothing fits M = 2 and Triton runs."""
    small = moe_configs.DeviceLimits("sm_999", 40000, 65536, 65536)
    got = _choices(small)
    assert got["full", 1].cuda and got["full", 1].table_pick, "39,296 + 96 bytes fit"
    m2 = got["full", 2]
    assert not m2.cuda and m2.table == "default"
    assert "needs 41,824 bytes of shared memory a block, over this device's 40,000" in m2.gate_up.reason
    assert m2.gate_up.reason.endswith("the Triton kernel runs")
    assert m2.record(7168, 2048)["impl"] == "triton"
    with pytest.raises(ValueError, match="runs the Triton kernel here"):
        m2.configs  # noqa: B018 - the property raises


def test_register_limits_are_checked_too() -> None:
    """The register count of the compiled kernel x its threads, in the driver's allocation units,
    against the block's and the SM's registers."""
    fat = "moe_w4a16_nt2_w4_r4_s2_h1_a16_sc0"
    tight = moe_configs.DeviceLimits("sm_90", 232448, 32768, 65536)
    ok = _choices(tight, resources(over={fat: 255}))[("full", 512)]
    assert ok.table_pick, "255 registers round up to 8,192 a warp: 32,768 a block fit exactly"
    tighter = moe_configs.DeviceLimits("sm_90", 232448, 32767, 65536)
    c = _choices(tighter, resources(over={fat: 255}))[("full", 512)]
    assert c.gate_up.config == moe_configs.H200["full"][256].gate_up
    assert c.gate_up.reason == (f"{fat} needs 32,768 registers a block (255 a thread), over this device's 32,767: "
                                "the M <= 256 bucket's pick")
    few = moe_configs.KernelResources(64, 96, 64)
    assert "launches 128 threads, over the 64" in moe_configs.misfit(moe_configs.H200["full"][1].gate_up, 7168, SM90, few)


def test_the_shared_memory_limit_can_be_lowered_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """$KDBENCH_CUDA_SMEM_LIMIT runs another device's limit here (sm_120's on an H200); it never raises the driver's."""
    attrs = {cuda_build.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448, cuda_build.MAX_REGISTERS_PER_BLOCK: 65536,
             cuda_build.MAX_REGISTERS_PER_MULTIPROCESSOR: 65536}
    monkeypatch.setattr(cuda_build, "device_attribute", lambda index, a: attrs[a])
    monkeypatch.setattr(cuda_build, "arch_of", lambda device: "sm_90")
    for env, want in ((None, (232448, None)), ("101376", (101376, 232448)), ("300000", (232448, None))):
        moe_cuda.device_limits.cache_clear()
        if env is None:
            monkeypatch.delenv(moe_cuda.SMEM_LIMIT_ENV, raising=False)
        else:
            monkeypatch.setenv(moe_cuda.SMEM_LIMIT_ENV, env)
        lim = moe_cuda.device_limits(0)
        assert (lim.smem_per_block, lim.lowered_from) == want and lim.arch == "sm_90"
    moe_cuda.device_limits.cache_clear()
    monkeypatch.setenv(moe_cuda.SMEM_LIMIT_ENV, "99k")
    with pytest.raises(ValueError, match="KDBENCH_CUDA_SMEM_LIMIT must be a number of bytes"):
        moe_cuda.device_limits(0)
    moe_cuda.device_limits.cache_clear()


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """moe_cuda on a pretend CUDA device: its limits and kernel resources are set by the test (the
    shape and fallback rules only; nothing launches)."""
    def use(limits: moe_configs.DeviceLimits) -> None:
        moe_cuda.bucket_choice.cache_clear()
        moe_cuda._why_not.cache_clear()
        monkeypatch.setattr(moe_cuda, "device_limits", lambda index: limits)
        monkeypatch.setattr(moe_cuda, "kernel_resources", lambda index, name: resources()(name))
        monkeypatch.setattr(moe_cuda, "_cuda", lambda device: torch.device("cuda", 0))
        monkeypatch.setattr(moe_cuda, "_unavailable", lambda index: None)
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    yield use
    moe_cuda.bucket_choice.cache_clear()
    moe_cuda._why_not.cache_clear()


def test_impl_and_build_record_say_which_kernel_runs_and_why(fake_device) -> None:  # noqa: ANN001
    w13 = torch.empty(384, 4096, 896, dtype=torch.int32, device="meta")  # K2 shapes, no memory
    w2 = torch.empty(384, 7168, 256, dtype=torch.int32, device="meta")
    x1, x2 = torch.zeros(1, 7168, dtype=torch.bfloat16), torch.zeros(2, 7168, dtype=torch.bfloat16)
    fake_device(SM120)
    assert ops.moe_impl(x1, w13, w2) == ops.moe_impl(torch.zeros(4096, 7168, dtype=torch.bfloat16), w13, w2) == "cuda"
    recs = moe_cuda.bucket_records(torch.device("cuda", 0), 2048, 7168)
    assert [r["bucket_max_m"] for r in recs] == sorted(moe_configs.H200["full"])
    last = recs[-1]
    assert last["impl"] == "cuda" and not last["table_pick"]
    assert last["gate_up"]["kernel"] == "moe_w4a16_nt2_w4_r4_s2_h1_a16_sc0" and "101,376" in last["gate_up"]["reason"]
    fake_device(moe_configs.DeviceLimits("sm_999", 40000, 65536, 65536))
    assert ops.moe_impl(x1, w13, w2) == "cuda" and ops.moe_impl(x2, w13, w2) == "triton"
    assert moe_cuda.bucket_records(torch.device("cuda", 0), 2048, 7168)[1]["impl"] == "triton"


def test_engine_build_runs_each_other_arch_choice_where_it_differs_from_this_devices(
        fake_device, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """On an H200 the build runs what sm_120 would run (its 101,376-byte opt-in: the 16-slot fallbacks
    above M = 512) at the first and last bench M of each differing choice, nothing for sm_100 / sm_103
    (the same picks fit), and says a larger arch cannot be checked on a smaller device; a wrong result
    under another arch's choice is a mismatch there."""
    from engine import bench_kernels, build

    fake_device(SM90)
    runs: list[tuple[int, int, str]] = []
    err = {"value": 3e-3}

    def run(kb, cuda, c, m, tp):  # noqa: ANN001, ANN202 - records instead of launching
        runs.append((tp, m, c.gate_up.config.kernel))
        return err["value"]

    monkeypatch.setattr(build, "_arch_run", run)
    kb = type("KB", (), {"p": bench_kernels.PROFILES["cuda", "full"]})()
    got = build.arch_checks(kb, torch.device("cuda", 0), "sm_90")
    assert got["sm_100"] == got["sm_103"] == {"status": "ok", "smem_per_block": 232448, "rel_err": None,
                                              "same_as_here": 26, "checked": []}
    sm120 = got["sm_120"]
    assert sm120["status"] == "ok" and sm120["rel_err"] == 3e-3 and sm120["same_as_here"] == 26 - 6
    assert runs == [(1, 1024, "moe_w4a16_nt2_w4_r4_s2_h1_a16_sc0"), (1, 4096, "moe_w4a16_nt2_w4_r4_s2_h1_a16_sc0"),
                    (8, 1024, "moe_w4a16_nt2_w4_r2_s2_h1_a16_sc1"), (8, 4096, "moe_w4a16_nt2_w4_r2_s2_h1_a16_sc1")]
    assert [r["m"] for r in sm120["checked"]] == [1024, 4096, 1024, 4096]
    assert "over this device's 101,376" in sm120["checked"][0]["gate_up"]["reason"]
    err["value"] = 0.5
    assert build.arch_checks(kb, torch.device("cuda", 0), "sm_90")["sm_120"]["status"] == "mismatch"
    fake_device(SM120)
    on_120 = build.arch_checks(kb, torch.device("cuda", 0), "sm_120")
    assert {a: r["status"] for a, r in on_120.items()} == dict.fromkeys(("sm_90", "sm_100", "sm_103"),
                                                                        "not checkable here")


def test_ops_names_the_impl_that_runs() -> None:
    x = torch.zeros(4, 64)
    w13, w2 = torch.zeros(8, 32, 8, dtype=torch.int32), torch.zeros(8, 64, 2, dtype=torch.int32)
    assert ops.moe_impl(x, w13, w2) == "torch"  # CPU tensors: the reference
    assert ops.moe_impl(x, w13, w2, "cuda") == "cuda"
    assert moe_cuda.unavailable_reason(torch.device("cpu")) == "not a CUDA device (cpu)"
    assert not moe_cuda.supports(x, w13, w2)


def test_real_nvcc_builds_every_listed_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    try:
        cuda_build.nvcc_path()
    except cuda_build.CudaUnavailable:
        pytest.skip("no nvcc on this machine")
    monkeypatch.setenv("KDBENCH_CUDA_CACHE", str(tmp_path))
    image = cuda_build.compile_cubin(SOURCE, "sm_90", moe_configs.cuda_prelude(moe_configs.KERNELS)).read_bytes()
    for name in moe_configs.KERNELS:
        assert name.encode() in image
    assert b"moe_align" in image and b"moe_silu_prep" in image and b"moe_sum" in image
    sweep = moe_cuda.SWEEP_BUILD - moe_configs.KERNELS
    assert sweep and not any(n.encode() in image for n in sweep)
    image = cuda_build.compile_cubin(SOURCE, "sm_90", moe_configs.cuda_prelude(moe_cuda.SWEEP_BUILD)).read_bytes()
    assert all(n.encode() in image for n in moe_cuda.SWEEP_BUILD), "the sweep build has both"
    with pytest.raises(cuda_build.CudaUnavailable, match="built through kernels/moe_cuda.py"):
        cuda_build.compile_cubin(SOURCE, "sm_90")  # no prelude: no layout, no build
    one = moe_configs.cuda_prelude(frozenset({"moe_w4a16_nt1_w4_r1_s2_h2_a8_sc0"}))
    assert ", 8192, 1024, 4608, 256)" in one
    with pytest.raises(cuda_build.CudaUnavailable, match=r"Stage<.*A=4096"):  # a layout its addressing cannot read
        cuda_build.compile_cubin(SOURCE, "sm_90", one.replace(", 8192, 1024, 4608, 256)", ", 8192, 1024, 4096, 256)"))


def test_a_one_step_chunk_asks_for_one_ring_stage() -> None:
    """The TP-8 down pass (K = 256) fills one stage: asking for all four would cap CTAs per SM."""
    of = moe_configs.PassConfig.of
    cfg = of("nt1_w4_r1_s4_h1_a8_sc0", 1, 2048)
    assert cfg.smem_bytes(256) * 4 == cfg.smem_bytes(2048)
    assert of("nt1_w4_r1_s4_h1_a8_sc0", 1, 512).smem_bytes(2048) * 2 == cfg.smem_bytes(2048)
    assert of("nt1_w4_r1_s2_h2_a8_sc0", 1, 2048).smem_bytes(2048) == cfg.smem_bytes(2048)
    assert of("nt1_w4_r1_s4_h1_a8_sc0", 4, 256).smem_bytes(256) == cfg.smem_bytes(2048), "tiles fill the ring"


# cuLaunchKernelEx's C signature, for a fake the host launcher can call as it calls the driver
LAUNCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class FakeDriver:
    """The driver calls a Launch makes, recorded: what the kernel would have been given. Its
    cuLaunchKernelEx is a C function pointer, so Python (ctypes) and launch_chain.c both call it."""

    def __init__(self, rc: int = 0) -> None:
        self.rc, self.launched, self.smem, self.n_params = rc, [], [], {}
        self.cuLaunchKernelEx = LAUNCH_FN(self._launch)

    def kernel(self, name: str, n_params: int) -> cuda_build.Kernel:
        """A fake kernel taking `n_params` 8-byte parameters (the recording reads that many)."""
        fn = len(self.n_params) + 1
        self.n_params[fn] = n_params
        return cuda_build.Kernel(self, ctypes.c_void_p(fn), name)

    def _launch(self, config: int, fn: int, params: int, extra: int | None) -> int:
        cfg = cuda_build.LaunchConfig.from_address(config)
        slots = (ctypes.c_void_p * self.n_params[fn]).from_address(params)
        self.launched.append((cfg.stream, list(cfg.grid), [ctypes.c_int64.from_address(p).value for p in slots]))
        return self.rc

    def cuFuncSetAttribute(self, fn, attr, value) -> int:  # noqa: ANN001, N802
        self.smem.append(value.value)
        return 0

    def cuGetErrorString(self, rc, out) -> int:  # noqa: ANN001, N802
        out._obj.value = b"invalid argument"
        return 0


@pytest.fixture(params=["c", "ctypes"])
def launcher(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """Each launch path: the host launcher (launch_chain.c built by this machine's nvcc; skipped
    without one) and the Python fallback a host without it runs."""
    built = cuda_build.host_launcher
    built.cache_clear()
    if request.param == "ctypes":
        monkeypatch.setattr(cuda_build, "host_launcher", lambda: (None, "no launcher (test)"))
    else:
        try:
            cuda_build.nvcc_path()
        except cuda_build.CudaUnavailable:
            pytest.skip("no nvcc on this machine")
        monkeypatch.setenv("KDBENCH_CUDA_CACHE", str(tmp_path))
        lib, why = cuda_build.host_launcher()
        assert lib is not None, why
    yield request.param
    built.cache_clear()


def test_a_launch_is_set_up_once_and_reads_its_arguments_from_the_buffer() -> None:
    """The params array points into the caller's int64 buffer: writing the buffer is all a call
    does before the launch; ints are read from a slot's low 4 bytes (little-endian)."""
    lib = FakeDriver()
    kernel = lib.kernel("k", 3)
    buf = np.zeros(6, dtype=np.int64)
    launch = cuda_build.Launch(kernel, (3, 2), 128, 70000, buf[2:5], pdl=True)
    assert lib.smem == [70000], "the opt-in above 48 KB is made at set-up"
    cuda_build.Launch(kernel, (1,), 128, 60000, buf[:2], pdl=False)
    assert lib.smem == [70000], "once per size: a smaller one needs none"
    buf[2:5] = [0x7F0000001000, 17, -1]
    launch(stream=99)
    assert lib.launched == [(99, [3, 2, 1], [0x7F0000001000, 17, -1])]
    assert ctypes.c_int.from_address(launch.params[2]).value == -1
    with pytest.raises(ValueError, match="contiguous int64"):
        cuda_build.Launch(kernel, (1,), 32, 0, buf[::2], pdl=False)
    lib.rc = 1
    with pytest.raises(RuntimeError, match=r"launch k failed: CUDA error 1 \(invalid argument\)"):
        launch(stream=99)


def test_launch_config_matches_cuda_h_and_asks_for_pdl_only_when_told() -> None:
    """cuLaunchKernelEx reads the config by cuda.h's layout: a wrong offset would launch garbage."""
    import ctypes
    import gc

    assert ctypes.sizeof(cuda_build.LaunchAttribute) == 72 and cuda_build.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(cuda_build.LaunchConfig) == 56
    assert [getattr(cuda_build.LaunchConfig, f).offset for f in ("grid", "block", "smem", "stream", "attrs",
                                                                  "num_attrs")] == [0, 12, 24, 32, 40, 48]
    cfg = cuda_build.launch_config((9, 64), 128, 4096, 1234, True)
    gc.collect()  # the attribute must live as long as the config
    assert list(cfg.grid) == [9, 64, 1] and list(cfg.block) == [128, 1, 1] and cfg.smem == 4096
    assert cfg.stream == 1234 and cfg.num_attrs == 1
    assert (cfg.attrs[0].id, cfg.attrs[0].value) == (6, 1)  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert cuda_build.launch_config((1,), 32, 0, 0, False).num_attrs == 0


def test_every_launch_waits_for_the_kernel_before_it() -> None:
    """With programmatic dependent launch a kernel that reads its predecessor's output before
    griddepcontrol.wait reads stale memory: each kernel of the chain waits, the GEMM before it
    reads the table unless the caller says the table is already complete (the down pass)."""
    src = SOURCE.read_text()
    for name in ("moe_align", "moe_silu_prep", "moe_sum"):
        body = src[src.index(f"    {name}("):]
        body = body[:body.index("\n}\n")]
        assert "grid_wait();" in body, name
    gemm = HEADERS[1].read_text()
    gemm = gemm[gemm.index("__device__ __forceinline__ void moe_gemm("):]
    assert gemm.index("if (!early) grid_wait();") < gemm.index("__ldcg(bexp")
    assert gemm.index("if (early) grid_wait();") < gemm.index("load(s, s, false, true)"), "activations after the wait"


def test_a_stage_of_one_token_serves_only_m_1(fake_device) -> None:  # noqa: ANN001
    """TA = 1 stages hold one token's activations: right only while no expert has two tokens (M = 1)."""
    fake_device(SM90)
    full = moe_configs.H200["full"]
    one, two = full[1], full[2]
    w13 = torch.empty(384, 4096, 896, dtype=torch.int32, device="meta")  # shapes, no memory
    w2 = torch.empty(384, 7168, 256, dtype=torch.int32, device="meta")
    assert moe_cuda.supports(torch.zeros(1, 7168, dtype=torch.bfloat16), w13, w2, one)
    assert not moe_cuda.supports(torch.zeros(2, 7168, dtype=torch.bfloat16), w13, w2, one)
    assert moe_cuda.supports(torch.zeros(2, 7168, dtype=torch.bfloat16), w13, w2, two)
    fewer = torch.empty(383, 7168, 256, dtype=torch.int32, device="meta")
    assert not moe_cuda.supports(torch.zeros(2, 7168, dtype=torch.bfloat16), w13, fewer, two), "w2's E is w13's"
    assert one.gate_up.smem_bytes(7168) < two.gate_up.smem_bytes(7168)
    big = full[1024]
    assert moe_cuda.supports(torch.zeros(2048, 7168, dtype=torch.bfloat16), w13, w2, big)
    fake_device(SM120)
    assert not moe_cuda.supports(torch.zeros(2048, 7168, dtype=torch.bfloat16), w13, w2, big), "an override is checked too"


def _cu_params(name: str) -> int:
    """How many parameters kernel `name` (or, for moe_w4a16_*, the MOE_KERNEL macro's) takes in the source."""
    src = SOURCE.read_text()
    at = src.index("moe_w4a16_nt##NT" if name.startswith("moe_w4a16_") else f"    {name}(")
    params = src[src.index("(", at) + 1:src.index(")", at)]
    return len(params.replace("\\", " ").split(","))


@pytest.fixture
def fake_module(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    """moe_cuda's module of kernels on a faked driver (each kernel taking as many parameters as the
    source declares), an sm_90 device, stream 5: the driver that records the launches."""
    lib = FakeDriver()
    kernels = {}

    class Mod:
        def kernel(self, name: str) -> cuda_build.Kernel:
            return kernels.setdefault(name, lib.kernel(name, _cu_params(name)))

    monkeypatch.setattr(moe_cuda, "_module", lambda device, sweep=False: Mod())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(cuda_build, "current_stream", lambda index: 5)
    return lib


def test_a_call_shape_is_laid_out_once_and_wires_each_pass_to_the_next(fake_module: FakeDriver, launcher: str) -> None:
    """_Call (CPU, driver faked): each launch gets as many arguments as its kernel declares, the
    buffers chain align -> gate_up -> SiLU -> down -> sum, workspace buffers are 256-byte aligned and
    disjoint, and a call writes only the base pointers. Passes of different block sizes (sm_120's
    TP-8 M = 1024 fallback: 16-slot gate_up, 32-slot down) get a table each."""
    lib = fake_module
    shard = moe_configs.H200["shard"]
    cfg = moe_configs.Bucket(shard[512].gate_up, shard[1024].down)
    m, h, e, inter, topk = 1000, 7168, 384, 256, 8
    call = moe_cuda._Call(0, m, h, e, inter, topk, cfg)
    assert call.chain.path == launcher
    names = [ln.kernel.name for ln in call.launches]
    assert names == ["moe_align", "moe_align", cfg.gate_up.kernel, "moe_silu_prep", cfg.down.kernel, "moe_sum"]
    for ln in call.launches:
        assert len(ln.args) == _cu_params(ln.kernel.name), ln.kernel.name
    ptr = dict(zip(moe_cuda._BASES, (0, *(i << 40 for i in range(1, 10)))))
    call(tuple(ptr.values()))
    assert [launch[0] for launch in lib.launched] == [5] * 6
    al_gu, al_dn, gu, silu, dn, sm = (list(ln.args) for ln in call.launches)
    ws = ptr["workspace"]
    bufs = sorted({a for args in (al_gu, al_dn, gu, silu, dn, sm) for a in args if ws <= a < ws + call.ws_bytes})
    assert all((a - ws) % 256 == 0 for a in bufs) and bufs[0] == ws
    s, ub = m * topk, lambda bm: -(-m * topk // bm) + min(e, m * topk)
    assert al_gu[:5] == [ptr["ids"], s, e, 16, ub(16)] and al_gu[10:13] == [ptr["x"], m, h]
    assert al_dn[:5] == [ptr["ids"], s, e, 32, ub(32)] and al_dn[10:] == [0, 0, 0, 0, 0]
    assert gu[:2] == al_gu[13:15], "gate_up reads the activations align prepared"
    assert gu[2:4] == [ptr["w13_q"], ptr["w13_s"]] and gu[5] == ptr["tw"] and gu[6:11] == al_gu[5:10]
    assert gu[11:] == [s, 2 * inter, h, 7168, 1, topk, e, 0, 0]
    assert silu[0] == gu[4] and silu[1:4] == [1, s, inter], "SiLU reads gate_up's partials"
    assert dn[:2] == silu[4:6] and dn[6:11] == al_dn[5:10], "down reads SiLU's output and its own table"
    assert dn[11:] == [s, h, inter, 256, 8, 1, e, 1, 1]
    assert sm == [dn[4], 1, s, m, h, topk, ptr["out"]]
    assert lib.launched[2][1] == [2 * inter // (cfg.gate_up.rows * cfg.gate_up.span), ub(16), 1], "row tiles first"
    assert lib.launched[4][1] == [h // (cfg.down.rows * cfg.down.span), ub(32), 1]
    need = 4 * s * 2 + 4 * e * 4 + 4 * (ub(16) + ub(32)) * 2 + 2 * m * h * 17 // 16 + 4 * s * 2 * inter + \
        2 * s * inter * 17 // 16 + 2 * s * h
    assert need <= call.ws_bytes <= need + 256 * 16
    ptr["x"] += 64
    call(tuple(ptr.values()))
    assert call.launches[0].args[10] == ptr["x"], "a call rewrites the base pointers"
    assert lib.launched[6][2][10] == ptr["x"], "and the launch reads the new one"


def test_a_small_workspace_lies_behind_the_output_in_one_allocation(fake_module: FakeDriver) -> None:
    """_Call.run (driver faked, CPU memory): up to _TOGETHER_MAX of workspace shares the output's allocation
    (the output first, [M, H] contiguous; the workspace at the next 256-byte boundary), a larger one gets
    its own; either way the launches get those pointers."""
    lib = fake_module
    shard = moe_configs.H200["shard"]
    h, inter, e = 7168, 256, 384
    small = moe_cuda._Call(0, 1, h, e, inter, 8, shard[1])
    large = moe_cuda._Call(0, 1024, h, e, inter, 8, shard[1024])
    assert small.ws_bytes <= moe_cuda._TOGETHER_MAX < large.ws_bytes
    assert small.together == (small.out_bytes + small.ws_bytes) // 2 and large.together == 0
    ins = [torch.zeros(4, dtype=torch.int64) for _ in range(7)]
    for call in (small, large):
        call.device = torch.device("cpu")  # the allocation on the host: what run hands the launches is checked
        lib.launched.clear()
        out = call.run(*ins)
        assert out.shape == call.shape and out.is_contiguous() and out.dtype == torch.bfloat16
        assert lib.launched[-1][2][-1] == out.data_ptr(), "moe_sum writes the output"
        ws = lib.launched[0][2][5]  # align's first table buffer: the workspace's start
        if call is small:
            assert ws == out.data_ptr() + call.out_bytes and call.out_bytes % 256 == 0
            assert out.untyped_storage().nbytes() == call.out_bytes + call.ws_bytes
        else:
            assert out.untyped_storage().nbytes() == 2 * 1024 * h


@pytest.fixture
def calls(fake_device, fake_module: FakeDriver, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN201
    """moe_cuda.prepared on a pretend sm_90 device (the driver faked, nothing set up yet): returns a
    function giving the shard experts' inputs at M rows on device `index` (weights on meta, no memory)."""
    fake_device(SM90)
    monkeypatch.setattr(moe_cuda._calls, "table", {}, raising=False)
    h, inter, e, topk = 7168, 256, 384, 8
    w13 = (torch.empty(e, 2 * inter, h // 8, dtype=torch.int32, device="meta"),
           torch.empty(e, 2 * inter, h // 32, dtype=torch.bfloat16, device="meta"))
    w2 = (torch.empty(e, h, inter // 8, dtype=torch.int32, device="meta"),
          torch.empty(e, h, inter // 32, dtype=torch.bfloat16, device="meta"))

    def inputs(m: int, index: int = 0) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr(torch.Tensor, "get_device", lambda self: index)
        return (torch.zeros(m, h, dtype=torch.bfloat16), w13[0], w13[1], w2[0], w2[1],
                torch.zeros(m, topk, dtype=torch.int64), torch.ones(m, topk) / topk)
    return inputs


def _prepared(x, w13_q, w13_s, w2_q, w2_s, ids, tw):  # noqa: ANN001, ANN202
    return moe_cuda.prepared(x, w13_q, w2_q, ids, tw)


def test_a_call_shape_is_set_up_once_per_shape_and_device(calls) -> None:  # noqa: ANN001
    """One set-up call a shape: the same object for the same shape and device, another for another M,
    device, top-k or configs; None (not an error) where supports() says the CUDA kernel does not run."""
    one = _prepared(*calls(1))
    assert one is not None and one is _prepared(*calls(1)) and one.shape == (1, 7168)
    others = [_prepared(*calls(2)), _prepared(*calls(1, index=1))]
    x, *w, ids, tw = calls(1)
    others.append(_prepared(x, *w, ids[:, :4].contiguous(), tw[:, :4].contiguous()))
    others.append(moe_cuda.prepared(x, w[0], w[2], ids, tw, moe_configs.H200["shard"][1024]))
    assert len({id(c) for c in (one, *others)}) == 5
    assert others[1].index == 1 and one.index == 0
    assert _prepared(x.float(), *w, ids, tw) is None, "fp32 activations: the Triton kernel's"


def test_the_set_up_calls_are_bounded(calls, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(moe_cuda, "CALLS_MAX", 2)
    first = _prepared(*calls(1))
    _prepared(*calls(2))
    _prepared(*calls(4))
    assert len(moe_cuda._calls.table) == 2
    again = _prepared(*calls(1))
    assert again is not first, "the oldest went first and is set up anew"


def test_bad_inputs_still_raise_naming_what_is_wrong(calls) -> None:  # noqa: ANN001
    """The routing's shapes (checked when a shape is set up, every time until one is), the weights'
    layout (checked each call), inputs the kernel cannot run: through ops and moe_cuda alike."""
    x, w13_q, w13_s, w2_q, w2_s, ids, tw = calls(1)
    for _ in range(2):
        with pytest.raises(ValueError, match="topk_ids .* and topk_weights .* must both be"):
            ops.moe_w4a16(x, w13_q, w13_s, w2_q, w2_s, ids, tw[:, :4])
    assert not moe_cuda._calls.table
    with pytest.raises(ValueError, match="must both be"):
        moe_cuda.moe_w4a16(x, w13_q, w13_s, w2_q, w2_s, ids[:, :4], tw)
    _prepared(x, w13_q, w13_s, w2_q, w2_s, ids, tw).device = torch.device("cpu")
    with pytest.raises(ValueError, match="expert weights and scales must be contiguous"):
        ops.moe_w4a16(x, w13_q, w13_s.transpose(1, 2), w2_q, w2_s, ids, tw)
    with pytest.raises(ValueError, match="cannot run these inputs here: the CUDA kernel takes bf16"):
        moe_cuda.moe_w4a16(x.half(), w13_q, w13_s, w2_q, w2_s, ids, tw)


def test_ops_runs_a_set_up_call_without_naming_the_impl_again(calls, fake_module: FakeDriver,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Under "auto" ops finds the set-up call in one lookup (moe_impl is not asked) and launches it; the
    routing is converted to what the kernel reads where it differs (int32 ids, bf16 weights)."""
    x, w13_q, w13_s, w2_q, w2_s, ids, tw = calls(1)
    call = _prepared(x, w13_q, w13_s, w2_q, w2_s, ids, tw)
    call.device = torch.device("cpu")  # the allocation on the host: what run hands the launches is checked

    def no(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("moe_impl asked on the set-up path")
    monkeypatch.setattr(ops, "moe_impl", no)
    fake_module.launched.clear()
    out = ops.moe_w4a16(x, w13_q, w13_s, w2_q, w2_s, ids.int(), tw.bfloat16())
    assert out.shape == (1, 7168) and out.dtype == torch.bfloat16
    assert len(fake_module.launched) == len(call.launches) and fake_module.launched[-1][2][-1] == out.data_ptr()


def test_a_chain_launches_in_order_and_names_the_launch_that_failed(launcher: str) -> None:
    """cuda_build.Chain on either path: slots = bases[which] + offset (base 0 a plain value), the
    launches in order on the stream given, the first failure named with the driver's error, and the
    launches after it not made."""
    lib = FakeDriver()
    args = np.zeros(5, dtype=np.int64)
    one, two = lib.kernel("one", 2), lib.kernel("two", 3)
    launches = [cuda_build.Launch(one, (4,), 64, 0, args[:2], pdl=True),
                cuda_build.Launch(two, (2, 3), 32, 0, args[2:], pdl=False)]
    chain = cuda_build.Chain(launches, args, np.array([1, 0, 2, 1, 0]), np.array([8, 7, 0, -8, -1]), 3,
                             cuda_build.host_launcher()[0])
    assert chain.path == launcher
    chain.bases[:] = (0, 1 << 44, 1 << 45)
    chain.launch(41)
    assert lib.launched == [(41, [4, 1, 1], [(1 << 44) + 8, 7]), (41, [2, 3, 1], [1 << 45, (1 << 44) - 8, -1])]
    assert [ln.config.num_attrs for ln in launches] == [1, 0], "programmatic dependent launch as each was set up"
    lib.launched.clear()
    lib.rc = 1
    with pytest.raises(RuntimeError, match=r"launch one failed: CUDA error 1 \(invalid argument\)"):
        chain.launch(42)
    assert len(lib.launched) == 1, "nothing launched after a failure"
    with pytest.raises(ValueError, match="below n_bases"):
        cuda_build.Chain(launches, args, np.array([1, 0, 3, 1, 0]), np.zeros(5), 3, None)


def test_without_a_host_compiler_the_launcher_says_why_and_the_python_path_runs(no_nvcc: None) -> None:
    """No nvcc (or one that fails): host_launcher answers None and the reason (build.json's
    launcher_unavailable), and a Chain made with it launches from Python: never a failure."""
    cuda_build.host_launcher.cache_clear()
    try:
        lib, why = cuda_build.host_launcher()
    finally:
        cuda_build.host_launcher.cache_clear()
    assert lib is None and "nvcc not found" in why


def test_the_sweep_picks_gate_up_then_down_from_checked_candidates() -> None:
    """engine.moe_sweep's choice with a fake timer: the baseline first, each gate_up candidate beside the
    baseline's down pass, then each down candidate beside the fastest of those gate_ups; a wrong result or
    an error is recorded and never picked (however fast it claims to be), one that does not run here is
    not tried; the picks come out as a table kernels/moe_configs.py reads back unchanged."""
    from engine import moe_sweep

    table = moe_configs.H200["full"]
    base = table[32]
    gu_fast, gu_wrong = table[256].gate_up, table[512].gate_up
    dn_fast, dn_broken, dn_absent = table[64].down, table[1024].down, table[512].down
    gu_us = {base.gate_up: 50.0, gu_fast: 30.0, gu_wrong: 1.0}
    dn_us = {base.down: 40.0, dn_fast: 25.0, dn_broken: 2.0}
    tried: list[tuple[str, moe_configs.Bucket, moe_sweep.Trial]] = []

    def measure(cfg: moe_configs.Bucket) -> moe_sweep.Trial | None:
        if cfg.down == dn_absent or cfg.gate_up not in gu_us or cfg.down not in dn_us:
            return None
        if cfg.gate_up == gu_wrong:
            return moe_sweep.Trial(0.5, error="wrong result")
        if cfg.down == dn_broken:
            return moe_sweep.Trial(error="RuntimeError: launch failed")
        return moe_sweep.Trial(3e-3, gu_us[cfg.gate_up] + dn_us[cfg.down])

    best, us, base_us = moe_sweep.pick("full", 32, base, table, measure, lambda *t: tried.append(t))
    assert best == moe_configs.Bucket(gu_fast, dn_fast) and (us, base_us) == (55.0, 90.0)
    assert tried[0][:2] == ("baseline", base)
    assert {c.down for w, c, _ in tried if w == "gate_up"} == {base.down}
    assert {c.gate_up for w, c, _ in tried if w == "down"} == {gu_fast}
    assert [t.error for w, c, t in tried if c.gate_up == gu_wrong] == ["wrong result"]
    assert [w for w, c, _ in tried if c.down == dn_broken] == ["down"]
    assert not any(c.down == dn_absent for _, c, _ in tried)
    with pytest.raises(RuntimeError, match="full M = 32: the table's own pick failed"):
        moe_sweep.pick("full", 32, base, table, lambda cfg: moe_sweep.Trial(error="x"), lambda *t: None)

    picks = {"full": {32: best, 1024: table[1024]}, "shard": dict(moe_configs.H200["shard"])}
    block = moe_sweep.table_block("sm_100", picks, "a test")
    space = {"_b": moe_configs._b, "Table": moe_configs.Table}
    exec(block, space)  # noqa: S102 - the block is this test's own output
    assert space["SM100"] == picks and "CUDA_CONFIGS['sm_100'] = SM100" in block
    assert "Sweep-only" not in block
    swept = moe_configs.Bucket(moe_configs.PassConfig.of(moe_configs.SWEEP_KERNELS[0], 1, 7168), best.down)
    assert moe_configs.SWEEP_KERNELS[0] in moe_sweep.table_block("sm_100", {"full": {1: swept}}, "a test")
