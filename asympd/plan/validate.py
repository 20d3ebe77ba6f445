"""The planner's simulator against what was measured or simulated before it existed.

The end-to-end study the issue names (P and D serving V4.1-Flash on H200s) does not exist yet, so
this replays the one closed-loop result there is: ``bench/results/admission_policy.json`` (the D
worker on one-GPU-equivalent H200 step times, Poisson arrivals, each admission policy) through
``asympd.plan.simulate.run_decode`` and reports the ratios. It checks that the planner's D model
(step table, scheduler use, speculative tokens) reproduces the benchmark's; it is not a check
against a GPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from asympd.config import v41_flash
from asympd.plan.gpus import GPUS
from asympd.plan.simulate import Arrival, run_decode
from asympd.plan.steps import RESULTS_DIR, StepModel, load_results

BENCH_POLICIES = {"admit-all": (None, None), "cap-4": (4, 512), "cap-8": (8, 1024)}


def bench_arrivals(ap: dict[str, Any], n: int, seed: int = 7) -> list[Arrival]:
    """The benchmark's Poisson stream: same rate, mix and output length (its own seed sequence)."""
    rng = random.Random(seed)
    lengths = [int(k) for k in ap["mix"]]
    weights = list(ap["mix"].values())
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(ap["rate_req_per_s"])
        out.append(Arrival(i, t, rng.choices(lengths, weights=weights)[0], ap["out_len"]))
    return out


def validate_admission(
    requests: int | None = None, policies: tuple[str, ...] = tuple(BENCH_POLICIES), results_dir: str | None = None
) -> dict[str, Any]:
    res = load_results(results_dir)
    ap = json.loads((Path(results_dir or RESULTS_DIR) / "admission_policy.json").read_text())
    cfg = v41_flash()
    steps = StepModel(res, GPUS["H200"], cfg.dim, cfg.n_activated_experts, cfg.window_size)
    arr = bench_arrivals(ap, requests or ap["requests"])
    out: dict[str, Any] = {"requests": len(arr), "rate_req_per_s": ap["rate_req_per_s"], "policies": {}}
    for name in policies:
        cap, budget = BENCH_POLICIES[name]
        run = run_decode(cfg, steps, "asymmetric", 1, 1 << 20, arr, 512, cap, budget, seed=11)
        ttft = sorted(run.first_token_s[a.index] - a.time_s for a in arr if a.index in run.first_token_s)
        itl = sorted(run.itl_s)

        def p(xs: list[float], q: float) -> float:
            return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1e3

        bench = ap["scenarios"]["poisson"][name]
        mine = {"itl_p50": p(itl, 50), "itl_p99": p(itl, 99), "ttft_p50": p(ttft, 50), "ttft_p99": p(ttft, 99)}
        ref = {
            "itl_p50": bench["itl_ms"]["p50"],
            "itl_p99": bench["itl_ms"]["p99"],
            "ttft_p50": bench["ttft_ms"]["p50"],
            "ttft_p99": bench["ttft_ms"]["p99"],
        }
        out["policies"][name] = {
            "planner_ms": mine,
            "benchmark_ms": ref,
            "ratio": {k: mine[k] / ref[k] for k in mine},
        }
    return out


if __name__ == "__main__":
    print(json.dumps(validate_admission(), indent=2))
