"""Parsing what a host reports about itself: validated, never trusted, never a crash."""

from __future__ import annotations

import json

from flows import REPO
from flows.inventory.files import load_host
from flows.transport.probe import _mismatches, _parse_facts, _wrong_gpu


def test_facts_parsing_is_defensive() -> None:
    smi = "NVIDIA H200, 570.86.15, 9.0\nNVIDIA H200, 570.86.15, 9.0\ngarbage line\n"
    out = "noise\nKDBENCH_FACTS " + json.dumps(
        {"python": "3.12.3", "torch": "2.9.0", "triton": 7, "disk_free_gb": "lots", "nvidia_smi": smi})
    f = _parse_facts(out)
    assert (f["gpu_count"], f["arch_found"], f["driver"], f["triton"], f["disk_free_gb"]) == (
        2, "sm_90", "570.86.15", None, None)
    pro = load_host(REPO / "hosts", "pro6000")
    found = _mismatches(pro, f, _wrong_gpu(pro, f, "RTX PRO 6000 Blackwell Server Edition"))
    assert any("sm_120" in m and "sm_90" in m for m in found)
    assert any(m.startswith("gpus:") for m in found) and any("NVIDIA H200" in m for m in found)
    assert _parse_facts("KDBENCH_FACTS [1, 2]")["arch_found"] == "cpu"
    assert _parse_facts("KDBENCH_FACTS {not json")["gpu_count"] == 0
    assert _parse_facts("KDBENCH_FACTS " + "[" * 50_000 + "]" * 50_000)["gpu_count"] == 0  # too deep for json
