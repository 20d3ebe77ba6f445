"""Sampling parameters and the sampler.

Greedy when temperature is 0. Otherwise temperature, then top-k, then top-p, then a draw from a
per-request generator when a seed is given (so a seeded request samples the same tokens whatever
else is in the batch). Log-probabilities are of the model's raw distribution (before
temperature/top-k/top-p), as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top-n per position; -1 = the whole vocabulary
    ignore_eos: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with a message fit for an HTTP 400."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or positive, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be -1 (whole vocabulary) or >= 0, got {self.logprobs}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids out of range [0, {vocab_size}): {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from (fp32 [vocab]) for temperature > 0."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        cum = sorted_p.cumsum(0)
        drop = cum - sorted_p > params.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(torch.argmax(logits))  # first maximum: deterministic ties
    probs = processed_probs(logits, params)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """The sampled token's log-probability plus the top-n (n = -1: every token)."""
    lp = torch.log_softmax(logits.float(), dim=-1).cpu()
    if n == -1:
        return {i: float(v) for i, v in enumerate(lp.tolist())}
    out = {token: float(lp[token])}
    if n > 0:
        vals, ids = torch.topk(lp, min(n, lp.numel()))
        for i, v in zip(ids.tolist(), vals.tolist(), strict=True):
            out.setdefault(i, float(v))
    return out
