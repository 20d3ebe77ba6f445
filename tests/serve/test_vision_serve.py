"""An image through the router in asymmetric mode, every part a real process, with the official
``openai`` client: the answer's tokens are the offline ``LLM``'s for the same prompt and image
(its last image straddles the split, so P ships that image's tail rows to D); and bad images get
400s that say why."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from asympd import LLM, SamplingParams
from asympd.engine.llm import load_tokenizer
from asympd.engine.modes import split_point
from asympd.serve.protocol import parse_request
from tests.serve.cluster import one_p_one_d


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vision-logs")
    args = ("--served-model-name", "tiny", "--max-images", "2", "--max-image-bytes", "20000")
    with one_p_one_d(tiny_ckpt, logs, "asymmetric", *args) as c:
        yield c["router"]


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=60)


def test_image_chat_through_the_router_equals_offline(client, tiny_ckpt):
    small, big = png(16, 16, seed=1), png(40, 24, seed=2)
    content = [
        {"type": "text", "text": "Compare these two pictures of the harbour at dawn, please."},
        {"type": "image_url", "image_url": {"url": data_url(small)}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(big)}},
        {"type": "text", "text": "ok"},
    ]
    messages = [{"role": "user", "content": content}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    got, prompt_ids = r.choices[0].model_extra["token_ids"], r.model_extra["prompt_token_ids"]

    tok = load_tokenizer(tiny_ckpt)
    text = parse_request("chat", {"messages": messages}).render_prompt()  # as every worker renders it
    ids = tok.encode(text, add_special_tokens=False).ids
    llm = LLM(tiny_ckpt, "asymmetric")
    out = llm.generate(
        prompt_token_ids=[ids],
        sampling_params=SamplingParams(max_tokens=8, temperature=0),
        images=[[small, big]],
    )[0]
    assert prompt_ids == out.prompt_token_ids and got == out.outputs[0].token_ids and len(got) == 8
    # the big image (a 3x5 grid: 20 rows) is the last one and straddles P's split
    img = llm.cfg.image_token_id
    spans = [i for i, t in enumerate(prompt_ids) if t == img]
    assert len(spans) == 8 + 20
    s = split_point(llm.cfg, len(prompt_ids), "carry")
    assert spans[8] < s <= spans[-1]


@pytest.mark.parametrize(
    ("parts", "needle"),
    [
        (
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}],
            "cannot decode the image",
        ),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "not valid base64"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], "--allow-image-urls"),
        ([{"type": "image_url", "image_url": {"url": data_url(png(100, 100, 3))}}], "exceeds the limit of 20000 bytes"),
        ([{"type": "image_url", "image_url": {"url": data_url(png(8, 8, k))}} for k in range(3)], "at most 2"),
        ([{"type": "text", "text": "<｜deepseek_image｜>"}], "1 image placeholders but 0 images"),
    ],
)
def test_bad_images_are_400(client, parts, needle):
    if needle.startswith("1 image placeholders"):  # a literal placeholder in text needs an image to pair with
        parts = [*parts, {"type": "image_url", "image_url": {"url": data_url(png(8, 8, 9))}}]
        needle = "2 image placeholders but 1 images"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert needle in str(e.value)
