"""The whole prefill role at true depth over two GPUs (issue 11 item 5), in one device call.

V4.1-Flash's prefill role -- the embedding, layers 0-19 with their own routed experts each (no
aliasing) and layer 20's KV path, 149.5 GB in the released formats -- does not fit one H200, so it
runs as one P worker over ``--ep 2`` ranks, each a process with its own GPU, through the project's
own expert-parallel machinery: rank 0 (this process) starts rank 1 with ``RankGroup`` (NCCL on CUDA,
gloo on CPU), runs the real P engine (``LLMEngine``, role prefill, mode asymmetric, chunked prefill
at ``--step-tokens``, prefix export) and ``DistributedExecutor`` broadcasts its step plans; rank 1
replays them (``python -m asympd.parallel.worker``); the MoE layers meet in their all-to-alls.

Weights. No checkpoint touches the disk: each rank draws ITS OWN share of the role's tensors on its
own device in the released storage formats (FP8 e4m3 with UE8M0 32x32 tiles, packed MXFP4 experts
with per-32 scales, as ``asympd.model.schema`` lists them), each tensor from a generator seeded by
its name (``bench.common.DrawnTensors``): distinct values in every layer, the replicated tensors
identical on every rank, and an expert's values the same whichever rank (or a single rank) draws it.
The ranks build the model through the loader's own path, ``build_model(..., ep=(rank, world))``,
handed the drawn tensors as a lazy mapping (``RankSpec.builder`` on rank 1), in the CUDA default
layout (``packed-experts``: MXFP4 experts packed, the Engram tables in pinned host memory).
Deviations from the release, both for host memory: Engram tables of 4.8M rows instead of 384M (each
rank holds its own copy, and two copies of 203 GB exceed the x2 machine's 256 GB; a lookup moves
the same bytes: ``bench.e2e.true_depth``), and Engram hashes over the identity token map (no real
tokenizer here: the compressed vocabulary is the whole vocabulary).

Measured in the same run, per rank (= per GPU):
  load            draw + build seconds; ``resident_bytes()`` and the allocator's bytes after the
                  build, against the released-format bytes of the rank's share (``asympd memory``'s
                  prefill figure less the other rank's experts) and against the exact figure the
                  layout should hold (``expected_resident``: released + the layout's deliberate copies);
  prompts         4K, 16K and 64K tokens, one request each, after a warm-up of one 4K and one 16K
                  prompt (Triton compiles and first-shape costs excluded; the warm-up times are kept):
                  wall seconds from ``add_request`` until the prefix state is exported and its copy
                  is done, prompt tokens per second per GPU, peak memory (allocated and reserved);
  EP comm         CUDA events around every collective of every EP MoE layer (``EPMoE.comm_timer``):
                  dispatch (counts + rows), combine, all-gather, per layer per forward, and the whole
                  EP MoE layer beside them; device time, so a rank's wait for the other counts;
  floor           prompt tokens per second per GPU bound by FLOPs at the H200's datasheet dense
                  bf16 and fp8 rates (``asympd.plan.gpus``) for the role's FLOPs per prompt
                  (``prefill_flops``), and the fraction reached; with attention replicated (each rank
                  computes all rows' attention, half the MoE) as a second, lower floor.

    python3 bench/prefill_role.py           # nvidia-h200-x2: prefill_role_x2.json in $ASYMPD_OUT or bench/results
    python3 bench/prefill_role.py --smoke   # CPU, 2 gloo ranks, the tiny config: prefill_role_smoke.json

``--ep 1`` runs the same on one rank (the test's reference: the same weights, the same PrefixState
bytes). The JSON is rewritten after each prompt, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if not torch.cuda.is_available():  # the MXFP4 grouped GEMM runs under Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from asympd.config import ModelConfig  # noqa: E402
from asympd.model.schema import FP8, Part, TensorSpec, role_schema  # noqa: E402
from asympd.model.transformer import Transformer  # noqa: E402
from asympd.parallel.ep import CommTimer, EPMoE, expert_range, rank_tensors, shard_moe  # noqa: E402
from asympd.parallel.launch import RankSpec, rank_device  # noqa: E402
from bench.common import log, record  # noqa: E402

BUILDER = "bench.prefill_role:rank_model"
KEY = "prefill_role/{rank}/{what}"  # the store keys each rank publishes its measurements under


@dataclasses.dataclass
class Settings:
    """One run: what ``main`` parses; the ranks get it through ``RankSpec.builder_args``."""

    smoke: bool = False
    ep: int = 2
    lengths: tuple[int, ...] = (4096, 16384, 65536)
    warmup: tuple[int, ...] = (4096, 16384)
    step_tokens: int = 16384  # the P engine's chunk (max_num_batched_tokens), as bench/p_throughput.py
    weights: str = "packed-experts"  # the CUDA default layout (asympd.model.loader.LAYOUTS)
    seed: int = 0
    budget_s: float = 540.0  # a prompt predicted to end later than this is skipped (one device call: 600 s)
    name: str = ""

    @classmethod
    def smoke_defaults(cls, **kw: Any) -> Settings:
        return cls(smoke=True, lengths=(40, 100, 200), warmup=(40,), step_tokens=64, **kw)

    @property
    def device(self) -> str:
        return "cpu" if self.smoke or not torch.cuda.is_available() else "cuda"

    @property
    def result_name(self) -> str:
        suffix = f"_ep{self.ep}" if self.ep != 2 else ""
        return self.name or f"prefill_role_{'smoke' if self.smoke else 'x2'}{suffix}"


# ---- the model -------------------------------------------------------------------------------------


def model_config(smoke: bool) -> ModelConfig:
    """The tiny config with top-3 routing (so the combine order matters, as tests/parallel/test_ep.py
    has it), or V4.1-Flash's own 40-layer schedule at its widths (``bench.e2e.true_depth``: Engram
    tables of 4.8M rows, no draft blocks, no vision), room for 64K-token prompts; both with Engram
    hashing over the identity token map."""
    if smoke:
        from asympd.config import tiny

        cfg = tiny().replace(n_activated_experts=3, max_seq_len=1 << 12)
    else:
        from bench.e2e import true_depth

        cfg = true_depth().replace(max_seq_len=1 << 17)
    return cfg.replace(engram_compressed_vocab_size=cfg.vocab_size)


def rank_specs(cfg: ModelConfig, rank: int, world: int) -> list[TensorSpec]:
    """The prefill role's tensors rank ``rank`` of ``world`` reads (all of them on one rank)."""
    keep = rank_tensors(cfg, rank, world)
    return [s for s in role_schema(cfg, "prefill") if keep(s.name)]


def expected_resident(cfg: ModelConfig, specs: list[TensorSpec], weights: str, device: str) -> dict[str, int]:
    """What a rank holding ``specs`` must hold on its device, exactly: the released-format bytes of
    its share (Engram tables aside: host memory on CUDA) plus the copies the layout makes on purpose
    (tests/model/test_packed.py::test_packed_role_holds_the_released_bytes): router gates in fp32 plus
    their bf16 twin, ratio-2 compressors in fp32, each attention's RoPE frequencies, and in
    ``packed-experts`` the FP8 matrices expanded to bf16 (their second byte, less their scales)."""
    if weights not in ("packed", "packed-experts"):
        raise ValueError(f"the byte accounting covers the packed layouts, not {weights!r}")
    names = {s.name: s for s in specs}
    k = cfg.last_kv_source
    released = sum(s.nbytes for s in specs if s.part not in (Part.ENGRAM_TABLE, Part.VISION))
    tables = sum(s.nbytes for s in specs if s.part is Part.ENGRAM_TABLE)
    gates = sum(cfg.moe_shape(layer)[0] * cfg.dim * 4 for layer in range(k))
    compressors = sum(2 * cfg.head_dim * cfg.dim * 2 for layer in cfg.kv_source_layers if cfg.ratio(layer) > 1)
    rope = (k + 1) * (cfg.rope_head_dim // 2) * 4
    expanded = 0
    if weights == "packed-experts":
        for s in specs:
            scale = names.get(s.name.removesuffix(".weight") + ".scale")
            if s.dtype == FP8 and scale is not None and s.part is not Part.ENGRAM_TABLE:
                expanded += math.prod(s.shape) - math.prod(scale.shape)
    extra = gates + compressors + rope + expanded
    return {
        "released_bytes": released,
        "engram_table_bytes": tables,
        "layout_extra_bytes": extra,
        "fp8_expanded_bytes": expanded,
        "expected_resident_bytes": released + extra + (tables if device == "cpu" else 0),
    }


def build_rank(s: Settings, rank: int, world: int, device: torch.device) -> tuple[Transformer, dict[str, Any]]:
    """Rank ``rank``'s prefill-role model from tensors drawn on ``device`` (``DrawnTensors``), built by
    the loader (``build_model(..., ep=(rank, world))``), and what its build cost and holds."""
    from asympd.model.engram_hash import NgramHasher
    from asympd.model.loader import build_model, resolve_weights
    from bench.common import DrawnTensors

    cfg = model_config(s.smoke)
    specs = rank_specs(cfg, rank, world)
    packed = resolve_weights(s.weights, device).experts
    host = [x.name for x in specs if x.part is Part.ENGRAM_TABLE] if packed else []
    tensors = DrawnTensors(cfg, [x.name for x in specs], device, s.seed, host=host)
    hasher = NgramHasher(cfg, torch.arange(cfg.vocab_size)) if cfg.engram_layer_ids else None
    sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    model = build_model(
        cfg,
        tensors,
        "prefill",
        dtype=torch.bfloat16,
        device=device,
        hasher=hasher,
        weights=s.weights,
        ep=(rank, world) if world > 1 else None,
    )
    gc.collect()
    sync(device)
    build_s = time.perf_counter() - t0
    lo, hi = expert_range(cfg.n_routed_experts, rank, world)
    load: dict[str, Any] = {
        "rank": rank,
        "device": str(device),
        "experts": [lo, hi],
        "tensors_drawn": len(tensors),
        "bytes_drawn": tensors.nbytes(),
        "draw_and_build_s": round(build_s, 2),
        "weights": model.weights,
        "resident_bytes": model.resident_bytes(),  # before shard_moe adds its tiny bounds buffers
        **expected_resident(cfg, specs, s.weights, device.type),
        # what --weights packed would hold (computed, not built): FP8 matrices as released too
        "packed_layout_expected_bytes": expected_resident(cfg, specs, "packed", device.type)["expected_resident_bytes"],
        "replicated_digest": replicated_digest(model),
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()
        load["allocated_after_build_bytes"] = torch.cuda.memory_allocated(device) - base
        load["reserved_after_build_bytes"] = torch.cuda.memory_reserved(device)
        load["allocated_over_released"] = load["allocated_after_build_bytes"] / load["released_bytes"]
    load["resident_over_released"] = load["resident_bytes"] / load["released_bytes"]
    load["resident_over_expected"] = load["resident_bytes"] / load["expected_resident_bytes"]
    return model, load


def replicated_digest(model: Transformer) -> str:
    """sha256 of a few replicated weights (embedding rows, layer 0's router gate and first attention
    projection's rows): equal on every rank when the ranks drew the same replicated tensors."""
    h = hashlib.sha256()
    block = model.blocks[0]
    for t in (model.embed[:64], block.ffn.gate[:8], block.attn.wq_a.weight[:8]):
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Probe:
    """A rank's measurements, published to the rank group's store after each forward (rank 0 reads
    every rank's): the EP collectives' times (``CommTimer``), rows, and the allocator's peaks."""

    def __init__(self, model: Transformer, rank: int, device: torch.device, store: Any):
        self.rank, self.device, self.store = rank, device, store
        self.timer = CommTimer(device)
        self.layers = 0
        for block in model.blocks:
            if block is not None and isinstance(getattr(block, "ffn", None), EPMoE):
                block.ffn.comm_timer = self.timer
                self.layers += 1
        self.forwards = 0
        inner = model.forward

        def forward(chunks: list, *args: Any, **kwargs: Any) -> Any:
            out = inner(chunks, *args, **kwargs)
            self.publish(sum(int(c.token_ids.numel()) for c in chunks))
            return out

        model.forward = forward  # the instance's forward: rank 0's proxy and rank 1's loop call it

    def publish(self, rows: int) -> None:
        stats: dict[str, Any] = {"rows": rows, "comm": self.timer.collect(), "moe_layers": self.layers}
        if self.device.type == "cuda":
            stats["max_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            stats["max_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
        self.store.set(KEY.format(rank=self.rank, what=f"forward/{self.forwards}"), json.dumps(stats))
        self.forwards += 1


def rank_model(spec: RankSpec, rank: int, world: int) -> Transformer:
    """``RankSpec.builder`` of ranks 1..N-1 (run by ``python -m asympd.parallel.worker``): build this
    rank's share, shard its MoE layers (the worker's own ``shard_moe`` then finds them done), attach
    the probe, and publish the load figures."""
    import torch.distributed as dist

    s = Settings(**spec.builder_args)
    device = rank_device(spec.device, rank)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    model, load = build_rank(s, rank, world, device)
    shard_moe(model, rank, world)
    Probe(model, rank, device, store)
    store.set(KEY.format(rank=rank, what="load"), json.dumps(load))
    return model


# ---- the floor -------------------------------------------------------------------------------------


def prefill_flops(cfg: ModelConfig, n: int, ep: int) -> dict[str, float]:
    """FLOPs of the asymmetric prefill role over an ``n``-token prompt (rows [0, n - W)): per layer
    below K its attention sublayer (projections, attention over W + top-k slots, compressor and
    indexer where it has them: ``bench.common.attention_work``), its MoE (router, 6 routed experts
    and the shared one: ``moe_work``), the two mHC mixes and, in Engram layers, the Engram ``wkv``
    GEMM; plus layer K's KV path (compressor and indexer keys). ``per_gpu`` splits the MoE over the
    ``ep`` ranks and replicates the rest, as the EP worker computes it."""
    from bench.common import attention_work, moe_work

    rows = max(0, n - cfg.window_size)
    k = cfg.last_kv_source
    attn = moe = other = 0.0
    for layer in range(k):
        attn += attention_work(cfg, layer, [dict(n=1, q=rows, start=0)])["flops"]
        moe += moe_work(cfg, rows, "bf16")["flops"]
        other += 2 * 2 * rows * (2 + cfg.hc_mult) * cfg.hc_mult * cfg.hc_mult * cfg.dim  # hc_{attn,ffn}_fn
        if layer in cfg.engram_layer_ids:
            other += 2 * rows * cfg.dim * (cfg.hc_mult + 1) * cfg.n_hash_cols * cfg.engram_head_dim  # its wkv
    ratio = cfg.ratio(k)
    kv_path = 2 * rows * (cfg.dim * cfg.head_dim * (2 if ratio > 1 else 1) + cfg.head_dim * cfg.index_head_dim)
    replicated = attn + other + kv_path
    return {
        "rows": rows,
        "attention": attn,
        "moe": moe,
        "other": other + kv_path,
        "total": replicated + moe,
        "per_gpu": replicated + moe / ep,
    }


def floor(cfg: ModelConfig, n: int, ep: int, wall_s: float) -> dict[str, Any]:
    """Prompt tokens per second per GPU bound by FLOPs at the H200's dense datasheet rates, and the
    fraction of it reached in ``wall_s``: ``model`` counts each FLOP once over ``ep`` GPUs (the
    bound with attention split too), ``replicated`` as this worker computes (attention on every GPU)."""
    from asympd.plan.gpus import GPUS

    gpu = GPUS["H200"]
    f = prefill_flops(cfg, n, ep)
    out: dict[str, Any] = {"flops": f, "gpu": gpu.name, "tokens_per_s_per_gpu": {}, "fraction": {}}
    for rate_name, tflops in (("bf16", gpu.bf16_tflops), ("fp8", gpu.fp8_tflops)):
        for basis, flops in (("model", f["total"] / ep), ("replicated", f["per_gpu"])):
            bound = n / (flops / (tflops * 1e12)) / ep if flops else math.inf
            out["tokens_per_s_per_gpu"][f"{basis}_{rate_name}"] = bound
            out["fraction"][f"{basis}_{rate_name}"] = (n / wall_s / ep) / bound if wall_s > 0 else None
    return out


# ---- the run ---------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefix_digest(state: Any) -> str:
    """sha256 of the exported PrefixState as it goes on the wire (``serialize``)."""
    return hashlib.sha256(state.serialize()).hexdigest()


class Run:
    """Rank 0: the ranks, the engine, and one prompt at a time through it."""

    def __init__(self, s: Settings):
        import torch.distributed as dist

        from asympd.engine.engine import EngineConfig, LLMEngine
        from asympd.engine.scheduler import SchedulerConfig
        from asympd.parallel.executor import DistributedExecutor
        from asympd.parallel.launch import RankGroup

        self.s, self.cfg = s, model_config(s.smoke)
        self.device = rank_device(s.device, 0)
        self.executor = None
        t0 = time.perf_counter()
        if s.ep > 1:
            # the children import bench.prefill_role (RankSpec.builder): the repository on their path
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            spec = RankSpec(
                checkpoint="(none: each rank draws its tensors on its device, bench/prefill_role.py)",
                role="prefill",
                device=s.device,
                dtype="bfloat16",
                weights=s.weights,
                builder=BUILDER,
                builder_args=dataclasses.asdict(s),
            )
            self.executor = DistributedExecutor(RankGroup(s.ep, spec))  # rank 1 draws while we do
            self.store = self.executor.group.store
        else:
            self.store = dist.HashStore()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            model, load = build_rank(s, 0, s.ep, self.device)
            log(f"rank 0: drew and built {load['bytes_drawn'] / 1e9:.2f} GB in {load['draw_and_build_s']:.1f} s")
            if s.ep > 1:
                shard_moe(model, 0, s.ep)
            self.probe = Probe(model, 0, self.device, self.store)
            self.store.set(KEY.format(rank=0, what="load"), json.dumps(load))
            longest = max((*s.lengths, *s.warmup))
            block = 16
            sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=s.step_tokens)
            ecfg = EngineConfig(
                role="prefill",
                mode="asymmetric",
                block_size=block,
                num_blocks=-(-(longest + s.step_tokens) // block) + 16,
                enable_prefix_caching=False,
                scheduler=sc,
            )
            self.engine = LLMEngine(model, ecfg)
            if self.executor is not None:
                self.executor.attach(self.engine)  # waits for the other ranks' builds
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - t0
        self.loads = [json.loads(self.store.get(KEY.format(rank=r, what="load"))) for r in range(s.ep)]
        for ld in self.loads:
            log(
                f"rank {ld['rank']} ({ld['device']}): experts [{ld['experts'][0]}, {ld['experts'][1]}), "
                f"drew and built {ld['bytes_drawn'] / 1e9:.2f} GB in {ld['draw_and_build_s']:.1f} s; resident "
                f"{ld['resident_bytes'] / 1e9:.3f} GB = {ld['resident_over_released']:.4f} x released "
                f"{ld['released_bytes'] / 1e9:.3f} GB ({ld['resident_over_expected']:.6f} x the layout's figure)"
            )
        log(f"ranks ready in {self.start_s:.1f} s")
        self.gen = torch.Generator().manual_seed(s.seed + 1)

    def prompt(self, n: int, tag: str) -> dict[str, Any]:
        """One ``n``-token random prompt through P until its prefix is exported; every rank's
        measurements over the forwards it took."""
        from asympd.engine.sampling import SamplingParams

        ids = torch.randint(3, self.cfg.vocab_size, (n,), generator=self.gen).tolist()
        rid = f"{tag}-{n}"
        first = self.probe.forwards
        sync(self.device)
        t0 = time.perf_counter()
        self.engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0))
        steps, state = [], None
        while self.engine.has_unfinished_requests():
            s0 = time.perf_counter()
            for out in self.engine.step():
                if out.error:
                    raise RuntimeError(f"{rid}: {out.error}")
                if out.finished:
                    state = out.exported_state()  # waits for the export's copy
            steps.append(round((time.perf_counter() - s0) * 1e3, 2))
        sync(self.device)
        wall = time.perf_counter() - t0
        self.engine.release_transfer(rid)
        forwards = range(first, self.probe.forwards)
        ranks = [self._rank_stats(r, forwards) for r in range(self.s.ep)]
        res: dict[str, Any] = {
            "prompt_tokens": n,
            "computed_rows": sum(f["rows"] for f in ranks[0]["forwards"]),
            "forwards": len(forwards),
            "wall_s": wall,
            "step_ms": steps,
            "prompt_tokens_per_s_per_gpu": n / wall / self.s.ep,
            "prefix_state": {
                "split": None if state is None else int(state.split),
                "wire_bytes": None if state is None else state.wire_nbytes,
                "sha256": None if state is None else prefix_digest(state),
            },
            "ranks": ranks,
            "floor": floor(self.cfg, n, self.s.ep, wall),
        }
        return res

    def _rank_stats(self, rank: int, forwards: range) -> dict[str, Any]:
        rows = [json.loads(self.store.get(KEY.format(rank=rank, what=f"forward/{i}"))) for i in forwards]
        comm: dict[str, dict[str, float]] = {}
        for f in rows:
            for kind, v in f["comm"].items():
                c = comm.setdefault(kind, {"calls": 0, "ms": 0.0})
                c["calls"] += v["calls"]
                c["ms"] += v["ms"]
        layer_calls = sum(f["moe_layers"] for f in rows)  # EP MoE layers run over the prompt's forwards
        per_layer = {k: v["ms"] / layer_calls for k, v in comm.items()} if layer_calls else {}
        a2a = sum(per_layer.get(k, 0.0) for k in ("dispatch", "combine", "gather"))
        out: dict[str, Any] = {
            "rank": rank,
            "forwards": [{"rows": f["rows"], "comm": f["comm"]} for f in rows],
            "comm_ms": comm,
            "comm_ms_per_layer_forward": per_layer,
            "ep_comm_ms_per_layer_forward": a2a,
            "ep_comm_share_of_moe_layer": a2a / per_layer["layer"] if per_layer.get("layer") else None,
        }
        if rows and "max_allocated_bytes" in rows[-1]:
            out["peak_allocated_bytes"] = rows[-1]["max_allocated_bytes"]
            out["peak_reserved_bytes"] = rows[-1]["max_reserved_bytes"]
        return out

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None


def released_figures(cfg: ModelConfig, ep: int) -> dict[str, Any]:
    """``asympd memory``'s prefill-role figures: the released V4.1-Flash and this run's config (the
    same GPU bytes: only the host-memory Engram tables differ), and per rank (``ep_resident_gb``)."""
    from asympd.config import v41_flash
    from asympd.parallel.ep import ep_resident_gb
    from asympd.plan.memory import memory_report

    prefill = memory_report(v41_flash())["roles"]["prefill"]
    ours = memory_report(cfg)["roles"]["prefill"]
    return {
        "asympd_memory_v41_flash_prefill_resident_bytes": prefill["resident_bytes"],
        "asympd_memory_v41_flash_prefill_engram_table_bytes": prefill["engram_table_bytes"],
        "this_config_prefill_resident_bytes": ours["resident_bytes"],
        "this_config_engram_table_bytes": ours["engram_table_bytes"],
        "per_rank_gb": ep_resident_gb(cfg, "prefill", ep),
    }


def run(s: Settings) -> dict[str, Any]:
    started = time.time()
    r = Run(s)
    res: dict[str, Any] = {
        "config": "tiny, top-3 routing (smoke)"
        if s.smoke
        else "V4.1-Flash 40-layer schedule at true widths, distinct random weights per layer; Engram tables "
        f"{r.cfg.engram_num_embeddings} rows (host memory; release: 384M each); no draft blocks, no vision",
        "settings": dataclasses.asdict(s),
        "ep": s.ep,
        "backend": "nccl" if r.device.type == "cuda" else "gloo",
        "mode": "asymmetric",
        "engine_role": "prefill",
        "window": r.cfg.window_size,
        "n_layers_prefill": r.cfg.last_kv_source,
        "start_s": r.start_s,
        "loads": r.loads,
        "released": released_figures(r.cfg, s.ep),
        "warmup": [],
        "prompts": [],
        "skipped": [],
        "timing_note": "wall from add_request until the exported prefix state's copy is done; after a warm-up "
        "(Triton compiles excluded); comm: CUDA events around each collective (device time, waits included)",
    }

    def save() -> None:
        res["wall_s"] = time.time() - started
        path = record(s.result_name, res, started)
        log(f"wrote {path}")

    try:
        for n in s.warmup:
            w = r.prompt(n, "warmup")
            res["warmup"].append({k: w[k] for k in ("prompt_tokens", "wall_s", "forwards")})
            log(f"warm-up {n} tokens: {w['wall_s']:.2f} s")
        last: tuple[int, float] | None = None
        for n in s.lengths:
            elapsed = time.time() - started
            predicted = last[1] * n / last[0] * 1.5 if last else 0.0  # attention grows with the prefix
            if elapsed + predicted > s.budget_s:
                res["skipped"].append({"prompt_tokens": n, "predicted_s": predicted, "elapsed_s": elapsed})
                log(f"skip {n} tokens: predicted {predicted:.0f} s after {elapsed:.0f} s (budget {s.budget_s:.0f} s)")
                continue
            p = r.prompt(n, "run")
            res["prompts"].append(p)
            last = (n, p["wall_s"])
            comm = max(x["ep_comm_ms_per_layer_forward"] for x in p["ranks"])
            peak = [x.get("peak_allocated_bytes", 0) / 1e9 for x in p["ranks"]]
            log(
                f"prompt {n} tokens: {p['wall_s']:.2f} s over {p['forwards']} forwards, "
                f"{p['prompt_tokens_per_s_per_gpu']:.0f} prompt tokens/s per GPU "
                f"({p['floor']['fraction']['model_bf16']:.3f} of the bf16 FLOP floor); EP comm "
                f"{comm:.3f} ms per layer-forward (slowest rank); peak allocated "
                + ", ".join(f"{g:.1f}" for g in peak)
                + " GB"
            )
            save()
    finally:
        r.close()
    save()
    return res


def parse(argv: list[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny config on CPU, 2 gloo ranks: plumbing only")
    p.add_argument("--ep", type=int, default=2, help="ranks (one GPU each on CUDA); 1: the single-rank reference")
    p.add_argument("--lengths", help="prompt lengths, comma-separated (default 4096,16384,65536)")
    p.add_argument("--warmup", help="warm-up prompt lengths (default 4096,16384)")
    p.add_argument("--step-tokens", type=int, help="P's chunk, rows per step (default 16384)")
    p.add_argument("--weights", default="packed-experts", help="loader layout: packed-experts (CUDA default) | packed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--name", default="", help="result name (default prefill_role_x2 / prefill_role_smoke)")
    a = p.parse_args(argv)
    kw = dict(ep=a.ep, weights=a.weights, seed=a.seed, budget_s=a.budget_s, name=a.name)
    s = Settings.smoke_defaults(**kw) if a.smoke else Settings(**kw)

    def ints(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(",") if x)

    if a.lengths is not None:
        s.lengths = ints(a.lengths)
    if a.warmup is not None:
        s.warmup = ints(a.warmup)
    if a.step_tokens is not None:
        s.step_tokens = a.step_tokens
    if s.device == "cuda" and torch.cuda.device_count() < s.ep:
        raise SystemExit(f"--ep {s.ep} needs {s.ep} GPUs, found {torch.cuda.device_count()}")
    return s


def main(argv: list[str] | None = None) -> int:
    s = parse(argv)
    if s.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
