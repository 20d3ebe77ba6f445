"""``bench/e2e.py --tiny``: real P, D, colocated and router processes driven by ``asympd bench serve``;
the JSON carries every field a study reads, the counters agree exactly with the traffic, and
``asympd plan --validate`` reads it. Also the checkpoint writer the GPU run uses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asympd.config import tiny
from asympd.engine.modes import split_point
from asympd.plan.validate import ValidationError, validate_e2e

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.e2e import write_on_device  # noqa: E402
from bench.p_throughput import reduced_config  # noqa: E402

MODES = ("asymmetric", "colocated")
PROMPTS = 4
LATENCY = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p90", "p99")]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("e2e")
    cmd = [sys.executable, "bench/e2e.py", "--tiny", "--modes", ",".join(MODES), "--rates", "20"]
    cmd += ["--num-prompts", str(PROMPTS), "--calib-batch", "2", "--calib-tokens", "4"]
    env = {**os.environ, "ASYMPD_OUT": str(out), "OMP_NUM_THREADS": "1", "ASYMPD_COMMIT": "test-commit"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((out / "e2e_tiny.json").read_text())


def test_result_fields_and_counts(result):
    assert result["benchmark"] == "e2e_tiny" and result["commit"] == "test-commit"
    assert result["command"].split()[1:3] == ["bench/e2e.py", "--tiny"]
    assert result["source_digest"] and "torch" in result["device"]
    assert result["model"]["depth"] == 7 and result["model"]["checkpoint"] == "tiny"
    assert set(result["modes"]) == set(MODES)
    window = tiny().window_size
    for mode, m in result["modes"].items():
        assert "error" not in m, m.get("error")
        assert m["calibration"]["lone"] and m["calibration"]["batch"]["size"] == 2
        assert {w["role"] for w in m["workers"].values()} == ({"colocated"} if mode == "colocated" else
                                                               {"prefill", "decode"})  # fmt: skip
        assert all(w["memory"]["weights_bytes"] > 0 for w in m["workers"].values())
        (run,) = m["runs"]
        assert run["request_rate"] == 20 and run["completed"] == PROMPTS and run["failed"] == 0
        assert all(isinstance(run[k], float) for k in LATENCY)
        req = run["requests"]
        lens = req["input_lens"]
        assert run["total_input_tokens"] == sum(lens) and run["total_output_tokens"] == sum(req["output_lens"])
        for ttft, e2el, itls, n_out in zip(req["ttfts"], req["e2els"], req["itls"], req["output_lens"], strict=True):
            assert 0 < ttft <= e2el and len(itls) == n_out - 1  # one chunk per token (return_token_ids)
        assert run["request_goodput"] is not None and run["request_goodput"] <= run["request_throughput"]
        assert math.isclose(run["request_goodput_per_gpu"], run["request_goodput"])
        side = "colocated" if mode == "colocated" else "prefill"  # busy time from the step histogram
        assert 0 < run[f"{side}_busy_s"] and 0 < run[f"{side}_busy_fraction"] <= 1
        assert run["prompt_tokens_per_p_busy_s"] == pytest.approx(sum(lens) / run[f"{side}_busy_s"])
        split = [split_point(tiny(), n, "carry") for n in lens]
        if mode == "asymmetric":  # P computes [0, N - W), D the rest; one prefix moved per request
            assert run["p_prompt_rows_computed"] == sum(split)
            assert run["d_prompt_rows_computed"] == sum(n - s for n, s in zip(lens, split, strict=True))
            assert run["transfers"] == sum(n > window for n in lens) and run["transfer_bytes_per_request"] > 0
        else:
            assert run["p_prompt_rows_computed"] == sum(lens) and run["transfers"] == 0
    assert {(r["mode"], r["rate"]) for r in result["headline"]} == {(m, 20) for m in MODES}


def test_validate_reads_the_result(result, tmp_path):
    v = validate_e2e(result)
    assert {(r["mode"], r["rate"]) for r in v["rows"]} == {(m, 20) for m in MODES}
    for r in v["rows"]:
        assert r["requests"] == PROMPTS
        for k in ("ttft_p50_ms", "itl_p50_ms", "goodput_req_s"):
            assert r["predicted"][k] > 0 and r["measured"][k] > 0
            assert r["ratio"][k] == pytest.approx(r["predicted"][k] / r["measured"][k])
        assert r["within_target"] == all(abs(q - 1) <= 0.15 for q in r["ratio"].values())
    steps = v["modes"]["asymmetric"]["steps_ms"]
    assert steps["d_step_ms"] > 0 and steps["p_step_ms"] + steps["p_row_ms"] > 0
    assert v["modes"]["colocated"]["steps_ms"]["move_ms"] == 0
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    out = tmp_path / "v.json"
    cmd = [sys.executable, "-m", "asympd.cli", "plan", "--validate", str(path), "--validate-out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr
    assert "planner vs measured" in p.stdout and "asymmetric" in p.stdout
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(v["rows"]))
    with pytest.raises(ValidationError, match="not a bench/e2e.py result"):
        validate_e2e({"modes": {}})
    broken = {**result, "modes": {"asymmetric": {**result["modes"]["asymmetric"], "workers": None}}}
    with pytest.raises(ValidationError, match="mode 'asymmetric' of the result is malformed"):
        validate_e2e(broken)


def test_write_on_device_is_the_released_layout(tmp_path):
    """The GPU run's writer, on the CPU at tiny width: the loader reads every role from it."""
    from asympd.model.checkpoint import load_config
    from asympd.model.loader import load_model

    cfg = reduced_config(tiny().replace(max_seq_len=4096))
    path = write_on_device(cfg, tmp_path / "ckpt", torch.device("cpu"))
    assert load_config(path) == cfg
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in path.glob("*.safetensors")}
    for role in ("prefill", "full"):
        model = load_model(str(path), role, "cpu", torch.float32)
        assert model.resident_bytes() > 0
