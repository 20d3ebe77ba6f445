"""Prefill-worker throughput, asymmetric vs symmetric, per GPU-second.

Two parts:

``--e2e`` (device): a reduced-depth model at true V4.1 widths -- 3 layers: a ratio-2 KV/index
source (an encoder layer like L2), the last KV source with the candidate pool (like L20) and a
ratio-1 reuse layer (like L21) -- run through the real engine (``LLMEngine``, role ``prefill``,
chunked prefill at a 16K token budget, paged KV, prefix export) in both modes: asymmetric P (the
prefill role: layer 0 + layer 1's KV path on [0, N - W)) and symmetric P (the full model:
decoder-replay on [0, N), layer 2 on the last W rows). Writes ``p_e2e.json``.

``--compose`` (anywhere): P throughput of the full 40-layer model composed from the layer step
times ``bench/layers.py`` measured for exactly these steps (``layers.json``, section ``p_steps``),
checked against the e2e run (the same composition applied to the 3-layer model). Writes
``p_throughput.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

from bench.common import log, out_dir, record

BUDGET = 16384
LENGTHS = [1024, 4096, 16384, 65536]
# a realistic request mix by count (long-context chat/RAG/agent traffic: most prompts short, a
# long tail); stated as an assumption, not a measurement
MIX = {1024: 0.40, 4096: 0.30, 16384: 0.20, 65536: 0.10}
# layers a prefill worker runs per kind, full V4.1 (bench/layers.py kind_counts on L0..K)
P_MAIN = {
    "asymmetric": {"swa": 2, "enc_src": 3, "enc_reuse": 15, "dec_src_kv_path": 1},
    "symmetric": {"swa": 2, "enc_src": 3, "enc_reuse": 15, "dec_src": 1},
}
P_TAIL = {"asymmetric": {}, "symmetric": {"dec_reidx": 4, "dec_reuse": 15}}
# the reduced-depth model: layer 0 ~ enc_src, layer 1 ~ dec_src (K), layer 2 ~ dec_reuse
R_MAIN = {"asymmetric": {"enc_src": 1, "dec_src_kv_path": 1}, "symmetric": {"enc_src": 1, "dec_src": 1}}
R_TAIL = {"asymmetric": {}, "symmetric": {"dec_reuse": 1}}


def reduced_config(base=None):
    from asympd.config import v41_flash

    base = base or v41_flash()
    return base.replace(
        n_layers=3,
        n_mtp_layers=0,
        compress_ratios=(2, 1, 1),
        kv_source_layers=(0, 1),
        index_source_layers=(0, 1),
        candidate_source_layer=1,
        engram_layer_ids=(),
        engram_num_embeddings=(),
        dspark_block_size=0,
        dspark_target_layer_ids=(),
        vision_n_layers=0,
    )


# ---- e2e ------------------------------------------------------------------------------------------


def timed(eng, device) -> None:
    """Wrap the runner's forward and prefix export with synchronised timers (eng.timing, ms)."""
    eng.timing = {"forward_ms": 0.0, "export_ms": 0.0}
    runner = eng.runner

    def wrap(fn, key):
        def inner(*a, **k):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*a, **k)
            if device.type == "cuda":
                torch.cuda.synchronize()
            eng.timing[key] += (time.perf_counter() - t) * 1e3
            return out

        return inner

    runner.execute = wrap(runner.execute, "forward_ms")
    runner.export_prefix = wrap(runner.export_prefix, "export_ms")


def workload(eng, cfg, gen, device, n: int, count: int, tag: str) -> dict[str, Any]:
    """``count`` random prompts of ``n`` tokens through the prefill engine until all are exported."""
    ids = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for _ in range(count)]
    for i, p in enumerate(ids):
        eng.add_request(f"{tag}-{n}-{i}", p)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    eng.timing = {k: 0.0 for k in eng.timing}
    steps = []
    while eng.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = eng.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        steps.append(round((time.perf_counter() - s0) * 1e3, 2))
        for o in outs:
            if o.finished:
                eng.release_transfer(o.request_id)
    wall = time.perf_counter() - start
    return {
        "n_prompt": n,
        "prompts": count,
        "tokens": n * count,
        "wall_s": wall,
        "step_ms": steps,
        **{k: round(v, 2) for k, v in eng.timing.items()},
    }


def e2e(smoke: bool) -> dict[str, Any]:
    from asympd.config import tiny
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.scheduler import SchedulerConfig
    from asympd.model.loader import build_model
    from bench.common import random_tensors

    device = torch.device("cpu" if smoke else "cuda")
    cfg = reduced_config(tiny().replace(max_seq_len=1 << 16) if smoke else None)
    budget = 64 if smoke else BUDGET
    lengths = [48, 100] if smoke else LENGTHS
    reps = {n: max(1, 2 * budget // n) for n in lengths}  # two steps' worth of prompts
    t0 = time.time()
    # every layer's experts alias layer 0's packed tensors (same bytes, one copy of the raw data)
    tensors = random_tensors(cfg, lambda n: not (".ffn.experts." in n and not n.startswith("layers.0.")), device)
    for name in [n for n in tensors if n.startswith("layers.0.ffn.experts.")]:
        for layer in range(1, cfg.n_layers):
            tensors[name.replace("layers.0.", f"layers.{layer}.", 1)] = tensors[name]
    out: dict[str, Any] = {"config": "reduced-3-layer", "budget": budget, "gen_s": round(time.time() - t0, 1)}
    runs = []
    for mode in ("asymmetric", "symmetric"):
        role = "prefill" if mode == "asymmetric" else "full"
        t1 = time.time()
        model = build_model(cfg, tensors, role, dtype=torch.bfloat16, device=device, hasher=None)
        build_s = time.time() - t1
        sc = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget)
        ecfg = EngineConfig(
            role="prefill", mode=mode, kv_cache_bytes=(3 << 30) if not smoke else (64 << 20), scheduler=sc
        )
        ecfg.enable_prefix_caching = False
        eng = LLMEngine(model, ecfg)
        timed(eng, device)
        gen = torch.Generator().manual_seed(5)

        workload(eng, cfg, gen, device, lengths[0] * 2 if not smoke else 50, 1, "warm")
        for n in lengths:
            r = workload(eng, cfg, gen, device, n, reps[n], "run")
            r.update(mode=mode, tokens_per_s=r["tokens"] / r["wall_s"])
            runs.append(r)
            log(f"e2e {mode} N={n} x{r['prompts']}: {r['wall_s'] * 1e3:.1f} ms, {r['tokens_per_s']:.0f} tok/s")
        out.setdefault("build_s", {})[mode] = round(build_s, 1)
        out.setdefault("resident_gb", {})[mode] = round(model.resident_bytes() / 1e9, 2)
        eng.runner.__dict__.pop("execute", None)  # the timing wrappers close over eng: break the cycle
        eng.runner.__dict__.pop("export_prefix", None)
        del eng, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["runs"] = runs
    return out


# ---- composition ---------------------------------------------------------------------------------


def per_prompt_times(layers: dict[str, Any], main: dict, tail: dict) -> dict[tuple[int, str], dict[str, float]]:
    """(n_prompt, mode) -> {time per prompt in ms, steps}, from the measured p_steps."""
    acc: dict[tuple[int, str], dict[str, float]] = {}
    for st in layers["p_steps"]:
        key = (st["n_prompt"], st["mode"])
        t = sum(c * st["t_main"][k]["ms"] for k, c in main[st["mode"]].items())
        t += sum(c * st["t_tail"][k]["ms"] for k, c in tail[st["mode"]].items()) if st["t_tail"] else 0.0
        a = acc.setdefault(key, {"ms": 0.0, "prompts": 0.0, "steps": 0})
        a["ms"] += t
        a["prompts"] += st["prompts"]
        a["steps"] += 1
    return {k: {"ms_per_prompt": v["ms"] / v["prompts"], "steps": v["steps"]} for k, v in acc.items()}


def compose(layers: dict[str, Any], e2e_res: dict[str, Any] | None) -> dict[str, Any]:
    full = per_prompt_times(layers, P_MAIN, P_TAIL)
    table = []
    lengths = sorted({k[0] for k in full})
    for n in lengths:
        row: dict[str, Any] = {"n_prompt": n}
        for mode in ("asymmetric", "symmetric"):
            if (n, mode) in full:
                ms = full[(n, mode)]["ms_per_prompt"]
                row[mode] = {"ms_per_prompt": ms, "tokens_per_gpu_s": n / (ms / 1e3)}
        if "asymmetric" in row and "symmetric" in row:
            row["asym_over_sym"] = row["asymmetric"]["tokens_per_gpu_s"] / row["symmetric"]["tokens_per_gpu_s"]
        table.append(row)
    mix = {}
    if all((n, m) in full for n in MIX for m in ("asymmetric", "symmetric")):
        for mode in ("asymmetric", "symmetric"):
            tok = sum(w * n for n, w in MIX.items())
            ms = sum(w * full[(n, mode)]["ms_per_prompt"] for n, w in MIX.items())
            mix[mode] = {"tokens_per_gpu_s": tok / (ms / 1e3)}
        mix["asym_over_sym"] = mix["asymmetric"]["tokens_per_gpu_s"] / mix["symmetric"]["tokens_per_gpu_s"]
        mix["weights"] = MIX
    check = []
    if e2e_res:
        red = per_prompt_times(layers, R_MAIN, R_TAIL)
        for r in e2e_res["runs"]:
            key = (r["n_prompt"], r["mode"])
            if key not in red:
                continue
            composed_tps = r["n_prompt"] / (red[key]["ms_per_prompt"] / 1e3)
            check.append(
                {
                    "n_prompt": r["n_prompt"],
                    "mode": r["mode"],
                    "e2e_tokens_per_s": r["tokens_per_s"],
                    "composed_tokens_per_s": composed_tps,
                    "e2e_over_composed": r["tokens_per_s"] / composed_tps,
                }
            )
    return {
        "per_length": table,
        "mix": mix,
        "layer_counts": {"main": P_MAIN, "tail": P_TAIL},
        "reduced_check": check,
        "notes": [
            "composed: sum over the 40-layer P stack of layer step times measured in bench/layers.py (p_steps)",
            "per GPU-second = prompt tokens / (one GPU's compute time for them); assumes the weights are spread"
            " over as many GPUs as needed with ideal scaling (no communication cost)",
            "not included: Engram lookups (L1, L14), embedding, prefix export/transfer",
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--compose", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None, help="result name (default: the script's, _smoke with --smoke)")
    ap.add_argument("--layers", default=None, help="layers.json to compose from")
    args = ap.parse_args()
    started = time.time()
    if args.e2e:
        res = e2e(args.smoke)
        record("p_e2e_smoke" if args.smoke else "p_e2e", res, started)
    if args.compose:
        d = out_dir()
        layers = json.loads(open(args.layers or d / ("layers_smoke.json" if args.smoke else "layers.json")).read())
        e2e_path = d / ("p_e2e_smoke.json" if args.smoke else "p_e2e.json")
        e2e_res = json.loads(e2e_path.read_text()) if e2e_path.exists() else None
        res = compose(layers, e2e_res)
        res["inputs"] = {
            "layers": layers.get("source_digest"),
            "e2e": e2e_res.get("source_digest") if e2e_res else None,
        }
        record(args.out or ("p_throughput_smoke" if args.smoke else "p_throughput"), res, started)
        for row in res["per_length"]:
            log(row)
        log("mix", res["mix"])
        for c in res["reduced_check"]:
            log(c)


if __name__ == "__main__":
    main()
