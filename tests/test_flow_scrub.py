"""What the flow logs of a host's answers is scrubbed: probe mismatches and quarantine reasons quote the host."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from flows.inventory.hosts import Host
from flows.pipelines import tasks
from flows.transport.probe import ProbeResult
from flows.transport.pull import Pulled

HOST = Host(name="box", address="gpu-box.lab.internal", port=22, user="alice", key_file="id_box", spec="h200-sxm",
            gpus=1, arch="sm_90", interconnect="none", python="python3", work_dir="kdbench")
SECRETS = ("gpu-box", "GPU-BOX", "10.9.8.7", "fe80::1", "alice@")


@pytest.fixture
def logged(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(tasks, "get_run_logger", lambda: logging.getLogger("test_flow_scrub"))
    caplog.set_level(logging.INFO, logger="test_flow_scrub")
    return caplog


def test_probe_mismatches_are_logged_scrubbed(monkeypatch: pytest.MonkeyPatch, logged: pytest.LogCaptureFixture) -> None:
    res = ProbeResult(host="box", outcome="ok", detail="connected", elapsed_s=0.1, pinned_fingerprints=[],
                      mismatches=["gpu: spec says H200, host has GPU-BOX.lab.internal at 10.9.8.7",
                                  "driver: fe80::1ff:fe23:4567:890a via alice@gw"])
    monkeypatch.setattr(tasks, "probe", lambda host, hosts_dir: res)
    assert tasks.probe_host.fn(HOST, Path(".")) is res
    text = logged.text
    # rich markup escaped (a log record is rendered by `prefect ... --watch`): [redacted] shows as written
    assert r"inventory mismatch on box: gpu: spec says H200, host has \[redacted] at \[redacted]" in text
    assert not any(s in text for s in SECRETS)


def test_quarantine_reasons_are_logged_scrubbed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                logged: pytest.LogCaptureFixture) -> None:
    pulled = Pulled(accepted_dir=tmp_path, accepted=[],
                    quarantined={"'10.9.8.7.arrow'": "unexpected file name (not fetched)",
                                 "kernels.arrow": "column 'gpu' holds GPU-BOX.lab\u200b.internal, alice@gw"})
    monkeypatch.setattr(tasks, "pull", lambda remote, out_dir, staging, host, run_id: pulled)

    class FakeRemote:
        host = HOST

    tasks.pull_results.fn(FakeRemote(), "box", "run1", "out", tmp_path)
    text = logged.text
    assert r"quarantined '\[redacted].arrow'" in text and r"quarantined kernels.arrow: column 'gpu' holds \[redacted]" in text
    assert not any(s in text for s in SECRETS)
