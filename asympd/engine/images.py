"""Image bytes -> the model's ``ImageInput``: decoding (Pillow, the optional ``vision`` extra), the
release's resize/pad to whole patches, normalization to bf16 patches, and the limits a server
enforces. Every failure is an ``ImageError`` (the API answers 400 with its message).

The pixel steps are the release's ``image_processor.py``: Pillow's ``ImageOps.pad`` (aspect kept,
centred on grey 127) or, past ``vision_max_wh_ratio``, a plain ``resize``; values ``(v/255 - 0.5)
/ 0.5`` rounded to bf16; patches cut row-major, channels first.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

import numpy as np
import torch

from asympd.config import ModelConfig
from asympd.model.vision import ImageInput, llm_grid, plan_pixels


class ImageError(ValueError):
    """An image that cannot be used: undecodable, too large, too many, or not allowed."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request may carry. ``max_bytes`` bounds each encoded image, ``max_pixels`` its
    decoded size (before resizing: a decompression bomb is refused before it is decoded)."""

    max_images: int = 8
    max_bytes: int = 20 << 20
    max_pixels: int = 50_000_000
    allow_http: bool = False  # fetch http(s) image URLs (off: only data URLs)
    http_timeout: float = 10.0


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError as e:  # pragma: no cover - the vision extra is installed in dev
        raise ImageError("image inputs need Pillow: pip install 'asympd[vision]'") from e
    return Image, ImageOps


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [(H/p) * (W/p), 3, p, p], patches in reading order."""
    c, h, w = pixels.shape
    return pixels.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 0, 2, 4).reshape(-1, c, patch, patch)


def decode_image(data: bytes, cfg: ModelConfig, limits: ImageLimits | None = None) -> ImageInput:
    """One encoded image (PNG, JPEG, ...) as the model's input; ``start`` is set when the prompt's
    placeholders are expanded (``vision.expand_placeholders``)."""
    limits = limits or ImageLimits()
    if cfg.vision_n_layers <= 0:
        raise ImageError("this model has no vision tower (vision_n_layers = 0): it cannot take images")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image of {len(data)} bytes exceeds the limit of {limits.max_bytes} bytes")
    image_mod, ops = _pil()
    try:
        with image_mod.open(io.BytesIO(data)) as src:
            if src.width * src.height > limits.max_pixels:
                raise ImageError(
                    f"image of {src.width}x{src.height} pixels exceeds the limit of {limits.max_pixels} pixels"
                )
            image = src.convert("RGB")
    except ImageError:
        raise
    except Exception as e:  # Pillow raises several types for corrupt or unknown data
        raise ImageError(f"cannot decode the image: {type(e).__name__}: {e}") from None
    if image.width < 1 or image.height < 1:
        raise ImageError("the image is empty")
    p = cfg.vision_patch_size
    width, height = plan_pixels(cfg, image.width, image.height)
    if width < p or height < p:
        raise ImageError(f"a {image.width}x{image.height} image is too thin to cut into {p}-pixel patches")
    if cfg.vision_max_wh_ratio is not None and image.width >= cfg.vision_max_wh_ratio * image.height:
        image = image.resize((width, height))
    else:
        image = ops.pad(image, (width, height), color=(127, 127, 127))
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255
    patches = patchify(((x - 0.5) / 0.5).to(torch.bfloat16), p)
    n_vit_h, n_vit_w = height // p, width // p
    digest = hashlib.sha256(patches.view(torch.uint8).numpy().tobytes()).hexdigest()[:32]
    grid = llm_grid(cfg, n_vit_h, n_vit_w)
    return ImageInput(0, patches, n_vit_h, n_vit_w, *grid, digest=f"{n_vit_w}x{n_vit_h}:{digest}")


def image_url_bytes(url: str, limits: ImageLimits | None = None) -> bytes:
    """The bytes an ``image_url`` names: a base64 ``data:`` URL, or (only with ``allow_http``) an
    http(s) URL fetched with a timeout and the byte limit."""
    limits = limits or ImageLimits()
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string")
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise ImageError("a data URL image must be base64-encoded (data:image/png;base64,...)")
        if len(payload) > limits.max_bytes * 4 // 3 + 4:
            raise ImageError(f"image exceeds the limit of {limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the data URL's payload is not valid base64") from None
    if url.startswith(("http://", "https://")):
        if not limits.allow_http:
            raise ImageError("http(s) image URLs are not fetched by this server (start it with --allow-image-urls)")
        return _fetch(url, limits)
    raise ImageError("image_url.url must be a data: URL (or an http(s) URL where the server allows it)")


def _fetch(url: str, limits: ImageLimits) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=limits.http_timeout, follow_redirects=True) as r:
            if r.status_code != 200:
                raise ImageError(f"fetching the image failed: HTTP {r.status_code}")
            out = bytearray()
            for piece in r.iter_bytes():
                out += piece
                if len(out) > limits.max_bytes:
                    raise ImageError(f"image exceeds the limit of {limits.max_bytes} bytes")
            return bytes(out)
    except httpx.HTTPError as e:
        raise ImageError(f"fetching the image failed: {type(e).__name__}") from None
