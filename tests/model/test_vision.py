"""The vision pieces on their own: the resize plan (pinned to the reference's outputs), the span
layout, the tower's shape contract, ``gate.bias_vl`` routing and the Engram mask on image rows."""

from __future__ import annotations

import pytest
import torch

from asympd.config import tiny, v41_flash
from asympd.model.loader import load_model
from asympd.model.moe import MoE
from asympd.model.vision import (
    END,
    IMAGE,
    NEWLINE,
    START,
    ImageInput,
    expand_placeholders,
    llm_grid,
    plan_pixels,
    span_kinds,
    span_length,
)

# (width, height) -> (n_llm_h, n_llm_w, height, width) as the release's image_processor.plan_image_grid
# returns them (run on both configs by tools/check_vision_against_reference.py's reference)
PLANS = {
    "tiny": {
        (16, 16): (2, 2, 16, 16),
        (5, 5): (1, 1, 8, 8),  # raised to min_pixels
        (40, 24): (3, 5, 24, 40),
        (200, 50): (3, 12, 24, 96),  # shrunk to fit max_n_token
        (3, 2000): (23, 1, 184, 8),  # very tall: one column
        (2000, 3): (1, 45, 8, 360),  # very wide: one row
        (640, 480): (5, 7, 40, 52),
    },
    "v41-flash": {
        (16, 16): (13, 13, 546, 546),
        (40, 24): (11, 17, 434, 714),
        (3, 2000): (335, 1, 14056, 28),
        (1024, 1024): (25, 25, 1036, 1036),
        (640, 480): (12, 16, 490, 644),
        (4000, 3000): (27, 36, 1134, 1512),
    },
}


@pytest.mark.parametrize("name", list(PLANS))
def test_resize_plan_matches_the_reference(name):
    cfg = tiny() if name == "tiny" else v41_flash()
    p = cfg.vision_patch_size
    for (w, h), (gh, gw, ph, pw) in PLANS[name].items():
        width, height = plan_pixels(cfg, w, h)
        assert (height, width) == (ph, pw), (w, h)
        assert llm_grid(cfg, height // p, width // p) == (gh, gw), (w, h)
        assert span_length(gh, gw) <= cfg.vision_max_n_token


def test_span_layout_and_placeholders():
    assert span_kinds(2, 3).tolist() == [START, IMAGE, IMAGE, IMAGE, NEWLINE, IMAGE, IMAGE, IMAGE, NEWLINE, END]
    assert span_length(2, 3) == 10
    cfg = tiny()
    img = cfg.image_token_id
    a = ImageInput(0, torch.zeros(16, 3, 4, 4, dtype=torch.bfloat16), 4, 4, 2, 2)
    b = ImageInput(0, torch.zeros(6 * 10, 3, 4, 4, dtype=torch.bfloat16), 6, 10, 3, 5)
    ids = expand_placeholders(cfg, [7, img, 8, img], [a, b])
    assert (a.start, a.length, b.start, b.length) == (1, 8, 10, 20)
    assert ids == [7] + [img] * 8 + [8] + [img] * 20
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        expand_placeholders(cfg, [img, img], [a])


def test_tower_rows_and_delimiters(tiny_ckpt):
    model = load_model(tiny_ckpt, "prefill")  # P holds the tower too
    tower = model.vision
    g = torch.Generator().manual_seed(0)
    im = ImageInput(3, (torch.rand(6 * 10, 3, 4, 4, generator=g) * 2 - 1).bfloat16(), 6, 10, 3, 5)
    rows = tower.span_rows(im)
    assert rows.shape == (20, model.cfg.dim) and rows.dtype == model.dtype
    kinds = span_kinds(3, 5)
    for kind, name in ((START, "image_start"), (NEWLINE, "image_newline"), (END, "image_end")):
        assert torch.equal(rows[kinds == kind], tower.w[name].expand(int((kinds == kind).sum()), -1))
    grid = rows[kinds == IMAGE]
    assert torch.equal(grid, tower.encode(im.patches, 6, 10))
    # rows are per image: another image in the same position does not change these
    other = ImageInput(3, torch.zeros_like(im.patches), 6, 10, 3, 5)
    tower.span_rows(other)
    assert torch.equal(tower.span_rows(im), rows)
    # a 2x2 cell folds 4 patches: an image one patch wider pads its last cell column with zeros
    assert tower.encode(torch.zeros(6 * 11, 3, 4, 4, dtype=torch.bfloat16), 6, 11).shape == (3 * 6, model.cfg.dim)


def test_bias_vl_picks_the_experts_of_image_rows():
    cfg = tiny()
    d, e = cfg.dim, cfg.n_routed_experts
    g = torch.Generator().manual_seed(0)
    w = {
        "gate.weight": torch.randn(e, d, generator=g) * 0.01,
        "gate.bias": torch.zeros(e),
        "gate.bias_vl": torch.zeros(e),
        "experts.w1": torch.zeros(e, cfg.moe_inter_dim, d),
        "experts.w2": torch.zeros(e, d, cfg.moe_inter_dim),
        "experts.w3": torch.zeros(e, cfg.moe_inter_dim, d),
        "shared_experts.w1": torch.zeros(cfg.moe_inter_dim, d),
        "shared_experts.w2": torch.zeros(d, cfg.moe_inter_dim),
        "shared_experts.w3": torch.zeros(cfg.moe_inter_dim, d),
    }
    w["gate.bias"][[0, 1]] = 5.0  # text rows go to experts 0 and 1
    w["gate.bias_vl"][[6, 7]] = 5.0  # image rows to 6 and 7
    moe = MoE(cfg, 0, w)
    x = torch.randn(4, d, generator=g)
    vl = torch.tensor([False, True, True, False])
    weights, ids = moe.route(x, vl)
    assert ids.sort(dim=1).values.tolist() == [[0, 1], [6, 7], [6, 7], [0, 1]]
    plain_w, plain_ids = moe.route(x)
    assert plain_ids.sort(dim=1).values.tolist() == [[0, 1]] * 4
    # the bias picks experts only: an image row's weights are its unbiased scores of 6 and 7
    scores = torch.nn.functional.softplus(x.float() @ w["gate.weight"].t()).sqrt()
    want = scores[1, ids[1]] / scores[1, ids[1]].sum() * cfg.route_scale
    assert torch.allclose(weights[1], want)


def test_engram_leaves_image_rows_untouched(tiny_ckpt):
    model = load_model(tiny_ckpt, "full")
    engram = model.blocks[0].engram
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, model.cfg.hc_mult, model.cfg.dim, generator=g)
    hashes = model.hasher.hash_ids(torch.arange(3, 8), 0, 5)[:, 0]
    text = torch.tensor([True, False, False, True, True])
    out = engram(h, hashes, text)
    assert torch.equal(out[~text], h[~text])
    assert torch.equal(out[text], engram(h, hashes)[text])
    assert not torch.equal(out[text], h[text])
