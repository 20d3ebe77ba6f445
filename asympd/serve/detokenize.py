"""Engine outputs -> text for the client: incremental detokenization, stop strings, logprobs
aligned to the tokens. Pure bookkeeping: the server runs ``update`` off the event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asympd.engine.request import RequestOutput


class OutputTracker:
    """Cumulative engine outputs -> what to send: incremental detokenization (a token ending in a
    partial UTF-8 sequence waits for the next one), stop strings on the text (with the text that
    could still become a stop string held back), and logprobs aligned to the new tokens."""

    def __init__(
        self,
        tokenizer: Any,
        stops: list[str],
        include_stop: bool,
        eos_token_id: int | None = None,
        first_logprobs: dict[int, float] | None = None,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer, self.eos = tokenizer, eos_token_id
        self.skip_special_tokens = skip_special_tokens  # vLLM's: special tokens left out of the text
        self.stops, self.include_stop = stops, include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.first_logprobs = first_logprobs  # symmetric D: P sampled the first token
        self.min_tokens = min_tokens  # vLLM: no stop string ends a request before min_tokens tokens
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.text = ""
        self._prefix = self._read = 0
        self.sent_text = self.sent_tokens = self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.stopped_by_string = False

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, out: RequestOutput) -> None:
        """Take the newest cumulative output of the request."""
        comp = out.outputs[0]
        new = comp.token_ids[len(self.token_ids) :]
        if comp.logprobs is not None:
            lps = list(comp.logprobs)
            if self.first_logprobs is not None and len(lps) < len(comp.token_ids):
                lps = [self.first_logprobs] + lps  # the engine did not carry P's entry itself
            self.logprobs = lps[: len(comp.token_ids)]
        if self.stopped_by_string:
            return
        self.token_ids.extend(new)
        before = len(self.text)
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        full = self._decode(self.token_ids[self._prefix :])
        if len(full) > len(prefix_text) and (not full.endswith("\ufffd") or out.finished):
            self.text += full[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.token_ids)
        if out.finished:
            self.finish_reason = comp.finish_reason
            last = comp.token_ids[-1] if comp.token_ids else None
            if comp.finish_reason == "stop" and last is not None and last != self.eos:
                self.stop_reason = last
        if self.stops and len(self.text) > before and len(self.token_ids) > self.min_tokens:
            self._check_stops(max(0, before - self.hold))

    def _check_stops(self, start: int) -> None:
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return
        i, s = min(hits)
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.finish_reason, self.stop_reason, self.stopped_by_string = "stop", s, True

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def delta(self) -> tuple[str, list[int], list[dict[int, float]]]:
        """New text (minus a possible stop-string start, unless done), tokens and logprobs."""
        upto = len(self.text) if self.done or not self.stops else max(self.sent_text, len(self.text) - self.hold)
        text = self.text[self.sent_text : upto]
        toks = self.token_ids[self.sent_tokens :]
        lps = self.logprobs[self.sent_logprobs : len(self.token_ids)]
        self.sent_text, self.sent_tokens = upto, len(self.token_ids)
        self.sent_logprobs += len(lps)
        return text, toks, lps
