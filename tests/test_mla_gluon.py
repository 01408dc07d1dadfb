"""The sm_90 Gluon MLA kernel off the GPU: which kernel a Config dispatches to, what it refuses, the
TMA descriptors it takes the cache as, and that it compiles for sm_90 (Triton targets a GPU it does
not have; ptxas ships with it) within the H200's shared memory, so a kernel that does not build
never reaches a device run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from kernels import mla_tree_attention as mta

pytest.importorskip("triton.experimental.gluon")
from kernels import mla_gluon, mla_gluon_ws  # noqa: E402

SM90_SHARED_BYTES = 227 * 1024  # the most one CTA may use on sm_90


def test_a_config_names_its_row_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """"gluon" is the sm_90 kernel at BM = BN = 64 and 8 warps, "gluon_ws" the warp-specialized one at
    4 warps a warpgroup; they refuse other tiles and warps, inputs other than bf16 and GPUs other than
    sm_90; an unknown kernel name is refused."""
    C, bf16 = mta.Config, torch.bfloat16
    assert mta.rows_kernel(C("triton", 64, 64, 8, 2), None, torch.float32) is mta._mla_rows
    assert mta.rows_kernel(C("gluon", 64, 64, 8, 1), (9, 0), bf16) is mla_gluon.mla_rows_sm90
    assert mta.rows_kernel(C("gluon_ws", 64, 64, 4, 1), (9, 0), bf16) is mla_gluon_ws.mla_rows_sm90_ws
    with pytest.raises(ValueError, match="BM = BN = 64, 4 warps a warpgroup"):
        mta.rows_kernel(C("gluon_ws", 64, 64, 8, 1), (9, 0), bf16)
    with pytest.raises(ValueError, match="needs Gluon"):
        mta.rows_kernel(C("gluon_ws", 64, 64, 4, 1), None, bf16)
    with pytest.raises(ValueError, match="needs Gluon"):
        mta.rows_kernel(C("gluon", 64, 64, 8, 1), None, bf16)  # the CPU interpreter
    for bad in (C("gluon", 64, 64, 4, 1), C("gluon", 64, 32, 8, 1)):
        with pytest.raises(ValueError, match="BM = BN = 64, 8 warps"):
            mta.rows_kernel(bad, (9, 0), bf16)
    for cap, dtype in (((9, 0), torch.float16), ((10, 0), bf16)):
        with pytest.raises(ValueError, match="needs Gluon"):
            mta.rows_kernel(C("gluon", 64, 64, 8, 1), cap, dtype)
    with pytest.raises(ValueError, match="unknown kernel 'cuda'"):
        mta.rows_kernel(C("cuda", 64, 64, 4, 1), (9, 0), bf16)
    monkeypatch.setattr(mta, "mla_gluon", None)  # a Triton without Gluon
    with pytest.raises(ValueError, match="needs Gluon"):
        mta.rows_kernel(C("gluon", 64, 64, 8, 1), (9, 0), bf16)


def test_the_launch_refuses_a_gluon_config_on_the_cpu() -> None:
    q = torch.zeros(1, 2, 8, 512, dtype=torch.bfloat16)
    kv, kr = torch.zeros(1, 64, 512, dtype=torch.bfloat16), torch.zeros(1, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs Gluon"):
        mta.mla_tree_attention(q, q[..., :64], kv, kr, torch.tensor([62]), None, 0.1, causal=True,
                               config=mta.Config("gluon", 64, 64, 8, 1))


def test_every_kernel_the_table_and_the_bench_name_launches_on_an_h200() -> None:
    bench = pytest.importorskip("engine.bench_mla")
    for cfg in [*bench.NAMED.values(), *mta.CONFIGS[(9, 0)].values()]:
        mta.rows_kernel(cfg, (9, 0), torch.bfloat16)
    assert mta.CONFIGS[(9, 0)]["rows"].kernel == "gluon_ws"


def test_the_gluon_kernel_takes_the_cache_as_descriptors_of_key_blocks() -> None:
    """2-D descriptors over [batch * S, D], one key block a tile; the Triton kernel takes the tensors."""
    kv, kr = torch.zeros(2, 128, 512, dtype=torch.bfloat16), torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    dc, dr = mta.key_args(mta.Config("gluon", 64, 64, 8, 1), kv, kr)
    assert (list(dc.shape), dc.block_shape, list(dr.shape), dr.block_shape) == ([256, 512], [64, 512], [256, 64], [64, 64])
    assert dc.layout == mla_gluon.KEY_LAYOUT
    ws = mta.key_args(mta.Config("gluon_ws", 64, 64, 4, 1), kv, kr)
    assert [(list(d.shape), d.block_shape) for d in ws] == [([256, 512], [64, 512]), ([256, 64], [64, 64])]
    assert mta.key_args(mta.Config("triton", 64, 64, 8, 2), kv, kr) == (kv, kr)


KERNELS = {"gluon": (lambda: mla_gluon.mla_rows_sm90, mla_gluon.NUM_WARPS.value),
           "gluon_ws": (lambda: mla_gluon_ws.mla_rows_sm90_ws, mla_gluon_ws.NUM_WARPS.value)}


def compile_sm90(name: str, causal: bool, one_split: bool):  # type: ignore[no-untyped-def]
    """triton.compile of a Gluon kernel for an sm_90 target, with the argument types a launch gives."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    lay = "NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)"
    sig = {"qn_ptr": "*bf16", "qr_ptr": "*bf16", "c_desc": f"tensordesc<bf16[64, 512],{lay}>",
           "kp_desc": f"tensordesc<bf16[64, 64],{lay}>",
           "ctx_ptr": "*i64", "mask_ptr": "*i8", "o_ptr": "*bf16" if one_split else "*fp32", "lse_ptr": "*fp32",
           "qk_scale": "fp32", "T": "i32", "S": "i32", "chunk": "i32", "n_splits": "i32"}
    consts = {"H": 8, "DL": 512, "DR": 64, "BM": 64, "BN": 64, "CAUSAL": causal, "ONE_SPLIT": one_split}
    sig |= {k: "constexpr" for k in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if i < 8 and k.endswith("_ptr")}  # as the JIT sees torch's
    fn, warps = KERNELS[name]
    return triton.compile(GluonASTSource(fn(), sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": 1})


def spilled_bytes(ptx: str, tmp: Path) -> int:
    """Bytes ptxas spills building `ptx` for sm_90a (its -v report), with the ptxas Triton bundles."""
    from triton.backends.nvidia.compiler import get_ptxas

    (tmp / "k.ptx").write_text(ptx)
    r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(tmp / "k.ptx"), "-o", str(tmp / "k.cubin")],
                       capture_output=True, text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", r.stderr))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("one_split", [True, False])
@pytest.mark.parametrize("name", ["gluon", "gluon_ws"])
def test_the_gluon_kernels_build_for_sm90_within_shared_memory(name: str, causal: bool, one_split: bool,
                                                               tmp_path: Path) -> None:
    """Both build within the shared memory of one CTA, with no register spilled (the warp-specialized
    kernel spilled ~250 bytes when its wgmma descriptors were hoisted out of the key loop)."""
    k = compile_sm90(name, causal, one_split)
    ptx = k.asm["ptx"]
    assert k.asm["cubin"] and ".target sm_90a" in ptx
    assert 0 < k.metadata.shared <= SM90_SHARED_BYTES and k.metadata.num_warps == 8  # ws: 4 + a worker warpgroup of 4
    # the key blocks by bulk tensor copies, completing on mbarriers
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
    if name == "gluon":  # latent and rope, both stages
        assert ptx.count("cp.async.bulk.tensor") == 4
    else:  # the softmax overlaps the tensor cores only if the two warpgroups are separate partitions
        assert "setmaxnreg" in ptx
    assert spilled_bytes(ptx, tmp_path) == 0
