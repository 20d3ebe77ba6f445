"""`asympd compare` through its public entry points."""

from __future__ import annotations

import json

from asympd.bench.compare import compare
from asympd.cli import main


def test_compare_report_is_consistent(tiny_ckpt):
    r = compare(tiny_ckpt, prompts_per_length=1, max_tokens=4, lengths_override=[8, 16, 40, 100])
    modes = r["modes"]
    assert modes["colocated/full"]["first_token_agreement"] == 1.0
    assert modes["colocated/full"]["mean_first_token_kl"] == 0.0
    # asymmetric P/D computes exactly the split semantics
    for key in ("first_token_agreement", "mean_first_token_kl", "mean_agreeing_prefix", "kl_by_length"):
        assert modes["asymmetric/carry"][key] == modes["colocated/split"][key]
    # both strongest symmetric baselines compute exactly the split semantics too; shipping the windows
    # costs bytes (the serialized prefix state, per prompt length): more than the global KV alone
    for name in ("symmetric-split", "symmetric-windows"):
        for key in ("first_token_agreement", "mean_first_token_kl", "mean_agreeing_prefix", "kl_by_length"):
            assert modes[name][key] == modes["colocated/split"][key], (name, key)
    split_b, win_b = (
        modes["symmetric-split"]["transfer_bytes_by_length"],
        modes["symmetric-windows"]["transfer_bytes_by_length"],
    )
    assert all(win_b[n] > split_b[n] > 0 for n in (8, 16, 40, 100))
    assert modes["asymmetric/carry"]["transfer_bytes_by_length"][8] == 0  # N <= W: P skipped
    assert modes["colocated/full"]["transfer_bytes_by_length"] == {8: 0, 16: 0, 40: 0, 100: 0}
    # symmetric's first token is P's decoder-replay token
    assert modes["symmetric"]["kl_by_length"] == modes["colocated/decoder-replay"]["kl_by_length"]
    for name, m in modes.items():  # within one window every mode is the full computation
        assert abs(m["kl_by_length"][8]) < 1e-9 and abs(m["kl_by_length"][16]) < 1e-9, name


def test_compare_cli_json(tiny_ckpt, capsys, monkeypatch):
    import asympd.bench.compare as mod

    real = mod.compare
    monkeypatch.setattr(mod, "compare", lambda ck, **kw: real(ck, **kw, lengths_override=[8, 30]))
    assert main(["compare", "--checkpoint", tiny_ckpt, "--json", "--prompts-per-length", "1", "--max-tokens", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["modes"]) >= {"colocated/full", "asymmetric/carry", "encoder-only"}
