"""The fused elementwise kernels (asympd/model/cuda_kernels.py) against the torch forms they replace,
run by Triton's interpreter on CPU: fp4_qdq and moe_combine bit for bit, hc_project and rms_norm to
fp32 summation order; and the probe the CUDA build uses to enable them. On a GPU machine the same
tests run the compiled kernels on the device."""

from __future__ import annotations

import pytest
import torch

from asympd.model import cuda_kernels as K
from asympd.model import ops, quant
from asympd.model.cuda_ops import probe_glue_kernels

pytestmark = pytest.mark.skipif(not K.AVAILABLE, reason="needs Triton")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block,e4m3", [(32, False), (16, True)])
def test_fp4_qdq_kernel_gives_the_references_bits(dtype, block, e4m3):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(19, 4, 128, generator=g) * torch.logspace(-10, 4, 128)
    x[0, 0, :32] = 0.0
    x[0, 1, :32] = -0.0
    # every rounding tie and its neighbours, under a block scale of 1 (the block's amax is 6)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[1, 0, :32] = torch.cat([ties, -ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(9.0))])
    x = x.to(DEV, dtype)
    y = K.fp4_qdq(x, block, e4m3)
    ref = quant.fp4_qdq(x, block, e4m3_scale=e4m3)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(_bits(y), _bits(ref))
    assert torch.signbit(y[0, 1, :32]).all()  # -0.0 stays -0.0, as the table's code 8


def test_fp4_qdq_kernel_reads_strided_rows():
    x = torch.randn(8, 256, device=DEV)[:, :128]  # rows 256 apart
    assert torch.equal(K.fp4_qdq(x, 32, False), quant.fp4_qdq(x, 32))


@pytest.mark.parametrize("splits", [None, 3, 6])  # 6: every 64-wide K step its own split
def test_hc_project_kernel_equals_the_mixes_projection(splits):
    g = torch.Generator().manual_seed(4)
    h = torch.randn(40, 4, 96, generator=g).to(DEV, torch.bfloat16)  # 40 rows: a partial 32-row tile
    fn = (torch.randn(24, 4 * 96, generator=g) * 0.1).to(DEV)
    x = h.flatten(-2).double()
    r = torch.rsqrt(x.square().mean(-1, keepdim=True))
    ref, magnitude = (x @ fn.double().t()) * r, (x.abs() @ fn.double().abs().t()) * r
    y = K.hc_project(h, fn, 1e-20, splits)  # 3: K split over programs, partial sums added after
    assert y.dtype == torch.float32 and y.shape == (40, 24)
    # fp32 sums in another order: within a few ulp of the sum of the terms' magnitudes
    assert ((y.double() - ref).abs() <= 1e-6 * magnitude).all()
    assert K.hc_project(h[:0], fn, 1e-20).shape == (0, 24)


def test_hc_project_refuses_more_splits_than_its_finish_adds():
    h = torch.zeros(2, 4, 272, dtype=torch.bfloat16, device=DEV)  # K = 1088: 17 steps of 64
    fn = torch.zeros(24, 4 * 272, device=DEV)
    with pytest.raises(ValueError, match="at most 16 splits of K, got 17"):
        K.hc_project(h, fn, 1e-6, 17)


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 320), (torch.float32, 48)])
def test_rms_norm_kernel_equals_ops_rms_norm(dtype, d):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(9, d, generator=g) * 3).to(DEV, dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(DEV, dtype)
    y = K.rms_norm(x, w, 1e-6)
    ref = ops.rms_norm(x.cpu(), w.cpu(), 1e-6)  # the torch form (on CUDA ops would take the kernel)
    assert y.dtype == dtype
    tol = {"rtol": 8e-3, "atol": 8e-3} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(y.float().cpu(), ref.float(), **tol)
    assert K.rms_norm(x[:0], w, 1e-6).shape == (0, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_combine_kernel_sums_each_tokens_slots_and_its_shared_row(dtype):
    """Bit for bit the chain from +0 over the slots in order, then the shared row, one rounding."""
    g = torch.Generator().manual_seed(6)
    t, k, d = 11, 6, 1100  # a partial column block
    rows = (torch.randn(t * k, d, generator=g) * 4).to(DEV, dtype)
    inv = torch.randperm(t * k, generator=g).to(DEV)
    shared = torch.randn(t, d, generator=g).to(DEV, dtype)
    slots = rows.cpu().float()[inv.cpu()].view(t, k, d)
    want = torch.zeros(t, d)
    for s in range(k):
        want = want + slots[:, s]
    want = (want + shared.cpu().float()).to(dtype)
    got = K.moe_combine(rows, inv, k, shared)
    assert got.dtype == dtype and torch.equal(_bits(got.cpu()), _bits(want))
    assert K.moe_combine(rows[:0], inv[:0], k, shared[:0]).shape == (0, d)


def test_the_probe_enables_all_four():
    assert probe_glue_kernels(DEV) == {
        "triton_fp4_qdq": True,
        "triton_hc_project": True,
        "triton_rms_norm": True,
        "triton_moe_combine": True,
    }


def test_install_takes_the_glue_kernels_that_passed_their_probe(monkeypatch):
    """What passed its probe and is named in ``GLUE_KERNELS`` is installed, and only that."""
    from asympd.model import cuda_ops

    passed = {"triton_fp4_qdq": True, "triton_hc_project": False, "triton_rms_norm": True}
    monkeypatch.setattr(cuda_ops, "caps", lambda device: passed)
    monkeypatch.setattr(ops, "CUDA_FAST", {})
    cuda_ops.install_kernels(torch.device("cpu"))
    assert sorted(ops.CUDA_FAST) == ["fp4_qdq", "rms_norm"]
    assert ops.CUDA_FAST["fp4_qdq"] is K.fp4_qdq
    passed["triton_hc_project"] = True
    cuda_ops.install_kernels(torch.device("cpu"))
    assert sorted(ops.CUDA_FAST) == sorted(cuda_ops.GLUE_KERNELS) == ["fp4_qdq", "hc_project", "rms_norm"]
