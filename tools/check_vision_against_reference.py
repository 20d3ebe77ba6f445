#!/usr/bin/env python3
"""Check asympd's vision path against the DeepSeek-V4.1-Flash reference (``inference/vision.py``,
``image_processor.py`` and the VL parts of ``model.py``), on a checkpoint with a vision tower.

The reference is imported from ``--reference-dir`` as in tools/check_against_reference.py (whose
loading, weight conversion and metrics this reuses); see docs/reference-check.md for how to
obtain it, and docs/vision.md for the result. Compared, all in bf16 with 1 thread:

1. the resize plan: the reference's ``plan_image_grid`` against ``vision.plan_pixels`` for every
   (width, height) in a grid of sizes, with ``vision_max_wh_ratio`` unset (the release) and set;
2. pixels -> patches: the reference's ``load_image`` against ``engine.images.decode_image`` on random
   PNGs (bit for bit);
3. the tower: ``Transformer.encode_image`` (ViT + aligner) against ``VisionTower.encode``;
4. the model: one-shot prefill of prompts holding images at several places (the reference's
   ``forward(..., images, token_types)``: span embeddings, ``bias_vl`` routing and the Engram mask),
   then greedy decode steps; logits of every row and every layer's output.

Run from the repository root:

    .venv/bin/python tools/check_vision_against_reference.py --reference-dir /tmp/refcheck --checkpoint CKPT
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import check_against_reference as C  # noqa: E402

from asympd.engine.images import decode_image  # noqa: E402
from asympd.model.transformer import Chunk, ChunkImages, Depth  # noqa: E402
from asympd.model.vision import expand_placeholders, llm_grid, plan_pixels, span_kinds, span_mask  # noqa: E402


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def check_plans(ip: Any, args: Any, cfg: Any) -> dict[str, int]:
    """Every size in a grid: (n_llm_h, n_llm_w, height, width) of the reference vs ours."""
    sizes = [(w, h) for w in range(1, 120, 3) for h in range(1, 120, 5)] + [(2000, 3), (3, 2000), (640, 480)]
    bad = 0
    for w, h in sizes:
        ref = ip.plan_image_grid(w, h, args)
        pw, ph = plan_pixels(cfg, w, h)
        p = cfg.vision_patch_size
        ours = (*llm_grid(cfg, ph // p, pw // p), ph, pw)
        bad += tuple(ref) != ours
    return {"sizes": len(sizes), "different": bad}


def check_pixels(ip: Any, args: Any, cfg: Any, images: list[bytes]) -> dict[str, int]:
    """Patches (bf16 bits) and grids of the reference's load_image against ours."""
    same = 0
    for data in images:
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = ip.load_image({"data": data}, args)
        ours = decode_image(data, cfg)
        same += (n_vit_h, n_vit_w, n_llm_h, n_llm_w) == (ours.n_vit_h, ours.n_vit_w, ours.n_llm_h, ours.n_llm_w) and (
            torch.equal(patches.view(torch.int16), ours.patches.view(torch.int16))
        )
    return {"images": len(images), "bit_identical": same}


def run_reference(R: Any, ref_mod: Any, ip: Any, ids: list[int], images: list[Any], stable: bool) -> torch.Tensor:
    """fp32 logits of every row of a one-shot prefill with images (the reference's VL forward)."""
    types = torch.full((len(ids),), ip.TEXT, dtype=torch.int64)
    inputs = []
    for im in images:
        kinds = span_kinds(im.n_llm_h, im.n_llm_w)
        types[im.start : im.end] = kinds  # the reference's token types are these kinds
        inputs.append(ip.ImageInput(im.start, im.patches, im.n_vit_h, im.n_vit_w, kinds))
    R.hidden = []
    original = torch.Tensor.topk
    if stable:
        torch.Tensor.topk = C._stable_topk
    try:
        with ref_mod.set_dtype(torch.bfloat16):
            _, logits, _ = R.model(torch.tensor([ids]), 0, images=[inputs], token_types=types.view(1, -1))
    finally:
        torch.Tensor.topk = original
    return logits[0].float()


def run_ours(O: Any, ids: list[int], images: list[Any], start: int, count: int) -> torch.Tensor:
    hist = torch.tensor(ids)
    lo, hi = start, start + count
    rows, embeds = [], []
    for im in images:
        a, b = max(lo, im.start), min(hi, im.end)
        if a < b:
            rows.append(torch.arange(a - lo, b - lo))
            embeds.append(O.model.vision.span_rows(im)[a - im.start : b - im.start])
    mm = ChunkImages(
        ~span_mask(len(ids), images),
        torch.cat(rows) if rows else torch.empty(0, dtype=torch.long),
        torch.cat(embeds) if embeds else torch.empty(0, O.cfg.dim, dtype=O.dtype),
    )
    O.hidden = []
    chunk = Chunk(O.kv, hist[lo:hi], lo, hist[:hi], depth=Depth.ALL, logits="all", images=mm)
    return O.model([chunk]).logits[0].float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-dir", type=Path, required=True)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--no-stable-topk", action="store_true", help="leave the reference's top-k tie order as is")
    ap.add_argument(
        "--no-patch-index-keys", action="store_true", help="leave the reference's decode index-key reads as released"
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)

    flat = a.checkpoint / "inference" / "config.json"
    config = json.loads((flat if flat.is_file() else a.checkpoint / "config.json").read_text())
    ref_mod = C.import_reference(a.reference_dir)
    ip = sys.modules["deepseek_v41.image_processor"]
    if not hasattr(ip, "load_image"):
        raise SystemExit(
            "the reference's image_processor.py is a stand-in: copy the real file (docs/reference-check.md)"
        )
    args, _ = C.reference_args(ref_mod, config, 256)
    stable = not a.no_stable_topk
    R = C.Reference(ref_mod, args, C.TokenizerShim(a.checkpoint / "tokenizer.json"), stable)
    C.IndexKeyWatch(ref_mod, R.model, args, fix=not a.no_patch_index_keys)
    load = C.load_reference_weights(R.model, C.read_checkpoint(a.checkpoint))
    O = C.Ours(a.checkpoint, torch.bfloat16)
    cfg = O.cfg
    out: dict[str, Any] = {"load": {k: v for k, v in load.items() if k != "conversions"}}
    missing, unused = load["missing_in_checkpoint"], load["unused_checkpoint_tensors"]
    print(f"reference params missing from the checkpoint: {missing}; checkpoint tensors unused: {unused}")

    out["plans"] = check_plans(ip, args, cfg)
    wide = dataclasses.replace(args, vision_max_wh_ratio=2)
    out["plans_max_wh_ratio_2"] = check_plans(ip, wide, cfg.replace(vision_max_wh_ratio=2))
    print(f"resize plans: {out['plans']}; with max_wh_ratio 2: {out['plans_max_wh_ratio_2']}")

    sizes = [(16, 16), (40, 24), (5, 5), (9, 30), (200, 50), (33, 17), (64, 64)]
    blobs = [png(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    out["pixels"] = check_pixels(ip, args, cfg, blobs)
    out["pixels_max_wh_ratio_2"] = check_pixels(ip, wide, cfg.replace(vision_max_wh_ratio=2), blobs)
    print(f"pixels -> patches: {out['pixels']}; with max_wh_ratio 2: {out['pixels_max_wh_ratio_2']}")

    tower = []
    for data in blobs:
        im = decode_image(data, cfg)
        ref = R.model.encode_image(im.patches, im.n_vit_h, im.n_vit_w).float()
        tower.append(C.tensor_metrics(O.model.vision.encode(im.patches, im.n_vit_h, im.n_vit_w).float(), ref))
    out["tower"] = tower
    print("tower (ViT + aligner) rows, exact fraction per image:", [m["exact"] for m in tower])

    gen = torch.Generator().manual_seed(0)

    def text(n: int) -> list[int]:
        return torch.randint(3, 490, (n,), generator=gen).tolist()

    img = cfg.image_token_id
    prompts = {
        "image first": (text(1) + [img] + text(20), [0]),
        "middle": (text(12) + [img] + text(12), [1]),
        "two images": (text(5) + [img] + text(7) + [img] + text(9), [2, 3]),
        "image last": (text(30) + [img], [4]),
        "three, one shrunk": (text(3) + [img] + [img] + text(4) + [img] + text(6), [5, 0, 1]),
    }
    rows = []
    for name, (raw, which) in prompts.items():
        images = [decode_image(blobs[i], cfg) for i in which]
        ids = expand_placeholders(cfg, raw, images)
        R.reset()
        O.reset()
        rl = run_reference(R, ref_mod, ip, ids, images, stable)
        ol = run_ours(O, ids, images, 0, len(ids))
        hm = C.hidden_metrics(O.hidden, R.hidden)
        res = {"n": len(ids), "prefill": C.logit_metrics(ol, rl), "layers_exact": [m["exact"] for m in hm]}
        hist, steps = list(ids), []
        tok = int(rl[-1].argmax())
        for _ in range(a.decode_steps):
            pos = len(hist)
            hist.append(tok)
            r = C.Reference.run(R, torch.tensor(hist[pos:]), pos)
            o = run_ours(O, hist, images, pos, 1)
            hm = C.hidden_metrics(O.hidden, R.hidden)
            first = next((j for j, m in enumerate(hm) if m["max_abs"] > 0), None)
            steps.append({**C.logit_metrics(o, r), "first_layer_differing": first})
            tok = int(r[0].argmax())
        res["decode"] = steps
        rows.append((name, res))
        out.setdefault("prompts", {})[name] = res

    print(f"\n{'prompt':<18} {'N':>4} {'prefill max|d|':>15} {'argmax':>8} {'layers exact':>13} | decode: ", end="")
    print("exact steps, argmax agree, first differing step (+ entered exactly) and layer")
    for name, res in rows:
        p, d = res["prefill"], res["decode"]
        exact = all(e == 1.0 for e in res["layers_exact"])
        n_exact = sum(s["first_layer_differing"] is None for s in d)
        div = next((i for i, s in enumerate(d) if s["first_layer_differing"] is not None), None)
        entered = exact and div is not None and all(s["first_layer_differing"] is None for s in d[:div])
        where = "-" if div is None else f"{res['n'] + div}{'+' if entered else '-'} L{d[div]['first_layer_differing']}"
        print(
            f"{name:<18} {res['n']:>4} {p['max_abs']:>15.3e} {p['argmax_agree']:>4}/{p['rows']:<3} "
            f"{'yes' if exact else 'no':>13} | {n_exact}/{len(d)}  {sum(s['argmax_agree'] for s in d)}/{len(d)}  "
            f"{where}"
        )
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
