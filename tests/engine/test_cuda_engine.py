"""The engine on a GPU (skipped without one; run on the device, log in bench/results/cuda_engine_tests.log).

In fp32 the GPU's batched path must keep the CPU suite's equivalences in greedy tokens: asymmetric
P->D gives colocated ``split``'s tokens, and speculation on or off gives the same tokens. In bf16 they
are only expected to agree mostly: a different row mix in a step (a bounded prefill beside decodes,
verify rows beside plain ones) changes GEMM tiling, hence bf16 rounding, and the tiny random model
amplifies a last-bit difference until an argmax flips; the test prints how often that happens.
"""

from __future__ import annotations

import pytest
import torch

from asympd import LLM, SamplingParams
from asympd.engine.scheduler import SchedulerConfig
from tests.util import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LENGTHS = [20, 40, 90, 150, 300]


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=random_prompts(LENGTHS, seed=41), sampling_params=params)
    return [o.outputs[0].token_ids for o in outs]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True))
    return same / sum(len(s) for s in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_asymmetric_equals_colocated_split_on_cuda(tiny_ckpt, dtype):
    split = _tokens(LLM(tiny_ckpt, "colocated", "split", device="cuda", dtype=dtype))
    asym = _tokens(LLM(tiny_ckpt, "asymmetric", device="cuda", dtype=dtype))
    rate = _agreement(asym, split)
    print(f"asymmetric vs colocated split, {dtype}: {rate:.3f} of greedy tokens agree")
    if dtype == torch.float32:
        assert asym == split
    else:
        assert rate > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculation_keeps_the_greedy_tokens_on_cuda(tiny_ckpt, dtype):
    plain = _tokens(LLM(tiny_ckpt, "colocated", device="cuda", dtype=dtype))
    spec = _tokens(LLM(tiny_ckpt, "colocated", device="cuda", dtype=dtype, num_spec_tokens=2))
    rate = _agreement(spec, plain)
    print(f"speculation on vs off, {dtype}: {rate:.3f} of greedy tokens agree")
    if dtype == torch.float32:
        assert spec == plain
    else:
        assert rate > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("mode", "spec"), [("colocated", 2), ("asymmetric", 0)])
def test_cuda_graphs_keep_the_greedy_tokens(tiny_ckpt, dtype, mode, spec):
    """Decode and verify steps replayed as CUDA graphs, each captured by the first step of its shape
    (lazy capture; start-up capture is the next test's), give the eager engine's greedy tokens:
    exactly in fp32; in bf16 mostly (a padded batch changes GEMM shapes, hence rounding)."""
    sem = "split" if mode == "colocated" else "full"
    eager = LLM(tiny_ckpt, mode, sem, device="cuda", dtype=dtype, num_spec_tokens=spec, enforce_eager=True)
    graphed = LLM(tiny_ckpt, mode, sem, device="cuda", dtype=dtype, num_spec_tokens=spec, cuda_graph_capture="lazy")
    want, got = _tokens(eager), _tokens(graphed)
    stats = graphed.engine.runner.graphs.stats
    rate = _agreement(got, want)
    print(f"CUDA graphs vs eager, {mode} k={spec}, {dtype}: {rate:.3f} of greedy tokens agree; {stats}")
    assert stats["captured"] >= 1 and stats["replayed"] >= 5 and stats["startup"] == 0, stats
    assert eager.engine.runner.graphs is None
    if dtype == torch.float32:
        assert got == want
    else:
        assert rate > 0.5


def _p_graphs_against_eager(ckpt: str, mode: str, **graphed) -> tuple[list, list, dict]:
    """fp32 greedy tokens of an eager engine and of one whose P replays CUDA graphs (``graphed``:
    ``LLM``'s graph options), and that P's graph stats."""
    eager = LLM(ckpt, mode, device="cuda", dtype=torch.float32, enforce_eager=True)
    with_graphs = LLM(ckpt, mode, device="cuda", dtype=torch.float32, **graphed)
    assert eager.prefill.runner.graphs is None
    return _tokens(eager), _tokens(with_graphs), with_graphs.prefill.runner.graphs.stats


@pytest.mark.parametrize("mode", ["symmetric-split", "symmetric-windows"])
def test_a_symmetric_p_replays_its_window_steps_on_cuda(tiny_ckpt, mode):
    """A symmetric P's window steps (its prompts' last W rows through every layer, alone in their
    steps) replay the graphs built at start-up: the eager engine's greedy tokens in fp32, and no
    step builds a graph of its own."""
    want, got, stats = _p_graphs_against_eager(tiny_ckpt, mode)
    print(f"symmetric P's window graphs, {mode}: {stats}")
    assert got == want
    assert stats["startup"] >= 1 and stats["replayed"] >= 1 and stats["first"] == 0, stats


@pytest.mark.parametrize("mode", ["asymmetric", "encoder-only"])
def test_a_prefill_workers_piecewise_graphs_keep_the_greedy_tokens(tiny_ckpt, mode):
    """An asymmetric or encoder-only P's prompt steps replayed as piecewise graphs (its default;
    captured by the warm-up's prompts, one at each piece size) give the eager engine's greedy tokens
    in fp32."""
    want, got, stats = _p_graphs_against_eager(tiny_ckpt, mode)
    print(f"a P's piecewise graphs, {mode}: {stats}")
    assert got == want
    assert stats["captured"] >= 2 and stats["blocks"] >= 10 and stats["eager_blocks"] == 0, stats


def test_greedy_drafts_come_from_the_drafter_graph_on_cuda(tiny_ckpt):
    """Greedy generation with 3 drafts (fp32, start-up capture): every drafting step takes its drafts
    from the drafter's graph (the Markov loop replayed inside it, ``DraftGraphs.num_drafts``), none
    runs it eagerly, the verify steps' window seeding runs inside it too (``DraftGraphs.seed_rows``),
    and the tokens are the eager engine's. How many drafts were accepted is printed
    beside the eager engine's (not asserted: the graph pads the drafting batch, and fp32 GEMMs of
    another row count may round a draft's logits differently)."""
    eager = LLM(tiny_ckpt, "colocated", device="cuda", dtype=torch.float32, num_spec_tokens=3, enforce_eager=True)
    graphed = LLM(tiny_ckpt, "colocated", device="cuda", dtype=torch.float32, num_spec_tokens=3)
    want, got = _tokens(eager), _tokens(graphed)
    drafts = graphed.engine.proposer.graphs
    e, g = eager.engine.counters, graphed.engine.counters
    print(f"drafter graphs: {drafts.stats}; accepted {g['spec_accepted']} (eager {e['spec_accepted']})")
    assert got == want
    # every drafting step a replay (built at start-up), and each one's drafts from the graph's loop
    assert drafts.num_drafts == 3 and drafts.stats["first"] == drafts.stats["eager"] == 0, drafts.stats
    assert drafts.stats["markov"] == drafts.stats["replayed"] >= 5, drafts.stats
    # verify steps of drafting requests alone seed the windows inside the captured graph (seed_rows
    # = 1 + k); steps beside a prompt's chunks seed eagerly
    assert drafts.seed_rows == 4 and drafts.stats["seeded"] >= 1, drafts.stats


@pytest.mark.parametrize(
    ("mode", "spec", "mixed"),
    [("colocated", 2, True), ("asymmetric", 0, True), ("asymmetric", 0, False), ("symmetric-split", 0, False)],
)
def test_graphs_captured_at_startup_serve_generate_without_a_capture(tiny_ckpt, mode, spec, mixed):
    """Start-up capture (the default): every decode/verify graph and drafter graph is built from
    padding-only steps before the first request; greedy generation then gives the eager engine's
    tokens (fp32) and captures nothing more: each step replays a graph built before the first request
    (at start-up, or by the warm-up's throwaway prompts). Unmixed
    (the alone-4 policy), a D's first steps alone (asymmetric's bounded prefills, symmetric-split's
    replays without logits or global writes) replay their graphs too."""
    sem = "split" if mode == "colocated" else "full"

    def llm(**kw) -> LLM:
        sched = SchedulerConfig(max_num_seqs=8, mixed_steps=mixed)  # padded sizes 1, 2, 4, 8 (5 prompts)
        return LLM(
            tiny_ckpt, mode, sem, device="cuda", dtype=torch.float32, num_spec_tokens=spec, scheduler=sched, **kw
        )

    eager, graphed = llm(enforce_eager=True), llm()
    report = graphed.engine.startup_capture
    print(report.line())
    decode = graphed.engine.runner.graphs
    every = [decode] + ([graphed.engine.proposer.graphs] if spec else [])
    contexts = [1024, 2048, 4096] + ([8192] if spec else [])  # up to tiny's max_seq_len 4096 + k
    assert sorted({k.context for k in report.keys}) == contexts and not report.lazy
    # sizes x rows (1 + k, 1, k) x contexts, and on a D steps of its W-row first steps
    # alone at every size (uncapped admissions; a 2048-row step holds 128 of tiny's 16-row ones)
    prefills = 4 * len(contexts) if mode != "colocated" else 0
    assert len(report.keys) == 4 * (1 + spec) * len(contexts) + prefills
    before = [dict(g.stats) for g in every]
    for g, b in zip(every, before, strict=True):
        assert b["captured"] == len(g.graphs) >= b["startup"] > 0 and b["replayed"] == b["first"] == 0, b
    # the start-up warm-up (on by default on CUDA) runs one prompt at a time; a prompt of a graph's
    # row count (1 + k or fewer rows, or W on a D) takes a graph of one request, captured then,
    # before the first request, as a served step of that shape would capture it mid-traffic
    extra = set(decode.graphs) - set(report.keys)
    assert len(extra) == before[0]["captured"] - before[0]["startup"], extra
    assert all(k.segments == 1 for k in extra), extra
    want, got = _tokens(eager), _tokens(graphed)
    first_steps = sum(n for k, n in decode.steps_by_key.items() if k.rows == 16)  # tiny's W
    print(f"start-up graphs, {mode} k={spec} mixed={mixed}: {decode.stats}, {first_steps} first steps")
    assert got == want
    if not mixed:  # every step a graph: the first steps (16 rows each; the five came in one step on the H200)
        assert first_steps >= 1 and decode.stats["eager"] == 0, decode.stats
    for g, b in zip(every, before, strict=True):
        assert g.stats["captured"] == b["captured"] and g.stats["first"] == 0, g.stats
        assert g.stats["replayed"] >= 5, g.stats


@pytest.mark.parametrize(("mode", "spec"), [("colocated", 2), ("asymmetric", 0)])
def test_fused_attention_on_cuda_attends_as_the_gathered_path(tiny_ckpt, monkeypatch, mode, spec):
    """The batched path's fused sparse attention (on by default on CUDA) against the gathered path
    it replaced, fp32, decode/verify steps replayed as CUDA graphs captured with the fused kernel
    (lazily): every eager call's output within 1e-5 (per row, relative) of the gathered path's on
    the same inputs, and graphs captured and replayed with it. (The greedy tokens of 2 of the 5
    prompts part from the gathered engine's on the H200, as they do under a random 1e-6 error on
    the gathered path's output: ``bench/fused_attention_tokens.py``; so only the agreement is
    printed.)"""
    import dataclasses

    from asympd.model.attention import Attention
    from asympd.model.cuda_ops import CUDA_KERNELS

    sem = "split" if mode == "colocated" else "full"
    checked: list[int] = []
    original = Attention._attend_fused

    def attend(self, q, kv, win, sel, view):
        got = original(self, q, kv, win, sel, view)
        if not torch.cuda.is_current_stream_capturing():
            want = self._attend_gathered(q, kv, win, sel, view)
            err = (got - want).abs().flatten(1).amax(1) / want.abs().flatten(1).amax(1).clamp_min(1e-30)
            assert float(err.max()) < 1e-5, f"layer {self.layer}: {float(err.max())}"
            checked.append(q.size(0))
        return got

    def llm(fused: bool) -> LLM:
        out = LLM(
            tiny_ckpt, mode, sem, device="cuda", dtype=torch.float32, num_spec_tokens=spec, cuda_graph_capture="lazy"
        )
        for e in (out.prefill, out.engine):
            for block in [] if e is None else e.runner.model.blocks:
                if getattr(block, "attn", None) is not None:
                    block.attn.kernels = dataclasses.replace(CUDA_KERNELS, fused_attention=fused)
        return out

    want = _tokens(llm(False))
    assert not checked
    monkeypatch.setattr(Attention, "_attend_fused", attend)
    fused = llm(True)
    got = _tokens(fused)
    stats = fused.engine.runner.graphs.stats
    print(f"fused attention, {mode} k={spec}: {len(checked)} calls checked; graphs {stats}; ", end="")
    print(f"{_agreement(got, want):.3f} of greedy tokens agree with the gathered path's")
    assert checked and stats["captured"] >= 1 and stats["replayed"] >= 5, stats


def test_images_through_asymmetric_pd_on_cuda(tiny_ckpt):
    """Image rows (the vision tower, ``gate.bias_vl`` in the CUDA MoE) on the GPU in fp32: asymmetric
    P->D gives colocated ``split``'s greedy tokens with images at the start, in the middle, inside
    the last W and straddling the split."""
    from tests.engine.test_vision import run

    params = SamplingParams(max_tokens=6, temperature=0)
    want = run(LLM(tiny_ckpt, "colocated", "split", device="cuda", dtype=torch.float32), params)
    got = run(LLM(tiny_ckpt, "asymmetric", device="cuda", dtype=torch.float32), params)
    assert {c: o.token_ids for c, o in got.items()} == {c: o.token_ids for c, o in want.items()}


@pytest.mark.parametrize("kv_format", ["unpacked", "fp4"])
def test_prefix_export_on_a_side_stream_gives_the_synchronous_bytes(tiny_ckpt, kv_format):
    """P's export is enqueued on a side stream into pooled pinned buffers and returns at once; the
    next step (another prompt's prefill) is enqueued before anyone waits for it. The bytes equal a
    synchronous export of the same blocks, and the pinned buffers go back to the pool with the
    transfer, for the next export to reuse. (Greedy asymmetric P->D tokens with the side stream:
    ``test_asymmetric_equals_colocated_split_on_cuda``.)"""
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.export import PrefixExporter
    from asympd.engine.scheduler import SchedulerConfig
    from asympd.model.loader import load_model
    from asympd.transfer.prefix_state import PrefixState

    model = load_model(tiny_ckpt, "prefill", device="cuda", dtype=torch.float32)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512)
    p = LLMEngine(model, EngineConfig(role="prefill", mode="asymmetric", kv_wire_format=kv_format, scheduler=sched))
    side = p.runner.exporter
    assert side.stream is not None and side.pool.pin

    def synchronous(rid: str) -> PrefixState:
        p.runner.exporter = PrefixExporter("cuda", side_stream=False)
        kw = {"fingerprint": p.fingerprint, "mode": "asymmetric", "policy": p.config.boundary_policy}
        try:
            return p.runner.export_prefix(p.held[rid], kv_format=kv_format, **kw).wait()
        finally:
            p.runner.exporter = side

    a, b = random_prompts([301, 151], seed=5)  # splits 285, 135: each with an open ratio-2 pair
    p.add_request("a", a)
    (out,) = [o for o in p.step() if o.finished]
    assert out.prefix_export.done is not None
    p.add_request("b", b)
    assert [o.request_id for o in p.step() if o.finished] == ["b"]  # enqueued while a's copy may run
    state = out.exported_state()
    ref = synchronous("a")
    assert 1 in state.pair_kv and state.pair_kv[1].is_pinned() and not ref.pair_kv[1].is_pinned()
    assert state.ckv[1].is_cuda == (kv_format == "fp4")
    assert state.equal(ref) and state.serialize() == ref.serialize()
    assert PrefixState.deserialize(state.serialize()).equal(ref)
    p.release_transfer("a")
    assert side.pool.stats()["idle_bytes"] > 0  # a's buffers, back in the pool with the transfer
    p.release_transfer("b")
    p.add_request("c", a)
    (out,) = [o for o in p.step() if o.finished]
    assert out.exported_state().equal(synchronous("c")) and side.pool.stats()["reused"] >= 1
    p.release_transfer("c")
    while p.has_unfinished_requests():  # b's copy, should it still be draining: an idle step waits for it
        p.step()
    assert p.blocks.num_used_blocks == 0 and not p.draining


def test_the_hand_off_packs_beside_the_compute_stream(tiny_ckpt):
    """Under fp4 the hand-off (P's seal, then its send) packs the wire format and copies it to the
    host on the exporter's pack stream: with the compute stream still busy (a long sleep enqueued
    after the export, standing in for P's next steps), the packed host bytes are ready before that
    work ends, and they are the bytes a CPU packs. Before, each host sync of the pack waited for the
    compute stream: the hand-off advanced only between P's steps (docs/planner.md)."""
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.scheduler import SchedulerConfig
    from asympd.model.loader import load_model
    from asympd.transfer.prefix_state import PrefixState, tensor_bytes

    model = load_model(tiny_ckpt, "prefill", device="cuda", dtype=torch.float32)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512)
    p = LLMEngine(model, EngineConfig(role="prefill", mode="asymmetric", kv_wire_format="fp4", scheduler=sched))
    p.add_request("a", random_prompts([301], seed=5)[0])
    (out,) = [o for o in p.step() if o.finished]
    state = out.exported_state()
    assert state.pack_stream is p.runner.exporter.pack_stream is not None
    assert state.pack_stream.priority < torch.cuda.default_stream().priority  # ahead of P's next step
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of the compute stream, enqueued after the export
    header, buffers = state.to_buffers(host=True)
    assert not compute.query(), "the hand-off waited for the compute stream"
    assert all(not b.is_cuda for b in buffers)
    cpu_header, cpu_buffers = state.to("cpu").to_buffers()
    assert header == cpu_header
    assert [tensor_bytes(b).tobytes() for b in buffers] == [tensor_bytes(b).tobytes() for b in cpu_buffers]
    assert PrefixState.from_buffers(header, buffers).equal(state.to("cpu"))
    torch.cuda.synchronize()
    p.release_transfer("a")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forked_choices_on_cuda_compute_the_prompt_once(tiny_ckpt, dtype):
    """OpenAI's n on the GPU with speculation and CUDA graphs: choices 1..n-1 fork from the first at
    its last prompt row (the prompt is computed once) and each gives the tokens it gives alone
    (exactly in fp32; mostly in bf16, where the forked rows share steps with other row mixes)."""
    (prompt,) = random_prompts([90], seed=41)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] + [
        SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (3, 4)
    ]
    llm = LLM(tiny_ckpt, "colocated", device="cuda", dtype=dtype, num_spec_tokens=2, enable_prefix_caching=False)
    eng = llm.engine

    def finish() -> dict[str, list[int]]:
        out = {}
        while eng.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        assert eng.blocks.num_used_blocks == 0
        return out

    alone = []
    for i, p in enumerate(params):
        eng.add_request(f"alone{i}", prompt, p)
        alone.append(finish()[f"alone{i}"])
    before = eng.counters["prompt_tokens"]
    for i, p in enumerate(params):
        eng.add_request(f"c{i}", prompt, p, fork_of="c0" if i else None)
    got = finish()
    forked = [got[f"c{i}"] for i in range(len(params))]
    rate = _agreement(forked, alone)
    graphs = eng.runner.graphs.stats if eng.runner.graphs else None
    print(f"forked choices vs alone, {dtype}: {rate:.3f} of tokens agree; graphs {graphs}")
    assert eng.counters["prompt_tokens"] - before == len(prompt)  # once, not three times
    if dtype == torch.float32:
        assert forked == alone
    else:
        assert rate > 0.5
