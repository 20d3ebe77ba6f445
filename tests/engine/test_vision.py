"""Images through every P/D mode (docs/vision.md): asymmetric P -> D (and both symmetric-split
baselines) give the bits of colocated ``split`` with an image at the start, in the middle, inside
the last W rows, straddling the split (one and two images), and with N <= W; encoder-only P -> D
gives the bits of D computing the prefix alone; and each side encodes only what it must."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from asympd import LLM, SamplingParams
from asympd.engine.modes import image_rows_shipped, split_point
from asympd.engine.scheduler import SchedulerConfig

W = 16  # the tiny preset's window
IMG = 511  # the tiny tokenizer's <｜deepseek_image｜>


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def text(n: int, seed: int) -> list[int]:
    return torch.randint(3, 490, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SMALL, BIG = (16, 16), (40, 24)  # spans of 8 and 20 tokens (2x2 and 3x5 aligner grids)
# name -> (token ids with one IMG placeholder per image, the images' sizes); expanded positions in comments
CASES = {
    "start": (text(0, 0) + [IMG] + text(40, 1), [SMALL]),  # N=48, image [0, 8), s=32
    "middle": (text(20, 2) + [IMG] + text(30, 3), [SMALL]),  # N=58, image [20, 28), s=42
    "last-W": (text(30, 4) + [IMG] + text(4, 5), [SMALL]),  # N=42, image [30, 38), s=26
    "straddle": (text(20, 6) + [IMG] + text(13, 7), [SMALL]),  # N=41, image [20, 28), s=25 (odd)
    "two": (text(3, 8) + [IMG] + text(10, 9) + [IMG] + text(5, 10), [SMALL, BIG]),  # N=46, [3,11) [21,41), s=30
    "short": (text(2, 11) + [IMG] + text(3, 12), [SMALL]),  # N=13 <= W: asymmetric P does nothing
}


def images_of(case: str) -> list[bytes]:
    return [png(w, h, seed=100 + i) for i, (w, h) in enumerate(CASES[case][1])]


def run(llm: LLM, params: SamplingParams):
    names = list(CASES)
    outs = llm.generate(
        prompt_token_ids=[CASES[c][0] for c in names], sampling_params=params, images=[images_of(c) for c in names]
    )
    return {c: o.outputs[0] for c, o in zip(names, outs, strict=True)}


def assert_same_bits(got, want, label: str) -> None:
    for case in CASES:
        g, w = got[case], want[case]
        assert g.token_ids == w.token_ids, f"{label}: {case}"
        for step, (lg, lw) in enumerate(zip(g.logprobs, w.logprobs, strict=True)):
            a, b = torch.tensor(list(lg.values())), torch.tensor(list(lw.values()))
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{label}: {case}, step {step}"


PARAMS = SamplingParams(max_tokens=4, temperature=0, logprobs=-1)
# chunks of 7 rows: a chunk boundary falls inside every image span
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7)


@pytest.mark.parametrize("policy", ["carry", "align"])
def test_pd_modes_with_images_equal_colocated_split(tiny_ckpt, policy):
    want = run(LLM(tiny_ckpt, "colocated", "split", boundary_policy=policy), PARAMS)
    for mode in ("asymmetric", "symmetric-split", "symmetric-windows"):
        llm = LLM(tiny_ckpt, mode, boundary_policy=policy, scheduler=SCHED)
        assert_same_bits(run(llm, PARAMS), want, f"{mode}/{policy}")
        for engine in (llm.prefill, llm.engine):
            assert engine.blocks.num_used_blocks == 0, mode
    chunked = LLM(tiny_ckpt, "colocated", "split", boundary_policy=policy, scheduler=SCHED)
    assert_same_bits(run(chunked, PARAMS), want, "colocated chunked")


def test_encoder_only_and_symmetric_with_images(tiny_ckpt):
    """encoder-only: P encodes every image and ships D's rows; D's replay then equals D computing the
    prefix itself (the fallback plan). symmetric: P's first token is colocated decoder-replay's."""
    llm = LLM(tiny_ckpt, "encoder-only")
    got = run(llm, PARAMS)
    alone = LLM(tiny_ckpt, "encoder-only")
    alone.prefill = None  # requests go straight to D, which computes the prefix (decode_fallback_plan)
    assert_same_bits(got, run(alone, PARAMS), "encoder-only")
    first = SamplingParams(max_tokens=1, temperature=0)
    sym = run(LLM(tiny_ckpt, "symmetric"), first)
    rep = run(LLM(tiny_ckpt, "colocated", "decoder-replay"), first)
    assert {c: o.token_ids for c, o in sym.items()} == {c: o.token_ids for c, o in rep.items()}


def test_each_side_encodes_only_what_it_must(tiny_ckpt, monkeypatch):
    """Asymmetric: P encodes the images it computes a row of and ships the straddler's tail; D encodes
    only images wholly in its rows. No image is encoded twice."""
    llm = LLM(tiny_ckpt, "asymmetric", boundary_policy="carry")
    counts = {"P": 0, "D": 0}
    for side, engine in (("P", llm.prefill), ("D", llm.engine)):
        tower = engine.model.vision
        orig = tower.encode

        def counted(*a, side=side, orig=orig):
            counts[side] += 1
            return orig(*a)

        monkeypatch.setattr(tower, "encode", counted)
    expect = {"start": (1, 0), "middle": (1, 0), "last-W": (0, 1), "straddle": (1, 0), "two": (2, 0), "short": (0, 1)}
    cfg = llm.cfg
    for case, (p, d) in expect.items():
        counts.update(P=0, D=0)
        ids, sizes = CASES[case]
        llm.transfer_bytes.clear()
        out = llm.generate(
            prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1), images=[images_of(case)]
        )
        assert out[0].outputs[0].token_ids, case
        assert (counts["P"], counts["D"]) == (p, d), case
    # what crosses for the straddler: the spans, and the image's rows at or after the split
    n = len(CASES["straddle"][0]) - 1 + 8
    s = split_point(cfg, n, "carry")
    assert image_rows_shipped(cfg, n, "asymmetric", "carry", [(20, 28)]) == list(range(s, 28))
    assert image_rows_shipped(cfg, n, "asymmetric", "carry", [(30, 38)]) == []  # wholly in D's rows
    assert image_rows_shipped(cfg, n, "symmetric", "carry", [(30, 38)]) == list(range(30, 38))  # P has it


def test_the_image_matters_and_prefix_cache_keys_on_it(tiny_ckpt):
    """Same token ids, another image: other logits; and a decode worker that cached the first image's
    prefix does not serve the second from it (the cache key carries the images' digests)."""
    ids = CASES["start"][0]
    a, b = [png(16, 16, seed=1)], [png(16, 16, seed=2)]
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=-1)
    warm = LLM(tiny_ckpt, "asymmetric")
    first = warm.generate(prompt_token_ids=[ids], sampling_params=params, images=[a])[0].outputs[0]
    assert warm.engine.blocks.pool.num_cached > 0  # D registered the imported prefix
    second = warm.generate(prompt_token_ids=[ids], sampling_params=params, images=[b])[0].outputs[0]
    fresh = LLM(tiny_ckpt, "asymmetric").generate(prompt_token_ids=[ids], sampling_params=params, images=[b])
    assert first.logprobs[0] != second.logprobs[0]
    assert second.logprobs == fresh[0].outputs[0].logprobs
    again = warm.generate(prompt_token_ids=[ids], sampling_params=params, images=[a])[0].outputs[0]
    assert again.logprobs == first.logprobs


def test_bad_image_requests_are_refused(tiny_ckpt):
    from asympd.engine.engine import RequestError
    from asympd.engine.images import decode_image

    llm = LLM(tiny_ckpt, "colocated")
    ids = CASES["middle"][0]
    with pytest.raises(ValueError, match="1 image placeholders but 2 images were given"):
        llm.generate(prompt_token_ids=[ids], images=[[png(16, 16, 0), png(16, 16, 1)]])
    with pytest.raises(ValueError, match="cannot decode the image"):
        llm.generate(prompt_token_ids=[ids], images=[[b"not an image"]])
    image = decode_image(png(16, 16, 0), llm.cfg)
    with pytest.raises(RequestError, match="image token 511 must fill exactly the image spans"):
        llm.engine.add_request("x", [5] * 12, SamplingParams(), images=[image.at(2)])
    with pytest.raises(RequestError, match="leaves the prompt"):
        llm.engine.add_request("y", [5, IMG, IMG], SamplingParams(), images=[image.at(1)])
    assert not llm.engine.requests and llm.engine.blocks.num_used_blocks == 0


def test_decode_worker_refuses_image_rows_it_did_not_ask_for(tiny_ckpt):
    """D checks the state's spans against its own request and its rows against the rule, before
    anything is allocated."""
    from asympd.engine.images import decode_image
    from asympd.model.vision import expand_placeholders
    from asympd.transfer.prefix_state import PrefixStateError

    llm = LLM(tiny_ckpt, "asymmetric")
    raw, _ = CASES["straddle"]
    images = [decode_image(b, llm.cfg) for b in images_of("straddle")]
    ids = expand_placeholders(llm.cfg, list(raw), images)
    llm.prefill.add_request("p", ids, SamplingParams(max_tokens=1), images=images)
    state = None
    while state is None:
        state = next((o.prefix_state for o in llm.prefill.step() if o.prefix_state is not None), None)
    s = split_point(llm.cfg, len(ids), "carry")
    assert state.image_spans.tolist() == [[20, 8]] and state.image_pos.tolist() == list(range(s, 28))
    cases = {
        "ships image rows at": dict(image_pos=state.image_pos[1:], image_rows=state.image_rows[1:]),
        "are not this request's": dict(image_spans=torch.tensor([[19, 9]])),
    }
    for needle, change in cases.items():
        bad = dataclasses.replace(state, **change)
        with pytest.raises(PrefixStateError, match=needle):
            llm.engine.add_request("d", ids, SamplingParams(max_tokens=1), prefix_state=bad, images=images)
    assert not llm.engine.requests and llm.engine.blocks.num_used_blocks == 0
    llm.engine.add_request("d", ids, SamplingParams(max_tokens=1), prefix_state=state, images=images)


def test_streamed_prefix_with_images_equals_colocated_split(tiny_ckpt):
    """P streams its prefix in slices as its chunks finish; the image rows travel in the last one."""
    names = ["straddle", "two", "last-W"]
    sub = {c: CASES[c] for c in names}
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=-1)

    def go(llm):
        outs = llm.generate(
            prompt_token_ids=[sub[c][0] for c in names], sampling_params=params, images=[images_of(c) for c in names]
        )
        return [o.outputs[0] for o in outs]

    want = go(LLM(tiny_ckpt, "colocated", "split"))
    streamed = LLM(tiny_ckpt, "asymmetric", scheduler=SCHED, stream_prefix=True)
    got = go(streamed)
    assert all(len(v) > 1 for v in streamed.slices.values())  # really in several slices
    for c, g, w in zip(names, got, want, strict=True):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs, c
