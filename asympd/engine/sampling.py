"""Sampling parameters and the sampler.

First the logits are adjusted as vLLM does: ``min_tokens`` masks EOS and ``stop_token_ids`` until
that many tokens exist, ``logit_bias`` is added, then the repetition penalty (prompt and output
tokens: positive logits divided by it, negative ones multiplied), the frequency penalty (times each
token's count in the output) and the presence penalty (once per token in the output) are applied.
Then greedy when temperature is 0; otherwise temperature, top-k, top-p, and a draw from a
per-request generator when a seed is given (so a seeded request samples the same tokens whatever
else is in the batch). Log-probabilities are of the model's raw distribution (before any of
this), as vLLM reports them by default. The engine does all of it batched over a step on the
model's device (``asympd.engine.sampler``); ``processed_probs`` is the one-row reference.
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
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 1e4:
            raise ValueError(f"repetition_penalty must be in (0, 1e4], got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        off = {t: b for t, b in self.logit_bias.items() if not -100 <= b <= 100}
        if off:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {off}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids out of range [0, {vocab_size}): {bad}")
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids out of range [0, {vocab_size}): {bad[:8]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """True when the logits depend on more than the model (then the engine does not draft)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], eos: int | None
) -> torch.Tensor:
    """The logits after min_tokens, logit_bias and the three penalties (a new fp32 tensor [vocab]);
    ``logits`` itself when the request asks for none of them."""
    if not params.adjusts_logits:
        return logits
    x = logits.float().clone()
    if len(output_ids) < params.min_tokens:
        stops = set(params.stop_token_ids) | ({eos} if eos is not None and not params.ignore_eos else set())
        idx = [t for t in stops if 0 <= t < x.numel()]
        if idx:
            x[idx] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=x.device)
        x.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=x.dtype, device=x.device))
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
        seen[torch.tensor(prompt_ids + output_ids, dtype=torch.long, device=x.device)] = True
        rp = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=x.numel()).to(x.device, x.dtype)
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(x.dtype)
    return x


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
