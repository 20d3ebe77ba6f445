"""The released FP4 cache formats on the wire: lossless packing (asserted on bits), the refusal of
values off the grid and of malformed packed buffers, and the bytes per prompt token (facts §5)."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asympd import LLM, SamplingParams
from asympd.config import tiny, v41_flash
from asympd.model.quant import E2M1_VALUES, FP4_TABLE, fp4_qdq, pack_fp4
from asympd.transfer import PrefixState, PrefixStateError, kv_pack
from asympd.transfer.kv_pack import MXFP4, NVFP4, KVPackError, pack, pack_unchecked, unpack, wire_bytes_per_token
from asympd.transfer.seal import seal, verify
from asympd.transfer.tcp import TcpTransport, UnpackOn, unpack_received
from asympd.transfer.transport import make_transport
from tests.transfer.transfer_peer import make_state
from tests.util import random_prompts

CFG = tiny()


def quantized(rows: int, width: int, fmt, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Cache entries as the model writes them: fp4_qdq of values over a wide range of magnitudes,
    with all-zero blocks and signed zeros among them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * 2.0 ** torch.randint(-30, 12, (rows, 1), generator=gen)
    x[0] = 0.0
    x[1, : fmt.block] = -0.0
    x[2] *= 1e-30  # below the quantizer's amax floor: the smallest scale
    return fp4_qdq(x.to(dtype), fmt.block, e4m3_scale=fmt is NVFP4)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pack_is_lossless_on_bits(fmt, dtype):
    values = quantized(64, 128, fmt, dtype)
    codes, scales = pack(values, fmt)
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == (64, 64)
    assert scales.dtype == fmt.scale_dtype and tuple(scales.shape) == (64, 128 // fmt.block)
    back = unpack(codes, scales, fmt).to(dtype)
    assert torch.equal(bits(back), bits(values))
    assert torch.signbit(back[1, : fmt.block]).all() and not torch.signbit(back[0]).any()
    assert codes.nbytes + scales.nbytes == 64 * fmt.bytes_per_entry(128)


def one_at_a_time(values: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale search as written first: each block tries amax / c for the e2m1 magnitudes c,
    largest first, and keeps the first scale the format stores that puts every value back bit for
    bit (amax 0: the quantizer's floor)."""
    g = values.float().reshape(-1, fmt.block)
    codes = torch.zeros(g.shape, dtype=torch.uint8)
    scales = torch.zeros(g.size(0))
    for i, block in enumerate(g):
        amax = float(block.abs().max())
        for c in E2M1_VALUES[1:].flip(0).tolist():
            s = torch.tensor(fmt.zero_scale) if amax == 0 else torch.tensor(amax) / c
            if not fmt.scale_ok(s):
                continue
            code = torch.searchsorted(E2M1_VALUES, (block / s).abs()).clamp_max(7).to(torch.uint8)
            code |= torch.signbit(block).to(torch.uint8) << 3
            if torch.equal((FP4_TABLE[code.long()] * s).view(torch.int32), block.view(torch.int32)):
                codes[i], scales[i] = code, s
                break
    n, d = values.shape
    return pack_fp4(codes.reshape(n, d)).view(torch.uint8), scales.reshape(n, -1).to(fmt.scale_dtype)


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
def test_pack_takes_the_scale_the_one_at_a_time_search_takes(fmt):
    """One pass at the natural scale, then every other candidate side by side for the blocks it
    missed (most MXFP4 blocks: their power-of-two scale is rarely amax / 6), gives the search's bytes."""
    values = quantized(40, 128, fmt, torch.bfloat16, seed=3)
    codes, scales, ok = pack_unchecked(values, fmt)
    want = one_at_a_time(values, fmt)
    assert ok.all() and torch.equal(codes, want[0]) and torch.equal(scales.view(torch.uint8), want[1].view(torch.uint8))
    amax = values.float().reshape(-1, fmt.block).abs().amax(-1)
    later = (scales.float().reshape(-1) != amax / 6) & (amax > 0)
    assert later.sum() >= 10  # the side-by-side pass is covered, not only the first


def test_pack_unchecked_flags_the_blocks_off_the_grid():
    values = quantized(6, 64, NVFP4)
    values[2, 40] = 0.1234567
    values[4, 0] = float("nan")
    codes, scales, ok = pack_unchecked(values, NVFP4)
    assert ok.view(6, 4).logical_not().nonzero().tolist() == [[2, 2], [4, 0]]
    good = pack(values[:2], NVFP4)
    assert torch.equal(codes[:2], good[0]) and torch.equal(scales[:2].view(torch.uint8), good[1].view(torch.uint8))


def test_values_off_the_grid_are_refused():
    values = quantized(8, 64, NVFP4)
    values[5, 20] = 0.1234567
    with pytest.raises(KVPackError, match=r"row 5, values 16\.\.31 are not on the nvfp4 grid"):
        pack(values, NVFP4)
    with pytest.raises(KVPackError, match="not on the mxfp4 grid"):
        pack(torch.full((1, 32), float("nan")), MXFP4)


def test_malformed_packed_buffers_are_refused():
    codes, scales = pack(quantized(4, 64, NVFP4), NVFP4)
    with pytest.raises(KVPackError, match=r"codes \(4, 31\) do not match scales \(4, 4\)"):
        unpack(codes[:, :31], scales, NVFP4)
    with pytest.raises(KVPackError, match=r"codes \(3, 32\) do not match scales \(4, 4\)"):
        unpack(codes[:3], scales, NVFP4)
    bad = scales.clone()
    bad.view(torch.uint8)[2, 1] = 0x7F  # e4m3 NaN
    with pytest.raises(KVPackError, match="scale of row 2, block 1 is nan: not a positive finite scale"):
        unpack(codes, bad, NVFP4)
    bad.view(torch.uint8)[2, 1] = 0xB8  # -1.0
    with pytest.raises(KVPackError, match="scale of row 2, block 1 is -1.0"):
        unpack(codes, bad, NVFP4)
    with pytest.raises(KVPackError, match="scales are torch.float8_e4m3fn, mxfp4 keeps them in torch.float8_e8m0fnu"):
        unpack(codes, scales, MXFP4)


def test_wire_bytes_per_token_at_v41_size():
    cfg = v41_flash()
    assert NVFP4.bytes_per_entry(cfg.head_dim) == 288 and MXFP4.bytes_per_entry(cfg.index_head_dim) == 68
    assert wire_bytes_per_token(cfg, "fp4") == 890  # facts §5
    assert wire_bytes_per_token(cfg, "unpacked", 2) == 3200  # bf16: 3.6x
    assert wire_bytes_per_token(CFG, "fp4") == 1.5 * (36 + 17)  # tiny: L1 ratio 2, L3 ratio 1


# ---- the prefix state on the wire -------------------------------------------------------------------


def packed_state(split: int = 21, n: int = 37, dtype: str = "bfloat16") -> PrefixState:
    """A tiny state whose ckv/idx hold quantized cache values (random bits elsewhere)."""
    state = make_state(split, n, dtype)
    for layer in CFG.kv_source_layers:
        rows = state.ckv[layer].size(0)
        state.ckv[layer] = quantized(rows, CFG.head_dim, NVFP4, seed=layer).to(state.ckv[layer].dtype)
        state.idx[layer] = quantized(rows, CFG.index_head_dim, MXFP4, seed=layer + 7).to(state.idx[layer].dtype)
    state.kv_format = "fp4"
    return state


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_state_round_trips_packed_bit_exact(dtype):
    state = packed_state(dtype=dtype)
    header, buffers = state.to_buffers()
    table = {e["name"]: (e["dtype"], tuple(e["shape"])) for e in json.loads(header)["buffers"]}
    assert table["ckv.1"] == ("uint8", (10, 32)) and table["ckv_scale.1"] == ("float8_e4m3fn", (10, 4))
    assert table["idx.3"] == ("uint8", (21, 16)) and table["idx_scale.3"] == ("float8_e8m0fnu", (21, 1))
    assert table["pair_kv.1"] == ("float32", (1, 64))  # the open pair stays as it is
    back = PrefixState.deserialize(state.serialize())
    assert back.equal(state) and back.kv_format == "fp4"
    for layer in CFG.kv_source_layers:
        assert torch.equal(bits(back.ckv[layer]), bits(state.ckv[layer]))
        assert torch.equal(bits(back.idx[layer]), bits(state.idx[layer]))
    state.validate(CFG, state.fingerprint)
    plain = PrefixState.from_buffers(*state.to_buffers())
    plain.kv_format = "unpacked"
    assert state.wire_nbytes < plain.wire_nbytes == plain.nbytes
    assert len(state.serialize()) < len(plain.serialize())


def test_state_off_the_grid_cannot_ship_packed():
    state = make_state(21, 37)  # random bits: not cache values
    state.kv_format = "fp4"
    with pytest.raises(PrefixStateError, match=r"ckv\[1\]: row 0, values 0\.\.15 are not on the nvfp4 grid"):
        state.serialize()


def test_the_wire_is_packed_once_for_the_seal_and_the_send(monkeypatch):
    """P seals a state (HMAC over its wire bytes), then sends it: the ckv/idx buffers are packed
    once, by the first, and both read the same host bytes."""
    state = packed_state()
    calls = []
    real = kv_pack.pack

    def counting(values, fmt):
        calls.append(fmt.name)
        return real(values, fmt)

    monkeypatch.setattr(kv_pack, "pack", counting)
    tag = seal(b"k", "xfer-1", state)
    header, buffers = state.to_buffers(host=True)
    blob = state.serialize()
    assert sorted(calls) == ["mxfp4"] * 2 + ["nvfp4"] * 2  # one per packed buffer of the two sources
    assert seal(b"k", "xfer-1", PrefixState.from_buffers(header, buffers)) == tag
    assert PrefixState.deserialize(blob).equal(state) and all(not b.is_cuda for b in buffers)
    # the seal and the send ask from two threads at once (P's handler and its transport): one pack
    calls.clear()
    fresh = dataclasses.replace(state)
    with ThreadPoolExecutor(4) as pool:
        wires = list(pool.map(lambda _: fresh.to_buffers(host=True), range(4)))
    assert sorted(calls) == ["mxfp4"] * 2 + ["nvfp4"] * 2
    same = [all(a.data_ptr() == b.data_ptr() for a, b in zip(w[1], wires[0][1], strict=True)) for w in wires]
    assert all(w[0] == header for w in wires) and all(same)  # the same host buffers, not copies


def _tamper(state: PrefixState, name: str, fn):
    header, buffers = state.to_buffers()
    parsed = json.loads(header)
    i = [e["name"] for e in parsed["buffers"]].index(name)
    entry = parsed["buffers"][i]
    buffers[i], shape = fn(buffers[i].clone())
    if shape is None:
        del parsed["buffers"][i], buffers[i]
    else:
        entry["shape"] = list(shape)
        entry["nbytes"] = buffers[i].numel() * buffers[i].element_size()
    return parsed, buffers


def test_truncated_or_misscaled_packed_buffers_are_refused():
    state = packed_state()

    def truncate(t):
        return t[:, :31].contiguous(), (10, 31)

    def nan_scale(t):
        t.view(torch.uint8)[3, 2] = 0xFF
        return t, t.shape

    def drop(t):
        return t, None

    cases = [
        ("ckv.1", truncate, r"packed ckv\[1\]: codes \(10, 31\) do not match scales \(10, 4\)"),
        ("ckv_scale.1", nan_scale, r"packed ckv\[1\]: scale of row 3, block 2 is nan"),
        ("idx_scale.3", drop, r"packed idx\[3\] arrived without its scales \(idx_scale\.3\)"),
        ("idx.3", drop, r"idx_scale\[3\] has no codes buffer"),
    ]
    for name, fn, msg in cases:
        with pytest.raises(PrefixStateError, match=msg):
            PrefixState.from_buffers(*_tamper(state, name, fn))


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_unpack_kernel_gives_the_torch_bits(fmt, dtype):
    """``kv_pack.unpack``'s one-launch Triton kernel (a GPU receiver's path; here under the
    interpreter) against its torch ops: every byte value (so every 4-bit code in both nibbles, -0
    included), scales across the format's range, a total that does not fill the last program."""
    g = torch.Generator().manual_seed(3)
    n, d = 37, 256
    codes = torch.randint(0, 256, (n, d // 2), generator=g, dtype=torch.uint8)
    codes[0] = torch.arange(128, dtype=torch.uint8)
    codes[1] = torch.arange(128, 256, dtype=torch.uint8)
    exps = torch.randint(-10, 4, (n, d // fmt.block), generator=g).float()
    scales = (2.0**exps * (1.0 if fmt is MXFP4 else 1.125)).to(fmt.scale_dtype)
    want = unpack(codes, scales, fmt, dtype, kernel=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there, else the interpreter
    got = unpack(codes.to(dev), scales.to(dev), fmt, dtype, kernel=True).cpu()
    assert got.dtype == dtype and got.shape == (n, d) and (n * d) % 1024
    assert torch.equal(bits(got), bits(want))
    minus_zero = got[1, 16:18]  # byte 0x88 (row 1, byte 8): code 8 in both nibbles
    assert (minus_zero == 0).all() and torch.signbit(minus_zero).all()
    assert got[0, 14].item() == 6.0 * scales[0, 0].float().item()  # byte 7: low nibble 7 (6), the even element
    if torch.cuda.is_available():  # the default on the GPU is the kernel
        assert torch.equal(bits(unpack(codes.cuda(), scales.cuda(), fmt, dtype).cpu()), bits(got))


def test_a_receiver_unpacks_each_kind_in_one_batch(monkeypatch):
    """Every layer's ckv in one unpack and every layer's idx in another (a GPU receiver shares the
    device with the steps in flight: fewer kernels and syncs to wait behind them); the values are
    the buffer-by-buffer unpacking's, bit for bit."""
    state = packed_state()
    header, buffers = state.to_buffers(host=True)
    calls = []
    real = kv_pack.unpack
    monkeypatch.setattr(
        kv_pack, "unpack", lambda c, s, fmt, *a, **k: calls.append((c.size(0), fmt.name)) or real(c, s, fmt, *a, **k)
    )
    got = PrefixState.from_buffers(header, buffers)
    rows = {kind: sum(getattr(state, kind)[k].size(0) for k in CFG.kv_source_layers) for kind in ("ckv", "idx")}
    assert sorted(calls) == sorted([(rows["ckv"], NVFP4.name), (rows["idx"], MXFP4.name)])
    assert got.equal(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packing_on_the_device_gives_the_host_bytes():
    """On a GPU the state's ckv/idx are packed where they live (the runner keeps them there under
    fp4): the packed buffers stay on the device until the D2H copy, and the blob is the host's."""
    state = packed_state()
    on_gpu = state.to("cuda")
    _, buffers = on_gpu.to_buffers()
    assert all(b.is_cuda for b in buffers if b.numel())
    assert on_gpu.serialize() == state.serialize()
    for fmt, values in ((NVFP4, state.ckv[1]), (MXFP4, state.idx[3])):
        codes, scales = pack(values.cuda(), fmt)
        want = pack(values, fmt)
        assert torch.equal(codes.cpu(), want[0])
        assert torch.equal(scales.cpu().view(torch.uint8), want[1].view(torch.uint8))
        assert torch.equal(bits(unpack(codes, scales, fmt).cpu()), bits(unpack(*want, fmt)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_d_unpacks_what_it_receives_on_its_gpu():
    """A D on a GPU (``TcpTransport(device=...)``, its engine's device) moves the packed KV there and
    unpacks it on a stream of its own: the values on the device, bit for bit the host's unpacking,
    the tag still checked over the host bytes that arrived."""
    state = packed_state()
    tag = seal(b"k", "xfer-1", state)
    with (
        TcpTransport(state.fingerprint, secret=b"k") as p,
        TcpTransport(state.fingerprint, secret=b"k", device="cuda") as d,
    ):
        got = d.fetch(p.publish("xfer-1", state), state.fingerprint, timeout=10)
        # ahead of the steps in flight (lower is higher; the engine's stream is at 0)
        assert d.unpack_on.stream.priority < torch.cuda.default_stream().priority
    assert set(got.receipt) == {"arrive_s", "unpack_s"} and got.receipt["unpack_s"] > 0
    for layer in CFG.kv_source_layers:
        assert got.ckv[layer].is_cuda and got.idx[layer].is_cuda
        assert torch.equal(bits(got.ckv[layer].cpu()), bits(state.ckv[layer]))
        assert torch.equal(bits(got.idx[layer].cpu()), bits(state.idx[layer]))
    assert not got.token_ids.is_cuda and all(not b.is_cuda for b in got.arrived[1])
    verify(b"k", "xfer-1", got, tag, state.token_ids.tolist())
    got.validate(CFG, state.fingerprint)


def test_a_tcp_receiver_unpacks_where_it_is_told():
    state = packed_state()
    header, buffers = state.to_buffers(host=True)
    assert make_transport("tcp", state.fingerprint, device="cpu").device == "cpu"
    assert unpack_received(header, buffers, None).equal(state)
    assert unpack_received(header, buffers, UnpackOn("cpu")).equal(state)


# ---- through the engines ----------------------------------------------------------------------------


def test_packed_and_unpacked_give_identical_d_tokens(tiny_ckpt):
    """Asymmetric P/D with the state shipped packed or unpacked: the same tokens and the same
    full-vocabulary log-probabilities, bit for bit; the packed wire is the smaller one."""
    lens = [17, 33, 48, 101]  # splits 1, 17 (odd: open pair), 32, 85
    prompts = random_prompts(lens, seed=5)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=-1)
    runs = {}
    for fmt in ("fp4", "unpacked"):
        llm = LLM(tiny_ckpt, "asymmetric", kv_wire_format=fmt)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        runs[fmt] = ([o.outputs[0] for o in outs], dict(llm.transfer_bytes))
    (packed, packed_bytes), (plain, plain_bytes) = runs["fp4"], runs["unpacked"]
    for a, b in zip(packed, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # floats compared exactly
    assert packed_bytes.keys() == plain_bytes.keys() and len(packed_bytes) == 4
    # the 101-token prompt (split 85): the fp32 cache's 576 B of global KV per prefix token become
    # 79.5 B; token ids, the open pair, the header and the 64-byte alignment are the rest of a blob
    split, rest = 85, 101 * 8 + 2 * 64 * 4
    assert split * wire_bytes_per_token(CFG, "fp4") + rest < packed_bytes["3"] < plain_bytes["3"] / 5
    assert split * wire_bytes_per_token(CFG, "unpacked", 4) + rest < plain_bytes["3"]
