"""Speculative decoding on the decode worker: drafting, verification, rollback, statistics.

One step of a request, after its bounded-prefill first step:

1. **draft** (end of the previous step): the proposer (DSpark by default, ``asympd.model.dspark``)
   appends the target-layer states of the rows the target just *accepted* to its window, then drafts
   up to ``num_spec_tokens`` tokens ``d1..dk`` from a block starting at the newest token ``t`` (at
   position ``p``). The window is seeded from whatever rows the engine computed at full depth, so in
   every mode the first decode step already speculates: D's bounded prefill or replay rows
   ``[N-W, N)`` are exactly a full window.
2. **verify**: one target forward over rows ``[t, d1..dk]`` at positions ``p..p+k`` with all logits,
   batched with other requests' prefills and decodes. Greedy: accept while ``d_i`` is the argmax of
   row ``i-1``, then emit that row's argmax. Sampled: rejection sampling, which emits tokens
   distributed exactly as sampling the target one token at a time would (``sampler.rejection_batch``
   for every sampled request of the step at once, on the device; ``rejection_sample`` for one).
3. **rollback**: rows past the accepted ones leave no visible trace. Windows and the compressor's
   open-group history are cut by position (``SequenceKV.truncate``), blocks past the end are released
   (``BlockManager.truncate``). Compressed entries / index keys of groups the rejected rows completed
   stay in the kept blocks as dead data: every read of entry ``j`` happens in a forward whose own rows
   rewrite it first (a query at ``i`` sees entries ``< (i+1)//r``, all pooled from rows ``<= i``, and
   the source layer writes the segment's groups before any layer reads), exactly as the unused tail of
   a block is dead in plain decoding. ``tests/engine/test_spec_decode.py`` poisons them with NaN to
   prove nothing reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from asympd.engine.sampler import batched_probs, greedy_accept, race, rejection_batch
from asympd.engine.sampling import SamplingParams
from asympd.model.attention import SequenceKV

__all__ = ["greedy_accept", "rejection_sample"]  # greedy_accept lives with the batched sampler


@dataclass
class DraftRequest:
    """One request's share of a draft pass: accepted main rows to seed, and a block to draft from
    (``num_drafts == 0``: seed only)."""

    kv: SequenceKV
    main_hidden: torch.Tensor | None  # [m, n_targets * dim]: target-layer states of accepted rows
    main_start: int  # position of the first main row
    block_start: int  # position of the newest token (the block's first row)
    first_token: int  # the newest token
    num_drafts: int
    params: SamplingParams
    generator: torch.Generator | None
    request: Any = None  # the engine's Request (for proposers that want more context)


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab]: the distribution each draft was sampled from
    confidence: torch.Tensor | None = None  # [len(tokens)] confidence logits, where the proposer has them


class Proposer(Protocol):
    def __call__(self, items: list[DraftRequest]) -> list[Proposal]: ...


class DSparkProposer:
    """Drafts with the DSpark blocks. Greedy requests draft the argmax of each Markov-biased row;
    sampled ones draw from it after the request's own temperature/top-k/top-p (the ``q`` that
    rejection sampling needs). With ``confidence_threshold`` a request's drafts stop before the
    first one whose ``sigmoid(confidence)`` falls below it (the reference computes the confidence
    head but applies no threshold: None, the default, keeps every draft)."""

    def __init__(self, drafter: Any, confidence_threshold: float | None = None):
        self.drafter = drafter
        self.confidence_threshold = confidence_threshold
        self.graphs: Any = None  # a cuda_graphs.DraftGraphs: the blocks' forward replayed (the engine sets it)

    def __call__(self, items: list[DraftRequest]) -> list[Proposal]:
        from asympd.model.dspark import DraftSegment

        segments, drafting, k = [], [], 0
        for i, it in enumerate(items):  # one pass: the segments, who drafts, the most drafts
            n = it.num_drafts
            segments.append(
                DraftSegment(it.kv, it.main_hidden, it.main_start, it.block_start if n > 0 else None, it.first_token)
            )
            if n > 0:
                drafting.append(i)
                k = max(k, n)
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i in drafting}
        # the sampled (not greedy) drafting requests, once per pass: positions past a request's drafts drop it
        sampled = [(j, items[i].num_drafts) for j, i in enumerate(drafting) if not items[i].params.greedy]

        def sample(step: int, logits: torch.Tensor) -> torch.Tensor:
            """Draft ``step + 1`` of every drafting request, on the device: greedy rows (and rows past
            a request's drafts) take the argmax, sampled rows one batched draw; their q rows stay
            on the device for verification."""
            out = logits.argmax(dim=-1)
            rows = [j for j, n in sampled if step < n]
            if rows:
                idx = torch.tensor(rows, device=logits.device)
                q = batched_probs(logits[idx], [items[drafting[j]].params for j in rows])
                out[idx] = race(q, [items[drafting[j]].generator for j in rows])
                for n, j in enumerate(rows):
                    q_rows[drafting[j]].append(q[n])
            return out

        greedy = not sampled  # every draft an argmax: the drafter's graph may run the Markov loop
        draft = self.drafter.draft(segments, k, sample, self.graphs, greedy)  # k = 0: seed the windows only
        proposals = [Proposal([]) for _ in items]
        if draft is None:
            return proposals
        tokens, confidence = draft.tokens.tolist(), draft.confidence.float().cpu()  # one copy each
        rows = confidence.unbind(0)  # every request's row in one call, not one indexing op each
        threshold = self.confidence_threshold
        for j, i in enumerate(drafting):
            n = items[i].num_drafts
            conf = rows[j] if n == k else rows[j][:n]
            if threshold is not None:
                low = (torch.sigmoid(conf) < threshold).nonzero()
                n = int(low[0]) if low.numel() else n
                conf = conf[:n]
            q = q_rows[i]
            probs = torch.stack(q[:n]) if q and n else None
            proposals[i] = Proposal(tokens[j] if n == k else tokens[j][:n], probs, conf)
        return proposals


# ---- verification ---------------------------------------------------------------------------------


def rejection_sample(
    target_probs: Callable[[int], torch.Tensor] | torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: list[int],
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft ``d_i`` was drawn from ``q_i = draft_probs[i]``; ``p_i = target_probs(i)`` (or row ``i``) is
    the distribution the plain sampler would draw that position from. Accept ``d_i`` with probability
    ``min(1, p_i(d_i) / q_i(d_i))``; on the first rejection emit a draw from ``norm(max(0, p_i - q_i))``
    and stop; when all ``k`` are accepted emit a bonus draw from ``p_k``. Then
    ``P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(0, p(x)-q(x)) / Z
    = min(p, q)(x) + max(0, p(x)-q(x)) = p(x)``, since ``Z = sum max(0, p-q) = 1 - sum min(p, q)``;
    by induction each emitted token is distributed as the target's given the tokens before it.
    One request through the batched ``rejection_batch`` (the engine calls that for the whole step).
    Returns (emitted tokens, number of drafts accepted)."""
    rows = target_probs if callable(target_probs) else target_probs.__getitem__
    k = len(drafts)
    target = torch.stack([rows(i) for i in range(k + 1)])
    draft = torch.zeros_like(target)
    draft[:k] = draft_probs[:k].to(target)
    d = torch.tensor([drafts], dtype=torch.long, device=target.device)
    accepted, extra = rejection_batch(target[None], draft[None], d, [k], [generator])
    a = int(accepted[0])
    return drafts[:a] + [int(extra[0])], a


# ---- rollback and statistics ----------------------------------------------------------------------


def rollback(cache: Any, blocks: Any, cuts: list[tuple[Any, int, int]]) -> None:
    """After a verify step, keep positions ``< num_tokens`` of each ``(seq_id, num_tokens, written)``
    whose step wrote rows up to ``written``: windows and open compressor groups cut by position (one
    host sync for the whole step), blocks past the end released (so the block table covers exactly
    the accepted positions)."""
    cache.truncate([(blocks.slot(sid), n) for sid, n, written in cuts if n < written])
    for sid, n, _ in cuts:
        if n < blocks.num_tokens(sid):
            blocks.truncate(sid, n)


def spec_metrics(proposed: int, accepted: int, steps: int) -> dict[str, float]:
    """Counters plus the two rates: ``spec_acceptance_rate`` = accepted / proposed drafts and
    ``spec_mean_accepted_length`` = tokens emitted per verify step (1 + accepted / steps), counting
    only steps that verified at least one draft."""
    return {
        "spec_proposed": proposed,
        "spec_accepted": accepted,
        "spec_steps": steps,
        "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_mean_accepted_length": 1 + accepted / steps if steps else 0.0,
    }
