"""What each role holds on a GPU and what is left for KV, from the checkpoint schema alone.

Sizes are the released storage formats (FP8 weights with UE8M0 tiles, packed FP4 experts), in
decimal GB as vendors state HBM. Engram tables are counted separately: in practice they live in
host memory (docs/model.md §4), so they are not resident unless ``engram_on_gpu`` says so. The vision
tower is excluded (text-only serving).

Assumption (named, overridable): a fixed ``reserve_gb`` per GPU for activations, CUDA context,
communication buffers and allocator slack; everything else after the weights holds KV.
"""

from __future__ import annotations

import math
from typing import Any

from asympd.config import ModelConfig
from asympd.model.schema import ROLE_PARTS, ROLES, Part, TensorSpec, checkpoint_schema

GB = 1e9
GPUS_GB = {"H200": 141.0, "B200": 180.0, "B300": 288.0}  # HBM per GPU, decimal GB as vendors state
DEFAULT_RESERVE_GB = 10.0
DEFAULT_CONTEXT_TOKENS = 32768
# SWA cache row per layer and token: docs/model.md §4 gives ~528-584 B; take the upper end (conservative)
SWA_BYTES_PER_LAYER_TOKEN = 584
PARTS = (Part.EMBEDDING, Part.ENCODER, Part.KV_PATH, Part.DECODER, Part.HEAD, Part.DRAFT)


def compressed_kv_bytes_per_token(cfg: ModelConfig) -> float:
    """Compressed main KV + index keys per prompt token, in the released cache formats: main KV
    NVFP4 (head_dim/2 B of codes + one e4m3 scale per 16) and index keys MXFP4 (index_head_dim/2 B
    + one UE8M0 scale per 32), one entry per ``ratio`` tokens per KV source. 890 B for V4.1-Flash."""
    main = cfg.head_dim // 2 + cfg.head_dim // 16
    index = cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    return sum((main + index) / cfg.ratio(s) for s in cfg.kv_source_layers)


def swa_layers(cfg: ModelConfig, role: str) -> int:
    """Layers that keep a sliding window for a request in this role: the prefill role runs
    attention only below the last KV source; the others run every layer and the draft blocks."""
    if role == "prefill":
        return cfg.last_kv_source
    return cfg.n_layers + (cfg.n_mtp_layers if cfg.dspark_block_size else 0)


def memory_report(
    cfg: ModelConfig,
    *,
    reserve_gb: float = DEFAULT_RESERVE_GB,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    engram_on_gpu: bool = False,
    gpus_gb: dict[str, float] | None = None,
    swa_bytes_per_layer_token: int = SWA_BYTES_PER_LAYER_TOKEN,
    schema: list[TensorSpec] | None = None,
) -> dict[str, Any]:
    """Resident bytes per role and part, and per GPU whether each role fits and its KV room.

    ``kv_tokens``: compressed-KV tokens the room holds (SWA aside); ``requests_at_context``: how
    many requests of ``context_tokens`` fit, each with its bounded SWA windows. ``schema``:
    ``checkpoint_schema(cfg)`` where the caller reads it too (building it is most of the time here)."""
    gpus_gb = GPUS_GB if gpus_gb is None else gpus_gb
    part_bytes = {p: 0 for p in Part}
    for spec in checkpoint_schema(cfg) if schema is None else schema:
        part_bytes[spec.part] += spec.nbytes
    per_token = compressed_kv_bytes_per_token(cfg)
    roles: dict[str, Any] = {}
    for role in ROLES:
        parts = {p.value: part_bytes[p] for p in PARTS if p in ROLE_PARTS[role]}
        tables = part_bytes[Part.ENGRAM_TABLE] if Part.ENGRAM_TABLE in ROLE_PARTS[role] else 0
        roles[role] = {
            "parts": parts,
            "weights_bytes": sum(parts.values()),
            "engram_table_bytes": tables,
            "resident_bytes": sum(parts.values()) + (tables if engram_on_gpu else 0),
            "swa_bytes_per_request": swa_layers(cfg, role) * cfg.window_size * swa_bytes_per_layer_token,
        }
    gpus: dict[str, Any] = {}
    reserve = int(reserve_gb * GB)
    for gpu, cap_gb in gpus_gb.items():
        cap = int(cap_gb * GB)
        per_role = {}
        for role, r in roles.items():
            room = cap - reserve - r["resident_bytes"]
            fits = room > 0
            room = max(room, 0)
            per_request = context_tokens * per_token + r["swa_bytes_per_request"]
            per_role[role] = {
                "fits": fits,
                "kv_free_bytes": room,
                "kv_tokens": math.floor(room / per_token) if per_token else 0,
                "requests_at_context": math.floor(room / per_request),
            }
        gpus[gpu] = {"capacity_bytes": cap, "roles": per_role}
    return {
        "parts": {p.value: part_bytes[p] for p in PARTS},
        "engram_table_bytes": part_bytes[Part.ENGRAM_TABLE],
        "vision_excluded_bytes": part_bytes[Part.VISION],
        "roles": roles,
        "kv": {
            "compressed_bytes_per_token": per_token,
            "swa_bytes_per_layer_token": swa_bytes_per_layer_token,
            "window_size": cfg.window_size,
            "context_tokens": context_tokens,
        },
        "assumptions": {
            "reserve_gb": reserve_gb,
            "engram_on_gpu": engram_on_gpu,
            "units": "bytes; GB below are decimal (1e9)",
            "vision": "vision tower not counted; only the VL gate biases appear in the schema",
        },
        "gpus": gpus,
    }


def _gb(n: float) -> str:
    return f"{n / GB:8.2f}"


def format_memory_report(report: dict[str, Any]) -> str:
    """A human-readable table of ``memory_report``'s result."""
    lines = []
    roles = list(report["roles"])
    lines.append("resident weights (GB, released formats; Engram tables listed separately)")
    lines.append(f"  {'part':<16}" + "".join(f"{r:>10}" for r in roles))
    for part in report["parts"]:
        row = [report["roles"][r]["parts"].get(part) for r in roles]
        lines.append(f"  {part:<16}" + "".join(f"  {_gb(b)}" if b is not None else f"{'-':>10}" for b in row))
    for label, key in (("= weights", "weights_bytes"), ("engram tables", "engram_table_bytes")):
        lines.append(f"  {label:<16}" + "".join(f"  {_gb(report['roles'][r][key])}" for r in roles))
    a = report["assumptions"]
    where = "on GPU" if a["engram_on_gpu"] else "in host memory"
    lines.append(
        f"  {'= resident':<16}"
        + "".join(f"  {_gb(report['roles'][r]['resident_bytes'])}" for r in roles)
        + f"   (Engram tables {where})"
    )
    kv = report["kv"]
    lines.append("")
    lines.append(
        f"KV: {kv['compressed_bytes_per_token']:.0f} B/token compressed; SWA {kv['swa_bytes_per_layer_token']} B"
        f" per layer-token x window {kv['window_size']} per request"
        + "".join(f"; {r} {report['roles'][r]['swa_bytes_per_request'] / 2**20:.2f} MiB" for r in roles)
    )
    lines.append(
        f"per GPU: {a['reserve_gb']:g} GB reserved (activations, CUDA context, buffers);"
        f" requests at {kv['context_tokens']} tokens of context"
    )
    lines.append(f"  {'gpu':<6}{'role':<9}{'fits':>5}{'KV room GB':>12}{'KV Mtokens':>12}{'requests':>10}")
    for gpu, g in report["gpus"].items():
        for role, r in g["roles"].items():
            lines.append(
                f"  {gpu:<6}{role:<9}{'yes' if r['fits'] else 'no':>5}{r['kv_free_bytes'] / GB:>12.2f}"
                f"{r['kv_tokens'] / 1e6:>12.2f}{r['requests_at_context']:>10}"
            )
    return "\n".join(lines)
