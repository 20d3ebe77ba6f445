"""``dtype="auto"``: bf16 on CUDA, fp32 on CPU, for load_model, LLM and asympd serve."""

import pytest
import torch

from asympd import cli
from asympd.engine.llm import LLM
from asympd.model.dtypes import resolve_dtype
from asympd.model.loader import load_model


@pytest.mark.parametrize(
    "dtype, device, expected",
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("auto", torch.device("cuda", 1), torch.bfloat16),
        ("bfloat16", "cpu", torch.bfloat16),
        (torch.float16, "cuda", torch.float16),
    ],
)
def test_resolve_dtype(dtype, device, expected):
    assert resolve_dtype(dtype, device) is expected


def test_unknown_dtype_named():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; expected auto, float32, bfloat16, float16"):
        resolve_dtype("fp8", "cpu")


def test_defaults_are_auto(tiny_ckpt):
    assert load_model(tiny_ckpt, "prefill").dtype is torch.float32
    assert load_model(tiny_ckpt, "prefill", dtype="bfloat16").dtype is torch.bfloat16
    assert LLM(tiny_ckpt).engine.model.dtype is torch.float32
    args = cli.build_parser().parse_args(["serve", "--checkpoint", tiny_ckpt])
    assert args.dtype == "auto"
