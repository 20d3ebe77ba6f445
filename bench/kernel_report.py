"""What the compiler made of the packed GEMMs: registers, spills, shared memory and the layout
conversions in the Triton IR, at a decode and a prefill size (one device call; run it under ``ncu``
for hardware counters). Writes ``kernel_report.json``.

    python3 bench/kernel_report.py                # compile, time, report
    ncu --clock-control none -k regex:mxfp4 -c 2 --section SpeedOfLight --section WarpStateStats \\
        python3 bench/kernel_report.py --once     # one launch per size, for the counters
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.config import v41_flash  # noqa: E402
from asympd.model import gemm_kernels as G  # noqa: E402
from asympd.model.packed import moe_block_m  # noqa: E402
from asympd.model.quant import fp8_qdq  # noqa: E402
from bench.common import log, record, time_cuda  # noqa: E402
from bench.formats import random_fp4_experts  # noqa: E402

DEV = torch.device("cuda")


def ir_summary(kernel) -> dict:
    """Counts of the operations that cost most in the IR: layout conversions, shared-memory traffic,
    dots; plus the compiled resources."""
    out = {"n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None)}
    md = getattr(kernel, "metadata", None)
    out["shared_bytes"] = getattr(md, "shared", None)
    asm = getattr(kernel, "asm", {}) or {}
    ttgir = asm.get("ttgir", "")
    for op in ("convert_layout", "local_alloc", "local_load", "local_store", "tt.dot", "warp_group_dot", "async_copy"):
        out[f"ttgir_{op}"] = len(re.findall(op, ttgir))
    ptx = asm.get("ptx", "")
    for ins in (
        "mma.sync",
        "wgmma.mma_async",
        "ld.shared",
        "st.shared",
        "ldmatrix",
        "ld.global",
        "cp.async",
        "lop3",
        "shl",
        "and.b32",
        "mul.f32",
        "mul.rn.f32",
        "cvt",
    ):
        out[f"ptx_{ins}"] = ptx.count(ins)
    return out


def main() -> None:
    once = "--once" in sys.argv
    started = time.time()
    cfg = v41_flash()
    g = torch.Generator(device=DEV).manual_seed(0)
    n_exp, d, inter, k = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts
    w13 = random_fp4_experts(n_exp, 2 * inter, d, g)
    report = {}
    for rows in (16, 512, 4096):
        x = fp8_qdq(torch.randn(rows, d, device=DEV, generator=g), 32).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(n_exp, device=DEV, generator=g)[:k] for _ in range(rows)]).reshape(-1)
        bm = moe_block_m(ids.numel(), n_exp)
        order, *blocks = G.moe_blocks(ids, n_exp, bm)
        token = order // k
        n_routed = ids.numel()

        touched = int(torch.unique(ids).numel())
        nbytes = touched * 2 * inter * d * (0.5 + 1 / 32)
        outs = {}
        for lut in (True, False):  # the PRMT table decode (default) and the bit-building one

            def run(x=x, blocks=blocks, token=token, bm=bm, r=n_routed, lut=lut):
                return w13.matmul(x, blocks, r, bm, token, {"lut": lut})

            outs[lut] = run()
            torch.cuda.synchronize()
            if once:
                continue
            t = time_cuda(run, iters=10, warmup=2, graph=True)
            key = f"{rows}_{'lut' if lut else 'bits'}"
            report[key] = {"block_m": bm, "ms": t["ms"], "TBps": nbytes / (t["ms"] * 1e-3) / 1e12}
            log(f"rows {rows} {'lut ' if lut else 'bits'}: {t['ms']:.3f} ms, {report[key]['TBps']:.2f} TB/s")
        same = bool(torch.equal(outs[True], outs[False]))
        diff = float((outs[True].float() - outs[False].float()).abs().max())
        report[f"{rows}_lut_equals_bits"] = same
        log(f"rows {rows}: LUT output equals bit-building output: {same} (max abs diff {diff:.3g})")
    if not once:
        # every compiled variant of the kernel (one per constexpr set)
        variants = []
        try:
            for dev_cache in G._mxfp4_moe_kernel.device_caches.values():
                for key, kern in dev_cache[0].items():
                    variants.append({"key": str(key)[:300], **ir_summary(kern)})
        except Exception as e:  # the cache layout is Triton-internal
            variants.append({"error": f"{type(e).__name__}: {e}"})
        report["variants"] = variants
        for v in variants:
            log({k: v[k] for k in v if k != "key"})
        import os

        if variants and "ttgir_tt.dot" in variants[0]:
            out = Path(os.environ.get("ASYMPD_OUT", "."))
            for i, dev_cache in enumerate(G._mxfp4_moe_kernel.device_caches.values()):
                for j, kern in enumerate(dev_cache[0].values()):
                    (out / f"mxfp4_{i}_{j}.ttgir").write_text(kern.asm.get("ttgir", ""))
        record("kernel_report", {"mxfp4_w13": report}, started)


if __name__ == "__main__":
    main()
