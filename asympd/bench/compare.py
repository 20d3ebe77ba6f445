"""How far each deployment mode's outputs are from the reference semantics (colocated/full).

For a set of prompts of lengths around and beyond the window W, every mode generates 16 greedy
tokens with full first-position log-probabilities. Reported per mode: first-token agreement,
mean KL(reference || mode) of the first-token distribution, the fraction of prompts whose 16
tokens all agree, and the mean length of the agreeing prefix; plus the KL per prompt length, and
the bytes of the serialized prefix state P hands D per prompt length (what each P/D mode moves).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from asympd.engine.llm import LLM
from asympd.engine.modes import VARIANTS
from asympd.engine.sampling import SamplingParams

MODES = VARIANTS


def mode_name(mode: str, semantics: str, policy: str) -> str:
    if mode == "colocated":
        return f"colocated/{semantics}"
    return f"{mode}/{policy}" if mode == "asymmetric" else mode


def prompt_lengths(window: int) -> list[int]:
    """Within one window, just past it, and far past it (where only compressed KV reaches)."""
    return [window // 2, window, window + 1, 2 * window + 1, 4 * window, 16 * window, 64 * window]


def kl(p_logprobs: dict[int, float], q_logprobs: dict[int, float]) -> float:
    return sum(math.exp(lp) * (lp - q_logprobs[t]) for t, lp in p_logprobs.items())


def compare(
    checkpoint: str | Path,
    *,
    prompts_per_length: int = 2,
    max_tokens: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    lengths_override: list[int] | None = None,
) -> dict[str, Any]:
    results: dict[str, list] = {}
    lengths: list[int] = []
    prompts: list[list[int]] = []
    timing: dict[str, float] = {}
    transfer: dict[str, dict[int, int]] = {}  # mode -> prompt length -> mean serialized prefix-state bytes
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=-1)
    for mode, semantics, policy in MODES:
        name = mode_name(mode, semantics, policy)
        t0 = time.perf_counter()
        llm = LLM(checkpoint, mode, semantics, boundary_policy=policy, dtype=dtype)
        if not prompts:
            g = torch.Generator().manual_seed(seed)
            for n in lengths_override or prompt_lengths(llm.cfg.window_size):
                for _ in range(prompts_per_length):
                    lengths.append(n)
                    prompts.append(torch.randint(3, llm.cfg.vocab_size, (n,), generator=g).tolist())
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        results[name] = [(o.outputs[0].token_ids, o.outputs[0].logprobs[0]) for o in outs]
        moved = [llm.transfer_bytes.get(o.request_id, 0) for o in outs]
        transfer[name] = {
            n: sum(b for m, b in zip(lengths, moved, strict=True) if m == n) // lengths.count(n) for n in lengths
        }
        timing[name] = time.perf_counter() - t0
    ref = results["colocated/full"]
    report: dict[str, Any] = {
        "checkpoint": str(checkpoint),
        "prompt_lengths": lengths,
        "max_tokens": max_tokens,
        "reference": "colocated/full",
        "modes": {},
    }
    for name, rows in results.items():
        first = [r[0][0] == x[0][0] for r, x in zip(ref, rows, strict=True)]
        kls = [kl(r[1], x[1]) for r, x in zip(ref, rows, strict=True)]
        prefix = [
            next((i for i, (a, b) in enumerate(zip(r[0], x[0], strict=True)) if a != b), len(r[0]))
            for r, x in zip(ref, rows, strict=True)
        ]
        by_len: dict[int, list[float]] = {}
        for n, v in zip(lengths, kls, strict=True):
            by_len.setdefault(n, []).append(v)
        report["modes"][name] = {
            "first_token_agreement": sum(first) / len(first),
            "mean_first_token_kl": sum(kls) / len(kls),
            "all_tokens_agree": sum(p == max_tokens for p in prefix) / len(prefix),
            "mean_agreeing_prefix": sum(prefix) / len(prefix),
            "kl_by_length": {n: sum(v) / len(v) for n, v in by_len.items()},
            "transfer_bytes_by_length": transfer[name],
            "seconds": round(timing[name], 2),
        }
    return report


def format_report(report: dict[str, Any]) -> str:
    n_tok = report["max_tokens"]
    lens = sorted(set(report["prompt_lengths"]))
    lines = [
        f"{len(report['prompt_lengths'])} prompts, lengths {lens}; reference {report['reference']}",
        f"{'mode':26} {'first tok':>9} {'mean KL':>9} {f'all {n_tok}':>7} {'prefix':>7} "
        f"{f'bytes@{lens[-1]}':>11}   KL by prompt length",
    ]
    for name, m in report["modes"].items():
        by_len = " ".join(f"{n}:{m['kl_by_length'][n]:.3f}" for n in lens)
        lines.append(
            f"{name:26} {m['first_token_agreement']:9.2f} {m['mean_first_token_kl']:9.4f} "
            f"{m['all_tokens_agree']:7.2f} {m['mean_agreeing_prefix']:7.1f} "
            f"{m['transfer_bytes_by_length'][lens[-1]]:11d}   {by_len}"
        )
    return "\n".join(lines)


def main(checkpoint: str, as_json: bool, prompts_per_length: int, max_tokens: int, seed: int) -> int:
    report = compare(checkpoint, prompts_per_length=prompts_per_length, max_tokens=max_tokens, seed=seed)
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0
