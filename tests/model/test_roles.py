"""Roles through the public loader: what the prefill role needs, and what it reports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asympd.cli import main
from asympd.kv.dense import DenseSequenceKV
from asympd.model.checkpoint import CheckpointError
from asympd.model.loader import load_model
from asympd.model.schema import role_schema
from asympd.model.transformer import Chunk, Depth
from tests.util import random_prompts


def strip_to_prefill(src: str, dst: Path) -> Path:
    """A copy of the checkpoint holding only the prefill role's tensors, as one file."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(Path(src) / name, dst / name)
    model = load_model(src, "prefill")
    keep = {s.name for s in role_schema(model.cfg, "prefill", vision=True)}
    tensors = {}
    for shard in Path(src).glob("*.safetensors"):
        tensors.update({k: v for k, v in load_file(shard).items() if k in keep})
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_prefill_role_works_without_any_decoder_tensor(tiny_ckpt, tmp_path):
    stripped = strip_to_prefill(tiny_ckpt, tmp_path / "p")
    p = load_model(stripped, "prefill")
    ref = load_model(tiny_ckpt, "prefill")
    ids = torch.tensor(random_prompts([37], seed=41)[0])
    kv_a, kv_b = DenseSequenceKV(p.cfg), DenseSequenceKV(p.cfg)
    for model, kv in ((p, kv_a), (ref, kv_b)):
        model([Chunk(kv, ids, 0, ids, Depth.ENCODER_KV, logits="none")])
    for layer in p.cfg.kv_source_layers:
        n = 37 // p.cfg.ratio(layer)
        assert torch.equal(kv_a.read_compressed(layer, n), kv_b.read_compressed(layer, n))
        assert torch.equal(kv_a.read_index_keys(layer, n), kv_b.read_index_keys(layer, n))
    missing = r"tensor 'layers\.3\.ffn_norm\.weight' needed by role 'decode' is missing"
    with pytest.raises(CheckpointError, match=missing):
        load_model(stripped, "decode")


def test_inspect_reports_real_resident_bytes(tiny_ckpt, capsys):
    sizes = {}
    for role in ("prefill", "decode"):
        assert main(["inspect", "--checkpoint", tiny_ckpt, "--role", role, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["bytes_read"] > 0 and out["resident_bytes"] > 0
        sizes[role] = (out["tensors_read"], out["resident_bytes"])
    assert sizes["prefill"][0] < sizes["decode"][0]
    assert sizes["prefill"][1] < 0.6 * sizes["decode"][1]
