"""Who computes which prompt rows, through which layers, seeing which windows (docs/modes.md).

The mode facts live here only: which roles run a mode, which checkpoint role each engine loads,
and when P is skipped.

K is the last KV source layer, W the window, N the prompt length.

    mode          prefill worker (P)                         decode worker (D) first step            first token
    colocated     -- one engine runs its semantics --                                                  same engine
    symmetric     decoder-replay on [0,N) (full model)       replays [N-W,N) through all layers,       P
                                                             global KV not rewritten
    encoder-only  layers < K + K's KV path on [0,N)          replays [N-W,N) through all layers,       D
                                                             global KV not rewritten
    asymmetric    layers < K + K's KV path on [0,s), s=N-W   bounded prefill of [s,N) through all      D
                                                             layers, writing its global KV
    symmetric-    split semantics on [0,N) (full model):     replays [s,N) through all layers with     P
      split       asymmetric P's rows, then all layers on    P's window floors, global KV not
                  [s,N)                                      rewritten
    symmetric-    as symmetric-split, and ships every        nothing to compute: imports the windows,  P
      windows     layer's sliding window too                 decodes at once (SGLang-style P/D)

The two ``symmetric-*`` modes are the strongest symmetric baselines: P does no avoidable work (only
K's KV path on the prefix, as asymmetric P), and in ``symmetric-windows`` D does none either, at the
price of shipping W rows of every layer's window.

Boundary policy for a split s that falls inside a compressor group (s odd for ratio 2): ``carry``
hands over the open group's raw rows; ``align`` moves s down to a group boundary and D takes the
extra rows. With N <= W the asymmetric P does nothing and D prefills the whole prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from asympd.config import ModelConfig
from asympd.model.depth import Depth

MODES = ("colocated", "symmetric", "encoder-only", "asymmetric", "symmetric-split", "symmetric-windows")
PD_MODES = MODES[1:]  # the modes with a prefill and a decode worker
SEMANTICS = ("full", "decoder-replay", "split")
BOUNDARY_POLICIES = ("carry", "align")
ROLES = ("colocated", "prefill", "decode")
# every distinct deployment: (mode, colocated semantics, boundary policy)
VARIANTS = (
    ("colocated", "full", "carry"),
    ("colocated", "decoder-replay", "carry"),
    ("colocated", "split", "carry"),
    ("asymmetric", "full", "carry"),
    ("asymmetric", "full", "align"),
    ("symmetric", "full", "carry"),
    ("encoder-only", "full", "carry"),
    ("symmetric-split", "full", "carry"),
    ("symmetric-windows", "full", "carry"),
)
# the P/D modes whose prefill worker samples the first token (``decode_plan(...).first_token_from_prefill``):
# several choices of one prompt (the API's ``n``) would all begin with that one token there
FIRST_TOKEN_FROM_PREFILL = ("symmetric", "symmetric-split", "symmetric-windows")
# the checkpoint role a P/D mode's prefill worker loads (the symmetric ones make the first token: all layers)
PREFILL_MODEL_ROLE = {
    "symmetric": "full",
    "encoder-only": "prefill",
    "asymmetric": "prefill",
    "symmetric-split": "full",
    "symmetric-windows": "full",
}


def check_role_mode(role: str, mode: str) -> None:
    """The one check that an engine role can run a mode: colocated runs only with colocated."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if (role == "colocated") != (mode == "colocated"):
        raise ValueError(f"role {role!r} cannot run mode {mode!r} (colocated runs only with colocated)")


def default_mode(role: str) -> str:
    return "colocated" if role == "colocated" else "asymmetric"


def model_role(role: str, mode: str) -> str:
    """The checkpoint role (asympd.model.schema.ROLES) an engine of ``role`` loads in ``mode``:
    the symmetric P modes need the whole model, the others' P only the prefill role."""
    check_role_mode(role, mode)
    if role == "prefill":
        return PREFILL_MODEL_ROLE[mode]
    return "full" if role == "colocated" else "decode"


def skips_prefill(mode: str, n: int, window_size: int) -> bool:
    """N <= W in the asymmetric mode: P has no row to compute, D prefills the whole prompt."""
    return mode == "asymmetric" and n <= window_size


@dataclass(frozen=True)
class Phase:
    """Prompt rows [lo, hi) run at one depth with fixed window floors."""

    lo: int
    hi: int
    depth: Depth
    floor: int = 0  # window floor above K
    encoder_floor: int = 0  # window floor up to K
    write_global: bool = True
    sample: bool = True  # the last row's logits give the first token

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"empty or negative phase [{self.lo}, {self.hi})")


def group_size(cfg: ModelConfig) -> int:
    """The compressor group length every split must respect under ``align``."""
    ratios = [cfg.ratio(s) for s in cfg.kv_source_layers]
    return math.lcm(*ratios) if ratios else 1


def split_point(cfg: ModelConfig, n: int, policy: str) -> int:
    """s = N - W, moved down to a compressor group boundary under ``align``."""
    if policy not in BOUNDARY_POLICIES:
        raise ValueError(f"unknown boundary policy {policy!r}; expected one of {', '.join(BOUNDARY_POLICIES)}")
    s = max(n - cfg.window_size, 0)
    if policy == "align":
        s -= s % group_size(cfg)
    return s


def _phases(*phases: Phase | None) -> list[Phase]:
    return [p for p in phases if p is not None]


def colocated_phases(cfg: ModelConfig, n: int, semantics: str, policy: str = "carry") -> list[Phase]:
    if semantics == "full":
        return [Phase(0, n, Depth.ALL)]
    if semantics == "decoder-replay":
        b = max(n - cfg.window_size, 0)
        return _phases(Phase(0, b, Depth.THROUGH_SOURCE, sample=False) if b else None, Phase(b, n, Depth.ALL, floor=b))
    if semantics == "split":
        s = split_point(cfg, n, policy)
        return _phases(
            Phase(0, s, Depth.ENCODER_KV, sample=False) if s else None, Phase(s, n, Depth.ALL, floor=s, encoder_floor=s)
        )
    raise ValueError(f"unknown prefill semantics {semantics!r}; expected one of {', '.join(SEMANTICS)}")


@dataclass(frozen=True)
class PrefillPlan:
    """What the prefill worker runs and hands over, and whether it samples the first token."""

    phases: list[Phase]
    export_upto: int
    samples_first_token: bool
    exports_windows: bool = False  # every layer's sliding window goes with the global KV


@dataclass(frozen=True)
class DecodePlan:
    """What the decode worker imports, then runs, and where its first token comes from."""

    import_upto: int
    phases: list[Phase]
    first_token_from_prefill: bool
    imports_windows: bool = False


def prefill_plan(cfg: ModelConfig, n: int, mode: str, policy: str = "carry") -> PrefillPlan:
    if mode == "asymmetric":
        s = split_point(cfg, n, policy)
        return PrefillPlan(_phases(Phase(0, s, Depth.ENCODER_KV, sample=False) if s else None), s, False)
    if mode == "encoder-only":
        return PrefillPlan([Phase(0, n, Depth.ENCODER_KV, sample=False)], n, False)
    if mode == "symmetric":
        return PrefillPlan(colocated_phases(cfg, n, "decoder-replay"), n, True)
    if mode in ("symmetric-split", "symmetric-windows"):
        phases = colocated_phases(cfg, n, "split", policy)
        return PrefillPlan(phases, n, True, exports_windows=mode == "symmetric-windows")
    raise ValueError(f"mode {mode!r} has no prefill worker; expected one of {', '.join(PREFILL_MODEL_ROLE)}")


# a symmetric P's steps of window chunks hold at most this many (the batch sizes its graphs replay)
P_WINDOW_GRAPH_BATCH = 4


def p_window_phase(cfg: ModelConfig, mode: str, policy: str = "carry") -> Phase | None:
    """A prefill worker's last phase where it runs through every layer (the symmetric modes: the
    prompt's last W rows, sampling the first token), for a prompt of 2W; None where P stops below
    the top layer (asymmetric, encoder-only). Its steps run alone and replay CUDA graphs on a GPU
    (``LLMEngine._first_step_graphs``, ``SchedulerConfig.one_depth_per_step``)."""
    phases = prefill_plan(cfg, 2 * cfg.window_size, mode, policy).phases
    return phases[-1] if phases and phases[-1].depth is Depth.ALL else None


def p_window_batch(cfg: ModelConfig, mode: str, step_tokens: int, max_seqs: int, policy: str = "carry") -> int | None:
    """How many window chunks one step of a symmetric P holds, and its CUDA graphs replay
    (``P_WINDOW_GRAPH_BATCH``, what the step budget and the slots allow); None for a P without a
    window phase (``p_window_phase``)."""
    phase = p_window_phase(cfg, mode, policy)
    if phase is None:
        return None
    return max(1, min(P_WINDOW_GRAPH_BATCH, max_seqs, step_tokens // (phase.hi - phase.lo)))


def decode_plan(cfg: ModelConfig, n: int, mode: str, policy: str = "carry") -> DecodePlan:
    if mode == "asymmetric":
        s = split_point(cfg, n, policy)
        return DecodePlan(s, [Phase(s, n, Depth.ALL, floor=s, encoder_floor=s)], False)
    b = max(n - cfg.window_size, 0)
    if mode == "encoder-only":
        return DecodePlan(n, [Phase(b, n, Depth.ALL, floor=b, encoder_floor=b, write_global=False)], False)
    if mode == "symmetric":
        return DecodePlan(n, [Phase(b, n, Depth.ALL, floor=b, encoder_floor=b, write_global=False, sample=False)], True)
    if mode == "symmetric-split":  # the replay sees the windows P's last phase saw: D's state is P's
        s = split_point(cfg, n, policy)
        return DecodePlan(n, [Phase(s, n, Depth.ALL, floor=s, encoder_floor=s, write_global=False, sample=False)], True)
    if mode == "symmetric-windows":
        return DecodePlan(n, [], True, imports_windows=True)
    raise ValueError(f"mode {mode!r} has no decode worker; expected one of {', '.join(PREFILL_MODEL_ROLE)}")


def image_rows_shipped(cfg: ModelConfig, n: int, mode: str, policy: str, spans: list[tuple[int, int]]) -> list[int]:
    """Positions of the image rows D computes from embeddings P encoded (they cross in the
    PrefixState): D's rows of every image [start, end) at least one row of which P computes -- the
    tail of an image straddling D's first row, or (symmetric modes) every image D replays. D encodes
    only the images P computes no row of."""
    if mode not in PREFILL_MODEL_ROLE or skips_prefill(mode, n, cfg.window_size):
        return []
    p_hi = max((ph.hi for ph in prefill_plan(cfg, n, mode, policy).phases), default=0)
    d_lo = min((ph.lo for ph in decode_plan(cfg, n, mode, policy).phases), default=n)
    return [q for lo, hi in spans if lo < p_hi for q in range(max(lo, d_lo), hi)]


def decode_fallback_plan(cfg: ModelConfig, n: int, mode: str, policy: str = "carry") -> list[Phase]:
    """D computing the prefix itself because P failed (policy ``recompute``), from one engine holding
    the full model: the same numbers the P/D pair would have produced, except in symmetric mode,
    where it is colocated decoder-replay: the pair's first token (P's, decoder-replay's), but past W
    prompt tokens the later ones differ: the pair's D rebuilt every layer's window by replaying
    [N-W, N), starting at N-W, where decoder-replay's windows up to layer K reach back past it
    (docs/modes.md)."""
    if mode in ("asymmetric", "symmetric-split", "symmetric-windows"):
        return colocated_phases(cfg, n, "split", policy)
    if mode == "symmetric":
        return colocated_phases(cfg, n, "decoder-replay")
    if mode == "encoder-only":
        # P's rows with full windows, then D's replay over the existing global KV
        b = max(n - cfg.window_size, 0)
        return [
            Phase(0, n, Depth.ENCODER_KV, sample=False),
            Phase(b, n, Depth.ALL, floor=b, encoder_floor=b, write_global=False),
        ]
    raise ValueError(f"unknown mode {mode!r}")
