"""A warmed-up P engine's prompt steps, one by one: which cost more than their size says, and why.

In the true-depth co-runs P's first step of 1107 prompt rows held the GPU 533 ms and its first of
1706 rows 455-537 ms, where 1792 rows took 186 ms (``e2e_h200x1_depth40_v10``, ``_v11``), after
the engine's start-up warm-up (engine/warm_up.py) had run 28 prompts. Such a step is a stall in
P's fitted step line (asympd.plan.validate ``stalls``) and, mid-traffic, in the TTFT of every
prompt behind it. This builds the P worker's engine exactly as ``asympd serve --role prefill --mode
asymmetric`` does (the same flags through ``serve_config_from_args``, ``load_model``,
``LLMEngine``: its warm-up included) on the study's checkpoint, then runs groups of prompts, one
group at a time (a group's prompts added together, as a burst reaches P), and for every step
records its prompt rows, its seconds to the GPU's end, and what ran inside it besides the model:
Triton compiles (the server's ``CompileWatch``: a compile or a load from the on-disk cache, each
a new specialisation; the first runs recorded the hook's whole kernel signature, later ones the
kernel's name) and the caching allocator's new segments (cudaMalloc).

    python3 bench/first_steps.py                    # H200: depth 40, the co-runs' sizes (first_steps.json)
    python3 bench/first_steps.py --tiny --groups '5;7+9' --out first_steps_tiny   # CPU

``--groups``: prompt rows (a P prompt is rows + W tokens), ``+`` within a group, ``;`` between
groups. The default is v11's co-run sizes in its order (896-row lone prompts, the mid burst's first
prompt and the rest together, the fill's first prompt, 1792 rows), then each of them again.

``--anatomy GROUPS``: after the groups, each of these groups three more times, to say where a
step's time goes when it is longer than its kernels (a lone 896-row P step takes 133-160 ms at
true depth where the composed layer benchmarks give about 35 ms): (1) plain, timing the step's
return to the host apart from the GPU's end (a host that returns long before the GPU ends is
not what holds the step; one that returns at the end is, or waited on the GPU inside); (2) under
``torch.cuda.set_sync_debug_mode("warn")``, counting each synchronizing call by its innermost
asympd frame (each is a point where the host waits for the GPU, and the GPU then for the host's
next launches); (3) under the PyTorch profiler: kernels launched, their summed GPU time (the step's
floor if nothing overlapped), and the ops with the most host time.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from asympd.engine.engine import CUDA_GRAPH_MODES  # noqa: E402
from asympd.serve.stall_watch import freeze_start_up_objects  # noqa: E402
from bench.common import log, record  # noqa: E402

DEFAULT_GROUPS = "896;896;1107;2269+2821+1483;1706;1792;896;1107;2269+2821+1483;1706;1792;1235;3001"


def parse_groups(text: str) -> list[list[int]]:
    """``'896;1107+2269'`` -> [[896], [1107, 2269]]; every size a positive integer."""
    try:
        groups = [[int(x) for x in g.split("+")] for g in text.split(";") if g.strip()]
    except ValueError as e:
        raise ValueError(f"--groups: prompt rows as integers, '+' within a group, ';' between: {e}") from None
    if not groups or any(r < 1 for g in groups for r in g):
        raise ValueError(f"--groups: at least one group of positive row counts, got {text!r}")
    return groups


class Watch:
    """What ran inside a step besides the model: Triton specialisations compiled or loaded (the
    server's own ``CompileWatch``), and the allocator's new segments (on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        from asympd.serve.stall_watch import CompileWatch, GCWatch

        self.device = device
        self.compiles = CompileWatch()
        self.gc = GCWatch()
        self.clocks = ClockSampler(device.index or 0) if device.type == "cuda" else None

    def compiled_since(self, mark: int) -> list[str]:
        return [name for name, n in self.compiles.since(mark).items() for _ in range(n)]

    def segments(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("segment.all.allocated", 0))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def build_engine(ckpt: str, device: str, step_tokens: int, kv_cache_bytes: int, shared: bool, extra: list[str]):
    """The P worker's engine as ``asympd serve --role prefill --mode asymmetric [extra]`` builds it."""
    from asympd.engine import modes
    from asympd.engine.engine import LLMEngine
    from asympd.model.loader import load_model
    from asympd.serve.config import add_serve_arguments, serve_config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    flags = ["--role", "prefill", "--mode", "asymmetric", "--checkpoint", ckpt, "--device", device]
    flags += ["--kv-cache-bytes", str(kv_cache_bytes), "--max-num-batched-tokens", str(step_tokens)]
    flags += (["--benchmark-shared-experts"] if shared else []) + extra
    cfg = serve_config_from_args(p.parse_args(flags)).resolve()
    role = modes.model_role(cfg.role, cfg.mode)
    model = load_model(cfg.checkpoint, role, cfg.device, cfg.dtype, cfg.weights, shared_experts=shared)
    return LLMEngine(model, cfg.engine)


def run_group(engine, group: list[int], tag: str, watch: Watch, vocab: int, seed: int) -> list[dict[str, Any]]:
    """Add the group's prompts together, step until each is exported, release them; every step's
    record."""
    rids = _add_group(engine, group, tag, vocab, seed)
    steps = []
    for _ in range(sum(group) + 8 * len(group)):
        if not _in_prompt(engine, rids):
            break
        watch.sync()
        mark, segs, graphs, gc_mark = watch.compiles.mark(), watch.segments(), _captured(engine), watch.gc.mark()
        pinned = _pinned_allocs(engine)
        wall, t = time.time(), time.perf_counter()
        engine.step()
        host = time.perf_counter() - t
        watch.sync()
        dt = time.perf_counter() - t
        steps.append(
            {
                "rows": engine.last_step[0],
                "ms": round(dt * 1e3, 2),
                "host_ms": round(host * 1e3, 2),  # when the step returned: before the GPU end, or the host held it
                "compiles": watch.compiled_since(mark),
                "new_segments": watch.segments() - segs,
                "graphs_captured": _captured(engine) - graphs,  # a capture mid-traffic (a piece of a new size)
                "gc": watch.gc.since(gc_mark),  # the collector's pauses inside the step
                "pinned_allocs": _pinned_allocs(engine) - pinned,  # the export's new host buffers (cudaHostAlloc)
                "clocks": None if watch.clocks is None else watch.clocks.during(wall, wall + dt),
            }
        )
    else:
        raise RuntimeError(f"group {group} made no progress")
    _release(engine, rids)
    return steps


def _captured(engine) -> int:
    """CUDA graphs (or pieces) the engine has captured so far."""
    graphs = engine.runner.graphs
    return 0 if graphs is None else graphs.stats["captured"]


def parse_smi_line(line: str) -> tuple[float, float, float] | None:
    """(SM clock MHz, power W, temperature C) from one ``nvidia-smi --query-gpu=clocks.sm,power.draw,
    temperature.gpu --format=csv,noheader,nounits`` line; None for a line that is not three numbers."""
    try:
        mhz, watts, temp = (float(x) for x in line.split(","))
    except ValueError:
        return None
    return mhz, watts, temp


class ClockSampler:
    """The GPU's SM clock, power and temperature every ``period_ms`` (``nvidia-smi -lms``, read on a
    thread), so that each step can say what the chip ran at: a step 30-65 ms over its twin with no
    compile, capture, allocation or collection in it (docs/performance.md §12) may be a clock that
    dropped while the GPU idled between steps, or a power limit. Nothing without ``nvidia-smi``."""

    def __init__(self, device_index: int = 0, period_ms: int = 20) -> None:
        self.samples: list[tuple[float, float, float, float]] = []  # (wall time read, MHz, W, C)
        self._lock = threading.Lock()
        query = "--query-gpu=clocks.sm,power.draw,temperature.gpu"
        cmd = ["nvidia-smi", query, "--format=csv,noheader,nounits", f"--loop-ms={period_ms}", f"--id={device_index}"]
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, name="clock-sampler", daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            got = parse_smi_line(line)
            if got is not None:
                with self._lock:
                    self.samples.append((time.time(), *got))

    def during(self, t0: float, t1: float) -> dict[str, float] | None:
        """The samples read between wall times ``t0`` and ``t1``: the lowest and mean SM clock, the
        highest power and temperature; None without a sampler or a sample."""
        with self._lock:
            inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return None
        mhz = [s[1] for s in inside]
        return {
            "samples": len(inside),
            "sm_mhz_min": min(mhz),
            "sm_mhz_mean": round(sum(mhz) / len(mhz), 1),
            "watts_max": max(s[2] for s in inside),
            "temp_c_max": max(s[3] for s in inside),
        }

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(5)


def _clock_line(c: dict[str, float]) -> str:
    return f"{c['sm_mhz_min']:.0f}-{c['sm_mhz_mean']:.0f} MHz, up to {c['watts_max']:.0f} W ({c['samples']} samples)"


def _pinned_allocs(engine) -> int:
    """Pinned host buffers the exporter's pool has allocated so far (not reused ones)."""
    return engine.runner.exporter.pool.counters["allocated"]


def _add_group(engine, group: list[int], tag: str, vocab: int, seed: int) -> list[str]:
    from asympd.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    w = engine.cfg.window_size
    rids = []
    for k, rows in enumerate(group):
        rid = f"{tag}-{k}"
        ids = torch.randint(3, vocab, (rows + w,), generator=g).tolist()
        engine.add_request(rid, ids, SamplingParams(max_tokens=1, ignore_eos=True))
        rids.append(rid)
    return rids


def _in_prompt(engine, rids: list[str]) -> bool:
    return any(r in engine.requests and engine.requests[r].in_prompt for r in rids)


def _release(engine, rids: list[str]) -> None:
    for rid in rids:
        engine.abort_request(rid)
        engine.release_transfer(rid)


class SyncSites:
    """Synchronizing CUDA calls made inside ``with``, by their innermost asympd frame (file:line
    function); nothing on CPU, where no call synchronizes."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.sites = device, collections.Counter()

    def _hook(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return self._shown(message, category, filename, lineno, file, line)
        ours = [f for f in traceback.extract_stack()[:-1] if "/asympd/" in f.filename.replace("\\", "/")]
        f = ours[-1] if ours else None
        self.sites[f"{Path(f.filename).name}:{f.lineno} {f.name}" if f else f"{Path(filename).name}:{lineno}"] += 1

    def __enter__(self) -> SyncSites:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._shown, warnings.showwarning = warnings.showwarning, self._hook
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        self._catch.__exit__(*exc)


def _profiled_step(engine, device: torch.device, top: int = 12) -> dict[str, Any]:
    """One step under the PyTorch profiler: kernels launched, their summed GPU time, and the
    ``top`` ops by host self time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: e.self_cpu_time_total, reverse=True)  # fmt: skip
    return {
        "kernels": sum(e.count for e in gpu),
        "kernel_ms": round(sum(e.self_device_time_total for e in gpu) / 1e3, 2),
        "host_ops": sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CPU),
        "top_host_ops": [
            {"op": e.key, "count": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in host[:top]
        ],
    }


def anatomy(engine, group: list[int], tag: str, watch: Watch, vocab: int) -> dict[str, Any]:
    """One group's first step three times over (fresh requests each time, the same prompts):
    timed plain (host return and GPU end), under sync debugging, under the profiler."""
    out: dict[str, Any] = {"prompt_rows": group}
    for kind in ("plain", "syncs", "profile"):
        rids = _add_group(engine, group, f"{tag}-{kind}", vocab, seed=7)
        watch.sync()
        t = time.perf_counter()
        if kind == "plain":
            engine.step()
            host = time.perf_counter() - t
            watch.sync()
            out |= {"rows": engine.last_step[0], "host_ms": round(host * 1e3, 2)}
            out["gpu_end_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        elif kind == "syncs":
            with SyncSites(watch.device) as sites:
                engine.step()
            watch.sync()
            out["sync_ms"] = round((time.perf_counter() - t) * 1e3, 2)
            out["syncs"] = sum(sites.sites.values())
            out["sync_sites"] = dict(sites.sites.most_common())
        else:
            out["profile"] = _profiled_step(engine, watch.device)
        for _ in range(sum(group) + 8 * len(group)):  # the rest of the prompts' steps, untimed
            if not _in_prompt(engine, rids):
                break
            engine.step()
        _release(engine, rids)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU: the tiny checkpoint (tests)")
    ap.add_argument("--groups", default=DEFAULT_GROUPS, help="prompt rows: '+' within a group, ';' between")
    ap.add_argument("--step-tokens", type=int, default=None, help="P's step budget (default: the e2e study's)")
    ap.add_argument("--anatomy", default="", help="groups whose first step is timed, sync-checked and profiled")
    ap.add_argument(
        "--cuda-graph-mode",
        choices=CUDA_GRAPH_MODES,
        default=None,
        help="P's --cuda-graph-mode (default: the prefill worker's, full_and_piecewise; full: eager prompt steps)",
    )
    ap.add_argument(
        "--gc",
        choices=["freeze", "plain"],
        default="freeze",
        help="freeze: start-up's objects frozen out of the collector, as the server does; plain: not",
    )
    ap.add_argument("--out", default="first_steps")
    args = ap.parse_args(argv)
    groups = parse_groups(args.groups)
    anatomy_groups = parse_groups(args.anatomy) if args.anatomy else []
    started = time.time()

    from bench.e2e import defaults, make_checkpoint

    d = defaults(args.tiny, 40)
    step_tokens = args.step_tokens or d["p_step_tokens"]
    device = "cpu" if args.tiny else "cuda"
    with tempfile.TemporaryDirectory(prefix="asympd_first_steps_") as work:
        ck = argparse.Namespace(checkpoint=None, tiny=args.tiny, depth=40)
        ckpt, info = make_checkpoint(ck, Path(work))
        log(f"checkpoint {ckpt}")
        t = time.perf_counter()
        watch = Watch(torch.device(device))
        try:
            extra = ["--cuda-graph-mode", args.cuda_graph_mode] if args.cuda_graph_mode else []
            engine = build_engine(ckpt, device, step_tokens, int(d["kv_cache_gb"] * 2**30), ck.shared_experts, extra)
            build_s = time.perf_counter() - t
            frozen = freeze_start_up_objects() if args.gc == "freeze" else 0
            warm = engine.warm_up_report
            start_compiles = watch.compiles.total
            log(f"engine built in {build_s:.1f} s; {warm.line() if warm else 'no warm-up'}; {start_compiles} compiles")
            out: dict[str, Any] = {
                "checkpoint": info,
                "step_tokens": step_tokens,
                "cuda_graph_mode": engine.config.cuda_graph_mode,
                "pieces": None if engine.runner.graphs is None else engine.runner.graphs.stats,
                "window": engine.cfg.window_size,
                "build_s": round(build_s, 1),
                "warm_up": {"rows": list(warm.rows), "seconds": round(warm.seconds, 2)} if warm else None,
                "compiles_at_build": start_compiles,
                "gc": args.gc,
                "gc_frozen_objects": frozen,
                "groups": [],
            }
            for i, group in enumerate(groups):
                steps = run_group(engine, group, f"g{i}", watch, engine.cfg.vocab_size, seed=i)
                out["groups"].append({"prompt_rows": group, "steps": steps})
                for s in steps:
                    log(
                        f"group {i} {group}: step of {s['rows']} rows {s['ms']} ms (host returned at {s['host_ms']}), "
                        f"{len(s['compiles'])} compiles, "
                        f"{s['new_segments']} new segments, {s['graphs_captured']} graphs captured, "
                        f"GC {s['gc']['ms']} ms ({s['gc']['gen2']} of the oldest generation), "
                        f"{s['pinned_allocs']} pinned buffers allocated"
                        + (f"; SM clock {_clock_line(s['clocks'])}" if s["clocks"] else "")
                    )
                record(args.out, out, started)
            if anatomy_groups:
                out["anatomy"] = []
            for i, group in enumerate(anatomy_groups):
                a = anatomy(engine, group, f"a{i}", watch, engine.cfg.vocab_size)
                out["anatomy"].append(a)
                prof = a["profile"]
                log(
                    f"anatomy {group}: {a['rows']} rows, host {a['host_ms']} ms, GPU end {a['gpu_end_ms']} ms; "
                    f"{a['syncs']} syncs ({a['sync_ms']} ms); {prof['kernels']} kernels, {prof['kernel_ms']} ms "
                    f"of them; {prof['host_ops']} host ops"
                )
                log(f"  sync sites: {a['sync_sites']}")
                log(f"  top host ops: {prof['top_host_ops'][:6]}")
                record(args.out, out, started)
            if engine.runner.graphs is not None:
                out["pieces"] = engine.runner.graphs.stats  # after the groups: pieces captured while stepping
                record(args.out, out, started)
        finally:
            watch.compiles.close()  # the hooks are process-wide
            watch.gc.close()
            if watch.clocks is not None:
                watch.clocks.close()
    log(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
