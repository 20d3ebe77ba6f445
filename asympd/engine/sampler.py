"""The step's sampler: every row a step samples, on the model's device, one host copy.

A per-request sampler copies a whole vocabulary row to the host for every token (0.5 MB at V4.1's
129K vocabulary). Here the rows that need sampling, logprobs or DSpark acceptance are batched over
the step and everything stays on the device until one packed copy of the small results.

Draws use the exponential race: with ``E_x ~ Exp(1)`` i.i.d., ``argmax_x p(x) / E_x`` is a sample from
``p / sum(p)`` (``p(x)/E_x`` is exponential with rate ``1/p(x)``; the largest of them is the one whose
rate is smallest relative to the total, with probability ``p(x) / sum p``). A request's randomness is
therefore a ``[vocab]`` noise row drawn from its own generator (or one shared draw for unseeded
rows), so a seeded request draws the same tokens whatever else is in the batch, and the
distribution need not be normalised (the rejection residual is used as it is).

Ordering of a seeded request's generator, which its reproducibility rests on: a plain sample draws
one noise row; a verify step draws ``k`` uniforms (the accept tests) then one noise row; a draft
step draws one noise row per sampled draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asympd.engine.sampling import SamplingParams, adjust_logits


@dataclass
class SampleJob:
    """One request's share of a step: rows ``[1, vocab]`` to sample a token from, or rows
    ``[k+1, vocab]`` verifying ``k`` drafts. ``logits`` are the model's raw logits (logprobs are of
    them); the logit adjustments are applied to the row a plain sample draws from."""

    logits: torch.Tensor
    params: SamplingParams
    generator: torch.Generator | None = None
    argmax: list[int] | None = None  # the rows' raw argmax, already on the host (greedy needs no more)
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [k, vocab]: the distribution each draft was drawn from
    prompt_ids: list[int] = field(default_factory=list)  # for adjust_logits
    output_ids: list[int] = field(default_factory=list)
    eos: int | None = None


@dataclass
class Drawn:
    tokens: list[int]  # emitted: one sampled token, or the accepted drafts plus one more
    accepted: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per emitted token, if asked


# ---- the batched primitives (all on the rows' device) ---------------------------------------------


def _to(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list on the device, queued without waiting for the device (host->device only)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def batched_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``processed_probs`` for every row ``[R, vocab]`` (temperature > 0) at once: per-row
    temperature, min-p, top-k and top-p as tensors, one sort for the rows that filter (none when no
    row does). A row's result does not depend on the other rows (seeded sampling is batch-invariant)."""
    r, v = logits.shape
    temp = _to([p.temperature for p in params], logits.device, torch.float32)
    x = logits.float() / temp[:, None]
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0 for p in params):  # 0 keeps every token (no probability is below 0)
        min_p = _to([p.min_p for p in params], logits.device, torch.float32)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
        probs = torch.softmax(x, dim=-1)
    ks = [p.top_k if p.top_k and 0 < p.top_k < v else v for p in params]
    tops = [p.top_p for p in params]
    rows = [i for i in range(r) if ks[i] < v or tops[i] < 1.0]
    if not rows:
        return probs
    idx = _to(rows, logits.device)
    sx, order = torch.sort(x[idx], dim=-1, descending=True, stable=True)
    k = _to([ks[i] for i in rows], logits.device)
    kth = sx.gather(1, (k - 1)[:, None])
    sp = torch.softmax(sx.masked_fill(sx < kth, float("-inf")), dim=-1)
    top_p = _to([tops[i] if tops[i] < 1.0 else float("inf") for i in rows], logits.device, torch.float32)
    sp = sp.masked_fill(sp.cumsum(-1) - sp > top_p[:, None], 0.0)  # the smallest prefix reaching top_p
    sp = sp / sp.sum(-1, keepdim=True)
    probs[idx] = torch.zeros_like(sp).scatter_(1, order, sp)
    return probs


def _fill(t: torch.Tensor, generator: torch.Generator, kind: str) -> None:
    """Fill ``t`` with uniforms or Exp(1) draws from a request's generator: in place when the
    generator lives on ``t``'s device (the engine creates it on the model's), else drawn where it
    lives and copied over (host->device)."""
    if generator.device != t.device:
        src = torch.empty(t.shape, device=generator.device)
        _fill(src, generator, kind)
        t.copy_(src)
    elif kind == "uniform":
        t.uniform_(generator=generator)
    else:
        t.exponential_(generator=generator)


def _noise(generators: list[torch.Generator | None], n: int, device: torch.device, kind: str) -> torch.Tensor:
    """``[len(generators), n]``: each seeded row from its own generator, the rest from one shared draw."""
    out = torch.empty(len(generators), n, device=device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == len(generators):
        return out.uniform_() if kind == "uniform" else out.exponential_()
    if shared:
        block = torch.empty(len(shared), n, device=device)
        out[_to(shared, device)] = block.uniform_() if kind == "uniform" else block.exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            _fill(out[i], g, kind)
    return out


def race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row ``[R, vocab]`` drawn from the (unnormalised) rows: ``argmax(p / E)``."""
    noise = _noise(generators, probs.size(-1), probs.device, "exponential").to(probs.dtype)
    return (probs / noise.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def rejection_batch(
    target: torch.Tensor,
    draft: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: list[int],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for B requests at once.

    ``target [B, K+1, vocab]``: the distributions the plain sampler would draw each row from;
    ``draft [B, K+1, vocab]``: the ones the drafts were drawn from, zero past a request's
    ``num_drafts[b]`` (so its row ``k_b`` is the bonus row: ``max(p - 0, 0) = p``); ``drafts [B, K]``.
    Accept ``d_i`` while ``u_i q_i(d_i) < p_i(d_i)``; at the first rejection ``a`` (or ``a = k_b``)
    emit a draw from ``max(p_a - q_a, 0)``: ``P(emit x) = min(p, q)(x) + max(0, p(x) - q(x)) = p(x)``.
    Returns (accepted ``[B]``, the extra token ``[B]``), both on the device."""
    b, k1, _ = target.shape
    k = k1 - 1
    u = torch.ones(b, k, device=target.device, dtype=target.dtype)
    for i, g in enumerate(generators):  # each request draws exactly its k_b uniforms
        n = num_drafts[i] if g is not None else 0
        if n:
            _fill(u[i, :n], g, "uniform")
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared and k:
        rows = _to(shared, target.device)
        u[rows] = _noise([None] * len(shared), k, target.device, "uniform").to(target.dtype)
    d = drafts[:, :, None]
    p_d, q_d = target[:, :k].gather(2, d).squeeze(2), draft[:, :k].gather(2, d).squeeze(2)
    live = torch.arange(k, device=target.device)[None, :] < _to(num_drafts, target.device)[:, None]
    accepted = ((u * q_d < p_d) & live).long().cumprod(dim=1).sum(dim=1)
    at = torch.arange(b, device=target.device)
    p_a = target[at, accepted]
    residual = (p_a - draft[at, accepted]).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)
    return accepted, race(residual, generators)


def greedy_accept(
    target_logits: torch.Tensor, drafts: list[int], argmax: list[int] | None = None
) -> tuple[list[int], int]:
    """Rows ``[k+1, vocab]``: accept drafts while each is its row's argmax (first maximum, as the
    plain sampler picks), then emit the argmax of the first row not matched (or of the last row).
    ``argmax``: the rows' argmax if already computed. Returns (emitted tokens, drafts accepted)."""
    if argmax is not None:
        target = argmax[: len(drafts) + 1]
    else:
        target = torch.argmax(target_logits[: len(drafts) + 1], dim=-1).tolist()
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return drafts[:a] + [target[a]], a


# ---- one step ------------------------------------------------------------------------------------


class _HostCopy:
    """The small tensors the host needs from a step, fetched with one device->host copy (float64
    holds token ids and fp32 logprobs exactly)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> int:
        self.parts.append(t.reshape(-1).double())
        return len(self.parts) - 1

    def fetch(self) -> list[list[float]]:
        if not self.parts:
            return []
        flat = torch.cat(self.parts).tolist()
        out, at = [], 0
        for p in self.parts:
            out.append(flat[at : at + p.numel()])
            at += p.numel()
        return out


def sample_step(jobs: list[SampleJob]) -> list[Drawn]:
    """Every job of a step: greedy and sampled tokens, DSpark verification, logprobs; one sort
    (``batched_probs`` over the sampled and verified rows together) and one device->host copy in
    all (the greedy argmax comes from the model's own copy)."""
    if not jobs:
        return []
    out = [Drawn([]) for _ in jobs]
    host = _HostCopy()
    row_tokens: dict[int, torch.Tensor] = {}  # job -> its rows' tokens on the device (for logprobs)
    greedy, sampled, verify = [], [], []  # plain greedy rows on the device, plain sampled, sampled verify
    for i, j in enumerate(jobs):
        if not j.drafts:
            if j.params.greedy and not j.params.adjusts_logits and j.argmax is not None:
                out[i].tokens = [j.argmax[-1]]
            else:
                (greedy if j.params.greedy else sampled).append(i)
        elif j.params.greedy:  # drafting is off for requests whose logits are adjusted: raw argmax
            out[i].tokens, out[i].accepted = greedy_accept(j.logits, j.drafts, j.argmax)
        elif j.draft_probs is None or j.draft_probs.size(0) != len(j.drafts):
            raise ValueError("sampled verification needs the distribution each draft was drawn from")
        else:
            verify.append(i)

    plain = greedy + sampled
    adjusted = [
        adjust_logits(jobs[i].logits[-1], jobs[i].params, jobs[i].prompt_ids, jobs[i].output_ids, jobs[i].eos)
        for i in plain
    ]
    ks = [len(jobs[i].drafts) for i in verify]
    to_probs = adjusted[len(greedy) :] + [jobs[i].logits[: k + 1] for i, k in zip(verify, ks, strict=True)]
    probs = None
    if to_probs:
        params = [jobs[i].params for i in sampled] + [
            jobs[i].params for i, k in zip(verify, ks, strict=True) for _ in range(k + 1)
        ]
        probs = batched_probs(torch.cat([x.float().reshape(-1, x.size(-1)) for x in to_probs]), params)

    plain_slot = verify_slot = None
    if plain:
        parts = [torch.stack(adjusted[: len(greedy)]).float().argmax(dim=-1)] if greedy else []
        if sampled:
            parts.append(race(probs[: len(sampled)], [jobs[i].generator for i in sampled]))
        toks = torch.cat(parts)
        plain_slot = host.add(toks)
        for n, i in enumerate(plain):
            row_tokens[i] = toks[n : n + 1]
    if verify:
        verify_slot, tokens = _verify(jobs, verify, probs[len(sampled) :], host)
        for n, (i, k) in enumerate(zip(verify, ks, strict=True)):
            row_tokens[i] = tokens[n, : k + 1]

    lp_slots = _logprobs(jobs, row_tokens, out, host)
    fetched = host.fetch()
    if plain_slot is not None:
        for i, t in zip(plain, fetched[plain_slot], strict=True):
            out[i].tokens = [int(t)]
    if verify_slot is not None:
        vals = fetched[verify_slot]
        for n, i in enumerate(verify):
            a, extra = int(vals[2 * n]), int(vals[2 * n + 1])
            out[i].tokens, out[i].accepted = jobs[i].drafts[:a] + [extra], a
    if lp_slots is not None:
        _read_logprobs(jobs, out, fetched, lp_slots)
    return out


def _verify(jobs: list[SampleJob], verify: list[int], probs: torch.Tensor, host: _HostCopy) -> tuple[int, torch.Tensor]:
    """Rejection sampling for the step's sampled verify jobs (``probs``: their rows' processed
    distributions, in order); the host slot of (accepted, extra) pairs and every job's row tokens
    ``[B, K+1]`` (accepted drafts, then the extra token)."""
    device, v = probs.device, probs.size(-1)
    ks = [len(jobs[i].drafts) for i in verify]
    k, b = max(ks), len(verify)
    target = torch.zeros(b, k + 1, v, device=device)
    draft = torch.zeros(b, k + 1, v, device=device)
    for n, (i, p) in enumerate(zip(verify, probs.split([x + 1 for x in ks]), strict=True)):
        target[n, : ks[n] + 1] = p
        draft[n, : ks[n]] = jobs[i].draft_probs.to(device, torch.float32)
    drafts = _to([jobs[i].drafts + [0] * (k - ks[n]) for n, i in enumerate(verify)], device)
    accepted, extra = rejection_batch(target, draft, drafts, ks, [jobs[i].generator for i in verify])
    slot = host.add(torch.stack([accepted, extra], dim=1))
    pos = torch.arange(k + 1, device=device)[None, :]
    padded = torch.cat([drafts, torch.zeros(b, 1, dtype=drafts.dtype, device=device)], dim=1)
    return slot, torch.where(pos < accepted[:, None], padded, extra[:, None])


@dataclass
class _LogprobSlots:
    """Where a step's logprob results sit in its host copy."""

    asked: list[int]  # jobs that asked, in row order
    rows: list[int]  # rows per asking job (1, or k+1 for a verify job)
    top: int  # top-n computed for every row (the largest n asked)
    token: int
    top_values: int | None
    top_ids: int | None
    whole: int | None  # rows of jobs asking for the whole vocabulary (n = -1)


def _logprobs(
    jobs: list[SampleJob], row_tokens: dict[int, torch.Tensor], out: list[Drawn], host: _HostCopy
) -> _LogprobSlots | None:
    """log_softmax once over the rows whose logprobs are asked; the emitted tokens' values, the
    top-n ids and values, and whole rows for n = -1, queued for the step's one host copy."""
    asked = [i for i, j in enumerate(jobs) if j.params.logprobs is not None]
    if not asked:
        return None
    device = jobs[asked[0]].logits.device
    rows = [len(jobs[i].drafts) + 1 if jobs[i].drafts else 1 for i in asked]
    # tokens already on the host (greedy) go over in one host->device copy, padded to the rows
    known = [t for n, i in zip(rows, asked, strict=True) for t in (out[i].tokens + [0] * n)[:n]]
    known_t = _to(known, device).split(rows)
    tokens = torch.cat([row_tokens.get(i, kt) for i, kt in zip(asked, known_t, strict=True)])
    lp = torch.log_softmax(torch.cat([jobs[i].logits[-n:] for n, i in zip(rows, asked, strict=True)]).float(), dim=-1)
    top = min(max(jobs[i].params.logprobs for i in asked), lp.size(-1))
    values = ids = None
    if top > 0:
        v, t = torch.topk(lp, top, dim=-1)
        values, ids = host.add(v), host.add(t)
    row_job = [i for i, n in zip(asked, rows, strict=True) for _ in range(n)]
    whole = [r for r, i in enumerate(row_job) if jobs[i].params.logprobs == -1]
    return _LogprobSlots(
        asked,
        rows,
        max(top, 0),
        host.add(lp.gather(1, tokens[:, None])),
        values,
        ids,
        host.add(lp[_to(whole, device)]) if whole else None,
    )


def _read_logprobs(jobs: list[SampleJob], out: list[Drawn], fetched: list[list[float]], s: _LogprobSlots) -> None:
    """Per emitted token: {token: logprob} then the top-n (vLLM's shape), or the whole row."""
    vocab = jobs[s.asked[0]].logits.size(-1)
    token = fetched[s.token]
    values = fetched[s.top_values] if s.top_values is not None else []
    ids = fetched[s.top_ids] if s.top_ids is not None else []
    whole = fetched[s.whole] if s.whole is not None else []
    row = w = 0
    for i, n in zip(s.asked, s.rows, strict=True):
        want = jobs[i].params.logprobs
        for r in range(n):
            if want == -1:
                if r < len(out[i].tokens):
                    out[i].logprobs.append(dict(enumerate(whole[w * vocab : (w + 1) * vocab])))
                w += 1
            elif r < len(out[i].tokens):
                d = {out[i].tokens[r]: token[row]}
                at = row * s.top
                for t, x in zip(ids[at : at + min(want, s.top)], values[at : at + min(want, s.top)], strict=True):
                    d.setdefault(int(t), x)
                out[i].logprobs.append(d)
            row += 1
