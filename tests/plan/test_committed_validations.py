"""Every committed validation is what this tree's planner writes for its result (each with its own
exclusions): a planner change that should leave older results alone is held to it, and one that
should not comes with the regenerated files (``python tools/regen_validations.py --write``)."""

from __future__ import annotations

import json

import pytest

from tools.regen_validations import RESULTS, regenerate


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*_validation*.json")), ids=lambda p: p.stem)
def test_a_committed_validation_regenerates_byte_identical(path):
    assert regenerate(path) == path.read_text()


def test_every_e2e_result_with_a_validation_is_checked():
    names = {p.name for p in RESULTS.glob("*_validation.json")}
    assert {"e2e_h200x1_depth40_oos_validation.json", "e2e_tiny_validation.json"} <= names and len(names) >= 8
    # the old runs asked what P's hand-off on its own stream gives (docs/planner.md's prediction table)
    what_if = sorted(p.name for p in RESULTS.glob("*_validation_handoff_pack.json"))
    assert len(what_if) == 4 and all(json.loads((RESULTS / n).read_text())["handoff_stream"] == "pack" for n in what_if)
