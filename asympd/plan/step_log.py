"""The workers' step logs read against each other (``GET /asympd/steps``: each step as [wall start,
seconds, prompt rows, decode sequences], and since the busy clock the seconds to its GPU end).
Here, not in bench/e2e.py, so that the planner's validation and the benchmark read "alone" and
"beside" by one rule (the planner does not import bench/)."""

from __future__ import annotations

BESIDE = 0.5  # a step counts as beside the other process's steps when they cover at least this much of it
# P's burst of the co-run's fill phase: its later steps overlap D's import of the prompts the first
# step finished (a few short D steps beside a long P step); below this much covered, a P step still
# counts as alone (it reads at most this fraction x (stretch - 1) long: < 10 % at stretch 2)
ALONE_P = 0.08
# P's step fit (asympd.plan.validate.fit_p_step) also takes the P steps D's steps covered up to this
# much, priced as if alone by the validation's own sharing rule (``alone_priced``): the fill burst's
# full-budget step beside D's first step for the prompt P finished first, the line's long lever.
# Through headline6 it was covered <= 0.17 and steps beside the decode batch >= 0.25 (the bound was
# 0.2); in v7a, with D's steps faster, the full-budget step was covered 0.245 and the decode-batch
# ones >= 0.78, so the bound is 0.3 (docs/planner.md, "v7"; of the older validations only oos2's
# moved, its summary unchanged).
P_FIT_MAX_OVERLAP = 0.3


def gpu_held(steps: list[list]) -> list[list]:
    """The steps as the GPU held them, where the log has each step's seconds to its GPU end (a fifth
    field, asympd/serve/busy.py): [start, seconds, prompt rows, decode sequences] from the step's
    start, or the GPU end of the step before if that came later (the GPU runs a worker's steps in
    order), to its own GPU end. A P that samples nothing returns from a step before its GPU work
    ends, so its host seconds leave that tail out; a step without the field keeps them."""
    out, before = [], float("-inf")
    for s in sorted(steps, key=lambda s: s[0]):
        end = s[0] + (s[4] if len(s) > 4 else s[1])
        start = max(s[0], before) if len(s) > 4 else s[0]
        out.append([start, max(0.0, end - start), s[2], s[3]])
        before = max(before, end)
    return out


def timed_to_gpu_end(steps: list[list]) -> bool:
    """Whether every step of the log carries its seconds to its GPU end."""
    return bool(steps) and all(len(s) > 4 for s in steps)


def overlap(s: list, other: list[list]) -> float:
    """The fraction of step ``s`` ([start, seconds, ...]) that steps of ``other`` covered."""
    a, b = s[0], s[0] + s[1]
    cover = sum(max(0.0, min(b, o[0] + o[1]) - max(a, o[0])) for o in other)
    return min(1.0, cover / s[1]) if s[1] > 0 else 0.0


def p_alone_steps(p_steps: list[list], d_steps: list[list], alone_below: float = ALONE_P) -> list[tuple[int, float]]:
    """(prompt rows, seconds) of every P step with prompt rows that D's steps covered less than
    ``alone_below`` of (or not at all): P's cost with the GPU to itself, at whatever size it ran
    (bench/e2e.py ``co_run_stretch`` reads P's alone steps by the same rule)."""
    return [(rows, secs) for rows, secs, f in _covered_p_steps(p_steps, d_steps) if f == 0.0 or f < alone_below]


def _covered_p_steps(p_steps: list[list], d_steps: list[list]) -> list[tuple[int, float, float]]:
    """(prompt rows, seconds, fraction D's steps covered) of every P step with prompt rows."""
    return [(int(s[2]), float(s[1]), overlap(s, d_steps)) for s in p_steps if s[2] > 0]


def alone_priced(seconds: float, covered: float, p_share: float = 0.5) -> float:
    """A P step's time had it run alone: the ``covered`` fraction of it ran at ``p_share`` of the
    GPU (equal shares: half), the rest at all of it."""
    return seconds * (1.0 - covered + covered * p_share)


def p_fit_steps(
    p_steps: list[list], d_steps: list[list], max_overlap: float = P_FIT_MAX_OVERLAP
) -> list[tuple[int, float, float]]:
    """(prompt rows, seconds priced alone, fraction covered) of every P step with prompt rows that
    D's steps covered less than ``max_overlap`` of: the points P's step line is fitted to. Why not
    only the alone steps (``p_alone_steps``): the fill burst's full-budget step, P's largest, is
    covered 10-25 % by D's first step of the prompt finished before it, and without it the alone
    steps of oos5/oos6 spanned 896-1792 rows, where the fitted slope moved 4.7x between two runs."""
    return [(rows, alone_priced(secs, f), f) for rows, secs, f in _covered_p_steps(p_steps, d_steps) if f < max_overlap]


def d_prompt_alone_steps(
    d_steps: list[list], p_steps: list[list], alone_below: float = ALONE_P
) -> list[tuple[int, float]]:
    """(prompt rows, seconds) of every D step with prompt rows and no decode sequence (a D's
    first-step chunks alone, a CUDA graph on a GPU) that P's steps covered less than
    ``alone_below`` of: D's prompt-step cost with the GPU to itself, by its own step log."""
    p = [s for s in p_steps if s[2] > 0]
    return [(int(s[2]), float(s[1])) for s in d_steps if s[2] > 0 and s[3] == 0 and overlap(s, p) < alone_below]
