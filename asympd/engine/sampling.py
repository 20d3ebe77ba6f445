"""Sampling parameters and the sampler.

First the logits are adjusted as vLLM does: ``allowed_token_ids`` masks every other token, bad words
(``bad_words_token_ids``) mask a sequence's last token wherever the output ends with the rest of it,
``min_tokens`` masks EOS and ``stop_token_ids`` until that many tokens exist, ``logit_bias`` is
added, then the repetition penalty (prompt and output tokens: positive logits divided by it,
negative ones multiplied), the frequency penalty (times each token's count in the output) and the
presence penalty (once per token in the output) are applied (a masked logit stays -inf).
Then greedy when temperature is 0; otherwise temperature, min-p (vLLM's order: on the tempered
distribution, before top-k), top-k, top-p, and a draw from a
per-request generator when a seed is given (so a seeded request samples the same tokens whatever
else is in the batch). Log-probabilities are of the model's raw distribution (before any of
this), as vLLM reports them by default. The engine does all of it batched over a step on the
model's device (``asympd.engine.sampler``); ``processed_probs`` is the one-row reference.
``SamplingParams`` lives in ``sampling_params.py`` (torch-free) and is re-exported here.
"""

from __future__ import annotations

import torch

from asympd.engine.sampling_params import SamplingParams


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], eos: int | None
) -> torch.Tensor:
    """The logits after allowed_token_ids, bad words, min_tokens, logit_bias and the three penalties
    (a new fp32 tensor [vocab]); ``logits`` itself when the request asks for none of them."""
    if not params.adjusts_logits:
        return logits
    x = logits.float().clone()
    if params.allowed_token_ids is not None:
        masked = torch.ones(x.numel(), dtype=torch.bool, device=x.device)
        masked[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=x.device)] = False
        x.masked_fill_(masked, float("-inf"))
    banned = bad_word_bans(params.bad_words_token_ids, output_ids)
    if banned:
        x[banned] = float("-inf")
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


def bad_word_bans(bad_words: list[list[int]], output_ids: list[int]) -> list[int]:
    """The tokens bad words forbid next (vLLM's rule): each sequence's last token where the output
    so far ends with the rest of the sequence; a one-token word's always."""
    n = len(output_ids)
    return [w[-1] for w in bad_words if len(w) - 1 <= n and output_ids[n - len(w) + 1 :] == w[:-1]]


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from (fp32 [vocab]) for temperature > 0."""
    x = logits.float() / params.temperature
    if params.min_p > 0:
        p = torch.softmax(x, dim=-1)
        x = x.masked_fill(p < params.min_p * p.max(), float("-inf"))
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
