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
