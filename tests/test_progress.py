"""The host's progress events become one short readable log line per point; hostile ones stay short."""

from __future__ import annotations

import json

from flows.pipelines.progress import log_line


def _ev(**ev: object) -> str:
    return "KDBENCH " + json.dumps(ev)


def test_point_lines_name_suite_position_label_time_and_headline() -> None:
    text, ev = log_line("kernels", _ev(event="point", suite="kernels", i=3, n=40, kernel="moe_w4a16", impl="triton",
                                       M=8, N=4096, K=7168, E=384, top_k=8, time_us_p50=152.34, achieved_gbps=812.06,
                                       budget=None, device="cuda", bytes=1.2e8))
    assert text == "kernels 3/40 moe_w4a16 triton M=8 N=4096 K=7168 E=384 top_k=8: 152.3 us, 812.1 GB/s"
    assert ev is not None and ev["event"] == "point"
    text, _ = log_line("e2e", _ev(event="point", i=1, n=12, config="k2-mini", concurrency=4, budget=64,
                                  step_ms_p50=81.234, tokens_per_s=45.12, accept_len_mean=3.456))
    assert text == "e2e 1/12 k2-mini C=4 B=64: 81.23 ms/step, 45.1 tokens/s, 3.46 accepted/step"
    text, _ = log_line("comm", _ev(event="point", i=2, n=9, op="all_reduce", world_size=2, bytes=1 << 20,
                                   time_us_p50=20.0, busbw_gbps=101.5, status="ok"))
    assert text == "comm 2/9 all_reduce n=2 1 MiB: 20.0 us, 101.5 GB/s bus"
    text, _ = log_line("comm", _ev(event="point", i=1, n=1, op="all_reduce", world_size=1, bytes=0,
                                   status="skipped", skip_reason="one GPU"))
    assert text == "comm 1/1 all_reduce n=1 0 B: skipped (one GPU)"
    text, _ = log_line("kernels", _ev(event="point", i=1, n=9, kernel="build_tree", impl="torch", batch=4,
                                      time_us_p50=1855907.4, achieved_gbps=0.01234))
    assert text == "kernels 1/9 build_tree torch batch=4: 1855.9 ms, 0.0123 GB/s"
    assert log_line("kernels", _ev(event="done", suite="kernels", status="complete", points=40))[0] == \
        "kernels done: complete, 40 points"


def test_other_lines_pass_through_and_hostile_events_stay_short() -> None:
    assert log_line("e2e", "warming up") == ("e2e: warming up", None)
    assert log_line("e2e", "KDBENCH {not json")[0] == "e2e: unreadable progress line (17 characters)"
    assert log_line("e2e", "KDBENCH [1, 2]")[1] is None
    text, _ = log_line("kernels", _ev(event="point", i="x" * 10_000, n=True, kernel="a\nb|\x1b[31m" + "k" * 5000,
                                      impl=["x"], M=float("nan"), time_us_p50="fast", achieved_gbps={"a": 1}))
    assert "\n" not in text and "\x1b" not in text and len(text) < 200
    assert text.startswith("kernels ?/? a b| [31m")
