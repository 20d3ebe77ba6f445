"""What the CUDA-graph path refuses and how it keys steps (engine/cuda_graphs.py), on CPU. That the
static path computes what the eager step computes is tests/engine/test_batched_step.py's; that
captured graphs do is tests/engine/test_cuda_engine.py's (on the device)."""

from __future__ import annotations

import pytest
import torch

from asympd import LLM
from asympd.config import tiny
from asympd.engine.cuda_graphs import (
    PIECE_ROWS,
    PREFILL_PIECE_ROWS,
    DecodeGraphs,
    DraftGraphs,
    PiecewiseGraphs,
    capture_at_startup,
    piece_sizes_for,
)
from asympd.engine.engine import EngineConfig
from asympd.engine.scheduler import SchedulerConfig
from asympd.kv.batch import BatchSegment, PagedBatch
from asympd.kv.paged_cache import PagedKVCache
from asympd.kv.spec import KVCacheSpec
from asympd.model.transformer import Chunk, Depth


def _cache(scratch: bool) -> PagedKVCache:
    return PagedKVCache(KVCacheSpec.from_config(tiny(), block_size=16), 8, 4, scratch=scratch)


def test_the_scratch_block_and_slot_are_extra_and_counted():
    plain, scratch = _cache(False), _cache(True)
    assert plain.scratch_block is None and plain.scratch_slot is None
    assert (scratch.scratch_block, scratch.scratch_slot) == (8, 4)  # past what the block manager hands out
    assert (scratch.num_blocks, scratch.max_seqs) == (8, 4)
    name = next(iter(plain.pools))
    assert scratch.pools[name].shape[0] == 9 and scratch.window_kv.shape[0] == 5
    assert scratch.nbytes() > plain.nbytes()


def test_graphs_refuse_a_cache_without_scratch_or_a_cpu_capture():
    with pytest.raises(ValueError, match="scratch=True"):
        DecodeGraphs(None, _cache(False), capture=False)
    with pytest.raises(ValueError, match="scratch=True"):
        DraftGraphs(None, _cache(False), capture=False)
    with pytest.raises(ValueError, match="need a CUDA device"):
        DecodeGraphs(None, _cache(True), capture=True)


def test_a_batch_reloads_only_its_own_layout():
    cache = _cache(True)
    segs = [BatchSegment([0, 1], 0, 17, 2), BatchSegment([2], 1, 3, 2)]
    batch = PagedBatch(cache, segs, width=4)
    assert batch.block_table.shape == (2, 4)
    batch.load([BatchSegment([3], 2, 40, 2), BatchSegment([4, 5, 6], 3, 9, 2)])  # same rows per segment
    assert batch.positions.tolist() == [40, 41, 9, 10]
    assert batch.block_table.tolist() == [[3, 0, 0, 0], [4, 5, 6, 0]]
    assert batch.slot.tolist() == [2, 3]
    with pytest.raises(ValueError, match="layout"):
        batch.load([BatchSegment([3], 2, 40, 1), BatchSegment([4], 3, 9, 3)])
    with pytest.raises(ValueError, match="does not fit a batch of width 1"):
        PagedBatch(cache, segs, width=1)


def test_which_steps_take_a_graph_and_at_what_padded_shape(tiny_ckpt):
    llm = LLM(tiny_ckpt, "colocated")
    eng = llm.engine
    graphs = DecodeGraphs(eng.model, eng.cache, capture=False)
    view = eng.cache.view("a", list(range(3)), 0)

    def chunk(rows: int, start: int = 100, **kw) -> Chunk:
        return Chunk(view, torch.zeros(rows, dtype=torch.long), start, None, **kw)

    def key(chunks: list[Chunk]):
        segs = [BatchSegment(c.kv.block_table, c.kv.slot, c.start, len(c.token_ids)) for c in chunks]
        return graphs.key(chunks, segs)

    k = key([chunk(3, logits="all")] * 5)
    assert (k.segments, k.rows, k.logits, k.context) == (8, 3, "all", 1024)  # 5 requests padded to 8
    assert k.width == 1024 // eng.spec.block_size  # the tables cover the context bound
    assert key([chunk(1, start=1500)]).context == 2048
    assert key([chunk(1), chunk(2)]) is None  # rows differ
    assert key([chunk(1), chunk(1, depth=Depth.ENCODER_KV)]) is None  # not every layer
    assert key([chunk(1), chunk(1, logits="last")]).logits == "last"
    assert key([chunk(16, logits="none", write_global=False)] * 2).write_global is False  # a symmetric D's replay
    assert key([chunk(16, logits="none"), chunk(16)]) is None  # logits differ
    assert key([chunk(16, write_global=False), chunk(16)]) is None  # global writes differ
    assert key([chunk(1)] * 513) is None  # past the largest captured size
    # an engine's graphs take decode and verify steps (1 + k rows a request) and, on a D, steps of
    # its first-step chunks alone (W rows each): other prompt rows run as a mixed step
    graphs.max_rows = 3
    assert key([chunk(3, logits="all")] * 5).rows == 3
    assert key([chunk(16)] * 5) is None
    graphs.prefill_rows = 16  # a D's first steps (W rows) alone: those, and no other prompt rows
    assert key([chunk(16)] * 5).rows == 16
    assert key([chunk(8)] * 5) is None
    assert eng.runner.graphs is None  # CPU engines run eagerly; on CUDA the engine sets both


def test_engine_config_refuses_an_unknown_graph_mode_and_cpu_engines_run_eagerly(tiny_ckpt):
    with pytest.raises(ValueError, match="unknown cuda_graph_mode 'piecewise'"):
        EngineConfig(cuda_graph_mode="piecewise").validate()
    llm = LLM(tiny_ckpt, "asymmetric")
    assert llm.engine.runner.graphs is None  # CPU: no graphs, the cache still keeps its scratch
    assert llm.engine.cache.scratch_block is not None
    assert llm.prefill.cache.scratch_block is None  # a prefill worker never decodes ...
    sym = LLM(tiny_ckpt, "symmetric-split")  # ... but a symmetric P's window steps replay graphs on CUDA
    assert sym.prefill.cache.scratch_block is not None and sym.prefill.runner.graphs is None
    assert sym.prefill.config.scheduler.one_depth_per_step and not llm.prefill.config.scheduler.one_depth_per_step
    eager = LLM(tiny_ckpt, "symmetric-split", enforce_eager=True)  # no graphs to replay: its steps stay mixed
    assert not eager.prefill.config.scheduler.one_depth_per_step


def test_piece_sizes_are_refused_unless_increasing_and_a_p_takes_pieces_by_default(tiny_ckpt):
    for bad in ((), (32, 16), (16, 16), (0, 16)):
        with pytest.raises(ValueError, match="piece sizes must be increasing positive row counts"):
            PiecewiseGraphs(torch.device("cpu"), capture=False, sizes=bad)
    llm = LLM(tiny_ckpt, "asymmetric")  # CPU: the engine builds none; a P's default makes PrefillPieces
    assert (llm.prefill.config.cuda_graph_mode, llm.engine.config.cuda_graph_mode) == ("full_and_piecewise", "full")
    pieces = llm.prefill.make_prefill_pieces(capture=False)
    assert pieces.piecewise.sizes == list(PREFILL_PIECE_ROWS) and pieces.run() is None
    assert llm.engine.make_prefill_pieces(capture=False) is None  # a D: its DecodeGraphs hold its pieces
    eager_prompts = LLM(tiny_ckpt, "asymmetric", cuda_graph_mode="full")  # asked: eager prompt steps
    assert eager_prompts.prefill.make_prefill_pieces(capture=False) is None
    # a step budget below the largest size: the sizes under it and the one a full step pads to
    small = LLM(tiny_ckpt, "asymmetric", scheduler=SchedulerConfig(max_num_batched_tokens=600))
    assert small.prefill.make_prefill_pieces(capture=False).piecewise.sizes == [16, 32, 64, 128, 256, 512, 768]
    assert piece_sizes_for(2048, PREFILL_PIECE_ROWS) == PREFILL_PIECE_ROWS  # a budget at a size: up to it
    assert piece_sizes_for(16384, PIECE_ROWS) == PIECE_ROWS and piece_sizes_for(1, PIECE_ROWS) == (16,)


def test_engine_config_refuses_a_bad_capture_setting_and_cpu_engines_capture_nothing(tiny_ckpt):
    with pytest.raises(ValueError, match="unknown cuda_graph_capture 'eager'"):
        EngineConfig(cuda_graph_capture="eager").validate()
    with pytest.raises(ValueError, match="cuda_graph_max_captures must be >= 0, got -1"):
        EngineConfig(cuda_graph_max_captures=-1).validate()
    llm = LLM(tiny_ckpt, "asymmetric", cuda_graph_capture="lazy")
    assert llm.engine.config.cuda_graph_capture == "lazy"
    with pytest.raises(ValueError, match="replays no CUDA graphs"):
        llm.engine.capture_graphs()  # CPU: every step runs eagerly, there is nothing to build


def test_startup_capture_stops_at_max_seq_len_to_capture(tiny_ckpt):
    """Start-up builds the graphs of contexts up to ``max_seq_len_to_capture`` (its power-of-two
    bound); the longer ones are left to be captured when first met."""
    eng = LLM(tiny_ckpt, "colocated").engine
    graphs = DecodeGraphs(eng.model, eng.cache, max_batch=2, capture=False)
    report = capture_at_startup(graphs, None, [1], 4096, 100, (), max_context=1500)
    assert [(k.segments, k.context) for k in report.keys] == [(2, 1024), (1, 1024), (2, 2048), (1, 2048)]
    assert [(k.segments, k.context) for k in report.lazy] == [(2, 4096), (1, 4096)]
    assert set(graphs.graphs) == set(report.keys)
    with pytest.raises(ValueError, match="max_seq_len_to_capture must be positive, got 0"):
        EngineConfig(max_seq_len_to_capture=0).validate()


def test_engine_stats_count_the_steps_graphs_served(tiny_ckpt):
    """``stats()["graphed_steps"]`` (``/metrics``: ``asympd_engine_steps_graphed_total``) counts the
    steps whose forward took the graph path; prompt steps ran eagerly. The static path stands in for
    graphs on CPU."""
    from asympd import SamplingParams
    from tests.util import random_prompts

    llm = LLM(tiny_ckpt, "colocated")
    eng = llm.engine
    assert eng.stats()["graphed_steps"] == 0  # CPU: no graphs
    eng.runner.graphs = DecodeGraphs(eng.model, eng.cache, max_batch=4, capture=False)
    llm.generate(
        prompt_token_ids=random_prompts([20, 30], seed=9), sampling_params=SamplingParams(max_tokens=5, temperature=0)
    )
    stats, g = eng.stats(), eng.runner.graphs.stats
    assert stats["graphed_steps"] == g["replayed"] + g["first"] == 4  # tokens 2-5 of both requests, one step each
    assert stats["steps"] == stats["graphed_steps"] + g["eager"] == 5  # the prompt step ran eagerly
