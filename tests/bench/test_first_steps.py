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
    # a group's prompts run in one step (P's budget holds them), rows = prompt length - W each
    assert [[s["rows"] for s in g["steps"]] for g in res["groups"]] == [[5], [16], [3]]
    assert [g["prompt_rows"] for g in res["groups"]] == [[5], [7, 9], [3]]
    assert all(s["compiles"] == [] and s["new_segments"] == 0 for g in res["groups"] for s in g["steps"])
