"""Memory report from the schema: released sizes (docs/model.md §4) and what fits where."""

import math

import pytest

from asympd.config import tiny, v41_flash
from asympd.model.schema import checkpoint_schema, role_schema
from asympd.plan.memory import (
    GPUS_GB,
    SWA_BYTES_PER_LAYER_TOKEN,
    compressed_kv_bytes_per_token,
    format_memory_report,
    memory_report,
    swa_layers,
)

GB = 1e9


@pytest.fixture(scope="module")
def report():
    return memory_report(v41_flash())


def test_released_role_sizes(report):
    full = report["roles"]["full"]["weights_bytes"]
    prefill = report["roles"]["prefill"]["weights_bytes"]
    assert full == pytest.approx(306.56 * GB, rel=0.005)
    assert prefill == pytest.approx(149.48 * GB, rel=0.005)
    assert 1 - prefill / full == pytest.approx(0.512, abs=0.002)  # "51.2% less"
    assert report["roles"]["decode"]["weights_bytes"] == full
    # the Engram tables are counted apart, not resident by default, and both roles need both
    assert report["engram_table_bytes"] == pytest.approx(202.8 * GB, rel=0.005)
    assert report["roles"]["prefill"]["engram_table_bytes"] == report["engram_table_bytes"]
    assert report["roles"]["full"]["resident_bytes"] == full


def test_released_part_sizes(report):
    parts = report["parts"]
    assert parts["embedding"] == pytest.approx(1.324 * GB, rel=0.005)
    assert parts["head"] == pytest.approx(1.324 * GB, rel=0.005)
    assert parts["encoder_layers"] == pytest.approx(148.15 * GB, rel=0.005)
    assert parts["decoder_layers"] == pytest.approx(147.82 * GB, rel=0.005)
    assert parts["kv_path"] == pytest.approx(5.4e6, rel=0.01)
    assert parts["draft_blocks"] == pytest.approx(7.93 * GB, rel=0.005)
    assert "vision" not in report["roles"]["full"]["parts"]
    assert report["roles"]["prefill"]["parts"].keys() == {"embedding", "encoder_layers", "kv_path"}


def test_matches_schema_sums():
    cfg = tiny()
    rep = memory_report(cfg, engram_on_gpu=True)
    for role in ("full", "prefill"):
        assert rep["roles"][role]["resident_bytes"] == sum(s.nbytes for s in role_schema(cfg, role))
    assert sum(rep["parts"].values()) + rep["engram_table_bytes"] + rep["vision_excluded_bytes"] == sum(
        s.nbytes for s in checkpoint_schema(cfg)
    )


def test_kv_bytes_per_token_is_890():
    assert compressed_kv_bytes_per_token(v41_flash()) == 890  # 2.5 entries x (288 + 68) B


def test_fits(report):
    g = report["gpus"]
    assert g["B300"]["roles"]["prefill"]["fits"] and not g["B300"]["roles"]["full"]["fits"]
    assert not g["B300"]["roles"]["decode"]["fits"]
    assert g["B200"]["roles"]["prefill"]["fits"]
    assert not g["H200"]["roles"]["prefill"]["fits"]
    assert g["H200"]["roles"]["prefill"]["kv_tokens"] == 0


def test_kv_room_arithmetic(report):
    r = report["gpus"]["B300"]["roles"]["prefill"]
    room = int(288 * GB) - int(10 * GB) - report["roles"]["prefill"]["resident_bytes"]
    assert r["kv_free_bytes"] == room
    assert r["kv_tokens"] == math.floor(room / 890)
    swa = swa_layers(v41_flash(), "prefill") * 128 * SWA_BYTES_PER_LAYER_TOKEN
    assert report["roles"]["prefill"]["swa_bytes_per_request"] == swa == 20 * 128 * 584
    assert r["requests_at_context"] == math.floor(room / (32768 * 890 + swa))
    assert report["roles"]["full"]["swa_bytes_per_request"] == 43 * 128 * 584  # 40 layers + 3 draft blocks


def test_reserve_and_engram_on_gpu_are_parameters():
    more = memory_report(v41_flash(), reserve_gb=50)
    assert more["gpus"]["B300"]["roles"]["prefill"]["kv_free_bytes"] == pytest.approx(
        memory_report(v41_flash())["gpus"]["B300"]["roles"]["prefill"]["kv_free_bytes"] - 40 * GB
    )
    on_gpu = memory_report(v41_flash(), engram_on_gpu=True)
    assert on_gpu["roles"]["prefill"]["resident_bytes"] == pytest.approx(352.3 * GB, rel=0.005)
    assert not on_gpu["gpus"]["B300"]["roles"]["prefill"]["fits"]
    assert set(memory_report(v41_flash(), gpus_gb={"X": 1000})["gpus"]) == {"X"}
    assert set(GPUS_GB) == {"H200", "B200", "B300"}


def test_format(report):
    text = format_memory_report(report)
    assert "306.56" in text and "149.48" in text and "B300" in text and "890 B/token" in text
    b300_prefill = next(line for line in text.splitlines() if line.split()[:2] == ["B300", "prefill"])
    assert "yes" in b300_prefill
