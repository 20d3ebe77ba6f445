"""Synthetic checkpoints in the released layout, and role-aware validated loading."""

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from asympd.config import tiny
from asympd.model import checkpoint as ck
from asympd.model.checkpoint import CheckpointError, load_config, load_tensors, write_checkpoint
from asympd.model.quant import dequant_fp4, dequant_fp8_rows, dequant_fp8_tiles
from asympd.model.schema import Part, checkpoint_schema, is_vision_tensor, role_schema

SHARD_BYTES = 400_000  # several shards for the ~3 MB tiny model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_checkpoint(tiny(), out, seed=0, shard_bytes=SHARD_BYTES, verbose=False)
    return out


@pytest.fixture(scope="module")
def full(ckpt):
    return load_tensors(ckpt, tiny(), "full", vision=True)


def _copy(ckpt, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(ckpt, dst)
    return dst


def _rewrite(d, edit):
    """Apply ``edit(tensors) -> tensors`` to every shard and rewrite the index to match."""
    index = json.loads((d / ck.INDEX_FILE).read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = edit(shard, load_file(str(d / shard)))
        save_file(tensors, str(d / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
    index["weight_map"] = weight_map
    (d / ck.INDEX_FILE).write_text(json.dumps(index))


def test_layout_matches_released_convention(ckpt):
    cfg = tiny()
    files = sorted(p.name for p in ckpt.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    n = len(shards)
    assert n > 3
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    release_files = {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert release_files | {"model.safetensors.index.json", "inference"} <= set(files)
    assert (ckpt / "inference" / "config.json").is_file()
    assert not [f for f in files if f.endswith(".partial")]
    index = json.loads((ckpt / ck.INDEX_FILE).read_text())
    specs = checkpoint_schema(cfg)
    assert set(index["weight_map"]) == {s.name for s in specs}
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in specs)
    by_name = {s.name: s for s in specs}
    for shard in shards:
        with safe_open(str(ckpt / shard), framework="pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == shard}
            for k in keys:
                sl = f.get_slice(k)
                assert tuple(sl.get_shape()) == by_name[k].shape
                assert ck.ST_DTYPES[sl.get_dtype()] == ck.torch_dtype(by_name[k].dtype)
        # a weight and its scale never straddle two shards
        for k in keys:
            if k.endswith(".scale") and k.removesuffix(".scale") + ".weight" in index["weight_map"]:
                assert index["weight_map"][k.removesuffix(".scale") + ".weight"] == shard
    assert load_config(ckpt) == cfg


def test_load_roles(ckpt, full):
    cfg = tiny()
    tensors, report = full
    assert len(report.tensors_read) == len(set(report.tensors_read))
    assert set(report.tensors_read) == {s.name for s in role_schema(cfg, "full", vision=True)}
    # everything but the draft blocks' VL gate biases (a draft block never routes an image row)
    every = [s for s in checkpoint_schema(cfg) if not (s.name.startswith("mtp.") and s.name.endswith("bias_vl"))]
    assert set(tensors) == {s.name for s in every}
    assert report.bytes_read == sum(s.nbytes for s in every)
    for spec in every:
        assert tensors[spec.name].shape == spec.shape and tensors[spec.name].dtype == ck.torch_dtype(spec.dtype)
    _, dec = load_tensors(ckpt, cfg, "decode", vision=True)
    assert set(dec.tensors_read) == set(report.tensors_read)


def test_prefill_reads_no_decoder_tensor(ckpt, full):
    cfg = tiny()
    tensors, report = load_tensors(ckpt, cfg, "prefill")
    part = {s.name: s.part for s in checkpoint_schema(cfg)}
    assert set(report.tensors_read) == set(tensors) == {s.name for s in role_schema(cfg, "prefill", vision=True)}
    assert not [n for n in report.tensors_read if part[n] in (Part.DECODER, Part.HEAD, Part.DRAFT)]
    assert not [n for n in report.tensors_read if n.startswith(("mtp.", "head.", "norm.", "layers.4.", "layers.6."))]
    # layer K = 3 contributes only its KV path
    k_names = {n for n in report.tensors_read if n.startswith("layers.3.")}
    assert k_names == {
        "layers.3.attn_norm.weight",
        "layers.3.attn.compressor.wkv.weight",
        "layers.3.attn.compressor.norm.weight",
        "layers.3.attn.indexer.wk.weight",
        "layers.3.attn.indexer.k_norm.weight",
    }
    assert report.bytes_read == sum(s.nbytes for s in role_schema(cfg, "prefill", vision=True)) < full[1].bytes_read
    assert len(report.files_opened) < len(full[1].files_opened)


def test_prefill_loads_without_decoder_tensors(ckpt, tmp_path):
    cfg = tiny()
    d = _copy(ckpt, tmp_path)
    prefill_names = {s.name for s in role_schema(cfg, "prefill", vision=True)}
    _rewrite(d, lambda shard, t: {k: v for k, v in t.items() if k in prefill_names})
    tensors, report = load_tensors(d, cfg, "prefill")
    assert set(tensors) == prefill_names
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.\d+\..*' needed by role 'decode' is missing"):
        load_tensors(d, cfg, "decode")


def test_misshapen_tensor_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = "layers.2.attn.q_norm.weight"
    _rewrite(d, lambda shard, t: {k: (v[:-1].clone() if k == name else v) for k, v in t.items()})
    msg = r"'layers\.2\.attn\.q_norm\.weight': expected shape \[64\], found \[63\]"
    with pytest.raises(CheckpointError, match=msg):
        load_tensors(d, tiny(), "prefill")


def test_wrong_dtype_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    name = "layers.1.ffn_norm.weight"
    _rewrite(d, lambda shard, t: {k: (v.float() if k == name else v) for k, v in t.items()})
    msg = r"'layers\.1\.ffn_norm\.weight': expected dtype torch\.bfloat16, found torch\.float32"
    with pytest.raises(CheckpointError, match=msg):
        load_tensors(d, tiny(), "full")


def test_unexpected_tensor_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    first = []

    def add(shard, t):
        if not first:
            first.append(shard)
            t["layers.0.attn.bogus.weight"] = torch.zeros(3)
        return t

    _rewrite(d, add)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.0\.attn\.bogus\.weight'"):
        load_tensors(d, tiny(), "prefill")


def test_unexpected_tensor_missing_from_index(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    index = json.loads((d / ck.INDEX_FILE).read_text())
    shard = index["weight_map"]["embed.weight"]
    t = load_file(str(d / shard))
    t["layers.0.attn.hidden.weight"] = torch.zeros(2)  # in the file, not in the index
    save_file(t, str(d / shard))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.0\.attn\.hidden\.weight'"):
        load_tensors(d, tiny(), "prefill")


def test_vision_tensors_read_only_with_vision(ckpt, full):
    """The tiny config has a tower: the default reads it; vision=False reads the text model only."""
    names = {s.name for s in checkpoint_schema(tiny()) if is_vision_tensor(s.name)}
    assert "vision.blocks.1.mlp.w2.weight" in names and "image_newline" in names
    assert "layers.0.ffn.gate.bias_vl" in full[0] and "mtp.0.ffn.gate.bias_vl" not in full[0]
    tensors, report = load_tensors(ckpt, tiny(), "full", vision=False)
    assert not names & set(tensors) and not names & set(report.tensors_read)
    prefill, _ = load_tensors(ckpt, tiny(), "prefill")
    k = tiny().last_kv_source  # P runs no FFN in layer K: no VL bias there
    assert {n for n in prefill if n.endswith("bias_vl")} == {f"layers.{i}.ffn.gate.bias_vl" for i in range(k)}


def test_single_file_checkpoint(ckpt, tmp_path, full):
    d = tmp_path / "single"
    d.mkdir()
    shutil.copy(ckpt / "config.json", d)
    save_file(full[0], str(d / ck.SINGLE_FILE))
    tensors, report = load_tensors(d, tiny(), "prefill")
    assert report.files_opened == [ck.SINGLE_FILE]
    assert set(tensors) == {s.name for s in role_schema(tiny(), "prefill", vision=True)}
    (d / ck.SINGLE_FILE).unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_tensors(d, tiny(), "prefill")


def test_missing_shard_and_config(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path)
    (d / "config.json").unlink()
    (d / "inference" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_config(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid config.json"):
        load_config(d)
    (d / "config.json").write_text(json.dumps({"dim": 128, "no_such_field": 1}))
    with pytest.raises(CheckpointError, match="no_such_field"):
        load_config(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_config(tmp_path / "nowhere")
    index = json.loads((d / ck.INDEX_FILE).read_text())
    (d / index["weight_map"]["embed.weight"]).unlink()
    with pytest.raises(CheckpointError, match="shard 'model-.*' listed in .* is missing"):
        load_tensors(d, tiny(), "prefill")


def test_deterministic_and_independent_of_sharding(ckpt, tmp_path, full):
    other = write_checkpoint(tiny(), tmp_path / "one", seed=0, shard_bytes=10**9, verbose=False)
    assert len(list(other.glob("model-*.safetensors"))) == 1
    tensors, _ = load_tensors(other, tiny(), "full")
    for name, t in full[0].items():
        assert torch.equal(t.view(torch.uint8), tensors[name].view(torch.uint8)), name
    assert (other / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    reseeded = write_checkpoint(tiny(), tmp_path / "seed1", seed=1, shard_bytes=10**9, verbose=False)
    t1, _ = load_tensors(reseeded, tiny(), "prefill")
    assert not torch.equal(t1["embed.weight"], full[0]["embed.weight"])


def test_refuses_without_disk_space(tmp_path, monkeypatch):
    class Usage:
        total, used, free = 10**9, 10**9 - 1000, 1000

    monkeypatch.setattr(ck.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(CheckpointError, match="not enough disk space"):
        write_checkpoint(tiny(), tmp_path / "out", seed=0, verbose=False)
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite(ckpt):
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        write_checkpoint(tiny(), ckpt, seed=0, verbose=False)


def test_progress_on_stderr(tmp_path, capsys):
    write_checkpoint(tiny(), tmp_path / "p", seed=0, shard_bytes=10**9)
    err = capsys.readouterr().err
    assert "[1/1] model-00001-of-00001.safetensors" in err


# ---- the random weights give a usable model -------------------------------------------------------


def _rms(t):
    return t.float().pow(2).mean().sqrt().item()


def test_weights_non_degenerate(full):
    cfg = tiny()
    t = full[0]
    assert abs(_rms(t["embed.weight"]) - 0.1) < 0.01
    for name, v in t.items():
        if name.endswith("norm.weight"):
            assert bool((v > 0).all()), name
        assert bool(torch.isfinite(v.float()).all()), name
    # fan-in scaled projections: FP8 tiles and FP4 experts both dequantize to gain * fan_in^-0.5
    wq_a = dequant_fp8_tiles(t["layers.2.attn.wq_a.weight"], t["layers.2.attn.wq_a.scale"])
    assert abs(_rms(wq_a) * math.sqrt(cfg.dim) - ck.GAIN["wq_a"]) < 0.1
    w1 = torch.cat(
        [
            dequant_fp4(t[f"layers.2.ffn.experts.{e}.w1.weight"], t[f"layers.2.ffn.experts.{e}.w1.scale"])
            for e in range(cfg.n_routed_experts)
        ]
    )
    assert abs(_rms(w1) * math.sqrt(cfg.dim) / ck.GAIN["w1"] - 1) < 0.35
    # Engram table rows have unit-ish RMS and differ
    table = dequant_fp8_rows(t["layers.0.engram.embed.weight"], t["layers.0.engram.embed.scale"])
    assert 0.8 < _rms(table) < 1.2 and table.unique(dim=0).shape[0] == table.shape[0]


def test_gate_routes_tokens_to_different_experts(full):
    cfg = tiny()
    t = full[0]
    x = t["embed.weight"].float()  # every token's embedding, normalised as the FFN input is
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * t["layers.0.ffn_norm.weight"].float()
    for layer in range(cfg.n_layers):
        g = f"layers.{layer}.ffn.gate."
        scores = torch.nn.functional.softplus(x @ t[g + "weight"].float().T).sqrt()
        picks = (scores + t[g + "bias"]).topk(cfg.n_activated_experts, -1).indices
        counts = torch.bincount(picks.flatten(), minlength=cfg.n_routed_experts)
        assert bool((counts > 0).all()), layer  # every expert used by some token
        assert counts.max().item() < 0.5 * x.shape[0]  # none picked by most tokens
        assert len({tuple(sorted(p)) for p in picks.tolist()}) > 10  # many distinct expert sets


def test_sinkhorn_mixes_non_trivial(full):
    cfg = tiny()
    t = full[0]
    hc = cfg.hc_mult
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, hc * cfg.dim, generator=gen) * 0.1
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}.hc_attn_"
        mixes = (h @ t[p + "fn"].T) * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))
        scale, base = t[p + "scale"], t[p + "base"]
        pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc])
        comb = (mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc).softmax(-1)
        for _ in range(cfg.hc_sinkhorn_iters):
            comb = comb / comb.sum(-2, keepdim=True)
            comb = comb / comb.sum(-1, keepdim=True)
        assert 0.2 < pre.mean().item() < 0.8 and pre.std().item() > 0.05
        assert (comb - 0.25).abs().mean().item() > 0.05  # not uniform
        assert (comb - torch.eye(hc)).abs().mean().item() > 0.05  # not identity
        assert comb.std(0).mean().item() > 0.01  # depends on the token


def test_config_follows_the_tokenizer_it_ships(tmp_path, capsys):
    # a config whose compressed size the synthetic tokenizer cannot give (as v41-flash's 99092)
    cfg = tiny().replace(engram_compressed_vocab_size=300)
    out = write_checkpoint(cfg, tmp_path / "c", seed=0, shard_bytes=10**9)
    assert "engram_compressed_vocab_size=303" in capsys.readouterr().err
    assert load_config(out) == tiny()


def test_vision_gate_biases_written_and_skipped(tmp_path):
    cfg = tiny().replace(vision_n_layers=1)
    out = write_checkpoint(cfg, tmp_path / "v", seed=0, shard_bytes=10**9, verbose=False)
    index = json.loads((out / ck.INDEX_FILE).read_text())
    assert "layers.0.ffn.gate.bias_vl" in index["weight_map"]
    tensors, report = load_tensors(out, cfg, "full", vision=False)
    assert not [n for n in report.tensors_read if n.endswith("bias_vl")]
