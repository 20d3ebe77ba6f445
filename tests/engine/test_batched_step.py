"""The batched step (every layer once over all of a step's sequences, straight from the paged cache:
kv/batch.py) against the per-sequence reference path it replaced, on the same workloads: the same
tokens and logprobs, and the same cache bytes and host bookkeeping afterwards."""

from __future__ import annotations

import pytest
import torch

from asympd import LLM, SamplingParams
from asympd.config import tiny
from asympd.engine.cuda_graphs import BATCH_SIZES, DecodeGraphs, DraftGraphs, PrefillPieces
from asympd.engine.scheduler import SchedulerConfig
from asympd.kv.batch import BatchSegment, PagedBatch, find_positions
from asympd.kv.paged_cache import PagedKVCache
from asympd.kv.spec import KVCacheSpec
from tests.util import random_prompts

LENGTHS = (3, 17, 40, 61, 100)  # tiny: window 16, ratios 2 and 1; a 24-row budget chunks the long ones


def _engines(llm: LLM) -> list:
    return [e for e in (llm.prefill, llm.engine) if e is not None]


_EAGER: dict[tuple, tuple[list, list[dict[str, torch.Tensor]]]] = {}


def _eager(
    ckpt: str, mode: str, spec: int, budget: int = 24, greedy: bool = False, lengths: tuple[int, ...] = LENGTHS
) -> tuple[list, list]:
    """The eager batched step's tokens, logprobs, counters and cache bytes, the reference most tests
    here compare against: run once per workload in the session (a run takes 3-10 s and is
    deterministic; the same workloads recur across tests). Callers only read the result."""
    key = (ckpt, mode, spec, budget, greedy, lengths)
    if key not in _EAGER:
        _EAGER[key] = _run(ckpt, mode, batched=True, spec=spec, budget=budget, greedy=greedy, lengths=lengths)
    return _EAGER[key]


def _run(
    ckpt: str,
    mode: str,
    batched: bool,
    spec: int,
    graphs: list | None = None,
    startup: list | None = None,
    mixed: bool = True,
    budget: int = 24,
    greedy: bool = False,
    markov: bool = False,
    seed: bool = False,
    lengths: tuple[int, ...] = LENGTHS,
    p_graphs: list | None = None,
    p_pieces: list | None = None,
) -> tuple[list, list[dict[str, torch.Tensor]]]:
    """``graphs``: give each decoding engine the static (graph) decode path without capture, and
    collect its DecodeGraphs here. ``startup``: build them first, from padding only, for the
    contexts up to 1024 (``LLMEngine.capture_graphs``), and collect its report here. ``mixed``:
    ``SchedulerConfig.mixed_steps``; ``budget``: its ``max_num_batched_tokens``. ``greedy``: every
    request greedy (else one samples); ``markov``: the drafter's graphs run the greedy Markov loop
    of ``spec`` drafts (``DraftGraphs.num_drafts``, as the engine builds them); ``seed``: they seed
    the windows with each request's 1 + ``spec`` accepted rows too (``DraftGraphs.seed_rows``);
    ``lengths``: the prompts' (one request each). ``p_graphs``: give a symmetric P its window
    steps' static path (``LLMEngine.make_graphs``) and collect it here (with ``startup``: built
    first, from padding only, every context bound the engine would). ``p_pieces``: run the P's
    prompt steps as piecewise graphs' static path (``cuda_graph_mode`` full_and_piecewise, as the
    engine builds them) and collect its graphs here."""
    sem = "split" if mode == "colocated" else "full"
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, mixed_steps=mixed)
    llm = LLM(ckpt, mode, sem, scheduler=sched, num_spec_tokens=spec)
    for e in _engines(llm):
        e.runner.model.batched = batched
        if p_graphs is not None and e.config.role == "prefill":  # a symmetric P's, as the engine builds them
            e.runner.graphs = e.make_graphs(capture=False)
            p_graphs.append(e.runner.graphs)
            if startup is not None:
                startup.append(e.capture_graphs())
        if p_pieces is not None and e.config.role == "prefill":
            e.config.cuda_graph_mode = "full_and_piecewise"
            e.runner.graphs = e.make_prefill_pieces(capture=False) or e.make_graphs(capture=False)
            p_pieces.append(e.runner.graphs)
        if graphs is not None and e.config.role != "prefill":
            n = sched.max_num_seqs  # padded sizes up to the engine's largest batch, as the engine builds them
            # as the engine builds them: a D's steps of first-step chunks alone (W rows) qualify too
            first = e._first_steps.rows if e._first_steps else None
            e.runner.graphs = DecodeGraphs(
                e.runner.model,
                e.runner.cache,
                max_batch=n,
                capture=False,
                piecewise=True,
                max_rows=1 + spec,
                prefill_rows=first,
            )
            graphs.append(e.runner.graphs)
            if e.proposer is not None:
                e.proposer.graphs = DraftGraphs(
                    e.proposer.drafter,
                    e.runner.cache,
                    max_batch=n,
                    capture=False,
                    num_drafts=spec if markov else 0,
                    seed_rows=1 + spec if seed else 0,
                )
                graphs.append(e.proposer.graphs)
            if startup is not None:
                # the smallest context bound only: every decode step here stays below 1024 positions
                prefills = e._first_steps.most if e._first_steps else 0  # W rows: padded request counts
                e.config.cuda_graph_max_captures = len(e.runner.graphs.sizes) * (1 + spec) + prefills
                startup.append(e.capture_graphs())
    params = [SamplingParams(max_tokens=10, temperature=0, logprobs=2) for _ in lengths]
    if not greedy:
        params[1] = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, logprobs=1)
    outs = llm.generate(prompt_token_ids=random_prompts(list(lengths), seed=3), sampling_params=params)
    result = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    # drafts do not change greedy tokens, only how many are accepted: compare those counts too
    result += [{k: v for k, v in e.counters.items() if k.startswith("spec_")} for e in _engines(llm)]
    caches = []
    for e in _engines(llm):
        c = e.runner.cache
        n, s = c.num_blocks, c.max_seqs  # the scratch block and slot (padding rows) hold anything
        state = {f"pool.{k}": v[:n].clone() for k, v in c.pools.items()}
        for layer, rows in {**{f"swa.{k}": v for k, v in c.windows.items()}, **c.pairs}.items():
            state[f"{layer}.length"] = torch.from_numpy(rows.length[:s].copy())
            state[f"{layer}.last"] = torch.from_numpy(rows.last[:s].copy())
            live = rows.pos[:s] >= 0  # rows past a slot's length are free space, whatever they hold
            state[f"{layer}.pos"] = rows.pos[:s].clone()
            for i, b in enumerate(rows.bufs[:-1]):
                state[f"{layer}.buf{i}"] = b[:s] * live.unsqueeze(-1)
        caches.append(state)
    return result, caches


@pytest.mark.parametrize(("mode", "spec"), [("colocated", 2), ("asymmetric", 2), ("symmetric", 0)])
def test_batched_step_equals_the_per_sequence_path(tiny_ckpt, mode, spec):
    """Mixed steps (chunked prefills beside decodes, speculative verify rows and their rollback, a
    seeded sampled request): tokens, logprobs and every cache byte match the reference path."""
    want_out, want_cache = _run(tiny_ckpt, mode, batched=False, spec=spec)
    got_out, got_cache = _eager(tiny_ckpt, mode, spec)
    assert got_out == want_out
    for want, got in zip(want_cache, got_cache, strict=True):
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize(
    ("mode", "spec"),
    [("colocated", 2), ("asymmetric", 0), ("symmetric-windows", 0), ("encoder-only", 2), ("symmetric-split", 0)],
)
def test_graph_decode_path_equals_the_eager_step(tiny_ckpt, mode, spec):
    """The path decode steps take as CUDA graphs (engine/cuda_graphs.py: requests padded to a
    captured batch size onto the scratch slot and block, key counts padded to a power of two,
    ceil(rows / ratio) compressor groups written with the incomplete ones sent to scratch, host row
    counts replayed from a log), run here without capture over the same static buffers step after
    step: tokens, logprobs and every cache byte equal the eager batched step's. With speculation the
    drafter's blocks take their static path too (DraftGraphs), and the other steps run each layer's
    parts around attention as padded pieces (PiecewiseGraphs)."""
    want_out, want_cache = _eager(tiny_ckpt, mode, spec)
    graphs: list = []
    got_out, got_cache = _run(tiny_ckpt, mode, batched=True, spec=spec, graphs=graphs)
    assert got_out == want_out
    for want, got in zip(want_cache, got_cache, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    assert len(graphs) == (2 if spec else 1)  # the decode steps', and the drafter's blocks'
    for g in graphs:
        assert g.stats["first"] >= 2, g.stats  # the static path at two padded sizes ...
        assert g.stats["replayed"] >= 2, g.stats  # ... and again over the same buffers
    g = graphs[0]
    # the other steps (prefill chunks beside decodes) ran their layers as padded pieces; with P's
    # windows shipped (symmetric-windows) D computes no prompt row, so it has none
    pieces = g.piecewise.stats
    assert (pieces["blocks"] == 0) if mode == "symmetric-windows" else (pieces["blocks"] >= 10), pieces
    assert not pieces["eager"], pieces
    assert all(k.segments in BATCH_SIZES for k in g.graphs)


@pytest.mark.parametrize("mode", ["asymmetric", "encoder-only", "symmetric-split", "symmetric"])
def test_a_prefill_workers_piecewise_steps_equal_its_eager_steps(tiny_ckpt, mode):
    """A P's prompt steps with each layer's parts around attention replayed as padded pieces
    (``cuda_graph_mode`` full_and_piecewise; here without capture, over the same static buffers):
    tokens, logprobs and every cache byte on both sides equal the eager engine's. An asymmetric or
    encoder-only P has no whole-step graph (``PrefillPieces``); a symmetric P's window steps keep
    theirs and its prompt chunks take the pieces."""
    want_out, want_cache = _eager(tiny_ckpt, mode, 0)
    pieces: list = []
    got_out, got_cache = _run(tiny_ckpt, mode, batched=True, spec=0, p_pieces=pieces)
    assert got_out == want_out
    for want, got in zip(want_cache, got_cache, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    (g,) = pieces
    assert isinstance(g, PrefillPieces) == (mode in ("asymmetric", "encoder-only"))
    stats = g.piecewise.stats
    assert stats["blocks"] >= 10 and not stats["eager"], stats  # every prompt step's layers, as pieces
    # the server's report (/metrics, bench/e2e.py's graphs_after) reads ``stats``: the pieces in it
    assert g.stats["blocks"] == stats["blocks"] and g.stats["eager_blocks"] == 0
    if isinstance(g, PrefillPieces):
        assert g.run() is None and not g.graphs


@pytest.mark.parametrize(
    ("mode", "spec", "greedy"), [("colocated", 2, True), ("asymmetric", 3, True), ("colocated", 2, False)]
)
def test_the_draft_graphs_markov_loop_equals_the_eager_drafts(tiny_ckpt, mode, spec, greedy):
    """The drafter's graphs with the greedy Markov loop inside (``DraftGraphs(num_drafts=k)``, as the
    engine builds them; here without capture): a step of greedy requests takes its drafts from the
    graph (drafts fewer than k near max_tokens keep a prefix of the graph's k), a step with a sampled
    request runs the loop eagerly on the graph's base logits. Tokens, logprobs, the drafts' acceptance
    counts and every cache byte equal the eager engine's."""
    budget = max(24, 8 * (1 + spec))  # a decode step of all 8 requests fits
    want_out, want_cache = _eager(tiny_ckpt, mode, spec, budget=budget, greedy=greedy)
    graphs: list = []
    got_out, got_cache = _run(
        tiny_ckpt, mode, batched=True, spec=spec, graphs=graphs, budget=budget, greedy=greedy, markov=True
    )
    assert got_out == want_out
    for want, got in zip(want_cache, got_cache, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    draft = graphs[1].stats
    assert draft["first"] + draft["replayed"] >= 5, draft
    if greedy:  # every drafting step took the graph's drafts
        assert draft["markov"] == draft["first"] + draft["replayed"], draft
    else:  # the sampled request drafts in most steps: those ran the loop eagerly
        assert 0 <= draft["markov"] < draft["first"] + draft["replayed"], draft


@pytest.mark.parametrize(
    ("mode", "spec", "greedy", "startup"),
    [("colocated", 2, True, False), ("asymmetric", 3, True, True), ("colocated", 2, False, False)],
)
def test_the_draft_graphs_seeding_equals_the_eager_seeding(tiny_ckpt, monkeypatch, mode, spec, greedy, startup):
    """The drafter's graphs that also seed the windows (``DraftGraphs(seed_rows=1 + k)``, as the
    engine builds them; here without capture): a verify step's accepted rows (1 to 1 + k per
    request, padded to 1 + k) are appended inside the static path, the host row counts replayed
    from its log; the other drafting steps (a prompt's last rows, seed-only requests) seed eagerly
    and the static seeding writes only the scratch slot. With ``startup`` the drafter's graphs come
    from padding requests before any request. Tokens, logprobs, acceptance counts and every cache
    byte (windows, their row counts) equal the eager engine's; right after each seeded step every
    seeded slot's host row counts match its window's positions (the next rollback would hide them)."""
    budget = max(24, 8 * (1 + spec))  # a decode step of all 8 requests fits
    want_out, want_cache = _eager(tiny_ckpt, mode, spec, budget=budget, greedy=greedy)
    checked = []
    run = DraftGraphs.run

    def run_and_check(self, tokens, positions, slots, seed=None):
        out = run(self, tokens, positions, slots, seed)
        if seed is not None:
            for layer, rows in self.cache.windows.items():
                if layer < self.drafter.cfg.n_layers:
                    continue  # the target's windows: the step's forward wrote them
                for slot, start, n in zip(slots, seed[1], seed[2], strict=True):
                    pos = rows.pos[slot]
                    assert int(rows.length[slot]) == int((pos >= 0).sum()), (layer, slot)
                    assert int(rows.last[slot]) == int(pos.max()) == start + n - 1, (layer, slot)
                    checked.append(slot)
        return out

    monkeypatch.setattr(DraftGraphs, "run", run_and_check)
    graphs: list = []
    got_out, got_cache = _run(
        tiny_ckpt,
        mode,
        batched=True,
        spec=spec,
        graphs=graphs,
        budget=budget,
        greedy=greedy,
        markov=True,
        seed=True,
        startup=[] if startup else None,
    )
    assert got_out == want_out
    for want, got in zip(want_cache, got_cache, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    draft = graphs[1].stats
    runs = draft["first"] + draft["replayed"]
    # most drafting steps are verify steps, seeded in the static path; the first (a prompt's rows) is not
    assert 3 <= draft["seeded"] < runs, draft
    assert len(checked) >= 3, len(checked)
    if startup:
        assert draft["startup"] == len(graphs[1].sizes) and draft["first"] == 0, draft


@pytest.mark.parametrize(
    ("mode", "spec"),
    [("colocated", 2), ("asymmetric", 0), ("symmetric-windows", 0), ("encoder-only", 2), ("symmetric-split", 0)],
)
def test_graphs_built_at_startup_serve_the_real_steps(tiny_ckpt, mode, spec):
    """The graphs built before any request, from steps of padding segments only (what start-up
    capture does on CUDA), then serve every decode and verify step: no step builds its own, and
    tokens, logprobs and every cache byte equal the eager batched step's. Run without capture, the
    static path re-runs its layers, but over the buffers and the batch the padding step built, and
    any host read of a segment's start or slot (which a graph would bake in) raises."""
    want_out, want_cache = _eager(tiny_ckpt, mode, spec)
    graphs: list = []
    reports: list = []
    got_out, got_cache = _run(tiny_ckpt, mode, batched=True, spec=spec, graphs=graphs, startup=reports)
    assert got_out == want_out
    for want, got in zip(want_cache, got_cache, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    (report,) = reports
    decode = graphs[0]
    rows = [3, 1, 2] if spec else [1]  # verify steps, plain decode steps, one draft fewer
    # a D's first steps alone (tiny's W = 16 rows; a 24-row step admits one), but for the modes that
    # compute no prompt row there
    prefills = [] if mode in ("colocated", "symmetric-windows") else [(16, 1)]
    assert [(k.rows, k.segments) for k in report.keys] == [(q, b) for q in rows for b in (8, 4, 2, 1)] + prefills
    assert {k.context for k in report.keys} == {1024} and {k.width for k in report.keys} == {1024 // 16}
    # left lazy: the other context bounds up to max_seq_len + k (4096 + 2 on tiny)
    assert sorted({k.context for k in report.lazy}) == ([2048, 4096, 8192] if spec else [2048, 4096])
    assert report.draft_graphs == (4 if spec else 0)
    line = report.line()
    assert line.startswith(f"CUDA graphs at start-up: {len(report.keys)} decode/verify graphs (batch sizes 1-8, ")
    assert f"{len(report.lazy)} left to capture when first met (contexts 2048-" in line
    for g in graphs:
        assert g.stats["startup"] == len(g.graphs), g.stats  # nothing built after start-up ...
        assert g.stats["first"] == 0 and g.stats["replayed"] >= 5, g.stats  # ... though steps ran on them
    assert decode.stats["startup"] == len(report.keys)


@pytest.mark.parametrize(("mode", "startup"), [("symmetric-split", False), ("symmetric-windows", True)])
def test_a_symmetric_p_replays_its_window_steps_as_graphs(tiny_ckpt, mode, startup):
    """A symmetric P's last phase (a prompt's last W rows through every layer, sampling the first
    token) takes the graph path when its step holds only such chunks, as a D's first steps do:
    tokens, logprobs and every cache byte of P and D equal the eager engine's. P's graphs are keyed
    by W rows only (P never decodes); with ``startup`` they are built from padding before any
    request, every context bound the engine would, and no step builds its own."""
    want_out, want_cache = _eager(tiny_ckpt, mode, 0)
    p_graphs: list = []
    reports: list | None = [] if startup else None
    got_out, got_cache = _run(tiny_ckpt, mode, batched=True, spec=0, startup=reports, p_graphs=p_graphs)
    assert got_out == want_out
    for want, got in zip(want_cache, got_cache, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    (g,) = p_graphs
    served = g.stats["first"] + g.stats["replayed"]
    # every window (W = 16 rows: the 17-, 40-, 61- and 100-token prompts') in a step of its own
    # (``SchedulerConfig.one_depth_per_step``); the prefix chunks and the 3-token prompt run eagerly
    assert served == 4 and g.stats["eager"] == 7, g.stats
    assert {(k.rows, k.logits, k.write_global) for k in g.graphs} == {(16, "last", True)}
    assert g.sizes == [1]  # a 24-row step holds one window (at most P_WINDOW_GRAPH_BATCH)
    if startup:
        (report,) = reports
        assert [(k.rows, k.segments, k.context) for k in report.keys] == [(16, 1, c) for c in (1024, 2048, 4096)]
        assert g.stats["startup"] == len(g.graphs) == 3 and g.stats["first"] == 0, g.stats


def test_a_prompt_of_a_power_of_two_tokens_replays_a_graph_built_at_start_up(tiny_ckpt):
    """A prompt of exactly 1024 tokens (a context bound) ends its window step with a block table one
    block past the bound (the block of the token P samples): the step takes the next bound's graph,
    built at start-up, where it used to build a wider graph of its own mid-traffic (a 0.5-0.8 s
    stall at true depth: the e2e calibration's 1024-token prompts met one in P and in D). Tokens,
    logprobs and every cache byte equal the eager engine's."""
    lengths = (1024, 40)
    want_out, want_cache = _eager(tiny_ckpt, "symmetric-split", 0, lengths=lengths)
    p_graphs: list = []
    reports: list = []
    got_out, got_cache = _run(
        tiny_ckpt, "symmetric-split", batched=True, spec=0, startup=reports, p_graphs=p_graphs, lengths=lengths
    )
    assert got_out == want_out
    for want, got in zip(want_cache, got_cache, strict=True):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    (g,) = p_graphs
    assert g.stats["replayed"] == 2 and g.stats["first"] == 0 and len(g.graphs) == g.stats["startup"], g.stats
    assert {k.context for k in g.steps_by_key} == {1024, 2048}  # the 40-token prompt's and the 1024's


@pytest.mark.parametrize("mode", ["asymmetric", "symmetric-split"])
def test_unmixed_steps_replay_the_first_steps_as_graphs(tiny_ckpt, mode, monkeypatch):
    """With the ``alone-4`` policy's unmixed steps, a D's first steps for its requests (W rows
    each: asymmetric's bounded prefill, symmetric-split's replay) come without decode rows and take
    the graphs built at start-up, as decode steps do; tokens and logprobs stay the eager mixed
    engine's. Mixed, those chunks ride in decode steps, which then run eagerly."""
    want_out, _ = _eager(tiny_ckpt, mode, 0, budget=32)
    steps: list[tuple[list[int], bool]] = []  # (rows of each chunk, served by a graph) of D's steps
    key = DecodeGraphs.key

    def recording(self, ordered, segs):
        k = key(self, ordered, segs)
        steps.append(([len(c.token_ids) for c in ordered], k is not None))
        return k

    monkeypatch.setattr(DecodeGraphs, "key", recording)
    served = {}
    for mixed in (True, False):
        steps.clear()
        got_out, _ = _run(tiny_ckpt, mode, batched=True, spec=0, graphs=[], startup=[], mixed=mixed, budget=32)
        assert got_out == want_out
        first = [ok for rows, ok in steps if 16 in rows]  # steps carrying a first-step chunk (W = 16 rows)
        served[mixed] = sum(first), len(first)
        if not mixed:
            assert not any(1 in rows and max(rows) > 1 for rows, _ in steps)  # no decode row beside prompt rows
            assert all(ok for rows, ok in steps if set(rows) in ({1}, {16}))  # decode steps, first steps alone
    # mixed, no first step is a graph's. Unmixed, symmetric-split's three are (17 and 40 share one); an
    # asymmetric D also prefills the 3-row prompt whole, and its rows beside two W-row chunks split the
    # third over two steps at this 32-row budget (cap-4's 512 rows are 4 x W: no split there)
    assert served == ({True: (0, 3), False: (1, 3)} if mode == "asymmetric" else {True: (0, 3), False: (3, 3)})


def test_a_captured_step_refuses_host_reads_of_segment_values(tiny_ckpt):
    """A graph bakes in every host decision of its capture: in a batch laid out for one
    (``fixed_groups``), the host starts and slots are off limits, the layout is not."""
    cache = PagedKVCache(KVCacheSpec.from_config(tiny(), block_size=16), 8, 4, scratch=True)
    batch = PagedBatch(cache, [BatchSegment([0], 0, 5, 2), BatchSegment([1], 1, 9, 2)])
    view = batch.rows_view(0, 2, decoder=False)
    assert view.host("start").tolist() == [5, 9]
    batch.fixed_groups = True
    for name in ("start", "slot"):
        with pytest.raises(RuntimeError, match=f"must not read the segments' host '{name}'"):
            view.host(name)
    assert view.host("rows").tolist() == [2, 2] and view.host("write_global").tolist() == [True, True]
    with pytest.raises(ValueError, match="layout"):  # write_global is part of the layout
        batch.load([BatchSegment([0], 0, 5, 2), BatchSegment([1], 1, 9, 2, write_global=False)])


def test_find_positions_searches_across_a_gap():
    """An imported prefix can leave a gap in a slot's positions: the lookup searches, never assumes
    position - first."""
    stored = torch.tensor([[3, 4, 5, 9, 10, -1, -1]])
    idx, found = find_positions(stored, torch.tensor([[4, 9, 10, 6, 11, -1]]))
    assert idx[found].tolist() == [1, 3, 4]
    assert found.tolist() == [[True, True, True, False, False, False]]


def test_paged_batch_lays_out_rows_and_rejects_an_empty_step(tiny_ckpt):
    from asympd.config import tiny

    cfg = tiny()
    cache = PagedKVCache(KVCacheSpec.from_config(cfg, 16, spec_slack=2), 8, 4)
    batch = PagedBatch(cache, [BatchSegment([1], 2, 5, 3), BatchSegment([0, 4], 0, 30, 2, floor=14)])
    assert batch.positions.tolist() == [5, 6, 7, 30, 31]
    assert batch.row_seg.tolist() == [0, 0, 0, 1, 1]
    assert batch.block_table.tolist() == [[1, 0], [0, 4]]
    view = batch.rows_view(1, 2, decoder=True)
    assert (view.r0, view.num_rows) == (3, 2)
    assert view.seg("floor").tolist() == [14]
    assert view.seg("lo").tolist() == [0]
    with pytest.raises(ValueError, match="at least one segment"):
        PagedBatch(cache, [])


def test_truncating_many_slots_at_once_equals_one_by_one(tiny_ckpt):
    """The speculative rollback of a whole step is one call (one host sync)."""
    from asympd.config import tiny

    cfg = tiny()
    spec = KVCacheSpec.from_config(cfg, 16, spec_slack=3)

    def filled() -> PagedKVCache:
        cache = PagedKVCache(spec, 8, 3)
        for slot, n in ((0, 20), (1, 7), (2, 12)):
            view = cache.view(slot, [slot], slot)
            pos = torch.arange(n)
            for layer in cache.windows:
                view.append_window(layer, pos, torch.randn(n, cfg.head_dim, generator=torch.Generator().manual_seed(n)))
            for layer in cache.pairs:
                view.append_pending(layer, pos, torch.ones(n, cfg.head_dim), torch.ones(n, cfg.head_dim))
        return cache

    a, b = filled(), filled()
    cuts = [(0, 18), (2, 11), (1, 7)]
    a.truncate(cuts)
    for slot, n in cuts:
        b.view(slot, [slot], slot).truncate(n)
    assert torch.equal(a.window_pos, b.window_pos)
    for la, lb in zip([*a.windows.values(), *a.pairs.values()], [*b.windows.values(), *b.pairs.values()], strict=True):
        assert la.length.tolist() == lb.length.tolist() and la.last.tolist() == lb.last.tolist()
        assert torch.equal(la.pos, lb.pos)
    assert a.windows[0].length.tolist() == [17, 7, 11]  # slot 0 held positions 1..19 (capacity 19)
    assert a.windows[0].last.tolist() == [17, 6, 10]


def test_the_fused_indexer_selects_what_the_batched_path_does(tiny_ckpt, monkeypatch):
    """The batched step with the fused Triton indexer (attn_kernels.py; under Triton's interpreter
    here, fp32) gives the same tokens and every cache byte as with the reference's functions."""
    import dataclasses

    from asympd.model import attn_kernels
    from asympd.model.attention import REFERENCE_KERNELS

    def run(fused: bool):
        llm = LLM(tiny_ckpt, "colocated", "split", scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=40))
        if fused:
            kernels = dataclasses.replace(REFERENCE_KERNELS, fused_indexer=True)
            for block in llm.engine.runner.model.blocks:
                block.attn.kernels = kernels
        outs = llm.generate(
            prompt_token_ids=random_prompts([30, 57], seed=5),
            sampling_params=SamplingParams(max_tokens=4, temperature=0),
        )
        return [o.outputs[0].token_ids for o in outs], {k: v.clone() for k, v in llm.engine.runner.cache.pools.items()}

    calls = []
    original = attn_kernels.indexer_topk
    monkeypatch.setattr(attn_kernels, "indexer_topk", lambda *a, **k: calls.append(1) or original(*a, **k))
    want_tokens, want_pools = run(False)
    assert not calls
    got_tokens, got_pools = run(True)
    assert calls  # the fused kernel did the selecting
    assert got_tokens == want_tokens
    for name, pool in want_pools.items():
        assert torch.equal(got_pools[name], pool), name


@pytest.mark.parametrize(
    ("mode", "spec", "graphs", "prompts"),
    [("colocated", 2, False, 3), ("colocated", 2, True, 3), ("asymmetric", 0, True, 4)],
)
def test_the_fused_attention_attends_as_the_gathered_path(tiny_ckpt, monkeypatch, mode, spec, graphs, prompts):
    """The batched step with the fused sparse attention kernel (``AttentionKernels.fused_attention``:
    one Triton launch reading the ring buffer, this step's rows and the pool in place; the
    interpreter here, fp32): in every layer call its output equals the gathered path's on the same
    inputs within 1e-5 (per row, relative), over prefill chunks (several sequences, chunked, windows partly in the ring
    buffer), decode and verify rows (1 + k), bounded prefills with a floor, window-only layers and,
    with ``graphs``, the padded static decode path (its padding rows finite); greedy tokens are
    those of the gathered path."""
    import dataclasses

    from asympd.model import attn_kernels
    from asympd.model.attention import REFERENCE_KERNELS, Attention

    seen: dict[str, int] = {}
    original = Attention._attend_fused

    def checked(self, q, kv, win, sel, view):
        got = original(self, q, kv, win, sel, view)
        want = self._attend_gathered(q, kv, win, sel, view)
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        assert torch.isfinite(got).all()
        # per row, relative to the row's largest value (a row of small values is checked as tightly)
        err = (got - want).abs().flatten(1).amax(1) / want.abs().flatten(1).amax(1).clamp_min(1e-30)
        assert float(err.max()) < 1e-5, f"layer {self.layer}: {float(err.max())}"
        rows = view.host("rows")
        from_ring = win.visible & ~win.is_new
        kinds = {
            "window-only": sel is None,
            "entries": sel is not None and bool((sel >= 0).any()),
            "decode": bool((rows == 1).any()),
            "verify": spec > 0 and bool((rows == 1 + spec).any()),
            "prefill": bool((rows > 1 + spec).any()),
            "ring": bool(from_ring.any()),
            "prefill+ring": bool((from_ring.any(-1) & (view.seg("rows")[view.row_seg] > 1 + spec)).any()),
            "several": len(rows) > 1,
            "floor": bool((view.seg("floor") > 0).any()),
            "graph": view.batch.fixed_groups,  # the static path: padded batch sizes, scratch rows
        }
        for k, v in kinds.items():
            seen[k] = seen.get(k, 0) + int(v)
        return got

    calls = []
    kern = attn_kernels.sparse_attention_paged
    monkeypatch.setattr(attn_kernels, "sparse_attention_paged", lambda *a, **k: calls.append(1) or kern(*a, **k))
    # the shortest ``prompts`` reach every kind of call checked at the end (the interpreted kernel's
    # cost is per row: all five took 3 x ~20 s); an asymmetric D needs a fourth for a chunk of prompt
    # rows whose window is partly in the ring buffer
    lengths = LENGTHS[:prompts]
    if graphs:
        want_out, _ = _run(tiny_ckpt, mode, batched=True, spec=spec, greedy=True, graphs=[], lengths=lengths)
    else:
        want_out, _ = _eager(tiny_ckpt, mode, spec, greedy=True, lengths=lengths)
    assert not calls
    monkeypatch.setattr(Attention, "_attend_fused", checked)
    monkeypatch.setattr(Attention, "kernels", dataclasses.replace(REFERENCE_KERNELS, fused_attention=True))
    got_out, _ = _run(
        tiny_ckpt, mode, batched=True, spec=spec, greedy=True, graphs=[] if graphs else None, lengths=lengths
    )
    assert calls  # the fused kernel attended
    n = len(lengths)
    assert [t for t, _ in got_out[:n]] == [t for t, _ in want_out[:n]]
    assert got_out[n:] == want_out[n:]  # the drafts' acceptance counts
    # logprobs are not compared: a 1e-7 difference in one attention output can move an FP8/FP4
    # rounding of a later KV row or index query by a whole step (measured: up to 0.25 in a logprob
    # of this random checkpoint), while every attention output itself stays within 1e-5 above
    expect = ["window-only", "entries", "decode", "prefill", "ring", "prefill+ring", "several"]
    expect += ["verify"] if spec else ["floor"]
    expect += ["graph"] if graphs else []
    assert all(seen.get(k, 0) > 0 for k in expect), seen
