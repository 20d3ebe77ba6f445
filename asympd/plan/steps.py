"""Step times for a worker replica on a chosen GPU, from the H200 measurements in bench/results.

Decode worker: the composed 40-layer step of ``d_admission.json`` (B requests x 4 rows at 8K context
plus j bounded prefills of 128 rows), rebuilt per layer kind from ``layers.json`` so that each kind's
measured time can be carried to another GPU by its own roofline (``gpus.roofline_factor``).
Prefill worker: the measured cost per prompt at a full 16K-token step (``p_throughput.json``, per
prompt length and mode), with a floor for part-filled steps from the measured prefill-chunk grid.

A replica of g GPUs runs expert parallelism of degree g with data-parallel attention: the measured
one-GPU-equivalent compute is divided by g (ideal split, as in the benchmarks) and each MoE layer
adds an all-to-all (dispatch in FP8, combine in bf16) at the measured link efficiency.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asympd.plan.gpus import GPUS, MEASURED_ON, GPUSpec, roofline_factor

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"
# the H200 tables the planner reads (by the key StepModel knows each by): layer steps timed with the
# MoE and attention kernels the CUDA build runs (packed MXFP4 experts in Gluon with the split-layout
# FP4 decode, sub-tiles, two weight tiles a program at 64- and 128-row blocks, today's M-blocks and
# tile order, the fused indexer's version 5 and attention's version 5 (Gluon), the glue kernels with
# the MoE's combine and the compressor's bf16 GEMM; ``bench/layers.py --out layers_v12 ...``,
# measured at 904b2ac), the D and P steps composed from them, the two-GPU links
TABLES = {
    "layers": "layers_v12.json",
    "d_admission": "d_admission_v12.json",
    "p_throughput": "p_throughput_v12.json",
    "two_gpu": "two_gpu.json",
}
# the tables of 2026-11-29 (bf16 experts, the gathered attention): admission_policy.json ran on them
BF16_TABLES = {
    "layers": "layers.json",
    "d_admission": "d_admission.json",
    "p_throughput": "p_throughput.json",
    "two_gpu": "two_gpu.json",
}
# the P/D modes with prefill-worker step times: asymmetric and symmetric (decoder-replay) as
# p_throughput.json composed them, symmetric-split from the same measured P steps (``split_ms_per_prompt``),
# symmetric-windows with symmetric-split's P (it ships the windows too, and its D replays nothing)
PLANNED_MODES = ("asymmetric", "symmetric", "symmetric-split", "symmetric-windows")
SPLIT_P = ("symmetric-split", "symmetric-windows")  # the P that runs every layer on the last W rows alone
COMPOSED_MODES = ("asymmetric", "symmetric")  # p_throughput.json's columns
P_STEP_TOKENS = 16384  # the prefill token budget the P measurements used
DEFAULT_A2A_LATENCY_US = 20.0  # per all-to-all launch; an assumption, not measured (see docs/planner.md)


class PlanInputError(ValueError):
    """A benchmark result the planner needs is missing or malformed."""


def interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points, linear extrapolation past the ends."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1]
    if x <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif x >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        i = next(i for i in range(1, len(pts)) if x <= pts[i][0])
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def load_results(results_dir: Path | str | None = None, tables: dict[str, str] | None = None) -> dict[str, Any]:
    """The benchmark results the planner reads (``tables``: key -> file, default ``TABLES``)."""
    d = Path(results_dir) if results_dir is not None else RESULTS_DIR
    tables = tables or TABLES
    out = {}
    for key, name in tables.items():
        path = d / name
        if not path.is_file():
            needed = ", ".join(tables.values())
            raise PlanInputError(f"{path} is missing: the planner needs {needed} from bench/results")
        try:
            out[key] = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PlanInputError(f"{path} is not valid JSON: {e}") from e
    return out


def _carried(entry: dict[str, Any], gpu: GPUSpec) -> float:
    return entry["ms"] * roofline_factor(entry["bytes_ms"], entry["flops_ms"], gpu)


def split_ms_per_prompt(
    layers: dict[str, Any], counts: dict[str, Any], window: int, carry: Callable[[dict[str, Any]], float]
) -> dict[int, float]:
    """A symmetric-split P's time per prompt of N tokens, composed from the P steps ``layers.json``
    measured for p_throughput.json (``carry``: an entry's ms on the GPU planned for): the asymmetric
    P's steps per prompt (L0-19 and L20's KV path on [0, N - W)), plus the last W rows through L0-19
    and L20 in full at the symmetric P's measured cost per row of those layers, plus its measured
    tail per prompt (the 19 decoder layers on the W rows, packed as many to a step as the 16K budget
    packs prompts). The symmetric (decoder-replay) P differs only by L20 in full on [0, N - W).
    Prompt lengths without both modes' steps are left out."""
    acc: dict[tuple[int, str], dict[str, float]] = {}
    for st in layers["p_steps"]:
        mode = st["mode"]
        if mode not in COMPOSED_MODES:
            continue
        a = acc.setdefault((st["n_prompt"], mode), {"main": 0.0, "tail": 0.0, "prompts": 0.0, "rows": 0.0})
        a["main"] += sum(c * carry(st["t_main"][k]) for k, c in counts["main"][mode].items())
        a["tail"] += sum(c * carry(st["t_tail"][k]) for k, c in counts["tail"][mode].items()) if st["t_tail"] else 0.0
        a["prompts"] += st["prompts"]
        a["rows"] += sum(ch["n"] * ch["q"] for ch in st["main"])
    out = {}
    for n in sorted({n for n, _ in acc}):
        asym, sym = acc.get((n, "asymmetric")), acc.get((n, "symmetric"))
        if asym and sym and asym["prompts"] and sym["prompts"] and sym["rows"]:
            out[n] = (asym["main"] + asym["tail"]) / asym["prompts"]
            out[n] += window * sym["main"] / sym["rows"] + sym["tail"] / sym["prompts"]
    return out


@dataclass(frozen=True)
class Comm:
    """Link model from the two-GPU measurement: a copy of n bytes takes latency + n / rate."""

    link_efficiency: float  # measured peer-copy rate / H200 one-way NVLink datasheet rate
    transfer_latency_s: float  # fixed cost of a PrefixState move (fit over the measured sizes)
    transfer_rate_gbps: float  # marginal rate of a PrefixState move, GB/s on the H200

    @classmethod
    def from_two_gpu(cls, two_gpu: dict[str, Any]) -> Comm:
        peer = two_gpu["link"]["gpu0_to_gpu1_GBps"]
        pts = sorted((v["nbytes"], v["seconds"]) for v in two_gpu["state"].values() if isinstance(v, dict))
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        return cls(peer / GPUS[MEASURED_ON].link_gbps_one_way, my - slope * mx, 1e-9 / slope)


class StepModel:
    """Step times (ms) of P and D replicas of ``gpus`` GPUs each on one GPU kind."""

    def __init__(
        self,
        results: dict[str, Any],
        gpu: GPUSpec,
        dim: int,
        topk: int,
        window: int,
        a2a_latency_us: float = DEFAULT_A2A_LATENCY_US,
    ):
        self.gpu = gpu
        self.dim, self.topk, self.window = dim, topk, window
        self.a2a_latency_s = a2a_latency_us * 1e-6
        self.comm = Comm.from_two_gpu(results["two_gpu"])
        self._d_table = self._decode_table(results["layers"], results["d_admission"])
        self._d_by_b: dict[int, list[tuple[float, float]]] = {}
        for b, j, ms in self._d_table:
            self._d_by_b.setdefault(b, []).append((j, ms))
        # decode_ms and prefill_cost_ms_per_row by their arguments: a simulation reads the same few
        # step shapes and prompt lengths thousands of times
        self._d_ms: dict[tuple[int, int, int], float] = {}
        self._p_row_ms: dict[tuple[str, int], float] = {}
        self._p_cost, self._p_floor = self._prefill_tables(results["layers"], results["p_throughput"])
        # MoE layers a P step runs on a prefix row: the asymmetric P's 20 layers below L20 (L20's KV
        # path has none); a symmetric-split P runs those on [0, N-W) and all 40 on [N-W, N)
        self.p_moe_layers = {"asymmetric": 20, "symmetric": 40, **dict.fromkeys(SPLIT_P, 20)}

    # ---- tables ---------------------------------------------------------------------------------

    def _decode_table(self, layers: dict[str, Any], d_adm: dict[str, Any]) -> list[tuple[int, int, float]]:
        counts = d_adm["layer_counts"]
        head = {(s["B"], s["j"]): s["head_ms"] for s in d_adm["steps"]}
        base = GPUS[MEASURED_ON]
        table = []
        for s in layers["d_steps"]:
            key = (s["B"], s["j"])
            if key not in head:
                continue
            ms = sum(counts[k] * _carried(e, self.gpu) for k, e in s["kinds"].items() if k in counts)
            ms += head[key] * base.hbm_tbps / self.gpu.hbm_tbps
            table.append((s["B"], s["j"], ms))
        if not table:
            raise PlanInputError("layers.json d_steps and d_admission.json steps share no (B, j) point")
        return table

    def _prefill_tables(self, layers: dict[str, Any], p_thr: dict[str, Any]):
        counts = p_thr["layer_counts"]
        factor: dict[tuple[int, str], tuple[float, float]] = {}
        for s in layers["p_steps"]:
            for part in ("main", "tail"):
                for k, e in s[f"t_{part}"].items():
                    c = counts[part][s["mode"]].get(k, 0)
                    num, den = factor.get((s["n_prompt"], s["mode"]), (0.0, 0.0))
                    factor[(s["n_prompt"], s["mode"])] = (num + c * _carried(e, self.gpu), den + c * e["ms"])
        cost: dict[str, list[tuple[float, float]]] = {m: [] for m in PLANNED_MODES}
        for row in p_thr["per_length"]:
            n = row["n_prompt"]
            for mode in COMPOSED_MODES:
                num, den = factor.get((n, mode), (1.0, 1.0))
                rows = n - self.window if mode == "asymmetric" else n
                cost[mode].append((math.log2(n), row[mode]["ms_per_prompt"] * num / den / rows))
        for n, ms in split_ms_per_prompt(layers, counts, self.window, lambda e: _carried(e, self.gpu)).items():
            for mode in SPLIT_P:
                cost[mode].append((math.log2(n), ms / n))
        # part-filled steps: a chunk of r rows from position 0, each kind's measured grid time; a
        # symmetric-split step's rows go through the asymmetric P's layers at least (its window rows'
        # extra layers are in its cost per row, not in this lower bound)
        kinds = {m: dict(counts["main"][m]) for m in COMPOSED_MODES}
        kinds.update(dict.fromkeys(SPLIT_P, kinds["asymmetric"]))
        grid: dict[str, list[tuple[float, float]]] = {}
        for g in layers["grid"]:
            if g["shape"] == "prefill" and g["start"] == 0 and g["n"] == 1:
                for k, e in g["kinds"].items():
                    grid.setdefault(k, []).append((g["q"], _carried(e, self.gpu)))
        floor = {}
        for mode in PLANNED_MODES:
            pts: dict[float, float] = {}
            for k, c in kinds[mode].items():
                for q, ms in grid.get(k, []):  # L20's KV path has no grid entry: left out of the floor
                    pts[q] = pts.get(q, 0.0) + c * ms
            floor[mode] = sorted(pts.items())
        return cost, floor

    # ---- step times -----------------------------------------------------------------------------

    def a2a_ms(self, rows: int, gpus: int, moe_layers: int) -> float:
        """Dispatch (1 B/value) + combine (2 B/value) of every MoE layer across ``gpus`` GPUs."""
        if gpus <= 1 or rows <= 0:
            return 0.0
        per_gpu = rows / gpus * self.topk * (gpus - 1) / gpus * self.dim * 3
        rate = self.gpu.link_gbps_one_way * 1e9 * self.comm.link_efficiency
        return moe_layers * (per_gpu / rate + 2 * self.a2a_latency_s) * 1e3

    def decode_ms(self, batch: int, prefill_rows: int, gpus: int) -> float:
        """One D step: ``batch`` requests x 4 rows and ``prefill_rows`` bounded-prefill rows."""
        key = (batch, prefill_rows, gpus)
        if key not in self._d_ms:
            j = prefill_rows / self.window
            per_b = [(b, interp(pts, j)) for b, pts in sorted(self._d_by_b.items())]
            one_gpu = max(0.1, interp(per_b, max(batch, 1)))
            self._d_ms[key] = one_gpu / gpus + self.a2a_ms(batch * 4 + prefill_rows, gpus, 40)
        return self._d_ms[key]

    def prefill_cost_ms_per_row(self, mode: str, n_prompt: int) -> float:
        """One-GPU-equivalent ms per prompt row at a full step, for a prompt of ``n_prompt``."""
        key = (mode, n_prompt)
        if key not in self._p_row_ms:
            pts = self._p_cost[mode]
            self._p_row_ms[key] = max(1e-6, interp(pts, min(max(math.log2(max(n_prompt, 2)), pts[0][0]), pts[-1][0])))
        return self._p_row_ms[key]

    def prefill_ms(self, mode: str, chunks: list[tuple[int, int]], gpus: int, windows: int = 0) -> float:
        """One P step over (rows, prompt length) chunks: the packed cost, never below the measured
        time of one chunk of that many rows (a part-filled step still streams every weight).
        ``windows`` (a step of that many window chunks alone) is not priced apart: the H200 tables
        measured P's cost per prompt, its window rows included."""
        rows = sum(r for r, _ in chunks)
        if rows == 0:
            return 0.0
        packed = sum(r * self.prefill_cost_ms_per_row(mode, n) for r, n in chunks)
        floor = max(0.0, interp(self._p_floor[mode], rows)) if self._p_floor[mode] else 0.0
        moe = self.p_moe_layers[mode]
        if mode in SPLIT_P:  # the window rows' share (W of each prompt's N) runs 20 MoE layers more
            moe += 20 * sum(r * min(1.0, self.window / n) for r, n in chunks) / rows
        return max(packed, floor) / gpus + self.a2a_ms(rows, gpus, moe)

    def transfer_ms(self, nbytes: float) -> float:
        """P -> D prefix move over NVLink: the measured fit, the rate scaled by the link ratio."""
        rate = self.comm.transfer_rate_gbps * self.gpu.nvlink_gbps / GPUS[MEASURED_ON].nvlink_gbps
        return (self.comm.transfer_latency_s + nbytes / (rate * 1e9)) * 1e3
