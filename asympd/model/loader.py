"""Build a role's model from checkpoint tensors in their storage formats.

Weight layouts (``weights=``), all the same function:
- ``dequantized`` (the CPU reference): FP8 and FP4 weights are dequantized once here (exactly: they
  fit bf16) and their GEMM inputs keep the reference's FP8 activation quantization at run time;
- ``packed``: FP8 matrices and MXFP4 experts stay as stored and run through the Triton GEMMs of
  ``gemm_kernels`` (``packed.py``), so a role holds exactly the bytes ``asympd memory`` counts;
- ``reference``: the CPU reference modules, on any device;
- ``packed-experts`` (the default on CUDA): MXFP4 experts packed (97 % of a layer's bytes, and the
  packed MoE is the faster one at decode sizes), the FP8 attention/shared-expert matrices expanded to
  bf16 (2 % of the bytes; cuBLAS on bf16 beats the FP8-tile kernel at most sizes measured,
  docs/performance.md), 2.5 % over the released bytes in all (both roles).
In the packed layouts the Engram tables stay in (pinned) host memory and only looked-up rows move.
Engram tables stay FP8 in every layout. The LM head is held in fp32, as the reference holds it (a bf16 GPU
model keeps its stored bf16 values and accumulates in fp32: the same products); logits are fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asympd.config import ModelConfig
from asympd.model.attention import Attention
from asympd.model.dspark import DSpark, DSparkAttention
from asympd.model.dtypes import resolve_dtype
from asympd.model.engram import Engram
from asympd.model.moe import MoE, expert_range
from asympd.model.ops import QLinear
from asympd.model.packed import FP8TileLinear, PackedExperts
from asympd.model.quant import dequant_fp4, dequant_fp8_tiles
from asympd.model.schema import ROLES
from asympd.model.shared_experts import alias, is_aliased
from asympd.model.shared_experts import source_layer as shared_source_layer
from asympd.model.transformer import Block, Transformer
from asympd.model.vision import VisionTower

ATTN_MATRICES = (
    "wq_a",
    "wq_b",
    "wkv",
    "wo_a",
    "wo_b",
    "compressor.wkv",
    "compressor.wgate",
    "indexer.wq_b",
    "indexer.weights_proj",
    "indexer.wk",
)
ATTN_VECTORS = ("q_norm.weight", "kv_norm.weight", "attn_sink", "compressor.norm.weight", "indexer.k_norm.weight")


class _Reader:
    """Takes tensors out of the loaded dict by name, dequantizing by storage dtype (or, ``packed``,
    keeping FP8 matrices and FP4 experts as stored)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        layout: Layout,
        shared_experts: int | None = None,
    ):
        self.t, self.dtype, self.device = tensors, dtype, device
        self.packed, self.packed_linears = layout.experts, layout.linears
        self.kernels = layout.kernels and device.type == "cuda"  # build the CUDA modules (cuda_ops.py)
        # matrices the reference multiplies in fp32 whose operands are bf16 values (the compressor's,
        # the head) stay bf16 on a bf16 GPU model: fp32 accumulation, the same products (ops.linear_f32)
        self.bf16_for_fp32 = device.type == "cuda" and dtype == torch.bfloat16
        self.shared_experts = shared_experts  # benchmark checkpoints: the layer all routed experts are
        self._built: dict[tuple, Any] = {}

    def experts(self, prefix: str, key: tuple, make: Callable[[str], Any]) -> Any:
        """``make(prefix)``'s routed-expert operand; where layers share experts (shared_experts.py),
        built once from the source layer and handed to every layer."""
        prefix = alias(prefix, self.shared_experts)
        if self.shared_experts is None:
            return make(prefix)
        if (prefix, *key) not in self._built:
            self._built[(prefix, *key)] = make(prefix)
        return self._built[(prefix, *key)]

    def has(self, name: str) -> bool:
        return f"{name}.weight" in self.t or name in self.t

    def matrix(self, name: str, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, bool]:
        """(dequantized weight, whether it was stored quantized)."""
        w = self.t[f"{name}.weight"]
        scale = self.t.get(f"{name}.scale")
        if w.dtype == torch.float8_e4m3fn:
            out, quantized = dequant_fp8_tiles(w, scale), True
        elif w.dtype == torch.int8:
            out, quantized = dequant_fp4(w, scale), True
        else:
            out, quantized = w, False
        return out.to(device=self.device, dtype=dtype or self.dtype), quantized

    def linear(self, name: str, dtype: torch.dtype | None = None) -> QLinear | FP8TileLinear:
        w = self.t[f"{name}.weight"]
        if self.packed_linears and w.dtype == torch.float8_e4m3fn:
            return FP8TileLinear(w.to(self.device), self.t[f"{name}.scale"].to(self.device), True, dtype or self.dtype)
        w, quantized = self.matrix(name, dtype)
        if self.kernels:
            from asympd.model.cuda_ops import FastQLinear

            return FastQLinear(w, quantized)
        return QLinear(w, quantized)

    def fp4_experts(self, prefix: str, experts: range, projs: tuple[str, ...]) -> PackedExperts:
        """The packed projection(s) of ``experts``, ``projs`` stacked along the output dim."""
        parts = []
        for e in experts:
            names = [f"{prefix}experts.{e}.{p}" for p in projs]
            parts.append(
                (
                    torch.cat([self.t[n + ".weight"] for n in names]),
                    torch.cat([self.t[n + ".scale"].view(torch.uint8) for n in names]),
                )
            )
        return PackedExperts.stack(parts, self.device)

    def host_table(self, name: str) -> torch.Tensor:
        """An Engram table kept in host memory (pinned when a GPU will read it)."""
        t = self.t[name]
        return t.pin_memory() if torch.cuda.is_available() else t

    def vector(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.t[name]
        return t.to(device=self.device, dtype=dtype or (torch.float32 if t.dtype == torch.float32 else self.dtype))

    def raw(self, name: str) -> torch.Tensor:
        return self.t[name].to(self.device)


def _attention(
    cfg: ModelConfig, layer: int, r: _Reader, prefix: str, round_probs: bool, cls: type[Attention] | None = None
) -> Attention:
    cls = cls or Attention
    w: dict[str, Any] = {}
    for name in ATTN_MATRICES:
        if not r.has(prefix + name):
            continue
        # the ratio>1 compressor pools in fp32, so its weights are promoted like the reference's
        # (kept bf16 where its GEMM accumulates bf16 products in fp32 instead: _Reader.bf16_for_fp32)
        fp32 = name.startswith("compressor.") and cfg.ratio(layer) > 1 and not r.bf16_for_fp32
        lin = r.linear(prefix + name, torch.float32 if fp32 else None)
        if name == "wo_a":
            lin.quantized = False  # applied as a grouped einsum on the bf16 weight, no act quant
        w[name] = lin
    for name in ATTN_VECTORS:
        if prefix + name in r.t:
            w[name.removesuffix(".weight")] = r.vector(prefix + name)
    attn = cls(cfg, layer, w, round_probs)
    if r.kernels:
        from asympd.model.cuda_ops import CUDA_KERNELS

        attn.kernels = CUDA_KERNELS
    attn.freqs = attn.freqs.to(r.device)  # RoPE tables beside the weights (no copy per step)
    return attn


def _moe(cfg: ModelConfig, layer: int, r: _Reader, prefix: str, ep: tuple[int, int] | None = None) -> MoE:
    """``ep=(rank, world)``: only that rank's routed experts (``expert_range``), as loaded."""
    n_exp, _ = cfg.moe_shape(layer)
    lo, hi = expert_range(n_exp, *ep) if ep else (0, n_exp)
    if r.packed:
        from asympd.model.cuda_ops import FastMoE

        shared = prefix + "shared_experts."
        if r.packed_linears:
            s13 = r.linear(shared + "w1")  # w1 and w3 share one GEMM: their tile rows stack exactly
            s13.weight = torch.cat([s13.weight, r.t[shared + "w3.weight"].to(r.device)])
            s13.scale = torch.cat([s13.scale, r.t[shared + "w3.scale"].to(r.device).view(torch.uint8)])
            s13.quantized, s13.out_features = False, s13.weight.size(0)
            s2 = r.linear(shared + "w2")
            s2.quantized = False
        else:
            s13 = torch.cat([r.matrix(shared + "w1")[0], r.matrix(shared + "w3")[0]])
            s2 = r.matrix(shared + "w2")[0]
        gate = {
            "weight": r.vector(prefix + "gate.weight", torch.float32),
            "bias": r.vector(prefix + "gate.bias", torch.float32),
        }
        if r.has(prefix + "gate.bias_vl"):
            gate["bias_vl"] = r.vector(prefix + "gate.bias_vl", torch.float32)
        w13 = r.experts(prefix, (lo, hi, "w13"), lambda p: r.fp4_experts(p, range(lo, hi), ("w1", "w3")))
        w2 = r.experts(prefix, (lo, hi, "w2"), lambda p: r.fp4_experts(p, range(lo, hi), ("w2",)))
        return FastMoE.packed(cfg, layer, gate, w13, w2, s13, s2, (lo, hi))
    w: dict[str, torch.Tensor] = {
        "gate.weight": r.vector(prefix + "gate.weight", torch.float32),
        "gate.bias": r.vector(prefix + "gate.bias", torch.float32),
    }
    if r.has(prefix + "gate.bias_vl"):  # read with the vision tower: image-span rows route with it
        w["gate.bias_vl"] = r.vector(prefix + "gate.bias_vl", torch.float32)

    def stack(p: str, proj: str) -> torch.Tensor:
        return torch.stack([r.matrix(f"{p}experts.{e}.{proj}")[0] for e in range(lo, hi)])

    for proj in ("w1", "w2", "w3"):
        w[f"experts.{proj}"] = r.experts(prefix, (lo, hi, proj), lambda p, proj=proj: stack(p, proj))
        w[f"shared_experts.{proj}"] = r.matrix(f"{prefix}shared_experts.{proj}")[0]
    if r.kernels:  # routed experts as one bf16 grouped-GEMM operand (the dequantized layout on CUDA)
        from asympd.model.cuda_ops import FastMoE

        moe = FastMoE(cfg, layer, w, (lo, hi))
        moe.convert("bf16")
        return moe
    return MoE(cfg, layer, w, (lo, hi))


def build_model(
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    role: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    hasher: Any | None = None,
    weights: str = "auto",
    ep: tuple[int, int] | None = None,
    shared_experts: int | None = None,
) -> Transformer:
    """The model of ``role`` from storage-format tensors (as ``load_tensors`` returns them).
    ``shared_experts``: benchmark checkpoints only (``shared_experts.py``): every backbone layer
    gets this layer's routed experts, built once.
    ``weights``: ``packed`` | ``packed-experts`` | ``dequantized`` | ``auto`` (packed-experts on CUDA,
    dequantized elsewhere). ``ep=(rank, world)``: every backbone MoE holds that rank's routed
    experts only (``tensors`` need hold no others); the drafter is built where its tensors are."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    device = torch.device(device)
    layout = resolve_weights(weights, device)
    packed = layout.experts
    r = _Reader(tensors, dtype, device, layout, shared_experts)
    round_probs = dtype == torch.bfloat16
    k = cfg.last_kv_source
    n_full = k if role == "prefill" else cfg.n_layers
    blocks: list[Block | None] = []
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        if layer > n_full:
            blocks.append(None)
            continue
        w: dict[str, Any] = {
            "attn_norm": r.vector(p + "attn_norm.weight"),
            "attn": _attention(cfg, layer, r, p + "attn.", round_probs),
        }
        if layer < n_full:
            w["ffn_norm"] = r.vector(p + "ffn_norm.weight")
            for sub in ("attn", "ffn"):
                for part in ("fn", "base", "scale"):
                    w[f"hc_{sub}_{part}"] = r.vector(f"{p}hc_{sub}_{part}", torch.float32)
            w["ffn"] = _moe(cfg, layer, r, p + "ffn.", ep)
        if layer in cfg.engram_layer_ids:
            e = p + "engram."
            tables = {n: (r.host_table if packed else r.raw)(e + n) for n in ("embed.weight", "embed.scale")}
            w["engram"] = Engram(
                cfg,
                {**tables, **{n: r.raw(e + n) for n in ("q_weight", "k_weight")}},
                r.linear(e + "wkv"),
            )
        blocks.append(Block(cfg, layer, w))
    embed = r.vector("embed.weight")
    norm = head = None
    if role != "prefill":
        norm = r.vector("norm.weight")
        # fp32 as the reference holds it; a bf16 GPU model keeps the stored bf16 values and multiplies
        # with fp32 accumulation instead (the same products: ops.linear_f32), half the bytes
        head = r.vector("head.weight", torch.bfloat16 if r.bf16_for_fp32 else torch.float32)
    model = Transformer(cfg, role, embed, blocks, norm, head, hasher, dtype)
    model.weights = layout.name
    if "vision.patch_embed.proj.weight" in tensors:
        from asympd.model.schema import Part, checkpoint_schema

        names = [s.name for s in checkpoint_schema(cfg) if s.part is Part.VISION and s.layer is None]
        model.vision = VisionTower(cfg, {n: tensors[n].to(device) for n in names}, dtype)
    if role != "prefill":
        model.drafter = _drafter(cfg, r, round_probs, embed, head)
    # the modules above are the CUDA ones where r.kernels (built as such, no class swaps); their fused
    # elementwise kernels are checked on this device once and registered
    if r.kernels:
        from asympd.model.cuda_ops import install_kernels

        install_kernels(device)
    return model


@dataclass(frozen=True)
class Layout:
    """Which stored formats stay packed on the device, and whether CUDA kernels replace the
    reference modules (``kernels``)."""

    name: str
    experts: bool
    linears: bool
    kernels: bool = True


LAYOUTS = {
    "dequantized": Layout("dequantized", False, False),
    "packed-experts": Layout("packed-experts", True, False),
    "packed": Layout("packed", True, True),
    "reference": Layout("reference", False, False, kernels=False),  # the CPU modules, on any device
}


def resolve_weights(weights: str, device: torch.device) -> Layout:
    """The layout ``weights`` names on ``device``. ``auto``: packed-experts on CUDA, dequantized
    elsewhere. ``reference`` keeps the CPU reference modules on CUDA too."""
    if weights == "auto":
        weights = "packed-experts" if device.type == "cuda" else "dequantized"
    if weights not in LAYOUTS:
        raise ValueError(f"weights must be auto or one of {', '.join(LAYOUTS)}, got {weights!r}")
    layout = LAYOUTS[weights]
    if layout.experts:
        from asympd.model.gemm_kernels import AVAILABLE

        if not AVAILABLE:
            raise RuntimeError(f"weights={weights!r} needs Triton (pip install triton)")
    return layout


def _drafter(cfg: ModelConfig, r: _Reader, round_probs: bool, embed: torch.Tensor, head: torch.Tensor) -> DSpark | None:
    """The DSpark draft blocks (``mtp.*``), sharing the target's embedding and LM head; None when
    the config has no draft blocks or the tensors were not loaded."""
    if not (cfg.dspark_block_size and cfg.n_mtp_layers) or "mtp.0.main_proj.weight" not in r.t:
        return None
    blocks = []
    for i in range(cfg.n_mtp_layers):
        layer, p = cfg.n_layers + i, f"mtp.{i}."
        w: dict[str, Any] = {
            "attn_norm": r.vector(p + "attn_norm.weight"),
            "ffn_norm": r.vector(p + "ffn_norm.weight"),
            "attn": _attention(cfg, layer, r, p + "attn.", round_probs, DSparkAttention),
            "ffn": _moe(cfg, layer, r, p + "ffn."),
        }
        for sub in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                w[f"hc_{sub}_{part}"] = r.vector(f"{p}hc_{sub}_{part}", torch.float32)
        blocks.append(Block(cfg, layer, w))
    last = f"mtp.{cfg.n_mtp_layers - 1}."
    return DSpark(
        cfg,
        blocks,
        main_proj=r.linear("mtp.0.main_proj"),
        main_norm=r.vector("mtp.0.main_norm.weight"),
        norm=r.vector(last + "norm.weight"),
        markov_embed=r.vector(last + "markov_head.embed.weight"),
        markov_head=r.vector(last + "markov_head.head.weight", torch.float32),
        confidence_proj=r.vector(last + "confidence_head.proj.weight", torch.float32),
        embed=embed,
        head=head,
        dtype=r.dtype,
    )


def load_model(
    checkpoint: str | Path,
    role: str = "full",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = "auto",
    weights: str = "auto",
    ep: tuple[int, int] | None = None,
    vision: bool | None = None,
    shared_experts: bool = False,
) -> Transformer:
    """Load a role from a checkpoint directory; ``.load_report`` says what was read.
    ``ep=(rank, world)``: rank ``rank`` of an expert-parallel worker, which reads only its own
    routed experts (and, past rank 0, no drafter: it runs on rank 0). ``vision`` (default: whether
    the config has a tower) also reads the vision tower and the VL gate biases. ``shared_experts``:
    allow a benchmark checkpoint whose layers share layer 0's routed experts (``shared_experts.py``;
    refused otherwise)."""
    from asympd.model.checkpoint import load_config, load_tensors

    dtype = resolve_dtype(dtype, device)

    cfg = load_config(checkpoint)
    source = shared_source_layer(checkpoint, shared_experts)
    keep = None
    if ep is not None:
        from asympd.parallel.ep import rank_tensors

        keep = rank_tensors(cfg, *ep)
    if source is not None:
        keep_rank = keep
        keep = lambda n: not is_aliased(n, source) and (keep_rank is None or keep_rank(n))  # noqa: E731
    tensors, report = load_tensors(checkpoint, cfg, role, keep=keep, vision=vision)
    hasher = None
    if cfg.engram_layer_ids:
        from asympd.model.checkpoint import CheckpointError
        from asympd.model.engram_hash import NgramHasher, compressed_token_map

        tokenizer_json = Path(checkpoint) / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise CheckpointError(f"checkpoint {str(checkpoint)!r} has no tokenizer.json: the Engram hashes need it")
        try:
            token_map, size = compressed_token_map(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise CheckpointError(f"invalid tokenizer.json in {str(checkpoint)!r}: {e}") from e
        if size != cfg.engram_compressed_vocab_size:
            raise CheckpointError(
                f"tokenizer.json compresses to {size} ids but config.json says engram_compressed_vocab_size="
                f"{cfg.engram_compressed_vocab_size}: every Engram hash would change"
            )
        hasher = NgramHasher(cfg, token_map)
    model = build_model(
        cfg, tensors, role, dtype=dtype, device=device, hasher=hasher, weights=weights, ep=ep, shared_experts=source
    )
    model.load_report = report
    model.checkpoint = str(checkpoint)
    return model
