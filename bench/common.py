"""What every benchmark shares: provenance (commit, device, command), ceilings measured in the same
run, timing, floors, and true-shape layers built on the GPU from the checkpoint schema.

Results are JSON under ``$ASYMPD_OUT`` (the device run's output folder) or ``bench/results``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


# ---- provenance -----------------------------------------------------------------------------------


# code a measurement never runs: the planner (it reads results, the servers and benchmarks never
# import it), so parts of one study run at commits that changed only the planner still merge
PLANNER_ONLY = Path("asympd/plan")


def digests(root: Path = ROOT) -> tuple[str, str]:
    """(source digest, serving digest) in one read of the sources: sha256 over the package and bench
    sources, which identifies the code that produced a result even where the tree is uncommitted or
    .git is absent (the device machine gets a copy without it); the serving digest leaves the
    planner's sources out (what ``bench/e2e.py --merge`` compares)."""
    source, serving = hashlib.sha256(), hashlib.sha256()
    for base in ("asympd", "bench"):
        for f in sorted((root / base).rglob("*.py")):
            rel = f.relative_to(root)
            chunk = str(rel).encode() + f.read_bytes()
            source.update(chunk)
            if not rel.is_relative_to(PLANNER_ONLY):
                serving.update(chunk)
    return source.hexdigest()[:16], serving.hexdigest()[:16]


def source_digest(root: Path = ROOT) -> str:
    return digests(root)[0]


def serving_digest(root: Path = ROOT) -> str:
    return digests(root)[1]


def commit() -> str:
    env = os.environ.get("ASYMPD_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except Exception:
        return "unknown"


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "host": platform.node(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name,
            sm_count=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
        )
        try:
            q = "name,driver_version,clocks.sm,clocks.mem,power.limit"
            out = subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
            )
            info["nvidia_smi"] = out.stdout.strip()
        except Exception as e:  # pragma: no cover - depends on the machine
            info["nvidia_smi"] = f"unavailable: {e}"
    else:
        info["gpu"] = None
    return info


def out_dir() -> Path:
    d = Path(os.environ.get("ASYMPD_OUT") or RESULTS)
    d.mkdir(parents=True, exist_ok=True)
    return d


def record(name: str, data: dict[str, Any], started: float | None = None) -> Path:
    """Write ``name``.json with provenance: commit, source digest, device, the command line."""
    payload = {
        "benchmark": name,
        "commit": commit(),
        **dict(zip(("source_digest", "serving_digest"), digests(), strict=True)),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_info(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(time.time() - started, 1) if started else None,
        **data,
    }
    path = out_dir() / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def log(*args: Any) -> None:
    print(*args, flush=True)


# ---- timing ---------------------------------------------------------------------------------------


_GRAPH_BROKEN: list[str] = []  # after one failed capture, time eagerly (a failed capture can leave debris)


def time_cuda(fn, *, iters: int = 10, warmup: int = 2, graph: bool = False) -> dict[str, Any]:
    """Median (and spread) of ``fn``'s device time in ms, timed with CUDA events per iteration.
    ``graph``: capture one call in a CUDA graph and time its replays (no launch overhead); falls
    back to eager timing, saying why, if the capture fails. Also counts the allocator's cudaMallocs
    and free-and-retries inside the timed calls (``cuda_mallocs``, ``alloc_retries``)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    mode, err, g = "eager", None, None
    if graph and _GRAPH_BROKEN:
        err = "graphs disabled after an earlier capture failure"
    elif graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            mode = "graph"
        except Exception as e:
            err = f"{type(e).__name__}: {str(e)[:300]}"
            _GRAPH_BROKEN.append(err)
            g = None
            torch.cuda.synchronize()
    run = g.replay if g is not None else fn
    before = torch.cuda.memory_stats()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    out = {
        "ms": times[len(times) // 2],
        "min_ms": times[0],
        "max_ms": times[-1],
        "iters": iters,
        "mode": mode,
    }
    # what the caching allocator did inside the timed calls: a cudaMalloc or a free-and-retry there
    # synchronizes and is timed too (the suspect in eager cells that drift within a run)
    after = torch.cuda.memory_stats()
    for key, name in (("num_device_alloc", "cuda_mallocs"), ("num_alloc_retries", "alloc_retries")):
        out[name] = after.get(key, 0) - before.get(key, 0)
    if err:
        out["graph_error"] = err
    del g
    return out


# ---- ceilings -------------------------------------------------------------------------------------


def ceilings() -> dict[str, Any]:
    """Device copy bandwidth (bytes read + written) and dense GEMM rates, measured now."""
    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    n = 1 << 30  # 1 GiB each way
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = time_cuda(lambda src=src, dst=dst: dst.copy_(src), iters=20, warmup=3)
    out["copy_bytes"] = 2 * n
    out["copy_ms"] = t["ms"]
    out["copy_TBps"] = 2 * n / (t["ms"] * 1e-3) / 1e12
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    t = time_cuda(lambda a=a, b=b: a @ b, iters=10, warmup=3)
    out["bf16_gemm_TFLOPs"] = 2 * m**3 / (t["ms"] * 1e-3) / 1e12
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        t = time_cuda(
            lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            iters=10,
            warmup=3,
        )
        out["fp8_gemm_TFLOPs"] = 2 * m**3 / (t["ms"] * 1e-3) / 1e12
    except Exception as e:
        out["fp8_gemm_error"] = str(e)[:200]
    af, bf = a.float(), b.float()
    t = time_cuda(lambda af=af, bf=bf: af @ bf, iters=3, warmup=1)
    out["fp32_gemm_TFLOPs"] = 2 * m**3 / (t["ms"] * 1e-3) / 1e12
    del a, b, af, bf
    torch.cuda.empty_cache()
    return out


# ---- true-shape tensors on the GPU ------------------------------------------------------------------


def _e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales 2^e as UE8M0 bytes (no float->e8m0 cast needed)."""
    return (exponent + 127).clamp(1, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def ensure_e8m0(device: torch.device) -> str:
    """The loader dequantizes with ``scale.float()``; where this torch cannot cast UE8M0 on the
    device, swap in a cast through the exponent bits (same values). Returns what was used."""
    try:
        v = torch.tensor([127, 130], dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu).float()
        if v.tolist() == [1.0, 8.0]:
            return "native"
    except Exception:
        pass
    import asympd.model.loader as loader
    from asympd.model import quant

    def as_float(scale: torch.Tensor) -> torch.Tensor:
        if scale.dtype == torch.float8_e8m0fnu:
            return (scale.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
        return scale.float()

    def dequant_fp8_tiles(weight, scale, block=32):
        rows, cols = weight.shape
        s = as_float(scale).repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
        return weight.float() * s

    def dequant_fp4(packed, scale, block=32):
        return quant.unpack_fp4(packed) * as_float(scale).repeat_interleave(block, -1)

    loader.dequant_fp8_tiles = dequant_fp8_tiles
    loader.dequant_fp4 = dequant_fp4
    return "exponent-bits"


def random_tensors(cfg, names_filter, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of the checkpoint schema whose name passes ``names_filter``, in storage formats,
    generated on ``device`` with the magnitudes of ``checkpoint.write_checkpoint`` (weights ~
    fan_in^-1/2; FP4 codes uniform with power-of-two scales jittered by one binade). One generator
    for the whole set: a tensor's values depend on which others were drawn (``DrawnTensors`` draws
    each from its own name)."""
    from asympd.model.schema import checkpoint_schema

    if device.type == "cuda":
        ensure_e8m0(device)
    specs = [s for s in checkpoint_schema(cfg) if names_filter(s.name)]
    by_name = {s.name: s for s in specs}
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for s in specs:
        if s.name.endswith(".scale"):
            continue
        scale = by_name.get(s.name.removesuffix(".weight") + ".scale")
        out[s.name] = draw_stored(cfg, s, scale is not None, device, g, seed)
        if scale is not None:
            out[scale.name] = draw_scale(s, scale, device, g)
    return out


def draw_stored(cfg, s, quantized: bool, device: torch.device, g: torch.Generator, seed: int) -> torch.Tensor:
    """One schema tensor's stored values (FP4 codes, FP8 codes, or a plain tensor), drawn from ``g``
    on ``device`` (small plain tensors from ``write_checkpoint``'s own per-name generator)."""
    from asympd.model.checkpoint import _generator, _plain, torch_dtype
    from asympd.model.schema import FP8, PACKED_FP4

    if s.dtype == PACKED_FP4 and quantized:  # packed FP4: uniform codes
        return torch.randint(-128, 128, s.shape, device=device, dtype=torch.int8, generator=g)
    if s.dtype == FP8 and quantized:  # 32x32 tiles (per-32 rows for Engram tables)
        codes = torch.randn(s.shape, device=device, generator=g) * 16
        return codes.clamp(-448, 448).to(torch.float8_e4m3fn)
    if len(s.shape) == 2 and s.shape[0] * s.shape[1] > (1 << 22):  # big plain matrix
        t = torch.randn(s.shape, device=device, generator=g) * s.shape[1] ** -0.5
        return t.to(torch_dtype(s.dtype))
    return _plain(cfg, s, _generator(seed, s.name)).to(device)


def draw_scale(weight, scale, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """The UE8M0 scales of ``weight`` (a schema spec): FP4 experts' per-32 scales at fan_in^-1/2
    jittered by one binade (drawn from ``g``), FP8 tiles' at one power of two."""
    from asympd.model.schema import FP4_BLOCK, PACKED_FP4

    if weight.dtype == PACKED_FP4:
        fan_in = weight.shape[1] * 2
        assert scale.shape[1] * FP4_BLOCK == fan_in
        base = round(math.log2(fan_in**-0.5 / 2.9))
        return _e8m0(base + torch.randint(-1, 2, scale.shape, device=device, dtype=torch.int32, generator=g))
    base = round(math.log2(weight.shape[1] ** -0.5 / 16))
    return _e8m0(torch.full(scale.shape, base, device=device, dtype=torch.int32))


def name_seed(seed: int, name: str) -> int:
    """A tensor's own seed: its values depend on its name and ``seed`` only."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DrawnTensors(Mapping):
    """The checkpoint tensors ``names`` of ``cfg`` as a read-only mapping that draws each tensor in its
    storage format on ``device`` when it is read, from a generator of its own name (``name_seed``), and
    keeps nothing: what ``build_model`` takes in place of a loaded checkpoint, so a model of 75 GB is
    built without a second copy of its tensors, and any subset of names (an EP rank's share) holds
    the values the whole set would. ``host``: names returned in host memory (Engram tables: the packed
    layouts keep them there and pin them). Reading a name twice draws it twice (the same values)."""

    def __init__(self, cfg, names, device: torch.device, seed: int = 0, host=()):
        from asympd.model.schema import checkpoint_schema

        if device.type == "cuda":
            ensure_e8m0(device)
        self.cfg, self.device, self.seed, self.host = cfg, device, seed, frozenset(host)
        wanted = set(names)
        self.specs = {s.name: s for s in checkpoint_schema(cfg) if s.name in wanted}
        if missing := wanted - self.specs.keys():
            raise KeyError(f"not in the checkpoint schema: {sorted(missing)[:5]}")

    def __getitem__(self, name: str) -> torch.Tensor:
        from asympd.model.checkpoint import torch_dtype

        s = self.specs[name]
        g = torch.Generator(device=self.device).manual_seed(name_seed(self.seed, name))
        if name.endswith(".scale"):
            t = draw_scale(self.specs[name.removesuffix(".scale") + ".weight"], s, self.device, g)
        else:
            scale = name.removesuffix(".weight") + ".scale" in self.specs
            t = draw_stored(self.cfg, s, scale, self.device, g, self.seed)
        assert t.shape == s.shape and t.dtype == torch_dtype(s.dtype), name
        return t.cpu() if name in self.host else t

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs.values())


# ---- a step's caches, for timing layers through the engine's own batched path ---------------------


class StepState:
    """A step of ``specs`` (dicts: n sequences of q rows from position ``start``; optional floor,
    encoder_floor, write_global) over a paged cache filled with random values: every sequence's
    blocks cover its context, its windows hold the W rows before ``start``, its open compressor
    groups the rows since the last full group. ``step_block`` runs a layer on it exactly as the
    engine does (``Block.forward`` over a ``PagedBatch``); running a layer again rewrites the same
    rows, so it can be timed repeatedly or captured in a CUDA graph."""

    def __init__(self, cfg, specs, dtype, device, generator=None, block_size: int = 64, spec_slack: int = 4):
        from asympd.kv.batch import BatchSegment, PagedBatch
        from asympd.kv.paged_cache import PagedKVCache
        from asympd.kv.spec import KVCacheSpec

        self.cfg, self.specs = cfg, [dict(s) for s in specs]
        seqs = [(sp, i) for sp in self.specs for i in range(sp["n"])]
        blocks = [-(-(sp["start"] + sp["q"]) // block_size) for sp, _ in seqs]
        spec = KVCacheSpec.from_config(cfg, block_size, spec_slack, dtype)
        self.cache = cache = PagedKVCache(spec, max(1, sum(blocks)), len(seqs), device)
        for pool in cache.pools.values():
            pool.normal_(generator=generator)
        cache.window_kv.normal_(generator=generator)
        segments, first = [], 0
        for slot, ((sp, _), nb) in enumerate(zip(seqs, blocks, strict=True)):
            start = sp["start"]
            for rows in cache.windows.values():
                self._fill(rows, slot, start, rows.capacity, device)
            for layer, rows in cache.pairs.items():
                for b in rows.bufs[:-1]:
                    b[slot].normal_(generator=generator)
                self._fill(rows, slot, start, start % cfg.ratio(layer), device)
            segments.append(
                BatchSegment(
                    list(range(first, first + nb)),
                    slot,
                    start,
                    sp["q"],
                    sp.get("encoder_floor", 0),
                    sp.get("floor", 0),
                    sp.get("write_global", True),
                )
            )
            first += nb
        self.segments = segments
        self.batch = PagedBatch(cache, segments)
        self.rows = self.batch.num_rows

    @staticmethod
    def _fill(rows, slot: int, start: int, n: int, device) -> None:
        n = min(n, start, rows.capacity)
        rows.pos[slot].fill_(-1)
        rows.pos[slot, :n] = torch.arange(start - n, start, device=device)
        rows.length[slot], rows.last[slot] = n, start - 1 if n else -1


def step_block(block, h: torch.Tensor, pre: torch.Tensor, state: StepState, kv_path_only: bool = False):
    """One layer over the step, through the product's path. ``kv_path_only``: the prefill role's last
    KV source (its KV path alone; h and pre come back unchanged)."""
    view = state.batch.rows_view(0, len(state.batch.h_rows), decoder=block.layer > block.cfg.last_kv_source)
    if kv_path_only:
        block.attn.kv_path(block.attn_input(h, pre), view)
        return h, pre
    return block(h, pre, view)


# ---- floors ---------------------------------------------------------------------------------------

D_BYTES = {"bf16": 2, "fp8": 1, "mxfp4": 0.53125}  # mxfp4: 4-bit codes + one UE8M0 byte per 32


def expected_experts(rows: int, n_exp: int = 384, k: int = 6) -> float:
    """Distinct experts a step of ``rows`` tokens touches under uniform random routing."""
    return n_exp * (1 - (1 - k / n_exp) ** rows)


def moe_work(cfg, rows: int, experts: str, touched: float | None = None) -> dict[str, float]:
    d, inter = cfg.dim, cfg.moe_inter_dim
    touched = expected_experts(rows, cfg.n_routed_experts, cfg.n_activated_experts) if touched is None else touched
    per_expert = 3 * d * inter
    wbytes = (touched * per_expert) * D_BYTES[experts] + per_expert * 2 + cfg.n_routed_experts * d * 4
    flops = rows * (cfg.n_activated_experts + 1) * per_expert * 2 + rows * d * cfg.n_routed_experts * 2
    act = rows * d * 2 * 2
    return {"flops": flops, "bytes": wbytes + act, "experts_touched": touched}


def attention_work(cfg, layer: int, groups: list[dict[str, int]]) -> dict[str, float]:
    """FLOPs and fewest bytes of one layer's attention sublayer (bf16 weights as held here)."""
    d, h, hd = cfg.dim, cfg.n_heads, cfg.head_dim
    r = cfg.ratio(layer)
    src = cfg.kv_source_of(layer)
    rows = sum(g["n"] * g["q"] for g in groups)
    macs_row = d * cfg.q_lora_rank + cfg.q_lora_rank * h * hd + d * hd
    macs_row += cfg.o_groups * (h * hd // cfg.o_groups) * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
    wparams = macs_row
    flops = 2 * rows * macs_row
    slots = cfg.window_size + (cfg.index_topk if r else 0)
    flops += rows * h * slots * hd * 2 * 2
    kv_bytes = 0.0
    if r:
        if src == layer:  # compressor
            cm = d * hd * (2 if r > 1 else 1)
            flops += 2 * rows * cm
            wparams += cm * (2 if r > 1 else 1)  # fp32 weights on ratio-2 sources
        if layer in cfg.index_source_layers:
            im = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_n_heads
            flops += 2 * rows * im
            wparams += im
            for g in groups:
                n_tot = (g["start"] + g["q"]) // r
                vis = (g["start"] + g["q"] / 2) / r  # mean visible entries of the rows
                flops += 2 * g["n"] * g["q"] * cfg.index_n_heads * cfg.index_head_dim * vis
                kv_bytes += g["n"] * n_tot * cfg.index_head_dim * 2
        for g in groups:
            n_tot = (g["start"] + g["q"]) // r
            kv_bytes += g["n"] * min(n_tot, g["q"] * cfg.index_topk) * hd * 2
    for g in groups:
        kv_bytes += g["n"] * (cfg.window_size + g["q"]) * hd * 2
    act = rows * cfg.hc_mult * d * 2 * 2
    return {"flops": flops, "bytes": wparams * 2 + kv_bytes + act}


def floor_ms(work: dict[str, float], ceil: dict[str, Any], rate_key: str = "bf16_gemm_TFLOPs") -> dict[str, float]:
    t_flops = work["flops"] / (ceil[rate_key] * 1e12) * 1e3
    t_bytes = work["bytes"] / (ceil["copy_TBps"] * 1e12) * 1e3
    return {"floor_ms": max(t_flops, t_bytes), "flops_ms": t_flops, "bytes_ms": t_bytes}
