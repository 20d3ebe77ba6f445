"""Image bytes -> ImageInput: data URLs, http(s) only when allowed (a real local server), and the
limits a server enforces, each a clear ImageError."""

from __future__ import annotations

import base64
import http.server
import threading

import pytest

from asympd.config import tiny
from asympd.engine.images import ImageError, ImageLimits, decode_image, image_url_bytes
from tests.engine.test_vision import png


@pytest.fixture(scope="module")
def http_url():
    body = png(16, 16, seed=5)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            if self.path == "/big.png":
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"x" * 5000)
                return
            self.send_response(200 if self.path == "/a.png" else 404)
            self.end_headers()
            if self.path == "/a.png":
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", body
    server.shutdown()


def test_http_urls_only_when_allowed(http_url):
    base, body = http_url
    with pytest.raises(ImageError, match="--allow-image-urls"):
        image_url_bytes(f"{base}/a.png")
    allowed = ImageLimits(allow_http=True, max_bytes=4000)
    assert image_url_bytes(f"{base}/a.png", allowed) == body
    with pytest.raises(ImageError, match="HTTP 404"):
        image_url_bytes(f"{base}/missing.png", allowed)
    with pytest.raises(ImageError, match="exceeds the limit of 4000 bytes"):
        image_url_bytes(f"{base}/big.png", allowed)


def test_data_urls_and_limits():
    data = png(40, 24, seed=1)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert image_url_bytes(url) == data
    for bad, needle in (
        ("data:image/png,abc", "must be base64-encoded"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("file:///etc/passwd", "must be a data: URL"),
        ("", "non-empty string"),
    ):
        with pytest.raises(ImageError, match=needle):
            image_url_bytes(bad)
    cfg = tiny()
    im = decode_image(data, cfg)
    assert (im.n_vit_h, im.n_vit_w, im.n_llm_h, im.n_llm_w, im.length) == (6, 10, 3, 5, 20)
    assert im.digest != decode_image(png(40, 24, seed=2), cfg).digest
    with pytest.raises(ImageError, match="exceeds the limit of 100 pixels"):
        decode_image(data, cfg, ImageLimits(max_pixels=100))  # refused from the header, before decoding
    with pytest.raises(ImageError, match="exceeds the limit of 10 bytes"):
        decode_image(data, cfg, ImageLimits(max_bytes=10))
    with pytest.raises(ImageError, match="no vision tower"):
        decode_image(data, cfg.replace(vision_n_layers=0))
