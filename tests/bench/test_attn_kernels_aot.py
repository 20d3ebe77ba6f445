"""The fused attention compiled for Hopper (sm_90) on this CPU machine (Triton's bundled ptxas,
bench/attn_kernels_aot.py): version 3's selected keys load as pipelined 16-byte copies, where
version 2's loaded two bytes at a time and synchronously (what kept it at 8 % of its floor in
prefill, docs/performance.md §12). A change that loses the alignment hint fails here, not on the
next device call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_version_3_loads_its_selected_keys_as_pipelined_16_byte_copies(tmp_path):
    # a process of its own: the suite runs Triton's interpreter (TRITON_INTERPRET), which replaces
    # @triton.jit functions by Python and cannot compile them
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = (
        "import json; from bench.attn_kernels_aot import attention_row; "
        "print(json.dumps([attention_row(2, 64, 16, 3), attention_row(3, 64, 16, 3), attention_row(3, 64, 32, 2)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    v2, v3_same_tiles, v3 = rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any("error" in r for r in rows), rows
    # version 2: one 16-key tile of 512 bf16 values a row, two bytes a load: 32 loads a thread
    assert v2["scalar_b16_loads"] == 16 * 512 // 256
    # the same launch with the hint: none, and the entry loop's tiles join the window loop's copies
    assert v3_same_tiles["scalar_b16_loads"] == 0 and v3_same_tiles["cp_async"] > v2["cp_async"]
    # the default launch (32-key tiles, two stages): no scalar loads, wgmma, nothing spilled
    assert v3["scalar_b16_loads"] == 0 and v3["wgmma"] > 0 and v3["stack"] == 0 and v3["hot_loop_spill_ops"] == 0


def test_the_mhc_projection_compiles_to_tensor_core_dots_without_spills(tmp_path):
    """cuda_kernels._hc_project_kernel's bf16x3 path (CUDA only: the interpreter runs the fp32 one)
    compiled for sm_90 at the default launch (64 rows x 64-wide K steps) and at 16-row tiles:
    tensor-core dots, pipelined loads, no local memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = """
import json
from asympd.model import cuda_kernels as K
from bench.attn_kernels_aot import compile_report
args = [("h_ptr", "*bf16"), ("fn_ptr", "*fp32"), ("part_ptr", "*fp32"), ("sq_ptr", "*fp32"), ("T", "i32"),
        ("K", "i32"), ("N", "i32"), ("K_PER_SPLIT", "i32")]
rows = [compile_report(K._hc_project_kernel, args, {"BLOCK_T": bt, "BLOCK_K": bk, "BLOCK_N": 32, "BF16X3": True,
        "PIPELINE": True}, 4, aligned={"K", "K_PER_SPLIT"}) for bt, bk in ((16, 128), (64, 64))]
print(json.dumps(rows))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    small, large = json.loads(out.stdout.strip().splitlines()[-1])
    for r in (small, large):
        assert r["local"] == 0 and r["stack"] == 0 and r["cp_async"] > 0, r
    assert small["mma_sync"] > 0 and large["wgmma"] > 0  # 16 rows: mma.sync; 64: a warp group's wgmma


def test_attention_version_5_compiles_for_hopper_without_spills(tmp_path):
    """attn_gluon's kernel (Gluon: the interpreter cannot run it) compiled for sm_90 at V4.1's shapes:
    wgmma for both products, 16-byte cp.async gathers, no local memory, and shared memory (queries,
    two 64-key stages, the probabilities) within the 227 KB a block may take."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    code = "import json; from bench.attn_kernels_aot import attention_gluon_row as r; print(json.dumps(r()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in row, row
    assert row["local"] == 0 and row["stack"] == 0 and row["hot_loop_spill_ops"] == 0, row
    assert row["wgmma"] > 0 and row["cp_async"] > 0 and row["shared_bytes"] <= 227 * 1024, row
