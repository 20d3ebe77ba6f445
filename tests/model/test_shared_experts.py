"""Benchmark checkpoints whose layers share layer 0's routed experts (asympd/model/shared_experts.py):
written without the other layers' experts, refused unless asked, and loaded as exactly the model
whose every layer holds layer 0's experts, with one copy of them in memory."""

from __future__ import annotations

import json

import pytest
import torch

from asympd.config import tiny
from asympd.kv.dense import DenseSequenceKV
from asympd.model.checkpoint import CheckpointError, load_config, load_tensors, write_checkpoint
from asympd.model.loader import build_model, load_model
from asympd.model.shared_experts import MARKER
from asympd.model.transformer import Chunk
from asympd.serve.config import ServeConfig
from tests.util import random_prompts


@pytest.fixture(scope="module")
def shared_ckpt(tmp_path_factory) -> str:
    return str(write_checkpoint(tiny(), tmp_path_factory.mktemp("shared") / "ckpt", seed=0, verbose=False,
                                shared_experts=True))  # fmt: skip


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model([Chunk(DenseSequenceKV(model.cfg), ids, 0, ids, logits="all")]).logits[0]


def test_only_layer_0_experts_are_stored(shared_ckpt, tiny_ckpt):
    names = set(json.loads(open(f"{shared_ckpt}/model.safetensors.index.json").read())["weight_map"])
    full = set(json.loads(open(f"{tiny_ckpt}/model.safetensors.index.json").read())["weight_map"])
    cfg = tiny()
    dropped = full - names
    assert dropped and all(".ffn.experts." in n and not n.startswith(("layers.0.", "mtp.")) for n in dropped)
    per_layer = 3 * 2 * cfg.n_routed_experts  # w1, w2, w3: weight + scale each
    assert len(dropped) == per_layer * (cfg.n_layers - 1) and names < full
    assert json.loads(open(f"{shared_ckpt}/{MARKER}").read())["source_layer"] == 0


def test_refused_unless_asked(shared_ckpt, tiny_ckpt):
    with pytest.raises(CheckpointError, match="benchmark checkpoint whose layers share one set of routed experts"):
        load_model(shared_ckpt, "full")
    with pytest.raises(CheckpointError, match=f"has no {MARKER}: it is not a shared-expert benchmark checkpoint"):
        load_model(tiny_ckpt, "full", shared_experts=True)
    with pytest.raises(ValueError, match="--benchmark-shared-experts runs on one rank"):
        ServeConfig(shared_ckpt, benchmark_shared_experts=True, ep=2).resolve()


@pytest.mark.parametrize("role", ["full", "prefill"])
def test_loads_as_every_layer_holding_layer_0s_experts(shared_ckpt, tiny_ckpt, role):
    model = load_model(shared_ckpt, role, shared_experts=True)
    moes = [b.ffn for b in model.blocks if b is not None and getattr(b, "ffn", None) is not None]
    assert len(moes) == (tiny().last_kv_source if role == "prefill" else tiny().n_layers)
    assert all(m.w1 is moes[0].w1 and m.w2 is moes[0].w2 and m.w3 is moes[0].w3 for m in moes)  # one copy
    assert all(m.s1 is not moes[0].s1 for m in moes[1:])  # the shared expert stays each layer's own
    read = model.load_report.tensors_read
    assert not any(".ffn.experts." in n and not n.startswith(("layers.0.", "mtp.")) for n in read)
    # the same seed's normal checkpoint with layer 0's experts copied into every layer: the same model
    cfg = load_config(tiny_ckpt)
    tensors, _ = load_tensors(tiny_ckpt, cfg, role)
    for name in [n for n in tensors if n.startswith("layers.0.ffn.experts.")]:
        for layer in range(1, cfg.n_layers):
            if name.replace("layers.0.", f"layers.{layer}.", 1) in tensors:
                tensors[name.replace("layers.0.", f"layers.{layer}.", 1)] = tensors[name]
    ref = build_model(cfg, tensors, role, hasher=model.hasher)
    one = sum(t.numel() * t.element_size() for t in (moes[0].w1, moes[0].w2, moes[0].w3))
    assert ref.resident_bytes() - model.resident_bytes() == one * (len(moes) - 1)  # counted (and held) once
    if role == "full":
        ids = torch.tensor(random_prompts([29], seed=3)[0])
        assert torch.equal(logits(model, ids), logits(ref, ids))
        assert not torch.equal(logits(load_model(tiny_ckpt, "full"), ids), logits(ref, ids))  # sharing changed it
