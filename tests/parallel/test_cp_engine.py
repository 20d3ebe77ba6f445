"""``asympd serve --role prefill --cp 2`` through real processes: a router in front of a CP = 2
prefill worker and one in front of a CP = 1 prefill worker, sharing a decode worker, give the same
tokens and move the same number of bytes (the exported state is the same); the worker starts its
rank, warms up when asked, answers prompts whose prefix is shorter than the group, and stops it
cleanly."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from asympd.engine.engine import EngineConfig
from asympd.parallel.cp_engine import CPPrefillEngine
from asympd.serve.procs import stop_all
from tests.serve.cluster import router_proc, start_all, wait_router, worker
from tests.util import random_prompts

W = 16  # the tiny preset's window
# N <= W (the router skips P), split 1 (shorter than the group: rank 0 alone), split 2 (one row per
# rank), odd split 29 (the open pair at s), a longer one
LENGTHS = [5, W + 1, W + 2, 45, 90]


def test_serve_cp2_answers_like_cp1(tiny_ckpt, tmp_path):
    p1 = worker("p-cp1", tiny_ckpt, "prefill", "asymmetric", tmp_path)
    # warmed (on a CPU only when asked): prefixes whose slices take each size class up to the step
    # budget, 1-64 rows a rank here, run before serving and change nothing that is served
    warmed = ("--warm-up", "--max-num-batched-tokens", "64")
    p2 = worker("p-cp2", tiny_ckpt, "prefill", "asymmetric", tmp_path, "--cp", "2", *warmed)
    d = worker("d", tiny_ckpt, "decode", "asymmetric", tmp_path)
    procs = [p1, p2, d]
    try:
        u1, u2, ud = start_all(procs)
        routers = [router_proc(f"router-{i}", [u], [ud], tmp_path) for i, u in ((1, u1), (2, u2))]
        procs += routers
        r1, r2 = start_all(routers)
        for r in (r1, r2):
            wait_router(r)
        info = httpx.get(f"{u2}/asympd/info", timeout=10).json()
        assert info["cp"] == 2 and len(info["cp_pids"]) == 1
        assert (info["warm_up"]["prompts"], info["warm_up"]["rows"]) == (12, [1, 64])  # 1, 2, 3, 4, 5, 8, ... 64
        for ids in random_prompts(LENGTHS, seed=41):
            body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
            one, two = (httpx.post(f"{r}/v1/completions", json=body, timeout=120).json() for r in (r1, r2))
            assert two["choices"][0]["token_ids"] == one["choices"][0]["token_ids"], len(ids)
            assert len(one["choices"][0]["token_ids"]) == 5
            t1, t2 = one["asympd_timings"], two["asympd_timings"]
            assert t2["prefill_path"] == t1["prefill_path"] == ("local" if len(ids) <= W else "remote")
            assert t2.get("transfer_bytes") == t1.get("transfer_bytes")
        stats = httpx.get(f"{u2}/asympd/stats", timeout=10).json()
        assert stats["engine"]["cp"] == 2 and stats["engine"]["prompt_tokens"] == sum(n - W for n in LENGTHS[1:])
    finally:
        stop_all(procs)
    assert p2.proc is not None and p2.proc.returncode in (0, -signal.SIGTERM)
    assert "CP rank" not in p2.log_path.read_text()  # rank 1 got stop and exited 0 (nothing killed)
    assert not any(os.path.exists(f"/proc/{p}") for p in info["cp_pids"])


def test_cp_engine_refuses_a_mode_without_a_kv_only_prefill():
    class Group:
        world_size, joined = 2, True

    with pytest.raises(ValueError, match="mode symmetric has no such prefill worker"):
        CPPrefillEngine(None, EngineConfig(role="prefill", mode="symmetric"), Group())  # type: ignore[arg-type]


def test_a_slow_cp_step_keeps_the_worker_serving(tiny_ckpt, tmp_path):
    """A CP step slower than a second (rank 1 held up here with SIGSTOP) is logged as slow; that log
    line read the single-rank engine's request table, which a CP engine does not have, and the
    engine thread died: the prefill worker answered 503 from then on (found by tools/soak.py)."""
    p = worker("p-cp2", tiny_ckpt, "prefill", "asymmetric", tmp_path, "--cp", "2")
    d = worker("d", tiny_ckpt, "decode", "asymmetric", tmp_path)
    procs = [p, d]
    try:
        up, ud = start_all(procs)
        r = router_proc("router", [up], [ud], tmp_path)
        procs.append(r)
        (ur,) = start_all([r])
        wait_router(ur)
        (rank1,) = httpx.get(f"{up}/asympd/info", timeout=10).json()["cp_pids"]
        prompts = random_prompts([45, 46], seed=3)
        os.kill(rank1, signal.SIGSTOP)  # rank 0's step waits on rank 1's slice
        try:
            with ThreadPoolExecutor(1) as pool:
                body = {"prompt": prompts[0], "max_tokens": 2}
                slow = pool.submit(httpx.post, f"{ur}/v1/completions", json=body, timeout=60)
                time.sleep(1.5)
                os.kill(rank1, signal.SIGCONT)
                first = slow.result()
        finally:
            os.kill(rank1, signal.SIGCONT)
        assert first.status_code == 200 and first.json()["asympd_timings"]["prefill_path"] == "remote"
        body = {"prompt": prompts[1], "max_tokens": 2}
        after = httpx.post(f"{ur}/v1/completions", json=body, timeout=60).json()
        assert after["asympd_timings"]["prefill_path"] == "remote"  # P still serves, not D's recompute
        assert httpx.get(f"{up}/health", timeout=10).status_code == 200
        assert "slow engine step" in p.log_path.read_text()
    finally:
        stop_all(procs)
    assert "Traceback" not in p.log_path.read_text()
