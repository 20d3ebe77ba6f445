"""bench/slo_goodput.py reads an e2e result under other SLOs: under the run's own SLO it must give the
goodput the run recorded, row for row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.slo_goodput import main, parse_slo, slo_goodput

RESULTS = Path(__file__).resolve().parents[2] / "bench/results"


@pytest.mark.parametrize("name", ["e2e_tiny.json", "e2e_h200x1_depth40.json"])
def test_the_runs_own_slo_gives_the_recorded_goodput(name):
    result = json.loads((RESULTS / name).read_text())
    slo = (result["slo"]["ttft_ms"], result["slo"]["itl_ms"])
    rows = slo_goodput(result, [slo])
    recorded = [
        (mode, run["request_rate"], run["request_goodput_per_gpu"])
        for mode, m in result["modes"].items()
        for run in m.get("runs", [])
    ]
    assert len(rows) == len(recorded) > 0
    for row, (mode, rate, goodput) in zip(rows, recorded, strict=True):
        assert (row["mode"], row["rate"]) == (mode, rate)
        assert row["goodput_req_per_s_per_gpu"] == pytest.approx(goodput, rel=1e-9)


def test_tighter_slos_never_admit_more_and_bad_input_is_refused(tmp_path, monkeypatch):
    result = json.loads((RESULTS / "e2e_h200x1_depth40.json").read_text())
    loose, tight = slo_goodput(result, [(5000, 600)]), slo_goodput(result, [(2000, 200)])
    assert all(t["met"] <= lo["met"] for t, lo in zip(tight, loose, strict=True))
    assert [r["met"] for r in tight if r["mode"] == "colocated"] == [5, 1, 0]
    with pytest.raises(Exception, match="TTFT_MS:ITL_MS"):
        parse_slo("2000")
    monkeypatch.setenv("ASYMPD_OUT", str(tmp_path))
    assert main([str(RESULTS / "e2e_h200x1_depth40.json"), "--slo", "2000:200"]) == 0
    written = json.loads((tmp_path / "e2e_h200x1_depth40_slo_goodput.json").read_text())
    assert written["source"]["commit"] == "7f0ed1c" and len(written["rows"]) == 15
