"""P's long prefix on two GPUs: context parallelism, the packed wire format, streaming (issue 17).

The model is V4.1-Flash at true width and **reduced depth** (``bench/p_throughput.reduced_config``:
3 layers -- a ratio-2 KV/index source like L2, the last KV source K with the candidate pool like
L20, one decoder layer; P holds layer 0 and layer 1's KV path). Random weights in the released
formats, every layer's experts aliasing layer 0's. Parts, each recorded as it finishes:

  cp      P TTFT (compute + export of the PrefixState) for 64K and 128K prompts, CP = 1 (one GPU,
          ``cp.local_prefill``) against CP = 2 (GPUs 0 and 1, NCCL, ``cp.cp_prefill``; the exporting
          rank on GPU 0), one forward per slice; whether the two states are the same bytes.
  bytes   global KV bytes per prompt token of the exported state: unpacked (bf16, in memory) and
          packed (the released FP4 formats, on the wire); the time to get the wire buffers to the
          host by packing on the GPU then copying, against copying the unpacked state and packing
          on the host (what P did before).
  stream  P (LLMEngine, prefill role, 16K-row chunks) on GPU 0, D (decode role) on GPU 1, the state
          over the TCP transport on loopback with D importing as slices arrive: the transfer time
          left on the TTFT path (P's last step done -> D holds the whole prefix) with the state
          handed over whole and streamed by chunk; D's first step and the TTFT.

    python bench/cp_prefill.py                 # the device run (nvidia-h200-x2), ~3-4 min
    python bench/cp_prefill.py --tiny          # CPU check: tiny widths, short prompts, gloo

Writes ``cp_prefill.json`` (``cp_prefill_tiny.json``) under $ASYMPD_OUT or bench/results.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log, record  # noqa: E402

LENGTHS = [65536, 131072]
TINY_LENGTHS = [200, 400]
CHUNK = 16384  # P's prefill chunk in the engine (part stream)
TINY_CHUNK = 64
CP_DEADLINE_S = 200.0  # the CP part's ranks are killed after this (a hung collective must not eat the run)


def model_config(tiny: bool):
    from asympd.config import tiny as tiny_cfg
    from bench.p_throughput import reduced_config

    return reduced_config(tiny_cfg().replace(max_seq_len=1 << 12) if tiny else None)


def weights(cfg, device: torch.device) -> dict[str, torch.Tensor]:
    """Storage-format tensors of the whole reduced model; experts alias layer 0's."""
    from bench.common import random_tensors

    tensors = random_tensors(cfg, lambda n: not (".ffn.experts." in n and not n.startswith("layers.0.")), device)
    for name in [n for n in tensors if n.startswith("layers.0.ffn.experts.")]:
        for layer in range(1, cfg.n_layers):
            tensors[name.replace("layers.0.", f"layers.{layer}.", 1)] = tensors[name]
    return tensors


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt(cfg, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()


def digest(state) -> str:
    return hashlib.sha256(state.serialize()).hexdigest()[:16]


# ---- part cp: one process per rank ----------------------------------------------------------------


def cp_rank(rank: int, world: int, init: str, tiny: bool, lengths: list[int], out: str) -> None:
    """Rank ``rank`` of the CP group: rank 0 runs CP = 1 alone, then both run CP = 2 (rank 0 holds the
    last slice and exports). Rank 0 writes ``out/cp.json`` (and the CP = 1 state of the first length
    to ``out/state.bin`` for part bytes)."""
    import datetime
    import json

    import torch.distributed as dist

    from asympd.engine import modes
    from asympd.engine.engine import checkpoint_id
    from asympd.model.loader import build_model
    from asympd.parallel.cp import cp_prefill, local_prefill
    from asympd.transfer.prefix_state import model_fingerprint

    torch.set_num_threads(1 if tiny else 8)
    device = torch.device("cpu") if tiny else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if tiny else "nccl"
    dist.init_process_group(
        backend, init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=150)
    )
    try:
        cfg = model_config(tiny)
        tensors = weights(cfg, device)
        for t in {id(t): t for t in tensors.values()}.values():  # rank 0's weights everywhere, as bytes
            dist.broadcast(t.reshape(-1).view(torch.uint8), src=0)
        dtype = torch.float32 if tiny else torch.bfloat16
        model = build_model(cfg, tensors, "prefill", dtype=dtype, device=device, hasher=None)
        fp = model_fingerprint(cfg, checkpoint_id(None), dtype)
        order = [*range(1, world), 0]

        def one_rank(ids: list[int], split: int) -> tuple[float, Any, int | None]:
            """CP = 1 on rank 0 (one forward; on an OOM, chunks of 32K then 16K rows), the others wait;
            every rank learns the chunk that fitted (CP = 2 then uses it too)."""
            dist.barrier()
            dt, state, chunk = 0.0, None, None
            if rank == 0:
                for chunk in (None, 32768, 16384):
                    try:
                        sync(device)
                        t = time.perf_counter()
                        state = local_prefill(model, ids, split, fingerprint=fp, chunk=chunk)
                        sync(device)
                        dt = time.perf_counter() - t
                        break
                    except torch.cuda.OutOfMemoryError:
                        state = None
                        torch.cuda.empty_cache()
                        log(f"CP=1 N={len(ids)} chunk {chunk}: out of memory")
            told = torch.tensor([chunk or 0], dtype=torch.int64, device=device)
            dist.broadcast(told, src=0)
            return dt, state, int(told.item()) or None

        def all_ranks(ids: list[int], split: int, chunk: int | None) -> tuple[float, Any]:
            dist.barrier()
            sync(device)
            t = time.perf_counter()
            state = cp_prefill(model, ids, split, fingerprint=fp, order=order, chunk=chunk)
            sync(device)
            dist.barrier()
            return time.perf_counter() - t, state

        warm = prompt(cfg, 4 * cfg.window_size if tiny else 4096, 0)
        warm_split = modes.split_point(cfg, len(warm), "carry")
        one_rank(warm, warm_split)
        all_ranks(warm, warm_split, None)
        rows = []
        for i, n in enumerate(lengths):
            ids = prompt(cfg, n, 1 + i)
            split = modes.split_point(cfg, n, "carry")
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t1, s1, chunk = one_rank(ids, split)
            peak1 = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t2, s2 = all_ranks(ids, split, chunk)
            peak2 = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            if rank == 0:
                same = digest(s1) == digest(s2)
                rows.append(
                    {
                        "prompt_tokens": n,
                        "split": split,
                        "cp1_ttft_s": t1,
                        "cp2_ttft_s": t2,
                        "speedup": t1 / t2,
                        "same_state_bytes": same,
                        "chunk": chunk,  # rows per forward within a slice (None: the whole slice)
                        "peak_gib_rank0": {"cp1": _gib(peak1), "cp2": _gib(peak2)},
                    }
                )
                log(f"cp N={n}: CP=1 {t1:.3f} s, CP=2 {t2:.3f} s ({t1 / t2:.2f}x), same state: {same}")
                if i == 0:
                    Path(out, "state.bin").write_bytes(s1.serialize())
                    Path(out, "state_split").write_text(str(split))
                del s1, s2
        if rank == 0:
            Path(out, "cp.json").write_text(json.dumps({"rows": rows, "backend": backend}))
    finally:
        dist.destroy_process_group()


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**30, 2)


def part_cp(tiny: bool, lengths: list[int], work: Path) -> dict[str, Any]:
    import json

    import torch.multiprocessing as mp

    init = f"file://{work}/rendezvous"
    ctx = mp.spawn(cp_rank, args=(2, init, tiny, lengths, str(work)), nprocs=2, join=False)
    end = time.monotonic() + CP_DEADLINE_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"the CP ranks did not finish within {CP_DEADLINE_S:.0f} s (killed)")
    res = json.loads((work / "cp.json").read_text())
    res["note"] = (
        "TTFT = P's compute of [0, split) + export (dense sequence cache, one forward per slice); CP = 2: "
        "rank 1 (GPU 1) computes the first slice, rank 0 (GPU 0) the second and exports. With a chunk (CP = 1 "
        "ran out of memory in one forward) a rank sends only after its last chunk, so CP = 2 overlaps less"
    )
    return res


# ---- part bytes -----------------------------------------------------------------------------------


def part_bytes(tiny: bool, work: Path) -> dict[str, Any]:
    from asympd.config import v41_flash
    from asympd.transfer.kv_pack import wire_bytes_per_token
    from asympd.transfer.prefix_state import PrefixState

    cfg = model_config(tiny)
    device = torch.device("cpu") if tiny else torch.device("cuda", 0)
    host = PrefixState.deserialize((work / "state.bin").read_bytes())
    split = int((work / "state_split").read_text())
    state = host.to(device)  # as P's export holds it: on the GPU, unpacked

    def global_kv(bufs: dict[str, torch.Tensor]) -> int:
        kinds = ("ckv", "idx", "ckv_scale", "idx_scale")
        return sum(t.numel() * t.element_size() for n, t in bufs.items() if n.split(".")[0] in kinds)

    unpacked = global_kv(state.named_buffers())
    packed = global_kv(state.wire_buffers())

    def device_pack() -> None:
        for b in state.wire_buffers().values():
            b.cpu()

    def host_pack() -> None:
        state.to("cpu").wire_buffers()

    times = {}
    for name, fn in (("pack_on_device_then_copy_s", device_pack), ("copy_then_pack_on_host_s", host_pack)):
        fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(3):
            fn()
        sync(device)
        times[name] = (time.perf_counter() - t) / 3
    return {
        "split": split,
        "cache_dtype": state.dtype,
        "unpacked_bytes_per_token": unpacked / split,
        "packed_bytes_per_token": packed / split,
        "ratio": unpacked / packed,
        "formula_packed_bytes_per_token": wire_bytes_per_token(cfg, "fp4"),
        "v41_flash_bytes_per_token": {
            "packed": wire_bytes_per_token(v41_flash(), "fp4"),
            "unpacked_bf16": wire_bytes_per_token(v41_flash(), "unpacked", 2),
        },
        "serialized_blob_bytes": len(host.serialize()),
        **times,
        "note": "global KV only (compressed main KV + index keys of the KV sources); this reduced model has "
        "2 KV sources (ratio 2 and ratio 1), V4.1-Flash 4: 890 B/token packed (facts section 5)",
    }


# ---- part stream ----------------------------------------------------------------------------------


def part_stream(tiny: bool, lengths: list[int]) -> dict[str, Any]:
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.scheduler import SchedulerConfig
    from asympd.model.loader import build_model
    from asympd.transfer import TcpTransport

    cfg = model_config(tiny)
    dev_p = torch.device("cpu") if tiny else torch.device("cuda", 0)
    dev_d = torch.device("cpu") if tiny else torch.device("cuda", 1)
    dtype = torch.float32 if tiny else torch.bfloat16
    chunk = TINY_CHUNK if tiny else CHUNK
    tensors = weights(cfg, dev_p)
    p_model = build_model(cfg, tensors, "prefill", dtype=dtype, device=dev_p, hasher=None)
    moved = {id(t): t.to(dev_d) for t in tensors.values()}  # the experts' aliasing kept
    d_tensors = {k: moved[id(t)] for k, t in tensors.items()}
    d_model = build_model(cfg, d_tensors, "decode", dtype=dtype, device=dev_d, hasher=None)
    del tensors, d_tensors, moved
    kv_bytes = (64 << 20) if tiny else (16 << 30)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk)
    d = LLMEngine(d_model, EngineConfig(role="decode", mode="asymmetric", kv_cache_bytes=kv_bytes, scheduler=sched))
    rows = []
    for streamed in (False, True):
        p = LLMEngine(
            p_model,
            EngineConfig(
                role="prefill", mode="asymmetric", kv_cache_bytes=kv_bytes, scheduler=sched, stream_prefix=streamed
            ),
        )
        for i, n in enumerate([lengths[0] // 8, *lengths]):  # the first is warm-up
            row = handover(p, d, cfg, prompt(cfg, n, 10 + i), f"{streamed}-{i}", dev_p, dev_d, TcpTransport)
            row.update(streamed=streamed, prompt_tokens=n, warmup=i == 0)
            rows.append(row)
            log(
                f"stream={streamed} N={n}: left on TTFT path {row['transfer_left_s'] * 1e3:.1f} ms, "
                f"slices {row['slices']}, TTFT {row['ttft_s']:.3f} s"
            )
        del p
    return {
        "rows": rows,
        "p_chunk": chunk,
        "note": "transfer_left_s: from the end of P's last step (compute + export of the last piece) until D "
        "holds the whole prefix in its cache; TCP on loopback through the host (no NIXL on the device image)",
    }


def handover(p, d, cfg, ids, rid, dev_p, dev_d, transport_cls) -> dict[str, Any]:
    """One request: P computes (pushing what it exports), D imports each piece as it arrives, then
    takes its first step."""
    from asympd.engine.sampling import SamplingParams
    from asympd.transfer.seal import new_transfer_id

    params = SamplingParams(max_tokens=1, temperature=0)
    tid = new_transfer_id()
    marks: dict[str, float] = {}
    errors: list[BaseException] = []
    with transport_cls(p.fingerprint) as tp_p, transport_cls(d.fingerprint) as tp_d:
        kv = tp_p.open_stream(tid)
        admitted = threading.Event()

        def decode() -> None:
            try:
                if dev_d.type == "cuda":
                    torch.cuda.set_device(dev_d)
                d.add_request(rid, ids, params, prefix_stream=True)
                d.step()  # admits it (blocks), computes nothing until the prefix is in
                admitted.set()
                nbytes = 0
                for piece in tp_d.fetch_stream(kv, d.fingerprint, timeout=120):
                    d.import_slice(rid, piece)
                    nbytes += piece.wire_nbytes
                    marks["slices"] = marks.get("slices", 0) + 1
                sync(dev_d)
                marks["ready"] = time.perf_counter()
                marks["bytes"] = nbytes
                first = False
                while not first:
                    first = any(o.outputs[0].token_ids for o in d.step())
                sync(dev_d)
                marks["first"] = time.perf_counter()
                while d.has_unfinished_requests():
                    d.step()
            except BaseException as e:
                errors.append(e)
                admitted.set()

        worker = threading.Thread(target=decode)
        worker.start()
        admitted.wait(60)
        if dev_p.type == "cuda":
            torch.cuda.set_device(dev_p)
        sync(dev_p)
        t0 = time.perf_counter()
        p.add_request(rid, ids, params)
        while rid in p.requests:
            for out in p.step():
                if out.prefix_state is not None:
                    tp_p.push(tid, out.prefix_state, last=out.finished)
        sync(dev_p)
        t_p = time.perf_counter()
        worker.join(300)
        p.release_transfer(rid)
    if errors:
        raise errors[0]
    return {
        "p_compute_s": t_p - t0,
        "transfer_left_s": marks["ready"] - t_p,
        "d_first_step_s": marks["first"] - marks["ready"],
        "ttft_s": marks["first"] - t0,
        "slices": marks["slices"],
        "wire_bytes": marks["bytes"],
    }


# ---- main -----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU check: tiny widths, short prompts, gloo")
    ap.add_argument("--parts", default="cp,bytes,stream")
    ap.add_argument("--lengths", default=None, help="prompt lengths, comma-separated (default 65536,131072)")
    args = ap.parse_args()
    started = time.time()
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else TINY_LENGTHS if args.tiny else LENGTHS
    if not args.tiny and torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs (nvidia-h200-x2); use --tiny for the CPU check")
    name = "cp_prefill_tiny" if args.tiny else "cp_prefill"
    res: dict[str, Any] = {
        "model": "V4.1-Flash widths, reduced depth: 3 layers (ratio-2 KV source, K, one decoder layer)"
        if not args.tiny
        else "tiny widths, reduced depth (3 layers)",
        "lengths": lengths,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    work = Path(tempfile.mkdtemp(prefix="cp-prefill-"))
    parts = {
        "cp": lambda: part_cp(args.tiny, lengths, work),
        "bytes": lambda: part_bytes(args.tiny, work),
        "stream": lambda: part_stream(args.tiny, lengths),
    }
    for part in args.parts.split(","):
        t = time.perf_counter()
        try:
            res[part] = parts[part]()
        except Exception:
            res[part] = {"error": traceback.format_exc(limit=8)}
            log(f"{part} failed:\n{res[part]['error']}")
        res[part]["wall_s"] = round(time.perf_counter() - t, 1)
        path = record(name, res, started)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
