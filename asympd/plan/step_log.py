"""The workers' step logs read against each other (``GET /asympd/steps``: each step as [wall start,
seconds, prompt rows, decode sequences]). Here, not in bench/e2e.py, so that the planner's
validation and the benchmark read "alone" and "beside" by one rule (the planner does not import
bench/)."""

from __future__ import annotations

BESIDE = 0.5  # a step counts as beside the other process's steps when they cover at least this much of it
# P's burst of the co-run's fill phase: its later steps overlap D's import of the prompts the first
# step finished (a few short D steps beside a long P step); below this much covered, a P step still
# counts as alone (it reads at most this fraction x (stretch - 1) long: < 10 % at stretch 2)
ALONE_P = 0.08


def overlap(s: list, other: list[list]) -> float:
    """The fraction of step ``s`` ([start, seconds, ...]) that steps of ``other`` covered."""
    a, b = s[0], s[0] + s[1]
    cover = sum(max(0.0, min(b, o[0] + o[1]) - max(a, o[0])) for o in other)
    return min(1.0, cover / s[1]) if s[1] > 0 else 0.0


def p_alone_steps(p_steps: list[list], d_steps: list[list], alone_below: float = ALONE_P) -> list[tuple[int, float]]:
    """(prompt rows, seconds) of every P step with prompt rows that D's steps covered less than
    ``alone_below`` of (or not at all): P's cost with the GPU to itself, at whatever size it ran
    (bench/e2e.py ``co_run_stretch`` reads P's alone steps by the same rule)."""
    out = []
    for s in p_steps:
        if s[2] <= 0:
            continue
        f = overlap(s, d_steps)
        if f == 0.0 or f < alone_below:
            out.append((int(s[2]), float(s[1])))
    return out
