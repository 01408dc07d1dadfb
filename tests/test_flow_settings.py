"""Flow settings come from KDBENCH_* variables; a bad one is named, never a traceback deep in a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.pipelines.settings import Settings, SettingsError


def _env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for var in Settings().env():
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)


def test_settings_round_trip_through_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _env(monkeypatch, {"KDBENCH_SUITES": "kernels, e2e", "KDBENCH_COMMIT": "0", "KDBENCH_PROFILE": "smoke",
                       "KDBENCH_UNREACHABLE_RUNS": "5", "KDBENCH_ARTIFACTS": "s3://bucket/kdbench",
                       "KDBENCH_HOSTS": str(tmp_path / "hosts"), "KDBENCH_REFERENCE": ""})
    s = Settings.from_env()
    assert (s.suites, s.commit, s.profile, s.unreachable_runs) == (["kernels", "e2e"], False, "smoke", 5)
    assert s.artifacts == "s3://bucket/kdbench" and s.hosts_dir == tmp_path / "hosts"
    assert s.reference == "h200"  # an empty variable means the default
    env = s.env()
    assert set(env) == {"KDBENCH_HOSTS", "KDBENCH_ARTIFACTS", "KDBENCH_DOCS", "KDBENCH_REPO", "KDBENCH_COMMIT",
                        "KDBENCH_SUITES", "KDBENCH_PROFILE", "KDBENCH_REFERENCE", "KDBENCH_UNREACHABLE_RUNS",
                        "KDBENCH_PROBE_RETRIES", "KDBENCH_RETRY_BACKOFF_S", "KDBENCH_BUILD_TIMEOUT_S",
                        "KDBENCH_BENCH_TIMEOUT_S"}
    _env(monkeypatch, env)
    assert Settings.from_env() == s


@pytest.mark.parametrize("var, value", [("KDBENCH_SUITES", "kernels,gemm"), ("KDBENCH_PROFILE", "huge"),
                                        ("KDBENCH_UNREACHABLE_RUNS", "0"), ("KDBENCH_COMMIT", "perhaps"),
                                        ("KDBENCH_BENCH_TIMEOUT_S", "-1")])
def test_a_bad_variable_is_named(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    _env(monkeypatch, {var: value})
    with pytest.raises(SettingsError, match=var):
        Settings.from_env()
