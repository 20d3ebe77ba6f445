"""Expert parallelism on CPU: 2 or 3 gloo ranks, each reading only its own experts and exchanging
tokens by all-to-all, give the bits of 1 rank (MoE, P, D, colocated; dequantized and packed MXFP4
experts), every rank's KV cache stays identical, and ``asympd serve --ep 2`` serves and stops cleanly.

The checkpoint routes each token to 3 experts (the tiny preset routes to 2): with two experts the
sum is the same in either order, with three only the reference's ascending-expert order gives the
single-rank bits, so the combine order is exercised."""

from __future__ import annotations

import os
import signal
import socket

import httpx
import pytest
import torch
import torch.multiprocessing as mp

from asympd.config import tiny
from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams
from asympd.model.checkpoint import write_checkpoint
from asympd.parallel import EPMoE, ParallelLLM, ep_resident_gb, expert_range
from asympd.parallel.ep import wire_bytes
from asympd.serve.api_server import ServeConfig
from asympd.serve.procs import stop_all
from tests.parallel.ranks import moe_rank
from tests.serve.cluster import start_all, worker
from tests.util import random_prompts

W = 16  # the tiny preset's window
LENGTHS = [3, W + 1, 2 * W + 1, 40]  # N <= W (no P), odd and even splits (carry), longer
GREEDY = SamplingParams(max_tokens=5, temperature=0)


@pytest.fixture(scope="module")
def ep_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with top-3 routing."""
    out = tmp_path_factory.mktemp("ckpt-top3") / "tiny-top3"
    write_checkpoint(tiny().replace(n_activated_experts=3), out, seed=0)
    return str(out)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Rank 0 is this process; each rank gets one thread (the ranks' thread counts must match)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def _assert_caches_equal(llm: ParallelLLM) -> None:
    digests = llm.executor.cache_digests()
    assert len(digests) == 2 and digests[0] == digests[1]


def test_expert_ranges_cover_every_expert_once():
    for n, world in ((8, 2), (384, 8), (7, 3), (128, 4)):
        ranges = [expert_range(n, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


@pytest.mark.parametrize(
    ("world", "cases"),
    [
        (2, [("dequantized", ("float32", "bfloat16"), 7)]),
        # 8 experts over 3 ranks: 2 + 3 + 3; MXFP4 experts through the grouped GEMM (Triton's
        # interpreter on CPU: slow, so one layer)
        (3, [("dequantized", ("float32",), 7), ("packed-experts", ("bfloat16",), 1)]),
    ],
)
def test_moe_is_bit_exact_over_ranks(ep_ckpt, world, cases):
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(moe_rank, args=(world, init, ep_ckpt, cases), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_only_its_experts(ep_ckpt, world):
    """The tensors (and bytes) rank r reads: the role's, less the routed experts outside its range,
    less the drafter past rank 0; every expert is read by exactly one rank."""
    from asympd.model.checkpoint import load_config
    from asympd.model.loader import load_model
    from asympd.model.schema import role_schema

    cfg = load_config(ep_ckpt)
    size = {s.name: s.nbytes for s in role_schema(cfg, "full", vision=True)}
    expert_names = {n for n in size if n.startswith("layers.") and ".ffn.experts." in n}
    single = load_model(ep_ckpt, "full").load_report
    assert set(single.tensors_read) == set(size)
    seen: list[str] = []
    for rank in range(world):
        report = load_model(ep_ckpt, "full", ep=(rank, world)).load_report
        names = set(report.tensors_read)
        lo, hi = expert_range(cfg.n_routed_experts, rank, world)
        mine = {n for n in expert_names if lo <= int(n.split(".")[4]) < hi}  # layers.L.ffn.experts.E.*
        want = (set(size) - expert_names) | mine
        if rank > 0:
            want = {n for n in want if not n.startswith("mtp.")}
        assert names == want
        assert report.bytes_read == sum(size[n] for n in want)
        assert report.bytes_read < single.bytes_read
        seen += sorted(names & expert_names)
    assert sorted(seen) == sorted(expert_names)  # each expert read once over the ranks


@pytest.mark.parametrize("semantics", ["full", "split"])
def test_colocated(ep_ckpt, semantics):
    prompts = random_prompts(LENGTHS, seed=21)
    want = _tokens(LLM(ep_ckpt, "colocated", semantics), prompts)
    with ParallelLLM(ep_ckpt, "colocated", semantics, ep=2) as llm:
        assert _tokens(llm, prompts) == want
        _assert_caches_equal(llm)


def test_a_warmed_sharded_engine_gives_the_single_rank_tokens(ep_ckpt):
    """``warm_up=True`` (the CUDA default) over 2 ranks: the warm-up runs once the ranks are
    attached, on both engines of a P/D pair (P sharded here), and changes no token."""
    prompts = random_prompts(LENGTHS, seed=22)
    want = _tokens(LLM(ep_ckpt, "asymmetric"), prompts)
    with ParallelLLM(ep_ckpt, "asymmetric", ep=2, shard="prefill", warm_up=True) as llm:
        assert llm.prefill.warm_up_report.rows and llm.engine.warm_up_report.rows
        assert _tokens(llm, prompts) == want
        _assert_caches_equal(llm)


def test_colocated_packed_experts(ep_ckpt):
    """The CUDA default layout (MXFP4 experts through the grouped GEMM) over 2 ranks: each rank
    built with its own packed experts only, the tokens and caches of 1 rank."""
    prompts = random_prompts([W + 3], seed=26)
    params = SamplingParams(max_tokens=3, temperature=0)
    want = _tokens(LLM(ep_ckpt, "colocated", weights="packed-experts"), prompts, params)
    with ParallelLLM(ep_ckpt, "colocated", ep=2, weights="packed-experts") as llm:
        moe = next(b.ffn for b in llm.engine.model.blocks if b is not None and b.ffn is not None)
        assert isinstance(moe, EPMoE) and moe.moe.experts == "mxfp4" and moe.moe.w13.n_experts == 4
        assert _tokens(llm, prompts, params) == want
        _assert_caches_equal(llm)


def test_sharding_a_model_that_holds_every_expert_is_refused(ep_ckpt):
    from asympd.model.loader import load_model
    from asympd.parallel import shard_moe

    with pytest.raises(ValueError, match=r"owns experts \[0, 4\) but the MoE holds \[0, 8\)"):
        shard_moe(load_model(ep_ckpt, "full"), 0, 2)


def _exported(llm: LLM, prompts: list[list[int]]) -> dict[str, object]:
    """Prefix states the prefill engine exports (prompts longer than W)."""
    assert llm.prefill is not None
    ids = {f"p{i}": p for i, p in enumerate(prompts) if len(p) > W}
    for rid, p in ids.items():
        llm.prefill.add_request(rid, p, GREEDY)
    states = {}
    while len(states) < len(ids):
        for out in llm.prefill.step():
            assert out.error is None, out.error
            states[out.request_id] = out.prefix_state
    for rid in ids:
        llm.prefill.release_transfer(rid)
    return states


def test_asymmetric_prefill_sharded(ep_ckpt):
    """P over 2 ranks exports the same PrefixState bytes as P on 1 rank; D then decodes the same."""
    prompts = random_prompts(LENGTHS, seed=22)
    ref = LLM(ep_ckpt, "asymmetric")
    want_states, want = _exported(ref, prompts), _tokens(ref, prompts)
    with ParallelLLM(ep_ckpt, "asymmetric", ep=2, shard="prefill") as llm:
        got_states = _exported(llm, prompts)
        assert got_states.keys() == want_states.keys()
        for rid, state in got_states.items():
            assert state.equal(want_states[rid]), rid
        assert _tokens(llm, prompts) == want
        _assert_caches_equal(llm)


def test_asymmetric_decode_sharded(ep_ckpt):
    """D over 2 ranks, fed the prefix states of the same (1-rank) P, decodes the tokens of 1-rank D;
    requests join while others run."""
    prompts = random_prompts(LENGTHS, seed=23)
    want = _tokens(LLM(ep_ckpt, "asymmetric"), prompts)
    with ParallelLLM(ep_ckpt, "asymmetric", ep=2, shard="decode") as llm:
        assert _tokens(llm, prompts[:2]) == want[:2]
        assert _tokens(llm, prompts) == want
        _assert_caches_equal(llm)


def test_speculative_decoding_rollbacks_are_mirrored(ep_ckpt):
    """DSpark drafts on rank 0; its window writes and every rollback's truncate reach rank 1."""
    prompts = random_prompts([5, 2 * W + 1], seed=24)
    want = _tokens(LLM(ep_ckpt, "colocated", num_spec_tokens=2), prompts)
    with ParallelLLM(ep_ckpt, "colocated", ep=2, num_spec_tokens=2) as llm:
        assert _tokens(llm, prompts) == want
        assert llm.engine.stats()["spec_steps"] > 0
        _assert_caches_equal(llm)


def test_forked_choices_are_mirrored(ep_ckpt):
    """OpenAI's n: choices 1 and 2 fork from choice 0 on rank 0 (its blocks shared, its slot and
    partial block copied: ``fork_slot``); rank 1 makes the same copies, and each choice decodes
    what it decodes alone."""
    prompt = random_prompts([2 * W + 5], seed=25)[0]
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=3 + i) for i in range(3)]
    single = LLM(ep_ckpt, "colocated", num_spec_tokens=2)
    want = [single.generate(prompt_token_ids=[prompt], sampling_params=p)[0].outputs[0].token_ids for p in params]
    with ParallelLLM(ep_ckpt, "colocated", ep=2, num_spec_tokens=2) as llm:
        for i, p in enumerate(params):
            llm.engine.add_request(f"c{i}", prompt, p, fork_of="c0" if i else None)
        got = {}
        while llm.engine.has_unfinished_requests():
            got |= {o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished}
        assert [got[f"c{i}"] for i in range(3)] == want
        assert llm.engine.counters["prompt_tokens"] == len(prompt)
        _assert_caches_equal(llm)


def test_closed_executor_refuses_work(ep_ckpt):
    llm = ParallelLLM(ep_ckpt, "colocated", ep=2)
    pids = llm.executor.group.pids()
    llm.close()
    llm.close()  # idempotent
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        _tokens(llm, [[5, 6, 7]])


def test_wire_bytes_per_token_at_v41_widths():
    """The figures docs/parallel.md tabulates: bytes one rank sends per token of the step."""
    assert wire_bytes(5120, 6, 1, 2, "allreduce") == 122880
    assert round(wire_bytes(5120, 6, 1, 2, "alltoall")) == 35852  # 3.4x fewer
    assert round(wire_bytes(5120, 6, 1, 8, "alltoall")) == 22405
    with pytest.raises(ValueError, match="comm must be one of alltoall, allreduce"):
        wire_bytes(5120, 6, 1, 2, "broadcast")


def test_tp_is_refused():
    with pytest.raises(ValueError, match="tensor parallel attention is not implemented"):
        ServeConfig(checkpoint="x", tp=2).resolve()


def test_memory_per_rank_of_the_released_model():
    from asympd.config import resolve_config

    cfg = resolve_config("v41-flash")
    one, two, eight = (ep_resident_gb(cfg, "decode", n) for n in (1, 2, 8))
    assert one["rank0_gb"] == pytest.approx(one["single_rank_gb"])
    assert 0.9 < one["routed_experts_gb"] / one["single_rank_gb"] < 0.97  # the experts are what EP splits
    assert eight["rank0_gb"] < two["rank0_gb"] < one["rank0_gb"]
    assert eight["other_rank_gb"] < eight["rank0_gb"]  # rank 0 alone holds the drafter


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out |= {int(c) for c in f.read().split()}
    return out


def test_serve_ep2_answers_like_ep1_and_stops_cleanly(ep_ckpt, tmp_path):
    """Both warmed (``--warm-up``, as on a GPU): the EP worker's warm-up runs once its ranks are
    attached (before that, rank 0 holds only its own experts), and serves the same tokens."""
    one = worker("ep1", ep_ckpt, "colocated", "colocated", tmp_path, "--warm-up")
    two = worker("ep2", ep_ckpt, "colocated", "colocated", tmp_path, "--ep", "2", "--warm-up")
    procs = [one, two]
    try:
        url1, url2 = start_all(procs)
        info = httpx.get(f"{url2}/asympd/info", timeout=10).json()
        assert info["ep"] == 2 and len(info["ep_pids"]) == 1
        warmed = httpx.get(f"{url1}/asympd/info", timeout=10).json()["warm_up"]
        assert info["warm_up"]["prompts"] == warmed["prompts"] > 10, (info["warm_up"], warmed)
        assert _children(two.pid) == set(info["ep_pids"])  # one process per rank, started by the worker
        ids = random_prompts([2 * W + 1], seed=25)[0]
        body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        answers = [httpx.post(f"{u}/v1/completions", json=body, timeout=60).json() for u in (url1, url2)]
        assert answers[1]["choices"][0]["token_ids"] == answers[0]["choices"][0]["token_ids"]
        assert len(answers[0]["choices"][0]["token_ids"]) == 6
    finally:
        stop_all(procs)
    assert two.proc is not None and two.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM
    assert "EP rank" not in two.log_path.read_text()  # rank 1 got stop and exited 0 (nothing killed)
    assert not any(os.path.exists(f"/proc/{p}") for p in info["ep_pids"])


def test_images_over_two_ranks(ep_ckpt):
    """Image rows reach every rank with the step plan: 2-rank colocated split equals 1 rank."""
    from tests.engine.test_vision import CASES, images_of

    names = ["start", "straddle", "two"]
    prompts, images = [CASES[c][0] for c in names], [images_of(c) for c in names]

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, images=images)
        return [o.outputs[0].token_ids for o in outs]

    want = run(LLM(ep_ckpt, "colocated", "split"))
    with ParallelLLM(ep_ckpt, "colocated", "split", ep=2) as llm:
        assert run(llm) == want
        _assert_caches_equal(llm)
