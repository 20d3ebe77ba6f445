"""A chat request's images, for a worker: each ``image_url`` part decoded (``engine.images``) and
its ``<｜deepseek_image｜>`` placeholder in the prompt expanded into the image's span. Every worker
of a deployment does this from the same body (the router forwards it to P and to D), so P and D
agree on the spans without shipping pixels; the PrefixState carries the spans to check that."""

from __future__ import annotations

from typing import Any

from asympd.config import ModelConfig
from asympd.engine.images import ImageError, ImageLimits, decode_image, image_url_bytes
from asympd.model.vision import ImageInput, expand_placeholders
from asympd.serve.protocol import APIError


def image_urls(messages: list[dict[str, Any]]) -> list[str]:
    """The URL of every image part, in prompt order (messages, then parts). A part that is not
    ``{"type": "image_url", "image_url": {"url": ...}}`` (or a bare string URL) is a 400."""
    urls = []
    for i, m in enumerate(messages):
        parts = m.get("content")
        if not isinstance(parts, list):
            continue
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image_url", "image"):
                continue
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str):
                raise APIError(f"messages[{i}].content[{j}]: an image part needs image_url.url", param="messages")
            urls.append(url)
    return urls


def request_images(
    messages: list[dict[str, Any]], ids: list[int], cfg: ModelConfig, limits: ImageLimits
) -> tuple[list[int], list[ImageInput]]:
    """(prompt ids with each image's span, the images). Blocking (decodes): call off the loop."""
    urls = image_urls(messages)
    if not urls:
        return ids, []
    if cfg.vision_n_layers <= 0:
        raise APIError("this model has no vision tower: image parts cannot be served", param="messages")
    if len(urls) > limits.max_images:
        raise APIError(f"{len(urls)} images in one request; at most {limits.max_images} are allowed", param="messages")
    images = []
    for k, url in enumerate(urls):
        try:
            images.append(decode_image(image_url_bytes(url, limits), cfg, limits))
        except ImageError as e:
            raise APIError(f"image {k}: {e}", param="messages") from None
    try:
        return expand_placeholders(cfg, ids, images), images
    except ValueError as e:  # a literal placeholder in the text: the counts disagree
        raise APIError(str(e), param="messages") from None
