"""``asympd serve``'s flags come from ServeConfig / EngineConfig / SchedulerConfig: each setting and
its default written once, the flags parse into the dataclasses the server runs."""

from __future__ import annotations

import dataclasses

import pytest

from asympd.cli import UsageError, build_parser
from asympd.engine.engine import EngineConfig
from asympd.engine.scheduler import SchedulerConfig
from asympd.serve.config import ServeConfig, serve_config_from_args


def _parse(*argv: str) -> ServeConfig:
    return serve_config_from_args(build_parser().parse_args(["serve", "--checkpoint", "CKPT", *argv]))


def test_defaults_are_the_dataclasses_own():
    cfg = _parse()
    assert cfg.engine.role == "colocated" and cfg.engine.mode == "colocated"
    want = ServeConfig("CKPT", engine=EngineConfig(num_spec_tokens=0))
    assert cfg == want
    assert cfg.engine.kv_cache_bytes == EngineConfig().kv_cache_bytes
    assert cfg.engine.scheduler == SchedulerConfig()


def test_every_setting_has_a_flag():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    dests = {a.dest for a in sub._actions}
    for cls, skip in (
        (ServeConfig, {"engine"}),
        (EngineConfig, {"scheduler", "eos_token_id", "stream_prefix"}),  # streaming: offline LLM and TCP only
        # EngineConfig.num_spec_tokens is the flag; --admission-policy sets mixed_steps
        (SchedulerConfig, {"num_spec_tokens", "mixed_steps"}),
    ):
        missing = {f.name for f in dataclasses.fields(cls)} - skip - dests
        assert not missing, (cls.__name__, missing)


def test_flags_land_in_the_nested_configs(tmp_path):
    key = tmp_path / "k"
    key.write_text("sk-test\n")
    cfg = _parse(
        "--role",
        "prefill",
        "--kv-cache-bytes",
        "12345",
        "--max-num-seqs",
        "3",
        "--max-num-batched-tokens",
        "96",
        "--no-enable-prefix-caching",
        "--boundary-policy",
        "align",
        "--max-body-bytes",
        "2048",
        "--num-spec-tokens",
        "2",
        "--api-key-file",
        str(key),
    ).resolve()
    e = cfg.engine
    assert (e.role, e.mode, e.boundary_policy) == ("prefill", "asymmetric", "align")  # mode follows the role
    assert (e.kv_cache_bytes, e.enable_prefix_caching, e.num_spec_tokens) == (12345, False, 0)  # P never drafts
    assert (e.scheduler.max_num_seqs, e.scheduler.max_num_batched_tokens) == (3, 96)
    assert (cfg.max_body_bytes, cfg.api_key_file, cfg.role, cfg.mode) == (2048, str(key), "prefill", "asymmetric")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--role", "prefill", "--mode", "colocated"], "cannot run mode"),
        (["--tp", "2"], "tensor parallel"),
        (["--max-body-bytes", "10"], "max-body-bytes"),
        (["--max-num-seqs", "0"], "must be positive"),
        (["--role", "prefill", "--cp", "0"], "--cp must be >= 1, got 0"),
        (["--cp", "2"], "--cp 2 splits a prefill worker's prefix over ranks: it needs --role prefill, not colocated"),
        (["--role", "decode", "--cp", "2"], "it needs --role prefill, not decode"),
        (["--role", "prefill", "--mode", "symmetric", "--cp", "2"], "mode symmetric has no such prefill worker"),
        (["--role", "prefill", "--cp", "2", "--ep", "2"], "--cp 2 with --ep 2: a worker runs one kind"),
        (["--device", "tpu"], "--device 'tpu' is not a device torch knows"),
        (["--max-images", "-1"], "--max-images must be >= 0"),
        (["--num-blocks", "-1"], "--num-blocks must be >= 0"),
        (["--port", "65536"], "--port 65536 is out of range: ports are 0-65535"),
        (["--api-key-file", "/no/such/key"], "cannot read the API key from /no/such/key"),
    ],
)
def test_bad_settings_are_refused(argv, needle):
    with pytest.raises(ValueError, match=needle):
        _parse(*argv).resolve()


def test_a_cuda_device_where_there_is_none_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda: this torch \(.*\) sees no CUDA device"):
        _parse("--device", "cuda").resolve()


def test_unknown_choice_is_a_usage_error():
    with pytest.raises(UsageError, match="invalid choice"):
        build_parser().parse_args(["serve", "--checkpoint", "C", "--role", "both"])


def test_admission_default_is_the_recommended_policy():
    """Each role runs its study's policy unless told otherwise: alone-4 on D (the true-depth e2e
    study, docs/performance.md §10: e2e_h200x1_depth40_part1.json against _asym_cap4.json, one
    commit), cap-4 colocated (§6, admission_policy.json); P is never capped; explicit flags and
    another policy override it."""
    import json
    from pathlib import Path

    from asympd.serve.admission import POLICIES, AdmissionPolicy, default_policy

    results = Path(__file__).resolve().parents[2] / "bench/results"
    study = json.loads((results / "admission_policy.json").read_text())
    assert study["scenarios"]["poisson"]["cap-4"]["policy"] == {"max_new_admissions": 4, "admission_token_budget": 512}
    alone, mixed = (
        json.loads((results / f"e2e_h200x1_depth40_{name}.json").read_text()) for name in ("part1", "asym_cap4")
    )
    assert (alone["d_policy"]["name"], mixed["d_policy"]["name"]) == ("alone-4", "cap-4")
    assert alone["commit"] == mixed["commit"]
    for a, m in zip(alone["headline"], mixed["headline"], strict=True):  # same rates, lower p99 ITL alone
        assert a["rate"] == m["rate"] and a["itl_p99_ms"] < m["itl_p99_ms"]
    assert (default_policy("decode"), default_policy("colocated")) == ("alone-4", "cap-4")
    assert POLICIES["alone-4"] == AdmissionPolicy(4, 512, mixed_steps=False)
    assert POLICIES["cap-4"] == AdmissionPolicy(4, 512, mixed_steps=True)
    s = _parse("--role", "decode").resolve().engine.scheduler
    assert (s.max_new_admissions, s.admission_token_budget, s.mixed_steps) == (4, 512, False)
    s = _parse("--role", "colocated").resolve().engine.scheduler
    assert (s.max_new_admissions, s.admission_token_budget, s.mixed_steps) == (4, 512, True)
    s = _parse("--role", "prefill").resolve().engine.scheduler
    assert (s.max_new_admissions, s.admission_token_budget) == (None, None)
    s = _parse("--role", "decode", "--admission-policy", "admit-all").resolve().engine.scheduler
    assert (s.max_new_admissions, s.admission_token_budget, s.mixed_steps) == (None, None, True)
    s = _parse("--role", "decode", "--max-new-admissions", "2").resolve().engine.scheduler
    assert (s.max_new_admissions, s.admission_token_budget, s.mixed_steps) == (2, 512, False)
    s = _parse("--role", "decode", "--admission-policy", "cap-4").resolve().engine.scheduler
    assert (s.max_new_admissions, s.admission_token_budget, s.mixed_steps) == (4, 512, True)
    with pytest.raises(UsageError, match="invalid choice"):
        build_parser().parse_args(["serve", "--checkpoint", "C", "--admission-policy", "cap-3"])
    with pytest.raises(ValueError, match="unknown admission policy 'cap-3'"):
        ServeConfig("C", admission_policy="cap-3").resolve()
