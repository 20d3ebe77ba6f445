"""Where a layer step's time goes: the torch profiler's top CUDA kernels for a few true-shape layer
steps, and the attention GEMM in the ways torch can run it (a choice the layer path makes).

Writes ``profile.json``. Device only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from bench.common import log, record, time_cuda


def top_kernels(fn, n: int = 25) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t:
            rows.append({"name": e.key[:160], "calls": e.count, "device_ms": t / 1e3})
    rows.sort(key=lambda r: -r["device_ms"])
    total = sum(r["device_ms"] for r in rows)
    return [{"total_device_ms": total}] + rows[:n]


def attention_gemms() -> list[dict[str, Any]]:
    """logits = q [m, 64, 512] x keys^T [m, 512, n] for one 2048-row chunk, four ways."""
    out = []
    dev = torch.device("cuda")
    for n_keys in (128, 640):
        m = 2048
        q = torch.randn(m, 64, 512, device=dev).to(torch.bfloat16)
        k = torch.randn(m, n_keys, 512, device=dev).to(torch.bfloat16)
        kt = k.transpose(1, 2)
        flops = 2 * m * 64 * 512 * n_keys
        kc = kt.contiguous()
        ways = {
            "bmm_bf16_out_f32": lambda q=q, kt=kt: torch.bmm(q, kt, out_dtype=torch.float32),
            "bmm_bf16_out_bf16": lambda q=q, kt=kt: torch.bmm(q, kt),
            "bmm_bf16_contig_keysT_out_f32": lambda q=q, kc=kc: torch.bmm(q, kc, out_dtype=torch.float32),
        }
        qf, kf = q.float(), kt.float()

        def tf32(qf=qf, kf=kf):
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                return torch.bmm(qf, kf)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False

        ways["bmm_fp32_inputs_tf32"] = tf32
        ways["bmm_fp32_inputs_fp32"] = lambda qf=qf, kf=kf: torch.bmm(qf, kf)
        for name, fn in ways.items():
            try:
                t = time_cuda(fn, iters=10, warmup=2)
                out.append({"keys": n_keys, "way": name, "ms": t["ms"], "TFLOPs": flops / (t["ms"] * 1e-3) / 1e12})
            except Exception as e:
                out.append({"keys": n_keys, "way": name, "error": str(e)[:200]})
            log(out[-1])
    return out


def main() -> None:
    from asympd.config import v41_flash
    from bench.common import step_block as group_block_forward
    from bench.layers import Steps, Timer, build, step_inputs

    started = time.time()
    cfg, device = v41_flash(), torch.device("cuda")
    res: dict[str, Any] = {"attention_gemms": attention_gemms()}
    built, _ = build(cfg, device, ("bf16",))
    steps = Steps(cfg, built, Timer(device), None, device)
    cases = {
        "prefill_16384_swa": ([dict(n=1, q=16384, start=0)], "swa"),
        "prefill_16384_dec_reuse": ([dict(n=1, q=16384, start=0)], "dec_reuse"),
        "prefill_16384_at_48K_dec_src": ([dict(n=1, q=16384, start=49152)], "dec_src"),
        "decode_256x4_at_16K_dec_src": ([dict(n=256, q=4, start=16384)], "dec_src"),
    }
    res["profiles"] = {}
    with torch.inference_mode():
        for name, (specs, kind) in cases.items():
            groups = steps.groups(specs)
            rows = groups.rows
            h, pre = step_inputs(cfg, rows, device, steps.gen)
            group_block_forward(built["blocks"]["dec_src"], h, pre, groups)
            block = built["blocks"][kind]
            res["profiles"][name] = top_kernels(lambda b=block, g=groups, h=h, p=pre: group_block_forward(b, h, p, g))
            log(name, res["profiles"][name][:6])
            del groups, h, pre
            torch.cuda.empty_cache()
    record("profile", res, started)


if __name__ == "__main__":
    main()
