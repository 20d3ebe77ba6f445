"""The release's two config files, read into one :class:`~asympd.config.ModelConfig`.

DeepSeek-V4.1-Flash ships ``inference/config.json`` (the flat key set of the reference inference
code; ``ModelConfig``'s field names) and a root ``config.json`` in the Transformers layout (the
model under ``text_config`` with Transformers names, the quantization under
``quantization_config``, the vision tower under ``vision_config``). ``FIELDS`` states each mapping
between the two once; reading and writing both go through it. docs/model.md §1 describes the
files.

Strictness: a key asympd does not know could change what the model computes, so it is refused
by name, except keys that cannot (``INERT``) and the vision tower's (never built: text only).
Keys whose value asympd implements one way only (``FIXED``) must have that value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asympd.config import ConfigError, ModelConfig

ROOT_FILE = "config.json"
FLAT_FILE = "inference/config.json"

# ModelConfig field (the inference/config.json key) -> where the root config.json keeps it
FIELDS: dict[str, str] = {
    "vocab_size": "text_config.vocab_size",
    "dim": "text_config.hidden_size",
    "moe_inter_dim": "text_config.moe_intermediate_size",
    "n_layers": "text_config.num_hidden_layers",
    "n_mtp_layers": "text_config.num_nextn_predict_layers",
    "n_heads": "text_config.num_attention_heads",
    "head_dim": "text_config.head_dim",
    "rope_head_dim": "text_config.qk_rope_head_dim",
    "q_lora_rank": "text_config.q_lora_rank",
    "o_groups": "text_config.o_groups",
    "o_lora_rank": "text_config.o_lora_rank",
    "window_size": "text_config.sliding_window",
    "n_routed_experts": "text_config.n_routed_experts",
    "n_shared_experts": "text_config.n_shared_experts",
    "n_activated_experts": "text_config.num_experts_per_tok",
    "score_func": "text_config.scoring_func",
    "route_scale": "text_config.routed_scaling_factor",
    "swiglu_limit": "text_config.swiglu_limit",
    "norm_eps": "text_config.rms_norm_eps",
    "compress_ratios": "text_config.compress_ratios",
    "kv_source_layers": "text_config.kv_source_layer_ids",
    "index_source_layers": "text_config.index_source_layer_ids",
    "index_n_heads": "text_config.index_n_heads",
    "index_head_dim": "text_config.index_head_dim",
    "index_topk": "text_config.index_topk",
    "candidate_source_layer": "text_config.candidate_source_layer_id",
    "candidate_topk_blocks": "text_config.candidate_topk_blocks",
    "candidate_block_size": "text_config.candidate_block_size",
    "rope_theta": "text_config.rope_theta",
    "compress_rope_theta": "text_config.compress_rope_theta",
    "original_seq_len": "text_config.rope_scaling.original_max_position_embeddings",
    "rope_factor": "text_config.rope_scaling.factor",
    "beta_fast": "text_config.rope_scaling.beta_fast",
    "beta_slow": "text_config.rope_scaling.beta_slow",
    "hc_mult": "text_config.hc_mult",
    "hc_sinkhorn_iters": "text_config.hc_sinkhorn_iters",
    "hc_eps": "text_config.hc_eps",
    "engram_layer_ids": "text_config.engram_layer_ids",
    "engram_vocab_size": "text_config.engram_vocab_size",
    "engram_num_embeddings": "text_config.engram_num_embeddings",
    "engram_max_ngram_size": "text_config.engram_max_ngram_size",
    "engram_n_heads": "text_config.engram_n_heads",
    "engram_head_dim": "text_config.engram_head_dim",
    "engram_pad_id": "text_config.engram_pad_token_id",
    "engram_compressed_vocab_size": "text_config.engram_compressed_vocab_size",
    "dspark_block_size": "text_config.dspark_block_size",
    "dspark_noise_token_id": "text_config.dspark_noise_token_id",
    "dspark_target_layer_ids": "text_config.dspark_target_layer_ids",
    "dspark_markov_rank": "text_config.dspark_markov_rank",
    "dspark_n_routed_experts": "text_config.dspark_n_routed_experts",
    "dspark_n_activated_experts": "text_config.dspark_num_experts_per_tok",
    "expert_dtype": "quantization_config.expert_dtype",
    "max_seq_len": "text_config.max_position_embeddings",
    "vision_n_layers": "vision_config.num_hidden_layers",
    "vision_dim": "vision_config.hidden_size",
    "vision_n_heads": "vision_config.num_attention_heads",
    "vision_inter_dim": "vision_config.intermediate_size",
    "vision_patch_size": "vision_config.patch_size",
    "vision_downsample_ratio": "vision_config.downsample_ratio",
    "vision_max_n_token": "vision_config.max_image_tokens",
    "vision_min_pixels": "vision_config.min_pixels",
    "vision_max_wh_ratio": "vision_config.max_wh_ratio",
    "vision_rope_theta": "vision_config.rope_theta",
    "image_token_id": "image_token_id",
}
# The one field with no key of its own: the root file says fp8 by carrying a quantization_config
# (``dtype`` at the root is the unquantized tensors' type, bf16 either way).
QUANTIZED_BY = "quantization_config"

# keys whose value asympd implements one way only: any other value changes the model
FIXED: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",  # older Transformers' name for ``dtype``
    "quantization_config.quant_method": "fp8",
    "quantization_config.activation_scheme": "dynamic",
    "quantization_config.weight_block_size": [32, 32],
    "quantization_config.scale_fmt": "ue8m0",
    "text_config.model_type": "deepseek_v41_text",
    "text_config.num_key_value_heads": 1,  # one shared KV latent (K = V)
    "text_config.topk_method": "noaux_tc",  # the gate's bias picks experts, unbiased scores weight them
    "text_config.norm_topk_prob": True,
    "text_config.hidden_act": "silu",
    "text_config.attention_bias": False,
    "text_config.tie_word_embeddings": False,
    "text_config.rope_scaling.rope_type": "yarn",
    "vision_config.model_type": "deepseek_v41_vision",
}

# keys that do not change what the model computes (token ids are the tokenizer's business)
INERT: dict[str, Any] = {
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "transformers_version": None,
    "text_config.use_cache": True,
    "text_config.initializer_range": 0.02,
    "text_config.attention_dropout": 0.0,  # no dropout at inference
    "text_config.bos_token_id": None,
    "text_config.eos_token_id": None,
    "text_config.pad_token_id": None,
}

# objects whose keys are checked one by one (any other object value is a leaf)
_SECTIONS = ("text_config", "vision_config", QUANTIZED_BY, "text_config.rope_scaling")
_PATH_OF = {path: name for name, path in FIELDS.items()}


def is_root_layout(raw: dict[str, Any]) -> bool:
    """Whether a config.json is the Transformers layout (else: the flat reference key set)."""
    return "text_config" in raw or "architectures" in raw or "model_type" in raw


def _leaves(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        path = prefix + key
        if path in _SECTIONS and isinstance(value, dict):
            out.update(_leaves(value, path + "."))
        else:
            out[path] = value
    return out


def root_to_flat(raw: dict[str, Any]) -> dict[str, Any]:
    """The root (Transformers-layout) config.json as inference/config.json keys.

    Only the keys the file states come back, so a missing key keeps ModelConfig's default. Raises
    ConfigError naming every key that would change the math and that asympd does not implement."""
    if not isinstance(raw.get("text_config"), dict):
        raise ConfigError("config.json (Transformers layout) has no text_config object")
    leaves = _leaves(raw)
    flat: dict[str, Any] = {"dtype": "fp8" if isinstance(raw.get(QUANTIZED_BY), dict) else "bf16"}
    if flat["dtype"] == "bf16":
        flat["expert_dtype"] = None
    unknown, wrong = [], []
    for path, value in leaves.items():
        if path in _PATH_OF:
            flat[_PATH_OF[path]] = value
        elif path in FIXED:
            if value != FIXED[path]:
                wrong.append(f"{path}={value!r} (asympd implements only {FIXED[path]!r})")
        elif path == QUANTIZED_BY and value is None:
            pass  # unquantized checkpoint
        elif path == "text_config.rope_scaling" and value is None:
            flat["original_seq_len"] = 0  # no YaRN on the compressed layers
        elif path in INERT or path.startswith("vision_config."):
            pass  # does not change the text model (the vision tower is never built)
        else:
            unknown.append(path)
    if wrong:
        raise ConfigError(f"config.json: unsupported value: {'; '.join(wrong)}")
    if unknown:
        raise ConfigError(
            f"config.json has fields asympd does not implement (they may change the model): {', '.join(unknown)}"
        )
    return flat


def flat_to_root(cfg: ModelConfig) -> dict[str, Any]:
    """The root config.json (Transformers layout) describing ``cfg``, shaped like the release's."""
    if cfg.dtype != "fp8" and cfg.expert_dtype is not None:
        raise ConfigError("the Transformers layout has no way to say fp4 experts without fp8 weights")
    out: dict[str, Any] = {
        "architectures": FIXED["architectures"],
        "model_type": FIXED["model_type"],
        "dtype": FIXED["dtype"],
        "bos_token_id": INERT["bos_token_id"],
        "eos_token_id": INERT["eos_token_id"],
        "pad_token_id": INERT["pad_token_id"],
    }
    if cfg.dtype == "fp8":
        out[QUANTIZED_BY] = {k.split(".", 1)[1]: v for k, v in FIXED.items() if k.startswith(QUANTIZED_BY + ".")}
    out["text_config"] = {"model_type": FIXED["text_config.model_type"]}
    out["vision_config"] = {"model_type": FIXED["vision_config.model_type"]}
    for path, value in FIXED.items():
        if path.startswith("text_config.") and not path.startswith("text_config.rope_scaling"):
            _put(out, path, value)
    for path, value in INERT.items():
        if path.startswith("text_config.") and value is not None:
            _put(out, path, value)
    values = cfg.to_dict()
    for name, path in FIELDS.items():
        if path.startswith("text_config.rope_scaling.") and not cfg.original_seq_len:
            continue
        if name == "expert_dtype" and cfg.dtype != "fp8":
            continue
        _put(out, path, values[name])
    if cfg.original_seq_len:
        _put(out, "text_config.rope_scaling.rope_type", FIXED["text_config.rope_scaling.rope_type"])
    else:
        out["text_config"]["rope_scaling"] = None
    return out


def _put(out: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        out = out.setdefault(key, {})
    out[leaf] = value


# ---- files ----------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return raw


def _flat_keys(raw: dict[str, Any], what: str) -> dict[str, Any]:
    if is_root_layout(raw):
        return root_to_flat(raw)
    known = ModelConfig.field_names()
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{what} has unknown fields: {', '.join(unknown)}")
    return raw


def _build(flat: dict[str, Any]) -> ModelConfig:
    try:
        return ModelConfig.from_dict(flat)
    except TypeError as e:
        raise ConfigError(str(e)) from e


def read_config_file(path: str | Path) -> ModelConfig:
    """One config.json, in either layout."""
    return _build(_flat_keys(_read_json(Path(path)), str(path)))


def _norm(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def read_config_dir(directory: str | Path) -> ModelConfig:
    """A checkpoint folder's config: its root config.json, its inference/config.json, or both.

    With both, every key both state must agree; a disagreement is an error naming the field in
    both spellings. A key only one states is taken from it."""
    d = Path(directory)
    root_path, flat_path = d / ROOT_FILE, d / FLAT_FILE
    if not root_path.is_file() and not flat_path.is_file():
        raise ConfigError(f"{str(d)!r} has no {ROOT_FILE} (nor {FLAT_FILE})")
    if not flat_path.is_file():
        return read_config_file(root_path)
    flat = _flat_keys(_read_json(flat_path), FLAT_FILE)
    if not root_path.is_file():
        return _build(flat)
    root_raw = _read_json(root_path)
    root = _flat_keys(root_raw, ROOT_FILE)

    def spelled(name: str) -> str:  # the field's name in the root file
        return FIELDS.get(name, QUANTIZED_BY) if is_root_layout(root_raw) else name

    clashes = [
        f"{name} ({ROOT_FILE}: {spelled(name)}={root[name]!r}, {FLAT_FILE}: {name}={flat[name]!r})"
        for name in sorted(set(root) & set(flat))
        if _norm(root[name]) != _norm(flat[name])
    ]
    if clashes:
        raise ConfigError(f"{ROOT_FILE} and {FLAT_FILE} disagree on {'; '.join(clashes)}")
    return _build({**root, **flat})


def write_config_files(cfg: ModelConfig, directory: str | Path) -> None:
    """Both configs, as the release ships them: root config.json and inference/config.json."""
    d = Path(directory)
    (d / FLAT_FILE).parent.mkdir(parents=True, exist_ok=True)
    (d / FLAT_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    (d / ROOT_FILE).write_text(json.dumps(flat_to_root(cfg), indent=2) + "\n")
