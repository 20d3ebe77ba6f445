"""The prefill worker's prefix export (engine/export.py): the bytes a plain copy gives, found without a
device sync, and blocks that outlive the copy reading them."""

from __future__ import annotations

import pytest
import torch

from asympd import SamplingParams
from asympd.engine import runner as runner_mod
from asympd.engine.engine import EngineConfig, LLMEngine, RequestError
from asympd.engine.export import PinnedPool
from asympd.engine.scheduler import SchedulerConfig
from asympd.model.loader import load_model
from asympd.transfer.prefix_state import PrefixState
from tests.util import random_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    return {"full": load_model(tiny_ckpt, "full"), "prefill": load_model(tiny_ckpt, "prefill")}


def prefill_engine(model, mode="asymmetric", **kw) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=kw.pop("chunk", 256))
    return LLMEngine(model, EngineConfig(role="prefill", mode=mode, scheduler=sched, **kw))


def run(eng: LLMEngine, limit: int = 200) -> list:
    outs = []
    for _ in range(limit):
        outs += eng.step()
        if not eng.has_unfinished_requests():
            return outs
    raise AssertionError("engine did not finish")


def masked_export(eng: LLMEngine, rid: str, start: int = 0) -> dict[str, torch.Tensor]:
    """The buffers as the export made them before it moved off the step: gathered entries, and
    slot rows selected by a mask over their positions (a device sync each)."""
    req, cfg = eng.held[rid], eng.cfg
    s, bt = req.export_upto, eng.blocks.block_table(rid)
    view = eng.runner.view(req)
    out = {}
    for layer in cfg.kv_source_layers:
        r = cfg.ratio(layer)
        out[f"ckv.{layer}"] = eng.cache.read_entries(f"ckv.{layer}", bt, s // r - start // r, start // r)
        out[f"idx.{layer}"] = eng.cache.read_entries(f"idx.{layer}", bt, s // r - start // r, start // r)
        if r > 1 and s % r:
            kv, score, pos = view.pending(layer)
            keep = (pos >= s // r * r) & (pos < s)
            out[f"pair_kv.{layer}"], out[f"pair_score.{layer}"] = kv[keep], score[keep]
    if eng.config.mode == "symmetric-windows":
        for layer in range(cfg.n_layers):
            kv, pos = view.window(layer)
            keep = pos >= req.num_prompt_tokens - cfg.window_size
            out[f"swa_kv.{layer}"], out[f"swa_pos.{layer}"] = kv[keep], pos[keep]
    return out


def no_mask(*_args):
    raise AssertionError("the export fell back to a masked (syncing) read of the slot rows")


@pytest.mark.parametrize(
    ("model", "mode", "kv_format", "n", "pair"),
    [
        ("prefill", "asymmetric", "unpacked", 41, True),  # split 25: an open ratio-2 pair
        ("prefill", "asymmetric", "fp4", 40, False),
        ("full", "symmetric-windows", "unpacked", 41, True),  # every layer's window too
        ("full", "symmetric-windows", "fp4", 9, True),  # N < W: the windows hold the whole prompt
    ],
)
def test_export_gives_the_bytes_of_a_masked_copy_without_a_sync(models, monkeypatch, model, mode, kv_format, n, pair):
    monkeypatch.setattr(runner_mod, "_masked", no_mask)
    p = prefill_engine(models[model], mode, kv_wire_format=kv_format)
    p.add_request("x", random_prompts([n], seed=n)[0], GREEDY)
    (out,) = [o for o in run(p) if o.finished]
    state = out.exported_state()
    assert out.prefix_export.ready() and state is out.prefix_state
    assert out.prefix_export.copy_s() is None  # a CPU copies as it exports: nothing to time
    want = masked_export(p, "x")
    got = {k: v for k, v in state.named_buffers().items() if not k.startswith("image") and k != "token_ids"}
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert ("pair_kv.1" in got) == pair and ("swa_kv.0" in got) == (mode == "symmetric-windows")
    again = PrefixState.deserialize(state.serialize())  # and it crosses the wire as it is
    assert again.equal(PrefixState.deserialize(state.serialize()))
    p.release_transfer("x")
    assert p.blocks.num_used_blocks == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_export_times_its_copy(tiny_ckpt):
    """``copy_s``: the GPU time from the step's compute end to the copy's end, once it is done;
    the server reports it beside its wait (``export_copy_s``)."""
    p = prefill_engine(load_model(tiny_ckpt, "prefill", device="cuda", dtype=torch.bfloat16))
    p.add_request("x", random_prompts([41], seed=41)[0], GREEDY)
    (out,) = [o for o in run(p) if o.finished]
    out.exported_state()
    copy = out.prefix_export.copy_s()
    assert copy is not None and 0.0 <= copy < 1.0, copy
    p.release_transfer("x")


def test_streamed_slices_are_exported_without_a_sync(models, monkeypatch):
    """A streamed prefix's slices (each chunk's entries, the open pair with the last) give the
    entries a whole export gives."""
    monkeypatch.setattr(runner_mod, "_masked", no_mask)
    prompt = random_prompts([75], seed=3)[0]  # split 59: an open pair at the end
    whole = prefill_engine(models["prefill"], kv_wire_format="unpacked")
    whole.add_request("x", prompt, GREEDY)
    (ref,) = [o.exported_state() for o in run(whole) if o.finished]
    p = prefill_engine(models["prefill"], kv_wire_format="unpacked", stream_prefix=True, chunk=16)
    p.add_request("x", prompt, GREEDY)
    pieces = [o.exported_state() for o in run(p) if o.prefix_state is not None]
    assert [(s.start, s.split) for s in pieces] == [(0, 16), (16, 32), (32, 48), (48, 59)]
    for layer in (1, 3):
        assert torch.equal(torch.cat([s.ckv[layer] for s in pieces]), ref.ckv[layer])
        assert torch.equal(torch.cat([s.idx[layer] for s in pieces]), ref.idx[layer])
    assert torch.equal(pieces[-1].pair_kv[1], ref.pair_kv[1]) and torch.equal(
        pieces[-1].pair_score[1], ref.pair_score[1]
    )


class Gate:
    """A copy's completion event whose completion the test decides; ``synchronize`` (a consumer
    waiting) completes it."""

    def __init__(self) -> None:
        self.done, self.waits = False, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def gate_exports(eng: LLMEngine) -> list[Gate]:
    """Every export of ``eng`` from now on reports its completion through a Gate (where a GPU
    engine's reports it through a CUDA event)."""
    gates: list[Gate] = []

    def completion() -> Gate:
        gates.append(Gate())
        return gates[-1]

    eng.runner.exporter.completion = completion
    return gates


@pytest.mark.parametrize("ending", ["abort", "release"])
def test_blocks_under_a_running_copy_are_not_reused(models, ending):
    """A request whose export is still copying keeps its blocks when aborted or released; a later
    step neither waits for the copy nor hands those blocks to another request; they are freed at
    the first step after the copy is done."""
    p = prefill_engine(models["prefill"], num_blocks=6, enable_prefix_caching=False, chunk=16)
    gates = gate_exports(p)
    a, b = random_prompts([41, 41], seed=7)
    p.add_request("a", a, GREEDY)
    outs = []
    while not outs:
        outs = [o for o in p.step() if o.finished]
    (out,) = outs
    a_table = list(p.blocks.block_table("a"))
    a_blocks = set(a_table)
    assert len(gates) == 1 and not out.prefix_export.ready() and len(a_blocks) == 3
    p.abort_request("a") if ending == "abort" else p.release_transfer("a")
    assert p.stats()["held_for_transfer"] == 0 and p.stats()["exports_draining"] == 1
    assert p.blocks.num_used_blocks == 3 and p.has_unfinished_requests()
    with pytest.raises(RequestError, match="already in use"):
        p.add_request("a", a, GREEDY)
    p.add_request("b", b, GREEDY)  # needs 3 of the 6 blocks: only the 3 free ones may serve it
    assert p.step() == []  # b's first chunk
    assert set(p.blocks.block_table("b")).isdisjoint(a_blocks) and p.blocks.num_free_blocks == 0
    assert gates[0].waits == 0 and "a" in p.draining  # the step ran beside the copy, not after it
    blob = out.prefix_state.serialize()  # reading the bytes waits for the copy, even without wait()
    assert gates[0].waits == 1 and torch.equal(out.prefix_state.ckv[3], p.cache.read_entries("ckv.3", a_table, 25))
    assert PrefixState.deserialize(blob).equal(out.exported_state())
    assert [o.request_id for o in p.step() if o.finished] == ["b"]
    assert "a" not in p.draining and "b" in p.held  # a's blocks went at the first step after the copy
    assert p.blocks.num_used_blocks == 3
    p.release_transfer("b")  # b's copy not done: nothing else runs, so the next step waits for it
    assert p.blocks.num_used_blocks == 3 and p.has_unfinished_requests()
    assert p.step() == [] and gates[1].waits == 1
    assert p.blocks.num_used_blocks == 0 and not p.has_unfinished_requests()
    p.add_request("a", a, GREEDY)  # and the id is free again
    assert [o.prefix_state.split for o in run(p) if o.finished] == [25]


class _HostPool(PinnedPool):
    """The pool's bookkeeping with plain memory standing in for pinned (no CUDA here)."""

    def _alloc(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)


def test_pinned_pool_reuses_by_size_class_and_keeps_a_bounded_idle_set():
    pool = _HostPool(max_idle_bytes=16 << 10)
    a = pool.acquire(5000)
    assert a.numel() == 8 << 10 and pool.acquire(100).numel() == 4 << 10  # power-of-two classes, 4 KiB floor
    pool.release(a)
    b = pool.acquire(6000)
    assert b.data_ptr() == a.data_ptr() and pool.stats()["reused"] == 1  # same class: the same buffer
    more = [pool.acquire(8 << 10) for _ in range(2)]
    for t in (b, *more):
        pool.release(t)
    assert pool.stats() == {"idle_bytes": 16 << 10, "allocated": 4, "reused": 1, "dropped": 1}
    assert PinnedPool(pin=False).acquire(5000).numel() == 5000  # no CUDA: plain, unpooled tensors
