"""tools/ttft_breakdown.py: a request's TTFT split into the servers' own parts, and the committed
oos3 / oos4 results read per mode and rate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools.regen_validations import RESULTS
from tools.ttft_breakdown import breakdown, fetch_parts, format_table, parts


def test_a_request_splits_into_the_servers_parts():
    t = {
        "prefill_path": "remote",
        "prefill_s": 0.5,
        "prefill_rtt_s": 0.65,
        "publish_s": 0.1,
        "transfer_s": 0.2,
        "decode_first_step_s": 0.15,
    }
    got = parts(t, ttft_s=1.02)
    assert got == pytest.approx({"p": 0.5, "publish": 0.1, "answer": 0.05, "fetch": 0.2, "d": 0.15, "other": 0.02})
    assert sum(got.values()) == pytest.approx(1.02)
    assert parts({**t, "prefill_path": "local"}, 1.0) is None  # P failed and D recomputed: no split
    assert parts({**t, "transfer_s": None}, 1.0) is None


def test_the_oos3_rate_runs():
    result = json.loads((RESULTS / "e2e_h200x1_depth40_oos3.json").read_text())
    rows = breakdown(result)
    assert list(rows) == ["asymmetric@0.75", "asymmetric@1.5", "encoder-only@0.75", "encoder-only@1.5"]
    run = result["modes"]["asymmetric"]["runs"][1]
    t, ttft = run["requests"]["asympd_timings"][3], run["requests"]["ttfts"][3]
    assert parts(t, ttft)["publish"] == t["publish_s"] and rows["asymmetric@1.5"]["requests"] == 16
    # under load the hand-off (publish + fetch, p50s 371 + 372 ms) held as much of TTFT as P
    hand_off = rows["asymmetric@1.5"]["publish"]["p50"] + rows["asymmetric@1.5"]["fetch"]["p50"]
    assert round(hand_off * 1e3) == 744 and round(rows["asymmetric@1.5"]["p"]["p50"] * 1e3) == 755
    cmd = [sys.executable, "tools/ttft_breakdown.py", str(RESULTS / "e2e_h200x1_depth40_oos3.json"),
           str(RESULTS / "e2e_h200x1_depth40_oos4.json")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=RESULTS.parents[1]).stdout
    assert "asymmetric@1.5" in out and "(0.87)" in out  # oos4's TTFT p50 over oos3's at 1.5 req/s


def test_the_fetch_splits_where_d_timed_its_parts():
    t = {"transfer_arrive_s": 0.01, "transfer_unpack_s": 0.2, "transfer_check_s": 0.03}
    assert fetch_parts(t) == {"arrive": 0.01, "unpack": 0.2, "check": 0.03}
    assert fetch_parts({**t, "transfer_unpack_s": None}) is None  # a result from before the split
    result = {"modes": {"asymmetric": {"runs": [{"request_rate": 1.0, "requests": {
        "asympd_timings": [{"prefill_path": "remote", "prefill_s": 0.5, "prefill_rtt_s": 0.6, "publish_s": 0.05,
                            "transfer_s": 0.25, "decode_first_step_s": 0.1, **t}],
        "ttfts": [1.0], "errors": [None]}}]}}}  # fmt: skip
    row = breakdown(result)["asymmetric@1"]
    assert row["fetch_split"]["unpack"] == {"p50": 0.2, "p90": 0.2}
    assert "D's fetch split" in format_table("r", {"asymmetric@1": row})
    assert "answer_split" not in row  # no export_s: a result from before it was timed
    result["modes"]["asymmetric"]["runs"][0]["requests"]["asympd_timings"][0]["export_s"] = 0.03
    row = breakdown(result)["asymmetric@1"]  # P's answer (0.6 - 0.5 - 0.05) = export 0.03 + the rest
    assert row["answer_split"]["export"]["p50"] == 0.03
    assert row["answer_split"]["rest"]["p50"] == pytest.approx(0.02)
    assert "P's answer split, ms (p50): export, rest" in format_table("r", {"asymmetric@1": row})
    assert "export copy" not in row["answer_split"]  # not timed (before the tenth session, or a CPU)
    result["modes"]["asymmetric"]["runs"][0]["requests"]["asympd_timings"][0]["export_copy_s"] = 0.004
    row = breakdown(result)["asymmetric@1"]
    assert row["answer_split"]["export copy"] == {"p50": 0.004, "p90": 0.004}
    table = format_table("r", {"asymmetric@1": row})
    assert "export, export copy, rest" in table and "         4.0" in table
    assert "p_split" not in row  # no prefill_queue_s: a result from before the thirtieth session
    result["modes"]["asymmetric"]["runs"][0]["requests"]["asympd_timings"][0]["prefill_queue_s"] = 0.125
    row = breakdown(result)["asymmetric@1"]  # P's 0.5 s: 0.125 waiting for its first step, 0.375 after
    assert row["p_split"] == {"queue": {"p50": 0.125, "p90": 0.125}, "compute": {"p50": 0.375, "p90": 0.375}}
    assert "P's part split, ms (p50): queue, compute" in format_table("r", {"asymmetric@1": row})
    assert "d_split" not in row  # D's queue not in this one
    result["modes"]["asymmetric"]["runs"][0]["requests"]["asympd_timings"][0]["decode_queue_s"] = 0.025
    row = breakdown(result)["asymmetric@1"]  # D's 0.1 s: 0.025 waiting, 0.075 its first step(s)
    assert row["d_split"]["queue"]["p50"] == 0.025 and row["d_split"]["compute"]["p50"] == pytest.approx(0.075)
    assert "D's part split, ms (p50): queue, compute" in format_table("r", {"asymmetric@1": row})
    assert (
        "fetch_split"
        not in breakdown(json.loads((RESULTS / "e2e_h200x1_depth40_oos3.json").read_text()))["asymmetric@1.5"]
    )
