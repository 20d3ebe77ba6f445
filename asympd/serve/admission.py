"""The decode worker's admission policies, by name: how many new requests, and how many of their
prompt rows, one engine step may take on, and whether that step also carries the running decodes
(``SchedulerConfig``'s ``max_new_admissions``, ``admission_token_budget`` and ``mixed_steps``).

Defaults, by role (``default_policy``), each from a study:

- a decode worker runs ``alone-4``: at most 4 new requests and 512 prompt rows per step, in steps of
  their own taking turns with decode steps, so that both kinds replay CUDA graphs (a mixed step of
  bounded prefills and decodes runs eagerly: 0.4-0.8 s at true depth). The end-to-end study at true
  depth (docs/performance.md §10, ``bench/results/e2e_h200x1_depth40*.json``) measured it against
  ``cap-4`` (the same caps, mixed steps) at the same commit on an asymmetric D: p99 ITL 0.64 / 0.59 /
  0.56x at 0.5 / 1 / 2 req/s, TTFT p50 1.00 / 0.90 / 0.91x, goodput 1.00 / 1.01 / 1.10x.
- a colocated worker keeps ``cap-4`` (mixed steps): its prompt chunks run eagerly either way, and
  mixing lets its decodes advance in the same step; the admission study (§6,
  ``bench/results/admission_policy.json``) chose the caps: p99 ITL 6 % (Poisson) to 34 % (P's bursts)
  under admit-all's, where caps below 3 let TTFT grow without bound. alone-4 on a colocated worker
  was measured once (the same study): ITL p50 213 ms at 2 req/s; cap-4 was not run beside it.

A prefill worker has no decodes to protect and is never capped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionPolicy:
    max_new_admissions: int | None  # new requests per step; None = no cap
    admission_token_budget: int | None  # prompt rows per step; None = the step budget
    mixed_steps: bool = True  # False: prompt rows and decode rows in separate steps, taking turns


POLICIES: dict[str, AdmissionPolicy] = {
    "cap-4": AdmissionPolicy(4, 512),
    "cap-8": AdmissionPolicy(8, 1024),
    "admit-all": AdmissionPolicy(None, None),
    "alone-4": AdmissionPolicy(4, 512, mixed_steps=False),
}
DEFAULT_POLICIES = {"decode": "alone-4", "colocated": "cap-4"}  # by role (the docstring says why)


def default_policy(role: str) -> str:
    """The admission policy a worker of ``role`` runs unless told otherwise."""
    return DEFAULT_POLICIES.get(role, "cap-4")


def policy_settings(name: str) -> AdmissionPolicy:
    """The policy ``name``."""
    if name not in POLICIES:
        raise ValueError(f"unknown admission policy {name!r}: {', '.join(POLICIES)}")
    return POLICIES[name]
