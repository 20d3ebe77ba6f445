"""The V4.1 vision tower: patches -> ViT -> 2D-downsampling aligner -> LLM-width rows, and where
those rows go in the token sequence.

An image of ``n_vit_h x n_vit_w`` patches (``vision_patch_size`` pixels square) runs through a
bidirectional ViT with 2D RoPE (half of each head's rotary pairs by patch row, half by column);
the aligner folds every ``r x r`` patch cell (r = ``vision_downsample_ratio``, the grid zero-padded
up to a multiple of r) into one row and projects it to ``dim`` through a GELU MLP. The prompt sees
an image as a *span* of ``image_token_id`` tokens laid out as

    START, (IMAGE * n_llm_w, NEWLINE) * n_llm_h, END

START / NEWLINE / END take learned embeddings (``image_start`` ...), the IMAGE slots take the
aligner rows in reading order. Every span row routes its MoE with ``gate.bias_vl`` and is kept out
of the Engram n-grams (``span_mask``). The math follows the release's ``inference/vision.py`` and
``image_processor.py`` (revision dba1be0a); nothing here depends on pixels or Pillow: patches are
made from an RGB array by ``asympd.engine.images``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asympd.config import ModelConfig
from asympd.model.ops import rms_norm

VISION_NORM_EPS = 1e-6  # the tower's RMSNorms (the text model uses norm_eps)
START, IMAGE, NEWLINE, END = range(4)  # span row kinds (the reference's token types)


# ---- layout: sizes and spans ---------------------------------------------------------------------


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Tokens an image of an ``n_llm_h x n_llm_w`` aligner grid takes in the prompt."""
    return n_llm_h * (n_llm_w + 1) + 2


def span_kinds(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """The kind (START/IMAGE/NEWLINE/END) of every row of a span, int64."""
    row = [IMAGE] * n_llm_w + [NEWLINE]
    return torch.tensor([START, *(row * n_llm_h), END], dtype=torch.int64)


def llm_grid(cfg: ModelConfig, n_vit_h: int, n_vit_w: int) -> tuple[int, int]:
    """The aligner grid of a patch grid (each side rounded up to whole r x r cells)."""
    r = cfg.vision_downsample_ratio
    return -(-n_vit_h // r), -(-n_vit_w // r)


def plan_pixels(cfg: ModelConfig, width: int, height: int) -> tuple[int, int]:
    """(width, height) in pixels an image of this size is resized/padded to: multiples of the patch
    size, at least ``vision_min_pixels`` in area (scaled up keeping the aspect), width capped at
    ``vision_max_wh_ratio`` x height, and shrunk until its span fits ``vision_max_n_token``."""
    p, r, cap = cfg.vision_patch_size, cfg.vision_downsample_ratio, cfg.vision_max_n_token
    w, h = width, height
    if cfg.vision_max_wh_ratio is not None and w > h * cfg.vision_max_wh_ratio:
        w = h * cfg.vision_max_wh_ratio
    if 0 < w * h < cfg.vision_min_pixels:
        grow = math.sqrt(cfg.vision_min_pixels / (w * h))
        w, h = int(w * grow), int(h * grow)
    pw, ph = math.ceil(w / p) * p, math.ceil(h / p) * p
    if span_length(math.ceil((ph // p) / r), math.ceil((pw // p) / r)) <= cap:
        return pw, ph
    # the largest aspect-preserving size whose grid fits: n_h * (n_w + 1) + 2 <= cap with n_h = n_w * h / w
    aspect, cell = h / w, p * r
    max_w = math.sqrt((cap - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    if max_w < 1.0:  # very tall: one column
        return cell, (cap - 2) // 2 * cell
    if max_h < 1.0:  # very wide: one row
        return (cap - 3) * cell, cell
    scale = min(math.floor(max_w) * cell / w, math.floor(max_h) * cell / h)
    return math.floor(w * scale / p) * p, math.floor(h * scale / p) * p


@dataclass
class ImageInput:
    """One image of a prompt: its patches (bf16 ``[n_vit_h * n_vit_w, 3, p, p]``, values in [-1, 1]
    as the release normalizes them) and where its span starts in the token ids."""

    start: int
    patches: torch.Tensor
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int
    digest: str = ""  # content hash (prefix caching must not mix two images' KV)

    @property
    def length(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)

    @property
    def end(self) -> int:
        return self.start + self.length

    def at(self, start: int) -> ImageInput:
        return ImageInput(start, self.patches, self.n_vit_h, self.n_vit_w, self.n_llm_h, self.n_llm_w, self.digest)


def span_mask(n: int, images: list[ImageInput]) -> torch.Tensor:
    """[n] bool, True on every row of an image span."""
    mask = torch.zeros(n, dtype=torch.bool)
    for im in images:
        mask[im.start : im.end] = True
    return mask


def check_spans(cfg: ModelConfig, token_ids: list[int], images: list[ImageInput]) -> None:
    """Raise ValueError unless the spans are in order, disjoint, inside the prompt, sized as their
    grids say, and carry ``image_token_id`` (and no other row does)."""
    prev = 0
    for i, im in enumerate(images):
        if im.start < prev or im.end > len(token_ids):
            raise ValueError(f"image {i}: span [{im.start}, {im.end}) overlaps another or leaves the prompt")
        if (im.n_llm_h, im.n_llm_w) != llm_grid(cfg, im.n_vit_h, im.n_vit_w) or im.length > cfg.vision_max_n_token:
            raise ValueError(
                f"image {i}: grid {im.n_llm_h}x{im.n_llm_w} does not fit its {im.n_vit_h}x{im.n_vit_w} patches"
            )
        p = cfg.vision_patch_size
        if tuple(im.patches.shape) != (im.n_vit_h * im.n_vit_w, 3, p, p):
            raise ValueError(f"image {i}: patches have shape {tuple(im.patches.shape)}")
        prev = im.end
    mask = span_mask(len(token_ids), images)
    is_image = torch.tensor(token_ids, dtype=torch.long) == cfg.image_token_id
    if not torch.equal(mask, is_image):
        raise ValueError(
            f"image token {cfg.image_token_id} must fill exactly the image spans: found it at "
            f"{int(is_image.sum())} positions, the spans cover {int(mask.sum())}"
        )


def expand_placeholders(cfg: ModelConfig, token_ids: list[int], images: list[ImageInput]) -> list[int]:
    """Each ``image_token_id`` in ``token_ids`` (one per image, in order) becomes that image's span;
    sets each image's ``start``. Raises ValueError on a count mismatch."""
    n = sum(t == cfg.image_token_id for t in token_ids)
    if n != len(images):
        raise ValueError(f"the prompt has {n} image placeholders but {len(images)} images were given")
    out: list[int] = []
    it = iter(images)
    for t in token_ids:
        if t != cfg.image_token_id:
            out.append(t)
            continue
        im = next(it)
        im.start = len(out)
        out += [cfg.image_token_id] * im.length
    return out


# ---- the tower -----------------------------------------------------------------------------------


def _rope_2d(n_h: int, n_w: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h * n_w, 1, dim]: the first dim/2 angles follow the patch row, the rest the column."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rows = torch.arange(n_h).repeat_interleave(n_w).float()
    cols = torch.arange(n_w).repeat(n_h).float()
    ang = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)
    return ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (i, i + d/2) of each head, in fp32."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class VisionTower(torch.nn.Module):
    """ViT + aligner + span embeddings, from the checkpoint's ``vision.*``, ``aligner.*`` and
    ``image_*`` tensors. Runs in the model dtype; per image, so a row never depends on a batch."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.heads = cfg.vision_n_heads
        self.rope_dim = cfg.vision_dim // cfg.vision_n_heads // 2
        self.w = {
            k: v.float() if k.endswith(("norm1.weight", "norm2.weight", "vision.norm.weight")) else v.to(dtype)
            for k, v in w.items()
        }

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    @torch.inference_mode()
    def encode(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """[n_llm_h * n_llm_w, dim] aligner rows of one image, in reading order."""
        cfg, w = self.cfg, self.w
        device = w["vision.patch_embed.proj.weight"].device
        x = self._linear(patches.to(device, self.dtype).flatten(1), "vision.patch_embed.proj")
        n = x.size(0)
        cos, sin = (t.to(device) for t in _rope_2d(n_vit_h, n_vit_w, self.rope_dim, cfg.vision_rope_theta))
        for i in range(cfg.vision_n_layers):
            p = f"vision.blocks.{i}."
            h = rms_norm(x, w[p + "norm1.weight"], VISION_NORM_EPS)
            q, k, v = (t.view(n, self.heads, -1) for t in self._linear(h, p + "attn.wqkv").chunk(3, dim=-1))
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            x = x + self._linear(o.transpose(0, 1).reshape(n, -1), p + "attn.wo")
            h = rms_norm(x, w[p + "norm2.weight"], VISION_NORM_EPS)
            gate, up = self._linear(h, p + "mlp.w1").chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, p + "mlp.w2")
        x = rms_norm(x, w["vision.norm.weight"], VISION_NORM_EPS)
        return self._align(x, n_vit_h, n_vit_w)

    def _align(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """Fold each r x r patch cell (channel-major, then cell row, then cell column) into one row."""
        r = self.cfg.vision_downsample_ratio
        c = x.size(-1)
        grid = F.pad(x.view(n_h, n_w, c).permute(2, 0, 1), (0, -n_w % r, 0, -n_h % r))
        gh, gw = grid.size(1) // r, grid.size(2) // r
        cells = grid.reshape(c, gh, r, gw, r).permute(1, 3, 0, 2, 4).reshape(gh * gw, c * r * r)
        return self._linear(F.gelu(self._linear(cells, "aligner.w1")), "aligner.w2")

    def span_rows(self, image: ImageInput) -> torch.Tensor:
        """[image.length, dim] the rows of the image's span, delimiters included (model dtype)."""
        grid = self.encode(image.patches, image.n_vit_h, image.n_vit_w)
        kinds = span_kinds(image.n_llm_h, image.n_llm_w).to(grid.device)
        out = torch.empty(image.length, grid.size(-1), dtype=self.dtype, device=grid.device)
        for kind, name in ((START, "image_start"), (NEWLINE, "image_newline"), (END, "image_end")):
            out[kinds == kind] = self.w[name]
        out[kinds == IMAGE] = grid
        return out
