"""A host whose GPU is not its spec's model is not measured: its figures would be filed, and projected,
under a machine it is not (found on a lent H100 registered with the H200 spec)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from flows.inventory.files import load_host, load_specs, update_host
from flows.pipelines import bench as bench_mod
from flows.transport.probe import ProbeResult, _mismatches, _wrong_gpu

FACTS = {"arch_found": "sm_90", "gpu_count": 1, "gpu_names": ["NVIDIA H100 80GB HBM3"], "python": "3.12.3",
         "torch": "2.11.0", "work_dir_exists": True}


def test_a_gpu_of_another_model_is_named_and_listed_with_the_mismatches(inv_dir: Path) -> None:
    host = update_host(inv_dir, "pro6000", spec="h200-sxm", gpus=1, arch="sm_90")
    wrong = _wrong_gpu(host, FACTS, load_specs(inv_dir)["h200-sxm"].gpu)
    assert wrong == "gpu: spec says H200, host has NVIDIA H100 80GB HBM3"
    assert _mismatches(host, FACTS, wrong) == [wrong]
    assert _wrong_gpu(host, FACTS, load_specs(inv_dir)["h100-sxm"].gpu) is None


def test_the_bench_flow_does_not_measure_a_host_with_the_wrong_gpu(inv_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "key").write_text("not a real key: never read, the probe is replaced\n")
    update_host(inv_dir, "pro6000", address="127.0.0.1", user="bench", key_file=str(tmp_path / "key"))
    res = ProbeResult(host="pro6000", outcome="ok", detail="connected; 1 mismatch(es) with the inventory",
                      elapsed_s=0.1, pinned_fingerprints=[], mismatches=["gpu: spec says RTX PRO 6000, host has H100"],
                      wrong_gpu="gpu: spec says RTX PRO 6000, host has H100")

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured a host whose GPU is not its spec's")

    monkeypatch.setenv("KDBENCH_HOSTS", str(inv_dir))
    monkeypatch.setenv("KDBENCH_ARTIFACTS", str(tmp_path / "art"))
    monkeypatch.setattr(bench_mod, "held", lambda name: contextlib.nullcontext())
    monkeypatch.setattr(bench_mod, "probe_with_retries", lambda host, s: res)
    monkeypatch.setattr(bench_mod, "get_run_logger", lambda: logging.getLogger("test_flow_wrong_gpu"))
    monkeypatch.setattr(bench_mod, "_measure", no_measuring)
    monkeypatch.setattr(bench_mod, "project_task", no_measuring)  # reachable: never projected
    monkeypatch.setattr(bench_mod, "_publish", lambda report, s: None)
    report = bench_mod.bench.fn("pro6000", notes=False)
    assert report.route == bench_mod.Route.WRONG_GPU and report.outcome == bench_mod.RunOutcome.UNMEASURED
    assert "host has H100" in report.detail and "hosts/pro6000.yaml" in report.detail
    assert load_host(inv_dir, "pro6000").status == "active"
