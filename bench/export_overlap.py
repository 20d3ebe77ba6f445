"""Does the prefill worker's prefix export stall its steps? (issue 10, item 6)

P's engine copies each finished prefix (compressed KV, index keys, open compressor rows) out of
the paged cache. On CUDA that copy runs on a side stream into pinned buffers (engine/export.py), so
the next step is enqueued behind it; with ``PrefixExporter(side_stream=False)`` the same copy runs
on the compute stream into pageable memory and the host waits for it, as a naive engine would.

One device call: the true-width 3-layer model of bench/engine_steps.py (prefill role, asymmetric),
batches of prompts whose steps each finish some prefixes. For each prompt length it times the whole
batch (first step enqueued to every copy complete: ``torch.cuda.synchronize`` waits on all
streams) with the side stream and without, in the same run, and counts the floor the overlap can
hide: the exported bytes over the measured pinned device-to-host copy rate. ``hidden`` = (time
without - time with) / that copy time: 1.0 means the side stream hides the whole copy.

    python3 bench/export_overlap.py            # on the GPU; JSON to bench/results/export_overlap.json
    python3 bench/export_overlap.py --smoke    # tiny config on CPU: plumbing only
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log, record  # noqa: E402
from bench.engine_steps import config, sync, tensors_for  # noqa: E402


def d2h_rate(device: torch.device, nbytes: int) -> float:
    """Pinned device-to-host copy rate (bytes/s), the copy engine the side stream uses."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:])


def run_batch(p_model, cfg, device, side_stream: bool, count: int, n: int, budget: int, reps: int) -> dict[str, Any]:
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.export import PrefixExporter
    from asympd.engine.sampling import SamplingParams
    from asympd.engine.scheduler import SchedulerConfig

    sc = SchedulerConfig(max_num_seqs=count, max_num_batched_tokens=budget)
    kv = int(count * (n + 64) * 3500 * 1.3) + (64 << 20)
    eng = LLMEngine(p_model, EngineConfig(role="prefill", mode="asymmetric", kv_cache_bytes=kv, scheduler=sc))
    eng.config.enable_prefix_caching = False
    eng.runner.exporter = PrefixExporter(device, side_stream=side_stream)
    gen = torch.Generator().manual_seed(n)
    params = SamplingParams(max_tokens=1, temperature=0)
    totals, steps, nbytes = [], 0, 0
    for r in range(reps + 1):
        for i in range(count):
            eng.add_request(f"p{r}.{i}", torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist(), params)
        done = []
        sync(device)
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            done += [o for o in eng.step() if o.finished]
            steps += r == reps
        sync(device)  # every stream: the last copies included
        elapsed = (time.perf_counter() - t) * 1e3
        if r:  # the first batch warms up (allocations, compiles)
            totals.append(elapsed)
        nbytes = sum(o.prefix_state.nbytes for o in done)
        for o in done:
            eng.release_transfer(o.request_id)
    del eng
    gc.collect()
    return {"batch_ms": round(statistics.median(totals), 3), "batch_ms_all": totals, "steps": steps, "bytes": nbytes}


def main() -> None:
    from asympd.model.loader import build_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU: plumbing only")
    args = ap.parse_args()
    started = time.time()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = config(args.smoke)
    p_model = build_model(cfg, tensors_for(cfg, device), "prefill", dtype=dtype, device=device)
    cases = ((4, 3 * cfg.window_size, 4 * cfg.window_size),) if args.smoke else ((8, 4096, 8192), (2, 16384, 8192))
    res: dict[str, Any] = {"config": "reduced 3 layers at V4.1 widths, prefill role" if not args.smoke else "tiny"}
    res["d2h_pinned_GBps"] = round(d2h_rate(device, 256 << 20) / 1e9, 2) if device.type == "cuda" else None
    res["cases"] = []
    for count, n, budget in cases:
        row: dict[str, Any] = {"prompts": count, "prompt_len": n, "budget": budget}
        for side in (True, False):
            reps = 1 if args.smoke else 3
            row["side_stream" if side else "inline"] = run_batch(p_model, cfg, device, side, count, n, budget, reps)
        nbytes = row["side_stream"]["bytes"]
        row["export_bytes"] = nbytes
        if res["d2h_pinned_GBps"]:
            copy_ms = nbytes / (res["d2h_pinned_GBps"] * 1e9) * 1e3
            saved = row["inline"]["batch_ms"] - row["side_stream"]["batch_ms"]
            row.update(copy_floor_ms=round(copy_ms, 3), saved_ms=round(saved, 3), hidden=round(saved / copy_ms, 2))
            row["copy_share_of_batch"] = round(copy_ms / row["side_stream"]["batch_ms"], 5)
        res["cases"].append(row)
        log(row)
    record("export_overlap_smoke" if args.smoke else "export_overlap", res, started)


if __name__ == "__main__":
    main()
