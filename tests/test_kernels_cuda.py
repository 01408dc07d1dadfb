"""The CUDA C++ MoE's host side: finding nvcc, building and caching the cubin, the config table.

The kernel itself runs only on a GPU (kernels/gpu_check.py and engine.build check it there against
the reference); here: what a host without nvcc, or with a broken one, is told, and that the table
only names kernels the source instantiates, at shapes they tile.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
import torch

from kernels import cuda_build, moe_cuda, ops

SOURCE = cuda_build.HERE / moe_cuda.SOURCE
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
    first = cuda_build.compile_cubin(SOURCE, "sm_90")
    again = cuda_build.compile_cubin(SOURCE, "sm_90")
    other = cuda_build.compile_cubin(SOURCE, "sm_120")
    assert first == again != other and first.read_text() == "cubin\n"
    assert log.read_text().count("run") == 2, "the second sm_90 build came from the cache"
    src = tmp_path / "moe_w4a16.cu"
    src.write_text(SOURCE.read_text() + "\n// changed\n")
    assert cuda_build.compile_cubin(src, "sm_90") != first, "changed source, new cubin"


def test_config_table_names_instantiated_kernels_that_tile_k2() -> None:
    made = {tuple(int(v) for v in m.groups())
            for m in re.finditer(r"^MOE_KERNEL\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+), ([01])\)", SOURCE.read_text(),
                                 re.M)}
    assert made == moe_cuda.KERNELS
    for cls, table in moe_cuda.CUDA_CONFIGS.items():
        inter, hidden = SHAPES[cls]
        for bucket, cfg in table.items():
            if cfg is None:
                continue
            assert moe_cuda.fits(cfg["gate_up"], 2 * inter, hidden), (cls, bucket)
            assert moe_cuda.fits(cfg["down"], hidden, inter), (cls, bucket)
            assert moe_cuda.smem_bytes(cfg["gate_up"], hidden) <= 227 * 1024, (cls, bucket)
            assert moe_cuda.smem_bytes(cfg["down"], inter) <= 227 * 1024, (cls, bucket)
    assert moe_cuda.cuda_config(5, 2048) == moe_cuda.cuda_config(32, 2048) != moe_cuda.cuda_config(33, 2048)
    assert moe_cuda.cuda_config(2, 2048) != moe_cuda.cuda_config(3, 2048) == moe_cuda.cuda_config(4, 2048)
    assert moe_cuda.cuda_config(4096, 256) == moe_cuda.cuda_config(1024, 256)  # above the last bucket: the last one's
    assert not moe_cuda.fits((1, 4, 1, 4, 1, 8, 0, 3, 256), 7168, 256), "3 tiles of 64 rows do not tile N = 7168"
    assert not moe_cuda.fits((1, 4, 1, 2, 2, 8, 0, 1, 256), 7168, 256), "H = 2 needs K chunks of 512"
    assert moe_cuda.fits((1, 4, 1, 4, 1, 8, 0, 1, 256), 7168, 256)
    assert not moe_cuda.fits((1, 4, 1, 4, 1, 8, 1, 1, 256), 7168, 256), "the scale form is part of the kernel"


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
    image = cuda_build.compile_cubin(SOURCE, "sm_90").read_bytes()
    for cfg in moe_cuda.KERNELS:
        assert moe_cuda.kernel_name((*cfg, 1, 256)).encode() in image
    assert b"moe_align" in image and b"moe_silu_prep" in image and b"moe_sum" in image


def test_a_one_step_chunk_asks_for_one_ring_stage() -> None:
    """The TP-8 down pass (K = 256) fills one stage: asking for all four would cap CTAs per SM."""
    cfg = (1, 4, 1, 4, 1, 8, 0, 1, 2048)
    assert moe_cuda.smem_bytes(cfg, 256) * 4 == moe_cuda.smem_bytes(cfg, 2048)
    assert moe_cuda.smem_bytes((1, 4, 1, 4, 1, 8, 0, 1, 512), 2048) * 2 == moe_cuda.smem_bytes(cfg, 2048)
    assert moe_cuda.smem_bytes((1, 4, 1, 2, 2, 8, 0, 1, 2048), 2048) == moe_cuda.smem_bytes(cfg, 2048)
    assert moe_cuda.smem_bytes((1, 4, 1, 4, 1, 8, 0, 4, 256), 256) == moe_cuda.smem_bytes(cfg, 2048), "tiles fill the ring"


def test_kernel_arguments_are_device_pointers_ints_or_null() -> None:
    t = torch.zeros(2)
    assert cuda_build._arg(t).value == t.data_ptr()
    assert cuda_build._arg(7).value == 7 and cuda_build._arg(True).value == 1
    assert cuda_build._arg(None).value is None, "None is a null pointer (moe_align without activations)"
    with pytest.raises(TypeError, match="float"):
        cuda_build._arg(1.5)


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
    gemm = src[src.index("__device__ __forceinline__ void moe_gemm("):]
    assert gemm.index("if (!early) grid_wait();") < gemm.index("__ldcg(bexp")
    assert gemm.index("if (early) grid_wait();") < gemm.index("load(s, s, false, true)"), "activations after the wait"


def test_a_stage_of_one_token_serves_only_m_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """TA = 1 stages hold one token's activations: right only while no expert has two tokens (M = 1)."""
    one = {"gate_up": (1, 4, 1, 2, 2, 1, 0, 1, 7168), "down": (1, 4, 1, 2, 2, 1, 0, 2, 2048)}
    w13 = torch.empty(384, 4096, 896, dtype=torch.int32, device="meta")  # shapes, no memory
    w2 = torch.empty(384, 7168, 256, dtype=torch.int32, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the shape rules only
    assert moe_cuda.supports(torch.zeros(1, 7168, dtype=torch.bfloat16), w13, w2, one)
    assert not moe_cuda.supports(torch.zeros(2, 7168, dtype=torch.bfloat16), w13, w2, one)
    two = moe_cuda.cuda_config(2, 2048)
    assert moe_cuda.supports(torch.zeros(2, 7168, dtype=torch.bfloat16), w13, w2, two)
    assert moe_cuda.smem_bytes(one["gate_up"], 7168) < moe_cuda.smem_bytes(two["gate_up"], 7168)
