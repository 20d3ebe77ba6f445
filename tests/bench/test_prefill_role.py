"""bench/prefill_role.py (the whole prefill role over two GPUs, issue 11 item 5) runs end to end on CPU
(``--smoke``: the tiny config, 2 gloo ranks, each drawing its own share of the weights), records what
the device run will, and its two ranks export the PrefixState bytes of one rank over the same weights."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asympd.config import tiny
from asympd.model.schema import Part, role_schema
from asympd.parallel.ep import ep_resident_gb, expert_range

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [40, 100, 200]  # the smoke prompts; the tiny window is 16 and the smoke's P chunk 64 rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("prefill-role")
    env = {**os.environ, "ASYMPD_OUT": str(out), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for ep in (2, 1):
        cmd = [sys.executable, "bench/prefill_role.py", "--smoke", "--ep", str(ep)]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=300)
    return {
        2: json.loads((out / "prefill_role_smoke.json").read_text()),
        1: json.loads((out / "prefill_role_smoke_ep1.json").read_text()),
    }


def test_each_rank_draws_and_holds_its_share(runs):
    r = runs[2]
    assert (r["ep"], r["backend"], r["mode"], r["engine_role"]) == (2, "gloo", "asymmetric", "prefill")
    cfg = tiny().replace(n_activated_experts=3)
    role = role_schema(cfg, "prefill")
    gpu_bytes = {s.name: s.nbytes for s in role if s.part not in (Part.ENGRAM_TABLE, Part.VISION)}
    experts = {n for n in gpu_bytes if ".ffn.experts." in n}
    assert [ld["rank"] for ld in r["loads"]] == [0, 1]
    for ld in r["loads"]:
        lo, hi = expert_range(cfg.n_routed_experts, ld["rank"], 2)
        assert ld["experts"] == [lo, hi] == [4 * ld["rank"], 4 * ld["rank"] + 4]
        mine = {n for n in experts if lo <= int(n.split(".")[4]) < hi}  # layers.L.ffn.experts.E.*
        # the released-format bytes of the rank's share: asympd memory's prefill role less the other
        # rank's experts (parallel.ep_resident_gb), as the schema counts them
        released = sum(b for n, b in gpu_bytes.items() if n not in experts or n in mine)
        assert ld["released_bytes"] == released
        assert ld["released_bytes"] == round(ep_resident_gb(cfg, "prefill", 2)["other_rank_gb"] * 1e9)
        others = {s.name for s in role if ".ffn.experts." in s.name and not lo <= int(s.name.split(".")[4]) < hi}
        assert ld["tensors_drawn"] == len(role) - len(others)  # Engram tables included (host memory)
        # the loader's build holds exactly the released bytes plus the packed-experts layout's copies
        assert ld["weights"] == "packed-experts"
        assert ld["resident_bytes"] == ld["expected_resident_bytes"]
        assert ld["resident_bytes"] == ld["released_bytes"] + ld["layout_extra_bytes"] + ld["engram_table_bytes"]
    assert r["loads"][0]["replicated_digest"] == r["loads"][1]["replicated_digest"]  # drawn alike on both
    assert runs[1]["loads"][0]["experts"] == [0, cfg.n_routed_experts]


def test_prompts_run_through_the_sharded_prefill_engine(runs):
    r = runs[2]
    w, layers = r["window"], r["n_layers_prefill"]
    assert [p["prompt_tokens"] for p in r["warmup"]] == [40]
    assert [p["prompt_tokens"] for p in r["prompts"]] == LENGTHS and not r["skipped"]
    for p in r["prompts"]:
        n = p["prompt_tokens"]
        assert p["computed_rows"] == p["prefix_state"]["split"] == n - w  # asymmetric P: rows [0, N - W)
        assert p["forwards"] == math.ceil((n - w) / 64)  # chunks of the smoke's 64-row step
        assert p["prompt_tokens_per_s_per_gpu"] == pytest.approx(n / p["wall_s"] / 2)
        frac = p["floor"]["fraction"]["model_bf16"]
        assert frac == pytest.approx(
            p["prompt_tokens_per_s_per_gpu"] / p["floor"]["tokens_per_s_per_gpu"]["model_bf16"]
        )
        assert p["floor"]["flops"]["rows"] == n - w
        for rank in p["ranks"]:  # every rank timed every collective of every MoE layer of every chunk
            assert [f["rows"] for f in rank["forwards"]] == [f["rows"] for f in p["ranks"][0]["forwards"]]
            assert sum(f["rows"] for f in rank["forwards"]) == n - w
            for kind in ("dispatch", "combine", "gather", "layer"):
                assert rank["comm_ms"][kind]["calls"] == layers * p["forwards"]
                assert rank["comm_ms"][kind]["ms"] > 0
            assert 0 < rank["ep_comm_share_of_moe_layer"] < 1


def test_two_ranks_export_the_single_rank_prefix_states(runs):
    """EP on CPU gives the single rank's bits (docs/parallel.md): the same weights drawn by one rank
    or split over two, the same prefix state bytes on the wire."""
    two, one = runs[2]["prompts"], runs[1]["prompts"]
    assert [p["prompt_tokens"] for p in one] == LENGTHS
    assert [p["prefix_state"]["sha256"] for p in two] == [p["prefix_state"]["sha256"] for p in one]
    assert all(p["prefix_state"]["wire_bytes"] > 0 for p in two)
    assert all(rank["comm_ms"] == {} for p in one for rank in p["ranks"])  # one rank: no collectives
