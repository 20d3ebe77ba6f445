"""Model configuration: ``ModelConfig`` mirrors the release's ``inference/config.json``.

Field names are exactly that file's keys (the reference inference code's ``ModelArgs``). The
release's root ``config.json`` (Transformers layout) is translated into these fields by
:mod:`asympd.release_config`; docs/model.md §1 describes both files. Nothing else in the
package hard-codes the layer schedule: the encoder/decoder split, the KV sources, the candidate
source and the draft blocks are all derived here from the fields, so any schedule the schema can
express works.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that does not describe a model this package can build."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    norm_eps: float = 1e-20
    # compressed KV / sparse attention; one ratio per layer, draft blocks included
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # rope (YaRN on compressed layers when original_seq_len > 0)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark draft blocks (mtp.*)
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # storage formats
    dtype: str = "fp8"
    expert_dtype: str | None = "fp4"
    # runtime limit, not a shape: sizes RoPE tables and bounds prompt + output length
    max_seq_len: int = 1 << 20
    # vision tower (vision_config; asympd/model/vision.py); 0 layers: text only
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 295936
    vision_max_wh_ratio: int | None = None
    vision_rope_theta: float = 10000.0
    image_token_id: int = 129264
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- schema derived once, used everywhere -------------------------------------------------

    @property
    def n_total_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    @property
    def last_kv_source(self) -> int:
        """The layer whose KV path ends the encoder: P computes layers below it plus its KV path."""
        return max(self.kv_source_layers)

    @property
    def encoder_layers(self) -> range:
        return range(self.last_kv_source)

    @property
    def decoder_layers(self) -> range:
        return range(self.last_kv_source + 1, self.n_layers)

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose compressed cache `layer` reads (the latest source at or below it
        with the same ratio), or None for a sliding-window-only layer."""
        if layer >= self.n_layers or self.ratio(layer) == 0:
            return None
        sources = [s for s in self.kv_source_layers if s <= layer and self.ratio(s) == self.ratio(layer)]
        return max(sources)

    def index_source_of(self, layer: int) -> int | None:
        """The index source whose top-k selection `layer` uses (itself when it is one)."""
        if layer >= self.n_layers or self.ratio(layer) == 0:
            return None
        sources = [s for s in self.index_source_layers if s <= layer and self.ratio(s) == self.ratio(layer)]
        return max(sources)

    @property
    def has_candidates(self) -> bool:
        return self.candidate_source_layer >= 0

    @property
    def n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def moe_shape(self, layer: int) -> tuple[int, int]:
        """(routed experts, activated experts) for a backbone layer or a draft block."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_n_activated_experts or self.n_activated_experts,
        )

    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise ConfigError(msg)

        self._check_types()
        bounds = (  # (fields, their least value, whether the model has that part)
            (_AT_LEAST_ONE, 1, True),
            (_VISION_AT_LEAST_ONE, 1, self.vision_n_layers > 0),
            (_ENGRAM_AT_LEAST_ONE, 1, bool(self.engram_layer_ids)),
            (_AT_LEAST_ZERO, 0, True),
        )
        small = [f"{n} = {getattr(self, n)}" for ns, low, has in bounds if has for n in ns if getattr(self, n) < low]
        if small:
            fail(f"sizes out of range: {', '.join(small)} (counts and widths are at least 1, layer counts at least 0)")
        if not self.n_activated_experts <= self.n_routed_experts:
            fail(f"n_activated_experts = {self.n_activated_experts} exceeds n_routed_experts = {self.n_routed_experts}")
        if len(self.compress_ratios) != self.n_total_layers:
            fail(
                f"compress_ratios has {len(self.compress_ratios)} entries, expected n_layers + n_mtp_layers"
                f" = {self.n_total_layers}"
            )
        if any(r not in (0, 1, 2, 4) for r in self.compress_ratios):
            fail(f"compress_ratios must be 0 (window only) or a small ratio, got {self.compress_ratios}")
        if not self.kv_source_layers:
            fail("kv_source_layers is empty: the model has no compressed KV")
        for name, layers in (
            ("kv_source_layers", self.kv_source_layers),
            ("index_source_layers", self.index_source_layers),
        ):
            for layer in layers:
                if not 0 <= layer < self.n_layers or self.compress_ratios[layer] == 0:
                    fail(f"{name} lists layer {layer}, which is not a compressed backbone layer")
        for layer in range(self.n_layers):
            if self.compress_ratios[layer] and not any(
                s <= layer and self.compress_ratios[s] == self.compress_ratios[layer] for s in self.kv_source_layers
            ):
                fail(f"layer {layer} (ratio {self.compress_ratios[layer]}) has no KV source at or below it")
            if self.compress_ratios[layer] and not any(
                s <= layer and self.compress_ratios[s] == self.compress_ratios[layer] for s in self.index_source_layers
            ):
                fail(f"layer {layer} (ratio {self.compress_ratios[layer]}) has no index source at or below it")
        if any(s not in self.index_source_layers for s in self.kv_source_layers):
            fail("every KV source must also be an index source (its indexer owns the index keys)")
        if self.has_candidates:
            if self.candidate_source_layer not in self.index_source_layers:
                fail("candidate_source_layer must be an index source")
            if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
                fail("candidate_topk_blocks and candidate_block_size must be positive with a candidate source")
        if any(lid >= self.last_kv_source for lid in self.engram_layer_ids) and self.engram_layer_ids:
            pass  # allowed by the schema; the prefill role then simply loads fewer tables
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            fail("engram_num_embeddings needs one entry per engram layer")
        if self.head_dim % 32 or self.dim % 32 or self.q_lora_rank % 32 or self.moe_inter_dim % 32:
            fail("dim, head_dim, q_lora_rank and moe_inter_dim must be multiples of 32 (FP8/FP4 block size)")
        if self.n_heads % self.o_groups:
            fail("n_heads must be divisible by o_groups")
        if self.score_func not in ("softmax", "sigmoid", "sqrtsoftplus"):
            fail(f"unknown score_func {self.score_func!r}")
        if self.n_shared_experts != 1:
            fail("exactly one shared expert is supported (as in the reference)")
        if self.dspark_block_size and self.n_mtp_layers:
            for lid in self.dspark_target_layer_ids:
                if not 0 <= lid < self.n_layers:
                    fail(f"dspark_target_layer_ids lists {lid}, not a backbone layer")
        if self.dtype not in ("fp8", "bf16"):
            fail(f"dtype must be fp8 or bf16, got {self.dtype!r}")
        if self.vision_n_layers and (self.vision_dim % (4 * self.vision_n_heads) or self.vision_max_n_token < 5):
            fail(
                "vision_dim must split into heads whose halves hold (row, column) rotary pairs (a multiple of "
                "4 * vision_n_heads), and vision_max_n_token must fit one image row (>= 5)"
            )

    def _check_types(self) -> None:
        """Every field of the type it is declared with (a JSON file can hold anything): an int is
        not a bool or a float, a float is finite, a tuple holds ints."""
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), str(f.type)
            if f.name == "extra" or (value is None and kind.endswith(" | None")):
                continue
            kind = kind.removesuffix(" | None")
            if not _TYPE_CHECKS[kind](value):
                raise ConfigError(f"{f.name} must be {_TYPE_NAMES[kind]}, got {value!r}")

    # ---- JSON -------------------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> set[str]:
        """The inference/config.json keys this class reads."""
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, strict: bool = True) -> ModelConfig:
        unknown = sorted(set(raw) - cls.field_names())
        if unknown and strict:
            raise ConfigError(f"config.json has unknown fields: {', '.join(unknown)}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in raw:
                value = raw[f.name]
                if isinstance(value, list):
                    value = tuple(value)
                elif f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)  # JSON writes 10000.0 as 10000
                kwargs[f.name] = value
        kwargs["extra"] = {k: raw[k] for k in unknown}
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """A config.json in either of the release's layouts."""
        from asympd.release_config import read_config_file

        return read_config_file(path)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_TYPE_CHECKS = {
    "int": _is_int,
    "float": lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v),
    "str": lambda v: isinstance(v, str),
    "tuple[int, ...]": lambda v: isinstance(v, tuple) and all(_is_int(x) for x in v),
}
_TYPE_NAMES = {
    "int": "an integer",
    "float": "a finite number",
    "str": "a string",
    "tuple[int, ...]": "a list of integers",
}
# sizes a layer divides or loops by (0 or below: a division by zero or an empty model deep in a build)
_AT_LEAST_ONE = (
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank",
    "o_groups", "o_lora_rank", "window_size", "n_routed_experts", "n_activated_experts", "index_n_heads",
    "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "max_seq_len",
)  # fmt: skip
_ENGRAM_AT_LEAST_ONE = ("engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size")
_VISION_AT_LEAST_ONE = (
    "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size", "vision_downsample_ratio",
    "vision_max_n_token",
)  # fmt: skip
_AT_LEAST_ZERO = (  # 0: no draft blocks, no tower, no YaRN
    "n_mtp_layers", "vision_n_layers", "dspark_block_size", "dspark_markov_rank", "engram_pad_id", "original_seq_len",
)  # fmt: skip


def v41_flash() -> ModelConfig:
    """The released DeepSeek-V4.1-Flash values (config.json at revision dba1be0a), vision included
    so the memory report can name what it excludes."""
    return ModelConfig(vision_n_layers=32, max_seq_len=1 << 20)


def tiny() -> ModelConfig:
    """Every block type of the real schedule, small enough that a forward takes milliseconds.

    layer 0: window only, Engram | 1: ratio-2 KV + index source, Engram | 2: ratio-2 reuse |
    3: ratio-1 KV source, candidate source (the last KV source: P stops here) | 4: ratio-1 reuse |
    5: re-index layer (ratio 1, restricted to the candidate pool) | 6: ratio-1 reuse | mtp.0: draft block.
    """
    return ModelConfig(
        vocab_size=512,
        dim=128,
        moe_inter_dim=64,
        n_layers=7,
        n_mtp_layers=1,
        n_heads=4,
        head_dim=64,
        rope_head_dim=16,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=64,
        window_size=16,
        n_routed_experts=8,
        n_activated_experts=2,
        compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0),
        kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 5),
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
        candidate_source_layer=3,
        candidate_topk_blocks=3,
        candidate_block_size=4,
        original_seq_len=64,
        rope_factor=4.0,
        engram_layer_ids=(0, 1),
        engram_vocab_size=97,
        # sum of each layer's bucket primes (engram_hash.engram_num_embeddings): 97+101+103+107+109+113
        # and 127+131+137+139+149+151; tests/model/test_engram_hash.py recomputes both
        engram_num_embeddings=(630, 834),
        engram_n_heads=2,
        engram_head_dim=32,
        # distinct ids of engram_hash.compressed_token_map over tiny_tokenizer.write_tiny_tokenizer(path, 512),
        # the tokenizer make-checkpoint ships; tests/model/test_engram_hash.py recomputes it
        engram_compressed_vocab_size=303,
        dspark_block_size=3,
        # the id of <｜System｜> in the tiny tokenizer, as the release shares them (tiny_tokenizer.special_token_ids)
        dspark_noise_token_id=498,
        dspark_target_layer_ids=(4, 5, 6),
        dspark_markov_rank=32,
        dspark_n_routed_experts=4,
        dspark_n_activated_experts=2,
        max_seq_len=4096,
        image_token_id=511,  # <｜deepseek_image｜> in the tiny tokenizer
        # a 2-layer tower on 4-pixel patches, 2x2 cells: a 16x16 image is a 2x2 grid, an 8-token span
        vision_n_layers=2,
        vision_dim=32,
        vision_n_heads=2,
        vision_inter_dim=64,
        vision_patch_size=4,
        vision_downsample_ratio=2,
        vision_max_n_token=48,
        vision_min_pixels=64,
    )


PRESETS = {"v41-flash": v41_flash, "tiny": tiny}


def resolve_config(name_or_path: str | Path) -> ModelConfig:
    """A preset name, a config.json (either layout), or a checkpoint directory holding one or both."""
    from asympd.release_config import read_config_dir

    if str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)]()
    path = Path(name_or_path)
    if path.is_dir():
        return read_config_dir(path)
    if not path.exists():
        raise ConfigError(f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
    return ModelConfig.from_json(path)
