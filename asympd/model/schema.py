"""Every tensor of the released checkpoint: name, shape, storage dtype, and which part it belongs to.

One table drives the loader, ``make-checkpoint``, ``inspect`` and the memory report, so the four
cannot disagree. Names are the reference code's parameter names (docs/model.md §4).

Roles:
- ``full``: the text model (the colocated engine, or a symmetric P).
- ``decode``: the same; the decode worker holds the whole text model plus the draft blocks.
- ``prefill``: the embedding, layers below the last KV source K, and K's *KV path*: what turns
  K's input into its compressed KV and index keys. K's input needs the mHC ``pre_mix`` that layer
  K-1's FFN computes (layer K-1 is loaded anyway), then ``attn_norm`` of K, the compressor
  (``wkv``, ``norm``, ``wgate`` when ratio > 1) and the indexer key path (``wk``, ``k_norm``); plus
  K's Engram when K is an Engram layer, since Engram writes the stream before attention reads it.
  K's own mHC coefficients (``hc_attn_*``) are *not* needed: they only mix attention's output
  back into the stream, which nothing on P reads.

The vision tower (``vision.*``, ``aligner.*``, ``image_*``) and the VL gate biases of the layers a
role runs an FFN in are ``Part.VISION``: a role reads them with ``vision=True`` (every role encodes
the images whose rows it computes first; docs/vision.md).

Torch-free: dtypes are the safetensors files' own names (``checkpoint.torch_dtype`` maps them), so
the memory report and the planner size every role without importing torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from asympd.config import ModelConfig

FP8_BLOCK = 32  # 32x32 weight tiles, one UE8M0 scale each
FP4_BLOCK = 32  # one UE8M0 scale per 32 K elements per row


@dataclass(frozen=True, slots=True)
class StorageDtype:
    """A dtype as stored in the safetensors files: its header name and bytes per element."""

    name: str
    itemsize: int

    def __str__(self) -> str:
        return self.name


BF16, F32 = StorageDtype("BF16", 2), StorageDtype("F32", 4)
FP8, UE8M0, PACKED_FP4 = StorageDtype("F8_E4M3", 1), StorageDtype("F8_E8M0", 1), StorageDtype("I8", 1)


class CheckpointError(Exception):
    """A checkpoint directory that does not hold what the config and role need."""


class Part(StrEnum):
    EMBEDDING = "embedding"
    ENCODER = "encoder_layers"
    KV_PATH = "kv_path"  # the last KV source's KV/indexer-key projection path
    DECODER = "decoder_layers"  # the rest of layer K and every layer after it
    HEAD = "head"  # final norm + LM head
    DRAFT = "draft_blocks"
    ENGRAM_TABLE = "engram_tables"
    VISION = "vision"


class Fmt(StrEnum):
    """How a weight is stored; quantized ones have a sibling ``.scale`` entry."""

    PLAIN = "plain"
    FP8 = "fp8"  # e4m3 + 32x32 UE8M0 tiles
    FP4 = "fp4"  # packed e2m1 pairs in int8 + per-32 UE8M0
    FP8_ROWS = "fp8_rows"  # Engram table: e4m3 + per-row per-32 UE8M0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: StorageDtype
    part: Part
    layer: int | None = None  # backbone layer or draft-block index (n_layers + i)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    def __init__(self) -> None:
        self.specs: list[TensorSpec] = []

    def add(self, name: str, shape: tuple[int, ...], dtype: StorageDtype, part: Part, layer: int | None = None) -> None:
        self.specs.append(TensorSpec(name, tuple(shape), dtype, part, layer))

    def linear(self, name: str, out_f: int, in_f: int, fmt: Fmt, part: Part, layer: int | None = None) -> None:
        """A Linear's weight (and scale) under the name prefix ``name`` (no ``.weight``)."""
        if fmt is Fmt.FP8:
            self.add(f"{name}.weight", (out_f, in_f), FP8, part, layer)
            self.add(f"{name}.scale", (_cdiv(out_f, FP8_BLOCK), _cdiv(in_f, FP8_BLOCK)), UE8M0, part, layer)
        elif fmt is Fmt.FP4:
            self.add(f"{name}.weight", (out_f, in_f // 2), PACKED_FP4, part, layer)
            self.add(f"{name}.scale", (out_f, in_f // FP4_BLOCK), UE8M0, part, layer)
        else:
            self.add(f"{name}.weight", (out_f, in_f), BF16, part, layer)


def weight_fmt(cfg: ModelConfig) -> Fmt:
    return Fmt.FP8 if cfg.dtype == "fp8" else Fmt.PLAIN


def expert_fmt(cfg: ModelConfig) -> Fmt:
    return Fmt.FP4 if cfg.expert_dtype == "fp4" else weight_fmt(cfg)


def _block(b: _Builder, cfg: ModelConfig, prefix: str, layer: int, part: Part, kv_path_part: Part) -> None:
    """One backbone layer or draft block. Tensors of the KV path get ``kv_path_part``."""
    d, hc = cfg.dim, cfg.hc_mult
    wf = weight_fmt(cfg)
    mix = (2 + hc) * hc
    p = f"{prefix}."
    b.add(p + "attn_norm.weight", (d,), BF16, kv_path_part, layer)
    b.add(p + "ffn_norm.weight", (d,), BF16, part, layer)
    for sub in ("attn", "ffn"):
        b.add(p + f"hc_{sub}_fn", (mix, hc * d), F32, part, layer)
        b.add(p + f"hc_{sub}_base", (mix,), F32, part, layer)
        b.add(p + f"hc_{sub}_scale", (3,), F32, part, layer)
    a = p + "attn."
    b.add(a + "attn_sink", (cfg.n_heads,), F32, part, layer)
    b.linear(a + "wq_a", cfg.q_lora_rank, d, wf, part, layer)
    b.add(a + "q_norm.weight", (cfg.q_lora_rank,), BF16, part, layer)
    b.linear(a + "wq_b", cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, wf, part, layer)
    b.linear(a + "wkv", cfg.head_dim, d, wf, part, layer)
    b.add(a + "kv_norm.weight", (cfg.head_dim,), BF16, part, layer)
    b.linear(a + "wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups, wf, part, layer)
    b.linear(a + "wo_b", d, cfg.o_groups * cfg.o_lora_rank, wf, part, layer)
    backbone = layer < cfg.n_layers
    if backbone and layer in cfg.kv_source_layers:
        b.linear(a + "compressor.wkv", cfg.head_dim, d, Fmt.PLAIN, kv_path_part, layer)
        b.add(a + "compressor.norm.weight", (cfg.head_dim,), BF16, kv_path_part, layer)
        if cfg.ratio(layer) > 1:
            b.linear(a + "compressor.wgate", cfg.head_dim, d, Fmt.PLAIN, kv_path_part, layer)
    if backbone and layer in cfg.index_source_layers:
        b.linear(a + "indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, wf, part, layer)
        b.linear(a + "indexer.weights_proj", cfg.index_n_heads, d, Fmt.PLAIN, part, layer)
        if layer in cfg.kv_source_layers:
            b.linear(a + "indexer.wk", cfg.index_head_dim, cfg.head_dim, Fmt.PLAIN, kv_path_part, layer)
            b.add(a + "indexer.k_norm.weight", (cfg.index_head_dim,), BF16, kv_path_part, layer)
    n_exp, _ = cfg.moe_shape(layer)
    f = p + "ffn."
    b.linear(f + "gate", n_exp, d, Fmt.PLAIN, part, layer)
    b.add(f + "gate.bias", (n_exp,), F32, part, layer)
    if cfg.vision_n_layers > 0:
        b.add(f + "gate.bias_vl", (n_exp,), F32, Part.VISION, layer)  # image-span rows route with it
    ef, inter = expert_fmt(cfg), cfg.moe_inter_dim
    for e in range(n_exp):
        b.linear(f + f"experts.{e}.w1", inter, d, ef, part, layer)
        b.linear(f + f"experts.{e}.w2", d, inter, ef, part, layer)
        b.linear(f + f"experts.{e}.w3", inter, d, ef, part, layer)
    b.linear(f + "shared_experts.w1", inter, d, wf, part, layer)
    b.linear(f + "shared_experts.w2", d, inter, wf, part, layer)
    b.linear(f + "shared_experts.w3", inter, d, wf, part, layer)
    if backbone and layer in cfg.engram_layer_ids:
        i = cfg.engram_layer_ids.index(layer)
        e = p + "engram."
        rows, hd = cfg.engram_num_embeddings[i], cfg.engram_head_dim
        b.add(e + "embed.weight", (rows, hd), FP8, Part.ENGRAM_TABLE, layer)
        b.add(e + "embed.scale", (rows, hd // FP8_BLOCK), UE8M0, Part.ENGRAM_TABLE, layer)
        b.linear(e + "wkv", d * (hc + 1), cfg.n_hash_cols * hd, wf, kv_path_part, layer)
        b.add(e + "q_weight", (hc, d), BF16, kv_path_part, layer)
        b.add(e + "k_weight", (hc, d), BF16, kv_path_part, layer)


def _vision(b: _Builder, cfg: ModelConfig) -> None:
    """The tower as the release names it: 2 + 8 per layer + 1 ``vision.*``, 4 ``aligner.*``, 3
    ``image_*`` (266 bf16 tensors, 0.97 GB at the released size)."""
    d, inter, p = cfg.vision_dim, cfg.vision_inter_dim, cfg.vision_patch_size
    v = Part.VISION
    b.add("vision.patch_embed.proj.weight", (d, 3 * p * p), BF16, v)
    b.add("vision.patch_embed.proj.bias", (d,), BF16, v)
    for i in range(cfg.vision_n_layers):
        q = f"vision.blocks.{i}."
        b.add(q + "norm1.weight", (d,), BF16, v)
        b.add(q + "attn.wqkv.weight", (3 * d, d), BF16, v)
        b.add(q + "attn.wqkv.bias", (3 * d,), BF16, v)
        b.add(q + "attn.wo.weight", (d, d), BF16, v)
        b.add(q + "attn.wo.bias", (d,), BF16, v)
        b.add(q + "norm2.weight", (d,), BF16, v)
        b.add(q + "mlp.w1.weight", (2 * inter, d), BF16, v)
        b.add(q + "mlp.w2.weight", (d, inter), BF16, v)
    b.add("vision.norm.weight", (d,), BF16, v)
    fold = d * cfg.vision_downsample_ratio**2
    b.add("aligner.w1.weight", (cfg.dim, fold), BF16, v)
    b.add("aligner.w1.bias", (cfg.dim,), BF16, v)
    b.add("aligner.w2.weight", (cfg.dim, cfg.dim), BF16, v)
    b.add("aligner.w2.bias", (cfg.dim,), BF16, v)
    for name in ("image_start", "image_end", "image_newline"):
        b.add(name, (cfg.dim,), BF16, v)


def checkpoint_schema(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the released checkpoint; the vision tower last (``Part.VISION``, with the VL
    gate biases), when the config has one."""
    b = _Builder()
    b.add("embed.weight", (cfg.vocab_size, cfg.dim), BF16, Part.EMBEDDING)
    k = cfg.last_kv_source
    for layer in range(cfg.n_layers):
        if layer < k:
            _block(b, cfg, f"layers.{layer}", layer, Part.ENCODER, Part.ENCODER)
        elif layer == k:
            _block(b, cfg, f"layers.{layer}", layer, Part.DECODER, Part.KV_PATH)
        else:
            _block(b, cfg, f"layers.{layer}", layer, Part.DECODER, Part.DECODER)
    b.add("norm.weight", (cfg.dim,), BF16, Part.HEAD)
    b.add("head.weight", (cfg.vocab_size, cfg.dim), BF16, Part.HEAD)
    if cfg.dspark_block_size:
        wf = weight_fmt(cfg)
        for i in range(cfg.n_mtp_layers):
            layer = cfg.n_layers + i
            _block(b, cfg, f"mtp.{i}", layer, Part.DRAFT, Part.DRAFT)
            if i == 0:
                b.linear(
                    f"mtp.{i}.main_proj", cfg.dim, cfg.dim * len(cfg.dspark_target_layer_ids), wf, Part.DRAFT, layer
                )
                b.add(f"mtp.{i}.main_norm.weight", (cfg.dim,), BF16, Part.DRAFT, layer)
            if i == cfg.n_mtp_layers - 1:
                r = cfg.dspark_markov_rank
                b.add(f"mtp.{i}.norm.weight", (cfg.dim,), BF16, Part.DRAFT, layer)
                b.add(f"mtp.{i}.markov_head.embed.weight", (cfg.vocab_size, r), BF16, Part.DRAFT, layer)
                b.add(f"mtp.{i}.markov_head.head.weight", (cfg.vocab_size, r), BF16, Part.DRAFT, layer)
                b.add(f"mtp.{i}.confidence_head.proj.weight", (1, cfg.dim + r), BF16, Part.DRAFT, layer)
    if cfg.vision_n_layers > 0:
        _vision(b, cfg)
    return b.specs


ROLES = ("full", "decode", "prefill")
ROLE_PARTS = {
    "full": {Part.EMBEDDING, Part.ENCODER, Part.KV_PATH, Part.DECODER, Part.HEAD, Part.DRAFT, Part.ENGRAM_TABLE},
    "decode": {Part.EMBEDDING, Part.ENCODER, Part.KV_PATH, Part.DECODER, Part.HEAD, Part.DRAFT, Part.ENGRAM_TABLE},
    "prefill": {Part.EMBEDDING, Part.ENCODER, Part.KV_PATH, Part.ENGRAM_TABLE},
}
VISION_PREFIXES = ("vision.", "aligner.", "image_")


def role_schema(cfg: ModelConfig, role: str, vision: bool = False) -> list[TensorSpec]:
    """The tensors a role reads; with ``vision``, the tower too and the VL gate biases of the layers
    the role runs an FFN in (below K on P; every backbone layer otherwise; the draft blocks never see
    an image row). Raises ValueError for an unknown role."""
    if role not in ROLE_PARTS:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    parts = ROLE_PARTS[role]
    ffn_layers = cfg.last_kv_source if role == "prefill" else cfg.n_layers

    def wanted(s: TensorSpec) -> bool:
        if s.part is not Part.VISION:
            return s.part in parts
        return vision and (s.layer is None or s.layer < ffn_layers)

    return [s for s in checkpoint_schema(cfg) if wanted(s)]


def is_vision_tensor(name: str) -> bool:
    return name.startswith(VISION_PREFIXES) or name.endswith(".gate.bias_vl")
