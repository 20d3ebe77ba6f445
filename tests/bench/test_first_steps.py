"""bench/first_steps.py on CPU: the P worker's engine, groups of prompts stepped one group at a time."""

import json

import pytest

from bench import first_steps


def test_groups_parse_and_bad_ones_are_refused():
    assert first_steps.parse_groups("896;1107+2269; 5") == [[896], [1107, 2269], [5]]
    with pytest.raises(ValueError, match="as integers"):
        first_steps.parse_groups("896;x")
    with pytest.raises(ValueError, match="positive row counts"):
        first_steps.parse_groups("896;0")


def test_each_step_of_each_group_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYMPD_OUT", str(tmp_path))
    assert first_steps.main(["--tiny", "--groups", "5;7+9;3", "--out", "fs"]) == 0
    res = json.loads((tmp_path / "fs.json").read_text())
    assert res["window"] == 16 and res["step_tokens"] == 2048 and res["warm_up"] is None  # no warm-up on CPU
    assert res["cuda_graph_mode"] == "full_and_piecewise"  # a prefill worker's default (no graphs on CPU)
    # a group's prompts run in one step (P's budget holds them), rows = prompt length - W each
    assert [[s["rows"] for s in g["steps"]] for g in res["groups"]] == [[5], [16], [3]]
    assert [g["prompt_rows"] for g in res["groups"]] == [[5], [7, 9], [3]]
    assert all(s["compiles"] == [] and s["new_segments"] == 0 for g in res["groups"] for s in g["steps"])
    assert all(s["graphs_captured"] == 0 for g in res["groups"] for s in g["steps"])  # CPU: no graphs
    assert all(s["pinned_allocs"] == 0 for g in res["groups"] for s in g["steps"])  # CPU: nothing pinned
    assert all(s["clocks"] is None and 0 < s["host_ms"] <= s["ms"] for g in res["groups"] for s in g["steps"])
    assert all(set(s["gc"]) == {"ms", "gen2", "all"} for g in res["groups"] for s in g["steps"])
    assert res["gc"] == "freeze" and res["gc_frozen_objects"] > 0  # as the server starts


def test_the_anatomy_times_checks_and_profiles_a_groups_first_step(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYMPD_OUT", str(tmp_path))
    args = ["--tiny", "--groups", "5", "--anatomy", "7;5+9", "--cuda-graph-mode", "full", "--out", "fs"]
    assert first_steps.main(args) == 0
    res = json.loads((tmp_path / "fs.json").read_text())
    assert res["cuda_graph_mode"] == "full" and res["pieces"] is None  # asked: eager prompt steps
    a = res["anatomy"]
    assert [x["prompt_rows"] for x in a] == [[7], [5, 9]] and [x["rows"] for x in a] == [7, 14]
    for x in a:
        assert 0 < x["host_ms"] <= x["gpu_end_ms"] and x["syncs"] == 0 and x["sync_sites"] == {}  # CPU: none
        prof = x["profile"]
        assert prof["kernels"] == 0 and prof["host_ops"] > 100  # the layers' ops, no CUDA kernels on CPU
        assert prof["top_host_ops"][0]["self_ms"] >= prof["top_host_ops"][-1]["self_ms"]


def test_sync_sites_count_only_the_synchronizing_warnings():
    import warnings

    import torch

    with pytest.warns(UserWarning, match="unrelated"):
        with first_steps.SyncSites(torch.device("cpu")) as sites:
            for _ in range(3):
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
            warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert sum(sites.sites.values()) == 3 and len(sites.sites) == 1


def test_the_clock_sampler_reads_nvidia_smi_and_sums_a_step(tmp_path, monkeypatch):
    """``ClockSampler`` against a stand-in ``nvidia-smi`` that prints what the real one does with
    ``--format=csv,noheader,nounits`` (a clock that drops, then an unavailable reading)."""
    import time

    assert first_steps.parse_smi_line("1980, 412.33, 51\n") == (1980.0, 412.33, 51.0)
    assert first_steps.parse_smi_line("[N/A], 412.33, 51") is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\n'
        "for l in '1980, 300.5, 50' '1755, 690.0, 58' '[N/A], 1.0, 1' '1980, 310.0, 52'; do echo \"$l\"; done\n"
        "sleep 5\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    t0 = time.time()
    clocks = first_steps.ClockSampler(device_index=0, period_ms=20)
    try:
        for _ in range(100):
            if len(clocks.samples) == 3:
                break
            time.sleep(0.05)
        got = clocks.during(t0, time.time())
    finally:
        clocks.close()
    assert got == {"samples": 3, "sm_mhz_min": 1755.0, "sm_mhz_mean": 1905.0, "watts_max": 690.0, "temp_c_max": 58.0}
    args = (tmp_path / "args").read_text().split()
    assert "--loop-ms=20" in args and "--id=0" in args and "--format=csv,noheader,nounits" in args
    assert clocks.during(0.0, 1.0) is None  # no sample in that window
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert first_steps.ClockSampler().proc is None  # no nvidia-smi: nothing sampled, no error
