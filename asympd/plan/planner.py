"""`asympd plan`: the cheapest P/D deployment that meets a TTFT and an ITL target for a traffic mix.

For each mode: the GPUs a replica needs come from the role schema (weights sharded by expert
parallelism, the rest is KV room); a first guess at replica counts comes from capacity; then the
engine's scheduler is simulated on the traffic (P replicas, the P -> D move, one D replica of its
round-robin share) and the side that misses its target gets one more replica (or, for D, the next
GPU count) until both targets hold or a limit is hit, which is then reported as the binding
constraint. The model and its assumptions: docs/planner.md.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asympd.config import ModelConfig, v41_flash
from asympd.engine.modes import PREFILL_MODEL_ROLE
from asympd.model.schema import ROLE_PARTS, checkpoint_schema
from asympd.plan.gpus import GPUSpec, gpu_spec
from asympd.plan.memory import DEFAULT_RESERVE_GB, PARTS, compressed_kv_bytes_per_token, memory_report
from asympd.plan.simulate import (
    BLOCK_SIZE,
    Arrival,
    DecodeEngine,
    DecodeSetup,
    PrefillEngine,
    PrefillSetup,
    ReplicaRun,
    run_decode,
    run_engines,
    run_prefill,
)
from asympd.plan.steps import P_STEP_TOKENS, PLANNED_MODES, StepModel, load_results
from asympd.serve.admission import POLICIES  # D admission policies (serve/admission.py)

D_MAX_SEQS = 512  # the largest decode batch measured (d_admission.json)
MAX_ROUNDS = 14
TIE_GOODPUT = 0.02  # modes on as many GPUs whose goodput per GPU differs by less are reported as a tie
P_SIZES_TRIED = 3  # GPUs per P replica: the fewest that fit and the next two EP degrees (shorter long prompts)
D_SIZES_TRIED = 3  # GPUs per D replica: the fewest that fit and the next two EP degrees
MAX_GPUS = 4096  # the largest deployment searched: past it a rate is out of the planner's (and a cluster's) scale
PLACEMENTS = ("separate", "shared")  # shared: each P replica on the GPUs of one D replica


class PlanError(ValueError):
    """Bad planner input (distribution, traffic file, SLO)."""


# ---- traffic ------------------------------------------------------------------------------------


def parse_dist(text: str, what: str) -> list[tuple[int, float]]:
    """``1024`` or ``1024:0.4,4096:0.6`` (weights are normalized)."""
    out = []
    try:
        for part in text.split(","):
            v, _, w = part.partition(":")
            out.append((int(v), float(w) if w else 1.0))
    except ValueError:
        raise PlanError(f"{what}: expected N or N:weight,N:weight,... got {text!r}") from None
    if any(v <= 0 for v, _ in out) or not all(0 < w < math.inf for _, w in out):
        raise PlanError(f"{what}: lengths and weights must be positive (and finite), got {text!r}")
    total = sum(w for _, w in out)
    return [(v, w / total) for v, w in out]


def poisson_arrivals(
    prompt: list[tuple[int, float]], output: list[tuple[int, float]], rate: float, n: int, seed: int
) -> list[Arrival]:
    if rate <= 0:
        raise PlanError(f"--rate must be positive, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        p = rng.choices([v for v, _ in prompt], weights=[w for _, w in prompt])[0]
        o = rng.choices([v for v, _ in output], weights=[w for _, w in output])[0]
        out.append(Arrival(i, t, p, o))
    return out


def load_traffic(path: str | Path, rate: float | None, n: int, seed: int) -> list[Arrival]:
    """JSON lines ``{"prompt_len": N, "output_len": M, "t": seconds}``; without ``t`` the arrivals are
    Poisson at ``rate``."""
    rows = []
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read the traffic file {str(path)!r}: {e}") from None
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            t = r.get("t")
            if t is not None and (isinstance(t, bool) or not math.isfinite(t)):
                raise ValueError(t)
            rows.append((t, int(r["prompt_len"]), int(r["output_len"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, OverflowError):
            raise PlanError(f'{path}:{k}: expected {{"prompt_len": N, "output_len": M[, "t": s]}}') from None
        if rows[-1][1] <= 0 or rows[-1][2] <= 0:
            raise PlanError(f"{path}:{k}: prompt_len and output_len must be positive")
    if not rows:
        raise PlanError(f"{path}: no requests")
    timed = all(t is not None for t, _, _ in rows)
    if not timed and not rate:
        raise PlanError(f'{path}: requests without "t" need --rate')
    rows = rows[:n]
    if timed:
        return [Arrival(i, float(t), p, o) for i, (t, p, o) in enumerate(sorted(rows, key=lambda r: r[0]))]
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, (_, p, o) in enumerate(rows):
        t += rng.expovariate(rate)
        out.append(Arrival(i, t, p, o))
    return out


# ---- memory ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleMemory:
    role: str
    replicated_bytes: int  # held by every GPU of a replica
    expert_bytes: int  # routed experts, split over the EP degree
    swa_bytes_per_request: int

    def per_gpu_bytes(self, gpus: int) -> float:
        return self.replicated_bytes + self.expert_bytes / gpus


def role_memory(cfg: ModelConfig, reserve_gb: float) -> dict[str, RoleMemory]:
    schema = checkpoint_schema(cfg)
    rep = memory_report(cfg, reserve_gb=reserve_gb, gpus_gb={}, schema=schema)
    experts = {p: 0 for p in PARTS}
    for spec in schema:
        if ".experts." in spec.name and spec.part in experts:
            experts[spec.part] += spec.nbytes
    out = {}
    for role, r in rep["roles"].items():
        e = sum(b for p, b in experts.items() if p in ROLE_PARTS[role])
        out[role] = RoleMemory(role, r["resident_bytes"] - e, e, r["swa_bytes_per_request"])
    return out


def ep_degrees(cfg: ModelConfig, gpu: GPUSpec) -> list[int]:
    """GPUs per replica the planner tries: EP degrees that split the experts evenly, within one
    NVLink domain."""
    return [
        g
        for g in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 72)
        if g <= gpu.nvlink_domain and cfg.n_routed_experts % g == 0
    ]


def kv_room(mem: RoleMemory, gpu: GPUSpec, gpus: int, reserve_gb: float) -> float:
    return gpus * (gpu.memory_gb * 1e9 - reserve_gb * 1e9 - mem.per_gpu_bytes(gpus))


def blocks_for(room: float, max_seqs: int, mem: RoleMemory, per_token: float) -> int:
    return max(0, math.floor((room - max_seqs * mem.swa_bytes_per_request) / (BLOCK_SIZE * per_token)))


# ---- results ----------------------------------------------------------------------------------------


@dataclass
class Deployment:
    mode: str
    feasible: bool
    binding: str | None = None  # why not feasible: the constraint that could not be met
    placement: str = "separate"  # shared: P replica r runs on D replica r's GPUs (p_gpus == d_gpus)
    p_replicas: int = 0
    p_gpus: int = 0  # per replica (= EP degree)
    d_replicas: int = 0
    d_gpus: int = 0
    d_policy: str = ""
    d_max_new_admissions: int | None = None
    d_admission_token_budget: int | None = None
    d_mixed_steps: bool = True  # False: prompt rows and decode rows in steps of their own (alone-4)
    d_max_num_seqs: int = 0
    total_gpus: int = 0
    ttft_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    ttft_p99_split_ms: dict[str, float] = field(default_factory=dict)  # P side vs D side
    goodput_tokens_per_s_per_gpu: float = 0.0
    slo_attainment: float = 0.0
    memory: dict[str, Any] = field(default_factory=dict)
    p_busy: float = 0.0  # busiest P replica: time in steps / time to its last export
    d_max_batch: int = 0
    d_preemptions: int = 0
    rounds: list[str] = field(default_factory=list)


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) in ms."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] * 1e3


@dataclass(frozen=True)
class PlanRequest:
    gpu: str
    arrivals: list[Arrival]
    rate: float  # requests/s offered (for goodput)
    slo_ttft_p99_s: float
    slo_itl_p99_ms: float
    modes: tuple[str, ...] = PLANNED_MODES
    reserve_gb: float = DEFAULT_RESERVE_GB
    seed: int = 0
    warmup_fraction: float = 0.1
    placement: str = "separate"


class Planner:
    def __init__(
        self,
        req: PlanRequest,
        cfg: ModelConfig | None = None,
        results: dict[str, Any] | None = None,
        results_dir: str | Path | None = None,
        jobs: int = 1,
    ):
        """``jobs``: processes that plan the modes at once (0: one a CPU; at most one a mode). Each
        simulation is seeded and independent of the others, so the plan is the same for any value."""
        if jobs < 0:
            raise PlanError(f"jobs must be >= 0, got {jobs}")
        if not (req.slo_ttft_p99_s > 0 and req.slo_itl_p99_ms > 0):  # NaN too
            raise PlanError("SLOs must be positive")
        for m in req.modes:
            if m not in PLANNED_MODES:
                raise PlanError(
                    f"mode {m!r} has no measured prefill-worker step times; plannable: {', '.join(PLANNED_MODES)}"
                )
        if req.placement not in PLACEMENTS:
            raise PlanError(f"placement must be one of {', '.join(PLACEMENTS)}, got {req.placement!r}")
        self.req = req
        self.cfg = cfg or v41_flash()
        longest = max(req.arrivals, key=lambda a: a.prompt_len + a.output_len, default=None)
        if longest is not None and longest.prompt_len + longest.output_len > self.cfg.max_seq_len:
            raise PlanError(
                f"a request of {longest.prompt_len} prompt + {longest.output_len} output tokens exceeds the "
                f"model's context of {self.cfg.max_seq_len} tokens: the servers refuse it"
            )
        self.gpu = gpu_spec(req.gpu)
        results = results or load_results(results_dir)
        # which measurements the step times rest on: each table's benchmark and commit (--json)
        self.step_tables = {
            key: {"benchmark": table.get("benchmark"), "commit": str(table.get("commit", "unknown"))[:12]}
            for key, table in results.items()
        }
        self.steps = StepModel(
            results,
            self.gpu,
            self.cfg.dim,
            self.cfg.n_activated_experts,
            self.cfg.window_size,
        )
        self.mem = role_memory(self.cfg, req.reserve_gb)
        self.per_token = compressed_kv_bytes_per_token(self.cfg)
        self.degrees = ep_degrees(self.cfg, self.gpu)
        self._p_cache: dict[tuple[str, int, int, int], ReplicaRun] = {}
        self.jobs = jobs or os.cpu_count() or 1

    # ---- memory limits ------------------------------------------------------------------------

    def _fits(self, role: str, gpus: int, max_seqs: int, need_tokens: int) -> bool:
        mem = self.mem[role]
        room = kv_room(mem, self.gpu, gpus, self.req.reserve_gb)
        return room > 0 and blocks_for(room, max_seqs, mem, self.per_token) * BLOCK_SIZE >= need_tokens

    def min_gpus(self, role: str, max_seqs: int, need_tokens: int) -> int | None:
        return next((g for g in self.degrees if self._fits(role, g, max_seqs, need_tokens)), None)

    def _memory_info(self, role: str, gpus: int, max_seqs: int) -> dict[str, Any]:
        mem = self.mem[role]
        room = kv_room(mem, self.gpu, gpus, self.req.reserve_gb)
        return {
            "role": role,
            "weights_gb_per_gpu": round(mem.per_gpu_bytes(gpus) / 1e9, 2),
            "kv_room_gb_per_gpu": round(room / gpus / 1e9, 2),
            "kv_blocks": blocks_for(room, max_seqs, mem, self.per_token),
            "kv_tokens": blocks_for(room, max_seqs, mem, self.per_token) * BLOCK_SIZE,
        }

    # ---- one deployment, simulated ----------------------------------------------------------

    def evaluate(self, mode: str, n_p: int, g_p: int, n_d: int, g_d: int, policy: str) -> dict[str, Any]:
        if self.req.placement == "shared":
            return self._evaluate_shared(mode, n_d, g_d, policy)
        cfg, arr = self.cfg, self.req.arrivals
        p_role = PREFILL_MODEL_ROLE[mode]
        p_blocks = blocks_for(
            kv_room(self.mem[p_role], self.gpu, g_p, self.req.reserve_gb), 64, self.mem[p_role], self.per_token
        )
        p_done: dict[int, float] = {}
        p_runs: list[ReplicaRun] = []
        for r in range(n_p):
            key = (mode, g_p, n_p, r)
            if key not in self._p_cache:
                self._p_cache[key] = run_prefill(cfg, self.steps, PrefillSetup(mode, g_p, p_blocks), arr[r::n_p])
            run = self._p_cache[key]
            p_done.update(run.done_s)
            p_runs.append(run)
        at_d = []
        for a in arr:
            if a.index not in p_done:
                continue
            moved = 0.0 if p_done[a.index] == a.time_s else self._move_ms(mode, a.prompt_len) / 1e3
            at_d.append(Arrival(a.index, p_done[a.index] + moved, a.prompt_len, a.output_len))
        at_d.sort(key=lambda a: (a.time_s, a.index))
        mine = at_d[0::n_d]  # replica 0's round-robin share; the others see the same statistics
        d_blocks = blocks_for(
            kv_room(self.mem["decode"], self.gpu, g_d, self.req.reserve_gb),
            D_MAX_SEQS,
            self.mem["decode"],
            self.per_token,
        )
        d = run_decode(cfg, self.steps, self._d_setup(mode, g_d, d_blocks, policy), mine)
        return self._summary(p_runs, d, mine)

    def _move_ms(self, mode: str, prompt_len: int) -> float:
        """P -> D: the prefix's compressed KV, and for symmetric-windows every layer's last W window rows
        too, as the engine ships them (``PrefixState.swa_kv`` in bf16 plus their int64 positions:
        5.28 MB a request, what the H200 studies moved beyond symmetric-split's state)."""
        nbytes = prompt_len * self.per_token
        if mode == "symmetric-windows":
            cfg = self.cfg
            nbytes += cfg.n_layers * min(prompt_len, cfg.window_size) * (2 * cfg.head_dim + 8)
        return self.steps.transfer_ms(nbytes)

    def _d_setup(self, mode: str, g_d: int, d_blocks: int, policy: str) -> DecodeSetup:
        """A D replica under the named admission policy (its caps and whether steps mix prompt and
        decode rows: the engine's scheduler runs it as configured)."""
        return DecodeSetup(mode, g_d, d_blocks, D_MAX_SEQS, POLICIES[policy], self.req.seed)

    def _shared_blocks(self, p_role: str, g: int, p_need: int) -> tuple[int, int]:
        """(P blocks, D blocks) for a P and a D replica on the same ``g`` GPUs: both roles' weights
        on every GPU; P keeps KV for one full step of prompts (or its longest prompt), D the rest."""
        pm, dm = self.mem[p_role], self.mem["decode"]
        hbm = self.gpu.memory_gb * 1e9 - self.req.reserve_gb * 1e9
        room = g * (hbm - pm.per_gpu_bytes(g) - dm.per_gpu_bytes(g))
        p_room = 64 * pm.swa_bytes_per_request + math.ceil(max(P_STEP_TOKENS, p_need) / BLOCK_SIZE) * (
            BLOCK_SIZE * self.per_token
        )
        if room <= p_room:
            return 0, 0
        return blocks_for(p_room, 64, pm, self.per_token), blocks_for(room - p_room, D_MAX_SEQS, dm, self.per_token)

    def _pair_fits(self, p_role: str, g: int, p_need: int, d_need: int) -> bool:
        p_blocks, d_blocks = self._shared_blocks(p_role, g, p_need)
        return p_blocks * BLOCK_SIZE >= p_need and d_blocks * BLOCK_SIZE >= d_need

    def _evaluate_shared(self, mode: str, n: int, g: int, policy: str) -> dict[str, Any]:
        """Pair 0 of ``n`` (P replica r on D replica r's ``g`` GPUs, arrivals round-robin over the
        pairs): P's and D's steps share the same GPUs (``run_engines``), so a D step in progress
        beside a P step runs at half speed, and so does the P step."""
        cfg, arr = self.cfg, self.req.arrivals
        longest = max(a.prompt_len for a in arr)
        p_blocks, d_blocks = self._shared_blocks(PREFILL_MODEL_ROLE[mode], g, longest + 1)
        mine_p = arr[0::n]
        p = PrefillEngine(cfg, self.steps, PrefillSetup(mode, g, p_blocks), mine_p)
        d = DecodeEngine(cfg, self.steps, self._d_setup(mode, g, d_blocks, policy), [], expected=mine_p)
        by_index = {a.index: a for a in mine_p}
        mine: list[Arrival] = []

        def hand_over(_: int, i: int, t: float) -> None:
            a = by_index[i]
            moved = 0.0 if t == a.time_s else self._move_ms(mode, a.prompt_len) / 1e3
            mine.append(Arrival(i, t + moved, a.prompt_len, a.output_len))
            d.push(mine[-1])

        run_engines([p, d], [0, 0], hand_over)
        return self._summary([p.run], d.run, mine)

    def _summary(self, p_runs: list[ReplicaRun], d: ReplicaRun, mine: list[Arrival]) -> dict[str, Any]:
        """TTFT, ITL, SLO attainment and load of D replica ``d`` (its arrivals ``mine``), the
        first ``warmup_fraction`` of requests left out."""
        arr = self.req.arrivals
        start = {a.index: a.time_s for a in arr}
        skip = int(len(arr) * self.req.warmup_fraction)
        counted = [a.index for a in mine if a.index >= skip and a.index in d.first_token_s]
        ttft = [d.first_token_s[i] - start[i] for i in counted]
        at = {b.index: b.time_s for b in mine}
        ttft_p = [at[i] - start[i] for i in counted]
        failed = {**{k: v for r in p_runs for k, v in r.failed.items()}, **d.failed}
        itl = [g for g, i in zip(d.itl_s, d.itl_request, strict=True) if i >= skip]
        good = [
            i
            for i in counted
            if d.first_token_s[i] - start[i] <= self.req.slo_ttft_p99_s
            and d.mean_itl_s.get(i, 0.0) * 1e3 <= self.req.slo_itl_p99_ms
        ]
        n_counted = len([a for a in mine if a.index >= skip])
        return {
            "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "itl_ms": {"p50": pct(itl, 50), "p90": pct(itl, 90), "p99": pct(itl, 99)},
            "ttft_p99_split_ms": {"p_side": pct(ttft_p, 99), "d_side": pct(ttft, 99) - pct(ttft_p, 99)},
            "attainment": len(good) / n_counted if n_counted else 0.0,
            "failed": failed,
            "p_busy": max(r.busy_s / max(max(r.done_s.values(), default=0.0), 1e-9) for r in p_runs),
            "d_max_batch": d.max_batch,
            "d_preemptions": d.preemptions,
        }

    def _searches(self, mode: str) -> Deployment | list[tuple[str, int, int, int, int, str]]:
        """What planning ``mode`` takes: one search per (P size, D size, admission policy), each from
        its capacity start, or a Deployment when a floor (memory, ITL, TTFT) already rules the mode
        out (its ``binding`` names the constraint)."""
        req, cfg = self.req, self.cfg
        p_role = PREFILL_MODEL_ROLE[mode]
        longest = max(a.prompt_len for a in req.arrivals)
        longest_total = max(a.prompt_len + a.output_len for a in req.arrivals) + 1 + 3
        dep = Deployment(mode, False)
        p_options = [g for g in self.degrees if self._fits(p_role, g, 64, longest + 1)]
        if not p_options:
            dep.binding = (
                f"memory: a {p_role}-role P replica does not fit {max(self.degrees)} {self.gpu.name} "
                f"({self.mem[p_role].per_gpu_bytes(max(self.degrees)) / 1e9:.1f} GB weights per GPU, "
                f"{req.reserve_gb:g} GB reserve, {self.gpu.memory_gb:g} GB HBM, prompt {longest} tokens)"
            )
            return dep
        d_options = [g for g in self.degrees if self._fits("decode", g, D_MAX_SEQS, longest_total)]
        if not d_options:
            dep.binding = (
                f"memory: a decode replica does not fit {max(self.degrees)} {self.gpu.name} with "
                f"{D_MAX_SEQS} sequences and a {longest_total}-token request"
            )
            return dep
        # ITL floor: the fastest D step there is (batch 1, most GPUs) against the target
        fastest = min(self.steps.decode_ms(1, 0, g) for g in d_options)
        if fastest > req.slo_itl_p99_ms:
            dep.binding = (
                f"ITL: the fastest decode step ({fastest:.1f} ms at batch 1 on "
                f"{d_options[-1]} {self.gpu.name}) exceeds the ITL p99 target {req.slo_itl_p99_ms:g} ms"
            )
            return dep
        # TTFT floor: the longest prompt alone on the largest P replica, moved, then D's step
        g_p_max = self.degrees[-1]
        rows = longest - cfg.window_size if mode == "asymmetric" else longest
        alone = (
            (self.steps.prefill_ms(mode, [(max(rows, 0), longest)], g_p_max) if rows > 0 else 0.0)
            + self._move_ms(mode, longest)
            + self.steps.decode_ms(1, 0 if mode == "symmetric-windows" else cfg.window_size, d_options[-1])
        )
        if alone / 1e3 > req.slo_ttft_p99_s:
            dep.binding = (
                f"TTFT: a {longest}-token prompt alone takes {alone:.0f} ms (prefill on {g_p_max} "
                f"{self.gpu.name}, move, first D step) > the TTFT p99 target {req.slo_ttft_p99_s * 1e3:g} ms"
            )
            return dep
        # capacity start (a lower bound: the search only adds): P fully busy, D from the ITL-limited batch
        span = req.arrivals[-1].time_s - req.arrivals[0].time_s or 1.0
        p_work = (
            sum(
                self.steps.prefill_ms(
                    mode, [(max(a.prompt_len - (cfg.window_size if mode == "asymmetric" else 0), 0), a.prompt_len)], 1
                )
                for a in req.arrivals
            )
            / 1e3
        )
        sizes = list(itertools.product(p_options[:P_SIZES_TRIED], d_options[:D_SIZES_TRIED]))
        if req.placement == "shared":  # a P and a D replica on the same GPUs
            both = [g for g in self.degrees if self._pair_fits(p_role, g, longest + 1, longest_total)]
            if not both:
                dep.binding = (
                    f"memory: a {p_role}-role P replica and a decode replica do not fit together on "
                    f"{max(self.degrees)} {self.gpu.name} (placement shared)"
                )
                return dep
            sizes = [(g, g) for g in both[:D_SIZES_TRIED]]
        searches = []
        for (g_p, g_d), policy in itertools.product(sizes, POLICIES):
            n_p = max(1, math.ceil(p_work / span / g_p))
            n_d = self._d_start(g_d, span)
            if req.placement == "shared":
                n_p = n_d = max(n_p, n_d)
            searches.append((mode, g_p, n_p, g_d, n_d, policy))
        fewest = min(self._gpus(*s[1:5]) for s in searches)
        if fewest > MAX_GPUS:  # the starts are lower bounds: no search could end under the cap
            dep.binding = (
                f"scale: keeping up with {req.rate:g} req/s takes at least {fewest} {self.gpu.name} (P's prompts "
                f"alone {p_work / span:.0f} GPU-seconds a second), more than the {MAX_GPUS} the planner searches"
            )
            return dep
        return [s for s in searches if self._gpus(*s[1:5]) <= MAX_GPUS]

    def _gpus(self, g_p: int, n_p: int, g_d: int, n_d: int) -> int:
        """A deployment's GPUs (shared placement: each P on a D replica's GPUs, counted once)."""
        return n_d * g_d if self.req.placement == "shared" else n_p * g_p + n_d * g_d

    def _search_mode(self, searches: list[tuple[str, int, int, int, int, str]]) -> list[Deployment]:
        """One mode's searches, the largest start first, then the fewest starting GPUs first (a search's
        rounds only add replicas); a search that cannot end with fewer GPUs than the cheapest feasible
        deployment found so far is skipped, or stopped once its rounds pass that count. Only such
        searches are left out: the plan picks the fewest GPUs (ties by TTFT p99, then search order),
        so it is the same as with every search run to its end. Returned in search order."""
        best, found = math.inf, {}
        start = [self._gpus(*s[1:5]) for s in searches]
        order = sorted(range(len(searches)), key=lambda i: (start[i], i))
        # the largest start first: most often feasible, it bounds the cheaper searches' rounds from the outset
        order.insert(0, order.pop())
        for i in order:
            if start[i] > best:
                continue
            dep = self._search(*searches[i], give_up_above=best)
            if dep is not None:
                found[i] = dep
                if dep.feasible:
                    best = min(best, dep.total_gpus)
        return [found[i] for i in sorted(found)]

    def _run_modes(self, prepared: dict[str, list[tuple[str, int, int, int, int, str]]]) -> list[list[Deployment]]:
        """``_search_mode`` for each mode; the modes in ``jobs`` forked processes where there are several."""
        jobs = min(self.jobs, len(prepared))
        if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
            return [self._search_mode(s) for s in prepared.values()]
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(self._search_mode, prepared.values()))

    def _d_start(self, g_d: int, span: float) -> int:
        """Replicas whose steady decode batch keeps the step within the ITL target (Little's law)."""
        req = self.req
        steps_per_req = sum(a.output_len for a in req.arrivals) / len(req.arrivals) / 2.8
        rate = len(req.arrivals) / span
        b = max(
            (
                b
                for b in range(1, D_MAX_SEQS + 1)
                if self.steps.decode_ms(b, self.cfg.window_size, g_d) <= 0.8 * req.slo_itl_p99_ms
            ),
            default=1,
        )
        t = self.steps.decode_ms(b, self.cfg.window_size, g_d) / 1e3
        return max(1, math.ceil(rate * steps_per_req * t / b / 2))  # half: the search only adds

    def _search(
        self, mode: str, g_p: int, n_p: int, g_d: int, n_d: int, policy: str, give_up_above: float = math.inf
    ) -> Deployment | None:
        """Rounds from the given replica counts, adding replicas on the side that binds until both
        targets hold (or more stops helping); None once a round would need more than
        ``give_up_above`` GPUs (a cheaper deployment of the mode is already known)."""
        req = self.req
        cap, budget = POLICIES[policy].max_new_admissions, POLICIES[policy].admission_token_budget
        shared = req.placement == "shared"
        dep = Deployment(
            mode,
            False,
            placement=req.placement,
            p_gpus=g_p,
            d_gpus=g_d,
            d_policy=policy,
            d_max_new_admissions=cap,
            d_admission_token_budget=budget,
            d_mixed_steps=POLICIES[policy].mixed_steps,
            d_max_num_seqs=D_MAX_SEQS,
        )
        limit = 4 * max(n_p * g_p + n_d * g_d, 8)
        prev_itl = math.inf
        for _ in range(MAX_ROUNDS):
            if self._gpus(g_p, n_p, g_d, n_d) > give_up_above:
                return None
            r = self.evaluate(mode, n_p, g_p, n_d, g_d, policy)
            dep.p_replicas, dep.d_replicas = n_p, n_d
            dep.total_gpus = self._gpus(g_p, n_p, g_d, n_d)
            dep.ttft_ms, dep.itl_ms, dep.ttft_p99_split_ms = r["ttft_ms"], r["itl_ms"], r["ttft_p99_split_ms"]
            dep.slo_attainment = r["attainment"]
            dep.p_busy, dep.d_max_batch, dep.d_preemptions = r["p_busy"], r["d_max_batch"], r["d_preemptions"]
            mean_out = sum(a.output_len for a in req.arrivals) / len(req.arrivals)
            dep.goodput_tokens_per_s_per_gpu = req.rate * r["attainment"] * mean_out / dep.total_gpus
            dep.memory = {
                "p": self._memory_info(PREFILL_MODEL_ROLE[mode], g_p, 64),
                "d": self._memory_info("decode", g_d, D_MAX_SEQS),
            }
            if shared:
                longest = max(a.prompt_len for a in req.arrivals)
                p_blocks, d_blocks = self._shared_blocks(PREFILL_MODEL_ROLE[mode], g_d, longest + 1)
                for side, blocks in (("p", p_blocks), ("d", d_blocks)):
                    dep.memory[side].update(kv_blocks=blocks, kv_tokens=blocks * BLOCK_SIZE, shares_gpus=True)
                    dep.memory[side].pop("kv_room_gb_per_gpu", None)
            itl_ok = r["itl_ms"]["p99"] <= req.slo_itl_p99_ms
            ttft_ok = r["ttft_ms"]["p99"] <= req.slo_ttft_p99_s * 1e3
            dep.rounds.append(
                f"{n_p}x{g_p} P + {n_d}x{g_d} D: TTFT p99 {r['ttft_ms']['p99']:.0f} ms, "
                f"ITL p99 {r['itl_ms']['p99']:.1f} ms"
            )
            if r["failed"]:
                i, why = next(iter(r["failed"].items()))
                dep.binding = f"memory: request {i} cannot fit the KV cache ({why})"
                return dep
            if itl_ok and ttft_ok:
                dep.feasible, dep.binding = True, None
                return dep
            if dep.total_gpus >= limit:
                break
            if not itl_ok:
                dep.binding = (
                    f"ITL: p99 {r['itl_ms']['p99']:.1f} ms > target {req.slo_itl_p99_ms:g} ms "
                    f"with {n_d} D replicas of {g_d} {self.gpu.name}"
                )
                if r["itl_ms"]["p99"] > 0.98 * prev_itl:  # more replicas no longer help: a step is too slow
                    dep.binding += " (more D replicas do not lower it"
                    if mode in ("symmetric", "symmetric-split"):  # P made the first token, D replays the window
                        dep.binding += "; the gap after P's first token spans D's admission and replay step"
                    elif mode == "symmetric-windows":  # P made the first token and sent the windows
                        dep.binding += "; the gap after P's first token spans D's admission step"
                    if shared:
                        dep.binding += "; on shared GPUs a D step shares them with the P step in progress"
                    dep.binding += ")"
                    break
                prev_itl = r["itl_ms"]["p99"]
                n_d += max(1, n_d // 4)
                n_p = n_d if shared else n_p
            else:
                split = r["ttft_p99_split_ms"]
                side = "P" if split["p_side"] >= split["d_side"] else "D"
                dep.binding = (
                    f"TTFT: p99 {r['ttft_ms']['p99']:.0f} ms > target {req.slo_ttft_p99_s * 1e3:g} ms "
                    f"({side} side binds: P {split['p_side']:.0f} ms, D {split['d_side']:.0f} ms)"
                )
                if side == "P":
                    n_p += max(1, n_p // 4)
                else:
                    n_d += max(1, n_d // 4)
                if shared:  # pairs: one more of each
                    n_p = n_d = max(n_p, n_d)
        dep.binding = f"{dep.binding}; gave up at {dep.total_gpus} GPUs"
        return dep

    def plan(self) -> dict[str, Any]:
        prepared = {m: self._searches(m) for m in self.req.modes}
        todo = {m: p for m, p in prepared.items() if not isinstance(p, Deployment)}
        found = dict(zip(todo, self._run_modes(todo), strict=True))
        deps = [p if isinstance(p, Deployment) else _cheapest(m, found[m]) for m, p in prepared.items()]
        ok = [d for d in deps if d.feasible]
        best = max(ok, key=lambda d: (d.goodput_tokens_per_s_per_gpu, -d.total_gpus), default=None)
        return {
            "gpu": asdict(self.gpu),
            "rate_req_per_s": self.req.rate,
            "requests_simulated": len(self.req.arrivals),
            "slo": {"ttft_p99_s": self.req.slo_ttft_p99_s, "itl_p99_ms": self.req.slo_itl_p99_ms},
            "deployments": [asdict(d) for d in deps],
            "recommendation": _why(best, deps),
            "step_tables": self.step_tables,
        }


def _cheapest(mode: str, searched: list[Deployment]) -> Deployment:
    """The feasible deployment with the fewest GPUs (then the lowest TTFT p99), in search order; else
    the last infeasible one."""
    best: Deployment | None = None
    last_fail: Deployment | None = None
    for d in searched:
        if d.feasible and (best is None or (d.total_gpus, d.ttft_ms["p99"]) < (best.total_gpus, best.ttft_ms["p99"])):
            best = d
        if not d.feasible:
            last_fail = d
    return best or last_fail or Deployment(mode, False)


def _why(best: Deployment | None, deps: list[Deployment]) -> dict[str, Any]:
    if best is None:
        why = "no mode meets the targets: " + "; ".join(f"{d.mode}: {d.binding}" for d in deps)
        return {"mode": None, "why": why, "ties": []}
    others = [d for d in deps if d is not best]

    def p_side(d: Deployment) -> str:
        m = d.memory.get("p", {})
        return f"its P holds the {m.get('role')} role, {m.get('weights_gb_per_gpu', 0):.0f} GB per GPU"

    pair = ", each P on a D replica's GPUs" if best.placement == "shared" else ""
    why = (
        f"{best.mode}: {best.total_gpus} GPUs ({best.p_replicas} P x {best.p_gpus} + {best.d_replicas} D x "
        f"{best.d_gpus}{pair}, D admission {best.d_policy}), goodput {best.goodput_tokens_per_s_per_gpu:.0f} "
        f"tokens/s per GPU; {p_side(best)}"
    )
    ties = [
        d.mode
        for d in others
        if d.feasible
        and d.total_gpus == best.total_gpus
        and abs(d.goodput_tokens_per_s_per_gpu - best.goodput_tokens_per_s_per_gpu)
        <= TIE_GOODPUT * best.goodput_tokens_per_s_per_gpu
    ]
    if ties:  # the simulated goodput of 300 requests does not separate them
        why += f"; a tie with {', '.join(ties)} (the same GPUs, goodput within {TIE_GOODPUT:.0%})"
    for d in others:
        if d.feasible:
            why += (
                f"; {d.mode} needs {d.total_gpus} GPUs ({d.p_replicas} P x {d.p_gpus} + {d.d_replicas} D x "
                f"{d.d_gpus}), {d.goodput_tokens_per_s_per_gpu:.0f} tokens/s per GPU; {p_side(d)}"
            )
        else:
            why += f"; {d.mode} is infeasible ({d.binding})"
    return {"mode": best.mode, "why": why, "ties": ties}


def format_plan(result: dict[str, Any]) -> str:
    lines = [
        f"{result['gpu']['name']}: {result['rate_req_per_s']:g} req/s, TTFT p99 <= "
        f"{result['slo']['ttft_p99_s']:g} s, ITL p99 <= {result['slo']['itl_p99_ms']:g} ms "
        f"({result['requests_simulated']} requests simulated)"
    ]
    w = max([11, *(len(d["mode"]) + 2 for d in result["deployments"])])
    hdr = (
        f"{'mode':<{w}}{'P n x EP':>14}{'D n x EP':>14}{'D admission':>12}{'GPUs':>6}"
        f"{'TTFT p50/p99 ms':>18}{'ITL p50/p99 ms':>17}{'goodput tok/s/GPU':>19}"
    )
    lines += [hdr, "-" * len(hdr)]
    for d in result["deployments"]:
        if d["binding"] and not d["feasible"] and not d["total_gpus"]:
            lines.append(f"{d['mode']:<{w}}infeasible: {d['binding']}")
            continue
        lines.append(
            f"{d['mode']:<{w}}{d['p_replicas']:>9} x {d['p_gpus']:<2}{d['d_replicas']:>9} x {d['d_gpus']:<2}"
            f"{d['d_policy']:>12}{d['total_gpus']:>6}"
            f"{d['ttft_ms']['p50']:>9.0f}/{d['ttft_ms']['p99']:<8.0f}{d['itl_ms']['p50']:>8.1f}/{d['itl_ms']['p99']:<8.1f}"
            f"{d['goodput_tokens_per_s_per_gpu']:>19.0f}"
        )
        if not d["feasible"]:
            lines.append(f"{'':<{w}}infeasible: {d['binding']}")
    lines.append(f"recommendation: {result['recommendation']['why']}")
    return "\n".join(lines)
