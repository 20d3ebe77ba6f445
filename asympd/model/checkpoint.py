"""Reading and writing checkpoints in the released safetensors layout.

Reading (``load_tensors``) is role-aware: it opens only the tensors ``role_schema`` lists, so a
prefill worker never touches a decoder, head or draft tensor (``LoadReport.tensors_read`` proves
it), and it validates names, shapes and dtypes against the schema before reading any data.

Writing (``write_checkpoint``) produces random weights in exactly the released format: same
names, shapes, dtypes, sharding convention and index file. It streams: shards are laid out from
the schema up front, and each tensor is generated and written straight to its offset in the file,
in row chunks for the Engram tables, so memory stays bounded at any model size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asympd.config import ConfigError, ModelConfig
from asympd.model.quant import E2M1_VALUES, quant_fp8_rows, quant_fp8_tiles
from asympd.model.schema import (
    FP8,
    FP8_BLOCK,
    PACKED_FP4,
    CheckpointError,
    StorageDtype,
    TensorSpec,
    checkpoint_schema,
    is_vision_tensor,
    role_schema,
)
from asympd.release_config import FLAT_FILE, read_config_dir, write_config_files

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_SHARD_BYTES = 10_000_000_000  # ~the released shards (48 shards, 510.3 GB)

# safetensors header dtype names <-> torch dtypes
ST_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


def torch_dtype(dtype: StorageDtype) -> torch.dtype:
    """The torch dtype of a schema dtype (the schema names dtypes as the files do, without torch)."""
    return ST_DTYPES[dtype.name]


@dataclass
class LoadReport:
    tensors_read: list[str] = field(default_factory=list)
    bytes_read: int = 0
    files_opened: list[str] = field(default_factory=list)


# ---- reading ------------------------------------------------------------------------------------


def checkpoint_dir(ckpt_dir: str | Path) -> Path:
    """``ckpt_dir`` as a Path; a CheckpointError where it is not a directory."""
    d = Path(ckpt_dir)
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"checkpoint {str(d)!r} is a file, not a directory")
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {str(d)!r} does not exist")
    return d


def load_config(ckpt_dir: str | Path) -> ModelConfig:
    """A checkpoint directory's config (root ``config.json``, ``inference/config.json`` or both,
    which must agree), as a validated ModelConfig."""
    d = checkpoint_dir(ckpt_dir)
    if not (d / CONFIG_FILE).is_file() and not (d / FLAT_FILE).is_file():
        raise CheckpointError(f"checkpoint {str(d)!r} has no {CONFIG_FILE} (nor {FLAT_FILE})")
    try:
        return read_config_dir(d)
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"invalid {CONFIG_FILE} in {str(d)!r}: {e}") from e


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """``generation_config.json`` in ``folder`` (Transformers' generation defaults), {} where there is
    none; one that is not a JSON object is a ``CheckpointError``."""
    path = Path(folder) / GENERATION_CONFIG_FILE
    if not Path(folder).is_dir():
        raise CheckpointError(f"generation config folder {str(folder)!r} does not exist")
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"invalid {GENERATION_CONFIG_FILE} in {str(folder)!r}: {e}") from e
    if not isinstance(out, dict):
        raise CheckpointError(f"invalid {GENERATION_CONFIG_FILE} in {str(folder)!r}: not a JSON object")
    return out


def _tensor_files(d: Path) -> tuple[dict[str, str], bool]:
    """name -> file for every tensor of the checkpoint, and whether an index described it."""
    index = d / INDEX_FILE
    if index.is_file():
        try:
            raw = json.loads(index.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"invalid {INDEX_FILE} in {str(d)!r}: {e}") from e
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
            raise CheckpointError(
                f"invalid {INDEX_FILE} in {str(d)!r}: weight_map is not an object of tensor name -> shard file name"
            )
        return dict(weight_map), True
    single = d / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as f:
                return {name: SINGLE_FILE for name in f.keys()}, False
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot open {SINGLE_FILE!r}: {e}") from e
    raise CheckpointError(f"checkpoint {str(d)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")


@dataclass
class RoleFiles:
    """Which shards a role reads, and what of it a (possibly partial) folder lacks."""

    shards_needed: list[str]
    shards_missing: list[str]
    tensors_missing: list[str]

    @property
    def complete(self) -> bool:
        return not self.tensors_missing


def role_files(ckpt_dir: str | Path, cfg: ModelConfig, role: str, vision: bool | None = None) -> RoleFiles:
    """The shards holding ``role``'s tensors, from the index alone, so it answers for a partial
    download (or a host that fetched only one role's shards) without opening any shard. ``vision``:
    with the vision tower (default: when the config has one)."""
    d = Path(ckpt_dir)
    files, _ = _tensor_files(d)
    needed, missing_shards, missing = set(), set(), []
    for spec in role_schema(cfg, role, cfg.vision_n_layers > 0 if vision is None else vision):
        fname = files.get(spec.name)
        if fname is not None:
            needed.add(fname)
        if fname is None or not (d / fname).is_file():
            missing.append(spec.name)
            if fname is not None:
                missing_shards.add(fname)
    return RoleFiles(sorted(needed), sorted(missing_shards), missing)


def _check_known(name: str, where: str, schema_names: set[str]) -> None:
    if name not in schema_names and not is_vision_tensor(name):
        raise CheckpointError(f"unexpected tensor {name!r} in {where}: not in the checkpoint schema of this config")


def load_tensors(
    ckpt_dir: str | Path,
    cfg: ModelConfig,
    role: str,
    *,
    device: str = "cpu",
    keep: Callable[[str], bool] | None = None,
    vision: bool | None = None,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """The tensors ``role`` needs, in storage dtypes, validated against the schema; ``keep``: of
    those, only the names it accepts (an expert-parallel rank's share, ``parallel.ep.rank_tensors``).

    Every tensor name of the checkpoint (the index's weight map, or the single file's header) must
    be in the schema or be a vision tensor (skipped). Only shards holding a needed tensor are
    opened; their header key lists are checked against the index too. Data is read for
    ``role_schema(cfg, role, vision)`` only, after every needed header entry's shape and dtype passed.
    ``vision`` (default: when the config has a tower) adds the tower and the role's VL gate biases."""
    from safetensors import safe_open

    d = checkpoint_dir(ckpt_dir)
    if vision is None:
        vision = cfg.vision_n_layers > 0
    needed = [s for s in role_schema(cfg, role, vision) if keep is None or keep(s.name)]
    schema_names = {s.name for s in checkpoint_schema(cfg)}
    files, indexed = _tensor_files(d)
    for name, fname in files.items():
        _check_known(name, fname, schema_names)
    by_file: dict[str, list[TensorSpec]] = {}
    for spec in needed:
        if spec.name not in files:
            raise CheckpointError(f"tensor {spec.name!r} needed by role {role!r} is missing from {str(d)!r}")
        by_file.setdefault(files[spec.name], []).append(spec)

    report = LoadReport()
    tensors: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles = {}
        for fname in sorted(by_file):
            path = d / fname
            if not path.is_file():
                raise CheckpointError(f"shard {fname!r} listed in {INDEX_FILE} is missing from {str(d)!r}")
            try:
                f = stack.enter_context(safe_open(str(path), framework="pt", device=device))
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot open {fname!r}: {e}") from e
            handles[fname] = f
            report.files_opened.append(fname)
            keys = set(f.keys())
            for name in keys:
                _check_known(name, fname, schema_names)
                if indexed and files.get(name) != fname:
                    raise CheckpointError(f"tensor {name!r} is in {fname!r} but {INDEX_FILE} maps it elsewhere")
            for spec in by_file[fname]:
                if spec.name not in keys:
                    raise CheckpointError(f"tensor {spec.name!r} needed by role {role!r} is missing from {fname!r}")
                sl = f.get_slice(spec.name)
                found = sl.get_dtype()
                found_shape = tuple(sl.get_shape())
                if found_shape != spec.shape:
                    raise CheckpointError(
                        f"tensor {spec.name!r}: expected shape {list(spec.shape)}, found {list(found_shape)}"
                    )
                if found != spec.dtype.name:
                    raise CheckpointError(
                        f"tensor {spec.name!r}: expected dtype {torch_dtype(spec.dtype)}, "
                        f"found {ST_DTYPES.get(found, found)}"
                    )
        for fname in sorted(by_file):
            for spec in by_file[fname]:
                t = handles[fname].get_tensor(spec.name)
                tensors[spec.name] = t
                report.tensors_read.append(spec.name)
                report.bytes_read += t.numel() * t.element_size()
    return tensors, report


# ---- random weights ------------------------------------------------------------------------------
#
# Fan-in scaled projections with per-projection gains, norm weights positive around per-owner means
# (10% spread), embedding RMS 0.1. Chosen so that, through mHC, every sublayer adds an update of
# the same order as the embedding to the residual streams: activations neither explode nor vanish
# over 40 layers, the Sinkhorn mixes are far from both uniform and identity, and different tokens
# route to different experts.

EMBED_STD = 0.1
NORM_MEAN = {  # matched on the name's tail, most specific first
    "compressor.norm": 0.6,
    "indexer.k_norm": 0.5,
    "attn_norm": 0.5,
    "ffn_norm": 0.5,
    "q_norm": 1.0,
    "kv_norm": 1.0,
    "main_norm": 1.0,
}
GAIN = {  # std = gain * fan_in ** -0.5, matched on the owner's tail
    "compressor.wkv": 1.0,
    "compressor.wgate": 1.0,
    "indexer.wq_b": 1.0,
    "indexer.weights_proj": 1.0,
    "indexer.wk": 1.0,
    "engram.wkv": 0.2,
    "wq_a": 1.0,
    "wq_b": 1.0,
    "wkv": 1.0,
    "wo_a": 1.0,
    "wo_b": 0.4,
    "gate": 2.0,
    "w1": 1.5,
    "w3": 1.5,
    "w2": 0.6,
    "main_proj": 1.0,
    "head": 2.0,
    "proj": 1.0,
}
ENGRAM_ROW_STD = 1.0
GATE_BIAS_STD = 0.02  # small next to the score spread, so the token decides the experts
ATTN_SINK_STD = 0.5
HC_FN_GAIN = 1.0  # mixes ~ N(0, 1): the stream is RMS-normalised before hc_fn
HC_SCALE = (0.5, 0.5, 1.0)  # pre / post / comb
HC_COMB_DIAG = 2.0  # comb logits favour keeping a stream, off-diagonal noise mixes them
HC_BASE_STD = 0.5
FP4_RMS = math.sqrt(float((E2M1_VALUES**2).mean()))  # RMS of a uniformly random e2m1 code
FP4_JITTER_RMS = math.sqrt((0.25 + 1.0 + 4.0) / 3)  # scale exponents jittered by -1/0/+1
ENGRAM_ROW_CHUNK = 1 << 20  # generation unit of the Engram tables (fixed: part of the seed recipe)


def _match(table: dict[str, float], owner: str, default: float) -> float:
    for key, value in table.items():
        if owner == key or owner.endswith("." + key):
            return value
    return default


def _generator(seed: int, name: str, chunk: int = 0) -> torch.Generator:
    """A generator per tensor (and chunk): values do not depend on sharding or write order."""
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def _plain(cfg: ModelConfig, spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    """An unquantized tensor (bf16 or f32), by what its name says it is."""
    name, shape = spec.name, spec.shape
    leaf = name.rsplit(".", 1)[-1]
    owner = name.removesuffix(".weight")
    hc = cfg.hc_mult
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        mean = _match(NORM_MEAN, owner, 1.0)
        t = mean * (1 + 0.1 * _randn(gen, *shape))
    elif name in ("embed.weight",) or name.endswith("markov_head.embed.weight"):
        t = EMBED_STD * _randn(gen, *shape)
    elif leaf in ("q_weight", "k_weight"):  # Engram gate weights, used as a product
        t = 1 + 0.1 * _randn(gen, *shape)
    elif leaf == "attn_sink":
        t = ATTN_SINK_STD * _randn(gen, *shape)
    elif leaf in ("bias", "bias_vl"):
        t = GATE_BIAS_STD * _randn(gen, *shape)
    elif leaf.endswith("_fn") and leaf.startswith("hc_"):
        t = _randn(gen, *shape) * shape[1] ** -0.5 * HC_FN_GAIN
    elif leaf.endswith("_base") and leaf.startswith("hc_"):
        t = HC_BASE_STD * _randn(gen, *shape)
        t[2 * hc :].view(hc, hc).diagonal().add_(HC_COMB_DIAG)
    elif leaf.endswith("_scale") and leaf.startswith("hc_"):
        t = torch.tensor(HC_SCALE) * (1 + 0.1 * _randn(gen, *shape))
    elif len(shape) == 2:
        t = _randn(gen, *shape) * shape[1] ** -0.5 * _match(GAIN, owner, 1.0)
    else:
        t = 0.1 * _randn(gen, *shape)
    return t.to(torch_dtype(spec.dtype))


def _fp8_tiles(weight: TensorSpec, gen: torch.Generator) -> list[torch.Tensor]:
    owner = weight.name.removesuffix(".weight")
    w = _randn(gen, *weight.shape) * weight.shape[1] ** -0.5 * _match(GAIN, owner, 1.0)
    return list(quant_fp8_tiles(w))


def _fp4(weight: TensorSpec, scale: TensorSpec, gen: torch.Generator) -> list[torch.Tensor]:
    """Random e2m1 codes with power-of-two scales, drawn in the storage format directly
    (quantizing gaussians at the released size would take minutes per layer)."""
    owner = weight.name.removesuffix(".weight")
    fan_in = weight.shape[1] * 2
    codes = torch.randint(0, 256, weight.shape, generator=gen, dtype=torch.uint8)
    target = fan_in**-0.5 * _match(GAIN, owner, 1.0) / (FP4_RMS * FP4_JITTER_RMS)
    exp = round(math.log2(target)) + torch.randint(-1, 2, scale.shape, generator=gen, dtype=torch.int32)
    return [codes.view(torch.int8), torch.pow(2.0, exp.float()).to(torch.float8_e8m0fnu)]


def _units(specs: list[TensorSpec]) -> list[list[TensorSpec]]:
    """Weights grouped with their ``.scale`` sibling: a unit is generated (and sharded) together."""
    units, i = [], 0
    while i < len(specs):
        s = specs[i]
        nxt = specs[i + 1] if i + 1 < len(specs) else None
        if nxt is not None and s.name.endswith(".weight") and nxt.name == s.name.removesuffix(".weight") + ".scale":
            units.append([s, nxt])
            i += 2
        else:
            units.append([s])
            i += 1
    return units


def _is_engram_table(unit: list[TensorSpec]) -> bool:
    return len(unit) == 2 and unit[0].name.endswith("engram.embed.weight")


def _generate_unit(cfg: ModelConfig, unit: list[TensorSpec], seed: int) -> list[torch.Tensor]:
    gen = _generator(seed, unit[0].name)
    if len(unit) == 1:
        return [_plain(cfg, unit[0], gen)]
    weight, scale = unit
    if weight.dtype == FP8:
        return _fp8_tiles(weight, gen)
    if weight.dtype == PACKED_FP4:
        return _fp4(weight, scale, gen)
    raise AssertionError(f"no generator for {weight.name} ({weight.dtype})")


def _engram_chunks(unit: list[TensorSpec], seed: int):
    """(first row, fp8 rows, scales) chunks of an Engram table, each from its own generator."""
    weight, _ = unit
    rows, dim = weight.shape
    for c, lo in enumerate(range(0, rows, ENGRAM_ROW_CHUNK)):
        n = min(ENGRAM_ROW_CHUNK, rows - lo)
        q, s = quant_fp8_rows(ENGRAM_ROW_STD * _randn(_generator(seed, weight.name, c), n, dim), FP8_BLOCK)
        yield lo, q, s


# ---- writing ------------------------------------------------------------------------------------


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _plan_shards(units: list[list[TensorSpec]], shard_bytes: int) -> list[list[list[TensorSpec]]]:
    shards: list[list[list[TensorSpec]]] = [[]]
    size = 0
    for unit in units:
        b = sum(s.nbytes for s in unit)
        if shards[-1] and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += b
    return shards


def _header(specs: list[TensorSpec]) -> tuple[bytes, dict[str, int]]:
    """safetensors header for ``specs``; tensors ordered by element size (largest first) so
    every tensor starts aligned. Returns the header bytes and each tensor's data offset."""
    order = sorted(specs, key=lambda s: -s.dtype.itemsize)
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, pos = {}, 0
    for s in order:
        meta[s.name] = {"dtype": s.dtype.name, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        offsets[s.name] = pos
        pos += s.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def _write_at(f, base: int, offset: int, t: torch.Tensor) -> None:
    f.seek(base + offset)
    f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write_tokenizer_files(out: Path) -> None:
    """tokenizer_config.json and generation_config.json beside tokenizer.json, as the release has
    them: the special tokens by name, BOS/EOS by id (no chat template: the release ships none)."""
    from asympd.model.tiny_tokenizer import SPECIAL_TOKENS

    bos, eos, pad = SPECIAL_TOKENS[:3]
    tok_cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    gen_cfg = {"bos_token_id": SPECIAL_TOKENS.index(bos), "eos_token_id": SPECIAL_TOKENS.index(eos)}
    (out / GENERATION_CONFIG_FILE).write_text(json.dumps(gen_cfg, indent=2) + "\n")


def write_checkpoint(
    cfg: ModelConfig,
    out_dir: str | Path,
    seed: int,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    *,
    verbose: bool = True,
    shared_experts: bool = False,
) -> Path:
    """Write a random-weight checkpoint of ``cfg`` in the released layout; returns ``out_dir``.
    ``shared_experts``: a benchmark checkpoint holding layer 0's routed experts only, for every
    layer (``shared_experts.py``; the loader refuses it unless asked).

    Files, as the release ships them: ``model-0000i-of-0000N.safetensors`` shards,
    ``model.safetensors.index.json``, the root ``config.json`` (Transformers layout) and
    ``inference/config.json`` (flat), a tiny-tokenizer ``tokenizer.json`` with ``cfg.vocab_size``
    ids, ``tokenizer_config.json`` and ``generation_config.json``.
    Deterministic given ``seed`` (independent of ``shard_bytes``)."""
    from asympd.model.engram_hash import compressed_token_map
    from asympd.model.tiny_tokenizer import write_tiny_tokenizer

    say = _progress if verbose else (lambda msg: None)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.glob("model*.safetensors*")):
        raise CheckpointError(f"{str(out)!r} already holds a checkpoint; choose an empty directory")
    specs = checkpoint_schema(cfg)
    if shared_experts:
        from asympd.model.shared_experts import is_aliased

        specs = [s for s in specs if not is_aliased(s.name, 0)]
    total = sum(s.nbytes for s in specs)
    free = _free_bytes(out)
    margin = 64 << 20  # tokenizer, config, headers
    if free < total + margin:
        raise CheckpointError(
            f"not enough disk space in {str(out)!r}: the checkpoint needs {total / 1e9:.2f} GB,"
            f" {free / 1e9:.2f} GB is free"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # read-only, no permission, a file on the way
        raise CheckpointError(f"cannot create {str(out)!r}: {e.strerror}") from e

    tok_path = write_tiny_tokenizer(out / TOKENIZER_FILE, cfg.vocab_size)
    if cfg.engram_layer_ids:
        _, compressed = compressed_token_map(tok_path)
        if compressed != cfg.engram_compressed_vocab_size:
            # the hash multipliers derive from it: keep config and tokenizer consistent
            say(
                f"note: the synthetic tokenizer compresses to {compressed} ids; writing"
                f" engram_compressed_vocab_size={compressed} (config had {cfg.engram_compressed_vocab_size})"
            )
            cfg = cfg.replace(engram_compressed_vocab_size=compressed)
    write_config_files(cfg, out)
    _write_tokenizer_files(out)

    shards = _plan_shards(_units(specs), shard_bytes)
    weight_map: dict[str, str] = {}
    written = 0
    say(f"writing {len(specs)} tensors, {total / 1e9:.3f} GB, in {len(shards)} shards to {out}")
    for i, shard in enumerate(shards):
        fname = _shard_name(i, len(shards))
        shard_specs = [s for unit in shard for s in unit]
        header, offsets = _header(shard_specs)
        tmp = out / (fname + ".partial")
        with open(tmp, "wb") as f:
            f.write(header)
            base = len(header)
            f.truncate(base + sum(s.nbytes for s in shard_specs))
            for unit in shard:
                if _is_engram_table(unit):
                    w, s = unit
                    row_w, row_s = w.nbytes // w.shape[0], s.nbytes // s.shape[0]
                    for lo, q, sc in _engram_chunks(unit, seed):
                        _write_at(f, base, offsets[w.name] + lo * row_w, q)
                        _write_at(f, base, offsets[s.name] + lo * row_s, sc)
                    say(f"  {w.name}: {w.shape[0]} rows")
                else:
                    for spec, t in zip(unit, _generate_unit(cfg, unit, seed), strict=True):
                        assert t.shape == spec.shape and t.dtype == torch_dtype(spec.dtype), spec.name
                        _write_at(f, base, offsets[spec.name], t)
                for spec in unit:
                    weight_map[spec.name] = fname
        tmp.rename(out / fname)
        written += sum(s.nbytes for s in shard_specs)
        say(f"[{i + 1}/{len(shards)}] {fname}  {written / 1e9:.3f}/{total / 1e9:.3f} GB")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if shared_experts:
        from asympd.model.shared_experts import write_marker

        write_marker(out, 0)
    return out
