"""The decode worker's admission policies, by name: how many new requests, and how many of their
prompt rows, one engine step may take on, and whether that step also carries the running decodes
(``SchedulerConfig``'s ``max_new_admissions``, ``admission_token_budget`` and ``mixed_steps``).

``cap-4`` (mixed steps) came out of the admission study (docs/performance.md §6,
``bench/results/admission_policy.json``): it keeps p99 ITL 6 % (Poisson) to 34 % (P's bursts) under
admit-all's, where caps below 3 let TTFT grow without bound. ``alone-4`` has the same caps but runs
the new rows in steps of their own, taking turns with decode steps: on a GPU both kinds of step then
replay CUDA graphs, where a mixed step of bounded prefills and decodes runs eagerly (at true depth
0.4-0.8 s against ~0.1 s for each graph; docs/performance.md §10). A prefill worker has no decodes
to protect and is never capped by it.
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
DEFAULT_POLICY = "cap-4"


def policy_settings(name: str) -> AdmissionPolicy:
    """The policy ``name``."""
    if name not in POLICIES:
        raise ValueError(f"unknown admission policy {name!r}: {', '.join(POLICIES)}")
    return POLICIES[name]
