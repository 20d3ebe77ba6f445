"""Admission policy on the decode worker: p50/p99 ITL and TTFT under a Poisson arrival stream, with
the engine's admission cap / token budget versus admitting everything at once.

A discrete-event simulation driven by the engine's real ``Scheduler`` (FCFS, decode rows first,
``max_new_admissions`` and ``admission_token_budget``) and ``BlockManager``: each step's duration is
the decode-worker step time composed from GPU measurements (``d_admission.json``: decode batch of B
requests x (1 + k) rows at 8K context plus j bounded prefills of 128 rows), interpolated in B and j
(linear extrapolation beyond j = 8 is labelled in the output). Times are one-GPU-equivalent: the
whole 40-layer step's compute on one H200 (a real D spreads the weights over several GPUs, which
scales the absolute latencies down; the ratios between policies are what this measures).

Arrivals (asymmetric mode: a request reaches D when P has exported its prefix):
- ``poisson``: one request at a time, Poisson;
- ``p_batches``: Poisson P steps, each delivering the prompts it finished together (18 x 1K,
  4 x 4K, 1 x 16K or the last chunk of a 64K prompt, by the prompt mix) -- how a batching P feeds D.
Each request decodes ``out_len`` tokens; a decode step emits 1-4 tokens (speculative, mean 2.8).

Writes ``admission_policy.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from bench.common import log, out_dir, record
from bench.d_admission import interp

ACCEPT = [(1, 0.10), (2, 0.25), (3, 0.40), (4, 0.25)]  # tokens per decode step, mean 2.8 (docs/model.md §6)
MIX = {1024: 0.40, 4096: 0.30, 16384: 0.20, 65536: 0.10}
PER_P_STEP = {1024: 18, 4096: 4, 16384: 1, 65536: 1}


class StepModel:
    """D step time (ms) from the composed table: f(B decode requests, j bounded prefills)."""

    def __init__(self, table: list[dict[str, Any]]):
        self.by_b: dict[int, list[tuple[float, float]]] = {}
        for r in table:
            self.by_b.setdefault(r["B"], []).append((r["j"], r["step_ms"]))
        self.bs = sorted(self.by_b)
        self.max_j = max(j for pts in self.by_b.values() for j, _ in pts)
        self.extrapolated_steps = 0

    def __call__(self, b: int, prefill_rows: int) -> float:
        j = prefill_rows / 128
        if j > self.max_j:
            self.extrapolated_steps += 1
        b = max(b, 1)
        per_b = [(bb, interp(self.by_b[bb], j)) for bb in self.bs]
        return max(0.1, interp(per_b, b))


def simulate(model: StepModel, policy: dict[str, Any], arrivals: list[tuple[float, int]], out_len: int, seed: int):
    from asympd.config import v41_flash
    from asympd.engine import modes
    from asympd.engine.request import Request, Status
    from asympd.engine.sampling import SamplingParams
    from asympd.engine.scheduler import Scheduler, SchedulerConfig
    from asympd.kv.block_manager import BlockManager
    from asympd.kv.spec import KVCacheSpec

    cfg = v41_flash()
    rng = random.Random(seed)
    sc = SchedulerConfig(
        max_num_seqs=policy.get("max_num_seqs", 512),
        max_num_batched_tokens=policy.get("max_num_batched_tokens", 65536),
        max_new_admissions=policy.get("max_new_admissions"),
        admission_token_budget=policy.get("admission_token_budget"),
        num_spec_tokens=3,
    )
    spec = KVCacheSpec.from_config(cfg, block_size=256, spec_slack=4)
    blocks = BlockManager(spec, num_blocks=1 << 20, max_seqs=sc.max_num_seqs, enable_prefix_caching=False)
    sched = Scheduler(sc, blocks)
    t, i = 0.0, 0
    pending = sorted(arrivals)
    reqs: dict[str, Request] = {}
    last_emit: dict[str, float] = {}
    itl: list[float] = []
    ttft: list[float] = []
    steps = 0
    batch_sizes, prefills = [], []
    tokens_out = 0
    while i < len(pending) or sched.has_work:
        while i < len(pending) and pending[i][0] <= t:
            at, n = pending[i]
            rid = f"r{i}"
            plan = modes.decode_plan(cfg, n, "asymmetric")
            req = Request(rid, [0] * n, SamplingParams(max_tokens=out_len), plan.phases, arrival_time=at)
            req.spec_enabled = True
            reqs[rid] = req
            sched.add(req)
            i += 1
        if not sched.has_work:
            t = pending[i][0]
            continue
        out = sched.schedule()
        dec = [c for c in out.chunks if c.phase is None]
        pre_rows = sum(c.num_rows for c in out.chunks if c.phase is not None)
        dt = model(len(dec), pre_rows) / 1e3
        t += dt
        steps += 1
        batch_sizes.append(len(dec))
        prefills.append(pre_rows / 128)
        for c in out.chunks:
            req = c.request
            if req.status is not Status.RUNNING:
                continue
            if c.phase is not None:
                req.cursor = c.hi
                if req.cursor == c.phase.hi:
                    req.phase_index += 1
                    if not req.in_prompt:
                        req.output_token_ids.append(1)
                        ttft.append(t - req.arrival_time)
                        last_emit[req.request_id] = t
                        tokens_out += 1
                continue
            k = rng.choices([a for a, _ in ACCEPT], weights=[w for _, w in ACCEPT])[0]
            k = min(k, out_len - len(req.output_token_ids))
            req.output_token_ids.extend([1] * k)
            tokens_out += k
            itl.append(t - last_emit[req.request_id])
            last_emit[req.request_id] = t
            if len(req.output_token_ids) >= out_len:
                req.status = Status.FINISHED_LENGTH
                sched.remove(req)
    itl.sort()
    ttft.sort()

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1e3 if xs else None

    return {
        "itl_ms": {"p50": pct(itl, 50), "p90": pct(itl, 90), "p99": pct(itl, 99), "n": len(itl)},
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99), "n": len(ttft)},
        "steps": steps,
        "sim_s": t,
        "mean_batch": sum(batch_sizes) / max(1, len(batch_sizes)),
        "max_prefills_in_step": max(prefills) if prefills else 0,
        "mean_prefills_per_step": sum(prefills) / max(1, len(prefills)),
        "tokens_per_s": tokens_out / t if t else None,
    }


def arrivals(kind: str, rate_req_s: float, n_req: int, seed: int) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    lengths, weights = zip(*MIX.items(), strict=True)
    out: list[tuple[float, int]] = []
    t = 0.0
    while len(out) < n_req:
        n = rng.choices(lengths, weights=weights)[0]
        if kind == "poisson":
            t += rng.expovariate(rate_req_s)
            out.append((t, n))
        else:
            m = PER_P_STEP[n]
            t += rng.expovariate(rate_req_s / m)
            out.extend((t, n) for _ in range(m))
    return out[:n_req]


POLICIES = {
    "admit-all": {"max_new_admissions": None, "admission_token_budget": None},
    "cap-1": {"max_new_admissions": 1, "admission_token_budget": 128},
    "cap-2": {"max_new_admissions": 2, "admission_token_budget": 256},
    "cap-4": {"max_new_admissions": 4, "admission_token_budget": 512},
    "cap-8": {"max_new_admissions": 8, "admission_token_budget": 1024},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-admission", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=256, help="target mean decode batch (sets the rate)")
    args = ap.parse_args()
    started = time.time()
    d = out_dir()
    table = json.loads(
        open(args.d_admission or d / ("d_admission_smoke.json" if args.smoke else "d_admission.json")).read()
    )
    model = StepModel(table["steps"])
    # the arrival rate whose steady state has the target decode batch (Little's law), counting the
    # prefills those arrivals add to each step: rate = B / (steps per request x T(B, rate x T))
    steps_per_req = args.out_len / 2.8
    t_step = model(args.concurrency, 0) / 1e3
    for _ in range(50):
        rate = args.concurrency / (steps_per_req * t_step)
        t_step = model(args.concurrency, int(rate * t_step * 128)) / 1e3
    n_req = 200 if args.smoke else args.requests
    res: dict[str, Any] = {
        "rate_req_per_s": rate,
        "target_concurrency": args.concurrency,
        "out_len": args.out_len,
        "requests": n_req,
        "accept": ACCEPT,
        "mix": MIX,
        "per_p_step": PER_P_STEP,
        "decode_only_step_ms_at_target": model(args.concurrency, 0),
        "steady_step_ms_at_target": t_step * 1e3,
        "scenarios": {},
    }
    for kind in ("poisson", "p_batches"):
        arr = arrivals(kind, rate, n_req, seed=7)
        res["scenarios"][kind] = {}
        for name, pol in POLICIES.items():
            model.extrapolated_steps = 0
            r = simulate(model, pol, arr, args.out_len, seed=11)
            r["steps_extrapolated_in_j"] = model.extrapolated_steps
            r["policy"] = pol
            # the same batch decoding with nothing admitted: what admission adds on top of it
            r["decode_only_step_ms_at_mean_batch"] = model(round(r["mean_batch"]), 0)
            r["p99_itl_over_decode_only"] = r["itl_ms"]["p99"] / r["decode_only_step_ms_at_mean_batch"]
            r["p50_itl_over_decode_only"] = r["itl_ms"]["p50"] / r["decode_only_step_ms_at_mean_batch"]
            res["scenarios"][kind][name] = r
            log(
                f"{kind:9s} {name:9s}: ITL p50 {r['itl_ms']['p50']:.0f} p99 {r['itl_ms']['p99']:.0f} ms, "
                f"TTFT p50 {r['ttft_ms']['p50']:.0f} p99 {r['ttft_ms']['p99']:.0f} ms, batch {r['mean_batch']:.0f}, "
                f"max prefills/step {r['max_prefills_in_step']:.0f}, extrapolated {r['steps_extrapolated_in_j']}"
            )
    res["inputs"] = {"d_admission": table.get("source_digest")}
    record("admission_policy_smoke" if args.smoke else "admission_policy", res, started)


if __name__ == "__main__":
    main()
