"""The decode worker's admission policies, by name: how many new requests, and how many of their
prompt rows, one engine step may take on beside the running decodes (``SchedulerConfig``'s
``max_new_admissions`` and ``admission_token_budget``).

``cap-4`` is the default of ``asympd serve`` for decode and colocated workers because it is what
the admission study recommends (docs/performance.md §6, ``bench/results/admission_policy.json``):
it keeps p99 ITL 6 % (Poisson) to 34 % (P's bursts) under admit-all's, where caps below 3 let
TTFT grow without bound. A prefill worker has no decodes to protect and is never capped by it.
"""

from __future__ import annotations

POLICIES: dict[str, tuple[int | None, int | None]] = {  # name: (max_new_admissions, admission_token_budget)
    "cap-4": (4, 512),
    "cap-8": (8, 1024),
    "admit-all": (None, None),
}
DEFAULT_POLICY = "cap-4"


def policy_settings(name: str) -> tuple[int | None, int | None]:
    """(max_new_admissions, admission_token_budget) of the policy ``name``."""
    if name not in POLICIES:
        raise ValueError(f"unknown admission policy {name!r}: {', '.join(POLICIES)}")
    return POLICIES[name]
