"""Two GPUs of one host: P on GPU 0, D on GPU 1, and D with expert parallelism over both.

Parts, each recorded as it finishes (a failure in one leaves the others' numbers):
  link       device-to-device copy rate GPU 0 -> GPU 1, and on one GPU, for reference;
  state      a V4.1-Flash-shaped PrefixState (bf16, split s) moved GPU 0 -> GPU 1, against `link`;
  ttft       the real engines, tiny checkpoint: P (prefill role) on cuda:0, D (decode role) on cuda:1,
             TTFT split into P compute / transfer / D first step (tiny model: the path, not the scale);
  ep         D (colocated engine) with ep=2 over both GPUs (NCCL) against ep=1: same greedy tokens?
             wall time (tiny model: dominated by per-step overheads, not MoE work).

NIXL is not on the device image and its wheel exceeds what a call can carry, so the GPU-to-GPU move
here is the PrefixState's own `to(device)` (a CUDA peer copy), not a NIXL READ.

    python bench/two_gpu.py --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def record(out: Path, results: dict) -> None:
    (out / "two_gpu.json").write_text(json.dumps(results, indent=2))


def timed(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    return (time.perf_counter() - t) / iters


def part_link() -> dict:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    c = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    peer = torch.cuda.can_device_access_peer(0, 1)
    cross = timed(lambda: b.copy_(a, non_blocking=True))
    local = timed(lambda: c.copy_(a, non_blocking=True))
    return {
        "bytes": n,
        "peer_access": peer,
        "gpu0_to_gpu1_GBps": n / cross / 1e9,
        "same_gpu_copy_GBps": 2 * n / local / 1e9,
        "note": "same-GPU counts read + write bytes",
    }


def part_state(link: dict) -> dict:
    from asympd.config import v41_flash
    from asympd.transfer.prefix_state import PrefixState

    cfg = v41_flash()
    out = {}
    for s in (4096, 16384, 65536):
        st = PrefixState.allocate(
            cfg, s, torch.zeros(s + 128, dtype=torch.long), fingerprint="bench", dtype=torch.bfloat16, device="cuda:0"
        )
        secs = timed(lambda st=st: st.to("cuda:1"), iters=5)
        gbps = st.nbytes / secs / 1e9
        out[str(s)] = {
            "nbytes": st.nbytes,
            "seconds": secs,
            "GBps": gbps,
            "fraction_of_link": gbps / link["gpu0_to_gpu1_GBps"] if link else None,
            "released_format_bytes": 890 * s,
        }
    return out


def part_ttft(ckpt: str) -> dict:
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.sampling import SamplingParams
    from asympd.model.loader import load_model

    p = LLMEngine(
        load_model(ckpt, "prefill", "cuda:0", torch.bfloat16), EngineConfig(role="prefill", mode="asymmetric")
    )
    d = LLMEngine(load_model(ckpt, "decode", "cuda:1", torch.bfloat16), EngineConfig(role="decode", mode="asymmetric"))
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate([64, 1000, 3000, 3000]):  # the first is warm-up
        ids = torch.randint(3, 500, (n,), generator=g).tolist()
        params = SamplingParams(max_tokens=1, temperature=0)
        rid = f"r{i}"
        t0 = time.perf_counter()
        p.add_request(rid, ids, params)
        state = None
        while state is None:
            for o in p.step():
                state = o.prefix_state
        torch.cuda.synchronize("cuda:0")
        t1 = time.perf_counter()
        moved = state.to("cuda:1")
        torch.cuda.synchronize("cuda:1")
        t2 = time.perf_counter()
        d.add_request(rid, ids, params, prefix_state=moved)
        first = None
        while first is None:
            for o in d.step():
                if o.outputs[0].token_ids:
                    first = o.outputs[0].token_ids[0]
        torch.cuda.synchronize("cuda:1")
        t3 = time.perf_counter()
        p.release_transfer(rid)
        rows.append(
            {
                "prompt_tokens": n,
                "p_compute_s": t1 - t0,
                "transfer_s": t2 - t1,
                "d_first_step_s": t3 - t2,
                "ttft_s": t3 - t0,
                "state_bytes": state.nbytes,
                "warmup": i == 0,
            }
        )
    return {"rows": rows, "blocks_left": [p.blocks.num_used_blocks, d.blocks.num_used_blocks]}


def part_ep(ckpt: str) -> dict:
    from asympd.engine.llm import LLM
    from asympd.engine.sampling import SamplingParams
    from asympd.parallel.llm import ParallelLLM

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 200, 700)]
    params = SamplingParams(max_tokens=8, temperature=0)
    # EP shards the reference MoE's stacked experts: both runs use the reference modules
    one = LLM(ckpt, "colocated", "split", device="cuda", dtype=torch.bfloat16, weights="reference")
    one.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    t = time.perf_counter()
    want = [o.outputs[0].token_ids for o in one.generate(prompt_token_ids=prompts, sampling_params=params)]
    t_one = time.perf_counter() - t
    del one
    with ParallelLLM(ckpt, "colocated", "split", ep=2, device="cuda", dtype=torch.bfloat16) as two:
        two.generate(prompt_token_ids=prompts[:1], sampling_params=params)
        t = time.perf_counter()
        got = [o.outputs[0].token_ids for o in two.generate(prompt_token_ids=prompts, sampling_params=params)]
        t_two = time.perf_counter() - t
    return {
        "same_tokens": got == want,
        "ep1_tokens": want,
        "ep2_tokens": got,
        "ep1_seconds": t_one,
        "ep2_seconds": t_two,
        "note": "tiny model: per-step overheads dominate; no MoE speed-up expected",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="link,state,ttft,ep")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = (
        os.environ.get("COMMIT")
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    results: dict = {
        "command": "python bench/two_gpu.py --out $OUT",
        "commit": commit or "unknown",
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
    }
    record(out, results)
    from asympd.config import tiny
    from asympd.model.checkpoint import write_checkpoint

    ckpt = str(Path(tempfile.mkdtemp()) / "tiny")
    write_checkpoint(tiny(), ckpt, seed=0, verbose=False)
    for name, fn in (
        ("link", part_link),
        ("state", lambda: part_state(results.get("link"))),
        ("ttft", lambda: part_ttft(ckpt)),
        ("ep", lambda: part_ep(ckpt)),
    ):
        if name not in args.parts.split(","):
            continue
        t = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc(limit=6)}
        results[name]["wall_s"] = time.perf_counter() - t
        record(out, results)
        print(name, json.dumps(results[name])[:600], flush=True)


if __name__ == "__main__":
    main()
