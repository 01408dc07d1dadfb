"""Flow settings come from KDBENCH_* variables; a bad one is named, never a traceback deep in a run."""

from __future__ import annotations

import pytest

from flows.settings import ENV, Settings, SettingsError


def test_settings_round_trip_through_the_environment() -> None:
    s = Settings.from_env({"KDBENCH_SUITES": "kernels, e2e", "KDBENCH_COMMIT": "0", "KDBENCH_PROFILE": "smoke",
                           "KDBENCH_UNREACHABLE_RUNS": "5", "KDBENCH_ARTIFACTS": "s3://bucket/kdbench"})
    assert (s.suites, s.commit, s.profile, s.unreachable_runs) == (["kernels", "e2e"], False, "smoke", 5)
    assert s.artifacts == "s3://bucket/kdbench"
    assert Settings.from_env(s.env()) == s
    assert set(s.env()) == set(ENV.values())


@pytest.mark.parametrize("var, value", [("KDBENCH_SUITES", "kernels,gemm"), ("KDBENCH_PROFILE", "huge"),
                                        ("KDBENCH_UNREACHABLE_RUNS", "0"), ("KDBENCH_COMMIT", "perhaps")])
def test_a_bad_variable_is_named(var: str, value: str) -> None:
    with pytest.raises(SettingsError, match=var):
        Settings.from_env({var: value})
