"""Benchmark-only checkpoints whose backbone layers share one stored set of routed experts.

V4.1-Flash at true depth holds 40 x 7.2 GB of routed experts: more than one H200. To time the real
layer schedule through the servers anyway, ``bench/e2e.py --depth 40`` writes layer 0's routed
experts only, plus the marker file ``MARKER``; loading such a checkpoint gives every backbone layer
layer 0's experts, built once (the same device tensors), so each layer still reads 7.2 GB of expert
weights per step while the device holds one copy. The outputs are not any real model's, so the
loader refuses the checkpoint unless asked (``load_model(..., shared_experts=True)``,
``asympd serve --benchmark-shared-experts``), and refuses the flag on a checkpoint without the marker.
Draft blocks (``mtp.*``) keep their own experts. One copy holds in the packed layouts (the CUDA
default) and on CPU; the dequantized layout on CUDA converts each layer's experts to its own bf16
operand, so there the copies come back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from asympd.model.checkpoint import CheckpointError

MARKER = "asympd_benchmark_shared_experts.json"
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.")


def write_marker(ckpt_dir: str | Path, source_layer: int = 0) -> Path:
    """Mark ``ckpt_dir`` as holding only ``source_layer``'s routed experts."""
    path = Path(ckpt_dir) / MARKER
    note = "benchmark only: every backbone layer's routed experts are this layer's (asympd/model/shared_experts.py)"
    path.write_text(json.dumps({"source_layer": source_layer, "note": note}, indent=1) + "\n")
    return path


def source_layer(ckpt_dir: str | Path, allowed: bool) -> int | None:
    """The layer whose experts every layer shares (None: a normal checkpoint). Raises
    CheckpointError for a marked checkpoint unless ``allowed``, and for ``allowed`` without a marker."""
    path = Path(ckpt_dir) / MARKER
    if not path.is_file():
        if allowed:
            raise CheckpointError(
                f"shared experts were asked for, but {str(ckpt_dir)!r} has no {MARKER}: it is not a "
                "shared-expert benchmark checkpoint"
            )
        return None
    if not allowed:
        raise CheckpointError(
            f"{str(ckpt_dir)!r} is a benchmark checkpoint whose layers share one set of routed experts "
            f"({MARKER}); its outputs are no real model's. Load it only on purpose: "
            "asympd serve --benchmark-shared-experts, or load_model(..., shared_experts=True)"
        )
    try:
        layer = json.loads(path.read_text())["source_layer"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is malformed: {e!r}") from e
    if not isinstance(layer, int) or layer < 0:
        raise CheckpointError(f"{path}: source_layer must be a layer index, got {layer!r}")
    return layer


def is_aliased(name: str, source: int) -> bool:
    """Whether tensor ``name`` is a routed-expert tensor of a layer other than ``source`` (not stored)."""
    m = _EXPERT.match(name)
    return m is not None and int(m.group(1)) != source


def alias(prefix: str, source: int | None) -> str:
    """``layers.L.ffn.`` -> ``layers.<source>.ffn.`` where experts are shared; anything else as is."""
    if source is None or not prefix.startswith("layers."):
        return prefix
    return re.sub(r"^layers\.\d+\.", f"layers.{source}.", prefix)
