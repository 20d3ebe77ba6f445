"""A request's sampling parameters, apart from the sampler (``sampling.py``) so that requests can
be built without torch (the planner's simulator does)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# vLLM's floor: a positive temperature below it is raised to it; dividing the logits by much less
# (under ~1e-37 in fp32) overflows them to inf, and the draw of a NaN distribution is token 0
MIN_TEMPERATURE = 1e-2
# the largest temperature the sampler's fp32 holds: past it the divisor is inf, and a masked
# token's logit becomes -inf / inf = NaN
MAX_TEMPERATURE = 3.4028234663852886e38


class SamplingParamsError(ValueError):
    """A parameter out of range; its message starts with the field's name (``param``)."""

    @property
    def param(self) -> str:
        return str(self).split(" ", 1)[0]


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0  # [0, 1]: drop tokens under min_p x the most likely one's probability; 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top-n per position; -1 = the whole vocabulary
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    allowed_token_ids: list[int] | None = None  # only these may be sampled (every other logit -inf); None: all
    # vLLM's bad_words, tokenized (the server tokenizes each word, with and without a leading space): a
    # sequence's last token is masked wherever the output ends with the rest of it (a one-token word: always)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError with a message fit for an HTTP 400."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise SamplingParamsError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN too
            raise SamplingParamsError(
                f"temperature must be in [0, {MAX_TEMPERATURE:.4g}] (fp32's largest), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (off) or positive, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < -1:
            raise SamplingParamsError(f"logprobs must be -1 (whole vocabulary) or >= 0, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 1e-4 <= self.repetition_penalty <= 1e4:  # far under 1 it overflows the logits it divides, as temperature
            raise SamplingParamsError(f"repetition_penalty must be in [1e-4, 1e4], got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        off = {t: b for t, b in self.logit_bias.items() if not -100 <= b <= 100}
        if off:
            raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {off}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise SamplingParamsError("allowed_token_ids must not be empty: it would leave no token to sample")
        if any(not w for w in self.bad_words_token_ids):
            raise SamplingParamsError("bad_words_token_ids must hold non-empty token id sequences")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(f"stop_token_ids out of range [0, {vocab_size}): {bad}")
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(f"logit_bias token ids out of range [0, {vocab_size}): {bad[:8]}")
            bad = [t for t in self.allowed_token_ids or () if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(f"allowed_token_ids out of range [0, {vocab_size}): {bad[:8]}")
            bad = [t for w in self.bad_words_token_ids for t in w if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(f"bad_words_token_ids out of range [0, {vocab_size}): {bad[:8]}")

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
            or self.allowed_token_ids is not None
            or self.bad_words_token_ids
        )


# generation_config.json's keys that a request's omitted sampling fields default to (vLLM's
# ``--generation-config auto``); max_new_tokens is the default max_tokens
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a generation config sets, under SamplingParams' names; a value
    SamplingParams would refuse is a ValueError naming the key (a server does not start on it)."""
    out = {k: generation_config[k] for k in GENERATION_DEFAULT_KEYS if generation_config.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    try:
        SamplingParams(**out).validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation_config.json: {e}") from None
    return out
