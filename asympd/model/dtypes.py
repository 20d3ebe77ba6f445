"""Compute dtypes by name, and what ``"auto"`` means on a device."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device) -> torch.dtype:
    """``"auto"`` is bf16 on CUDA (the reference's compute dtype) and fp32 on CPU (where bf16
    GEMMs are slow and the batch-invariance guarantees are stated for fp32); names as in DTYPES."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
