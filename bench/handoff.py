"""What the prefix hand-off costs each side, at V4.1-Flash's cache shapes, through the product's code.

P seals a finished prefix (an HMAC over its wire bytes: the released FP4 formats, transfer/kv_pack.py)
when it answers the router, then sends those bytes when D fetches. D receives them, unpacks the
values and checks the tag before anything touches its cache. Per prompt length this times, in one run:

- **P, the wire**: ``PrefixState.to_buffers(host=True)`` on a fresh state. That is the pack and the
  copy to the host, on the state's device; the seal and the send share it (eighth session). The old
  hand-off packed twice, with a host sync per candidate scale and buffer, so it is also timed here:
  ``old_pack_s`` is the one-at-a-time search the packer replaced, run on every buffer, times two.
- **D, the receipt**: a real TCP fetch from a real ``TcpTransport`` (``recv_s``: the socket plus
  the unpacking, on ``--device`` as a D on that device unpacks: ``tcp.unpack_received``), then
  ``seal.verify``. The current D checks the tag over the bytes
  that arrived (``verify_s``). The old D packed the received values again to check it
  (``verify_repack_s``, the same call on the same state without ``arrived``).
- **the floor of the check**: HMAC-SHA256 over the wire bytes alone (``hmac_s``): no check can take
  less time.

The states hold quantized random cache values (every ckv/idx entry through the reference's
quantizer, so packing is lossless as in the engine), the open compressor pair, and the token ids.
D's CPU time matters because D's engine thread shares the host (one GIL) with its fetches.

    python3 bench/handoff.py                 # V4.1 shapes, 1K-64K tokens; JSON to bench/results/handoff.json
    python3 bench/handoff.py --device cpu --name handoff_cpu   # P's cache on the host too
    python3 bench/handoff.py --smoke         # tiny config, two lengths: plumbing only (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.config import ModelConfig, tiny, v41_flash  # noqa: E402
from asympd.model.quant import E2M1_VALUES, FP4_TABLE, fp4_qdq, pack_fp4  # noqa: E402
from asympd.transfer import PrefixState, TcpTransport  # noqa: E402
from asympd.transfer.kv_pack import MXFP4, NVFP4, FP4Format  # noqa: E402
from asympd.transfer.prefix_state import tensor_bytes  # noqa: E402
from asympd.transfer.seal import seal, verify  # noqa: E402
from bench.common import log, record  # noqa: E402

SECRET = b"bench-handoff-secret-32-bytes!!!"


def fp4_state(cfg: ModelConfig, n_tokens: int, device: torch.device, seed: int = 0) -> PrefixState:
    """An asymmetric prefix of ``n_tokens`` (split N - W) whose ckv/idx are quantized cache values."""
    g = torch.Generator().manual_seed(seed)
    split = max(n_tokens - cfg.window_size, 1)
    tokens = torch.randint(0, cfg.vocab_size, (n_tokens,), generator=g)
    state = PrefixState.allocate(cfg, split, tokens, fingerprint="bench", kv_format="fp4")
    for layer in cfg.kv_source_layers:
        for kind, fmt in (("ckv", NVFP4), ("idx", MXFP4)):
            t = getattr(state, kind)[layer]
            x = torch.randn(t.shape, generator=g) * 2.0 ** torch.randint(-8, 4, (t.size(0), 1), generator=g)
            getattr(state, kind)[layer] = fp4_qdq(x, fmt.block, e4m3_scale=fmt is NVFP4).to(t.dtype).to(device)
    for kind in ("pair_kv", "pair_score"):
        for layer, t in getattr(state, kind).items():
            getattr(state, kind)[layer] = torch.randn(t.shape, generator=g)
    return state


def one_at_a_time(values: torch.Tensor, fmt: FP4Format) -> None:
    """The scale search the packer replaced: one candidate pass at a time over the blocks still
    without a scale, a host sync per pass (its output is not kept: only its time)."""
    g = values.float().reshape(-1, fmt.block)
    amax = g.abs().amax(-1)
    grid = E2M1_VALUES.to(g.device)
    table = FP4_TABLE.to(g.device)
    codes = torch.zeros(g.shape, dtype=torch.uint8, device=g.device)
    todo = torch.arange(g.size(0), device=g.device)
    for i, c in enumerate(E2M1_VALUES[1:].flip(0).tolist()):
        if todo.numel() == 0:
            break
        gt, at = g[todo], amax[todo]
        s = at / c
        if i == 0:
            s = torch.where(at == 0, torch.full_like(at, fmt.zero_scale), s)
        q = gt / s.unsqueeze(-1)
        cand = torch.searchsorted(grid, q.abs().contiguous()).clamp_max(7).to(torch.uint8)
        cand |= torch.signbit(q).to(torch.uint8) << 3
        exact = (table[cand.long()] * s.unsqueeze(-1)).view(torch.int32) == gt.view(torch.int32)
        ok = fmt.scale_ok(s) & exact.all(-1)
        codes[todo[ok]] = cand[ok]
        todo = todo[~ok]
    pack_fp4(codes)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, Any]:
    """The median seconds of ``repeats`` calls after one untimed call (each from a synchronised
    device) and the last result."""
    times, out = [], fn()
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(cfg: ModelConfig, n_tokens: int, device: torch.device, repeats: int) -> dict[str, Any]:
    state = fp4_state(cfg, n_tokens, device)
    # a new state each time (the same tensors, no wire made yet), as each export makes one
    wire_s, (header, buffers) = timed(lambda: dataclasses.replace(state).to_buffers(host=True), device, repeats)
    nbytes = len(header) + sum(b.numel() * b.element_size() for b in buffers)
    packed = [t for kind in ("ckv", "idx") for t in getattr(state, kind).values()]
    fmts = [NVFP4] * len(state.ckv) + [MXFP4] * len(state.idx)
    old_pack_s, _ = timed(lambda: [one_at_a_time(t, f) for t, f in zip(packed, fmts, strict=True)], device, repeats)
    tag = seal(SECRET, "xfer-bench", state)
    ids = state.token_ids.tolist()
    with TcpTransport("bench", secret=SECRET) as p, TcpTransport("bench", secret=SECRET, device=device) as d:
        recv, verify_s, verify_repack_s = [], [], []
        for i in range(repeats):
            params = p.publish(f"xfer-{i}", state)
            t0 = time.perf_counter()
            got = d.fetch(params, "bench", timeout=600, ack=True)
            recv.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            verify(SECRET, "xfer-bench", got, tag, ids)
            verify_s.append(time.perf_counter() - t0)
            got.arrived = None  # the old D: pack the received values again to check the tag
            t0 = time.perf_counter()
            verify(SECRET, "xfer-bench", got, tag, ids)
            verify_repack_s.append(time.perf_counter() - t0)

    def digest() -> str:
        mac = hmac.new(SECRET, header, hashlib.sha256)
        for b in buffers:
            mac.update(memoryview(tensor_bytes(b)))
        return mac.hexdigest()

    hmac_s, _ = timed(digest, torch.device("cpu"), 10)
    row = {
        "prompt_tokens": n_tokens,
        "split": state.split,
        "wire_bytes": nbytes,
        "p_wire_s": round(wire_s, 6),
        "p_old_pack_s": round(2 * old_pack_s, 6),
        "d_recv_s": round(statistics.median(recv), 6),
        "d_verify_s": round(statistics.median(verify_s), 6),
        "d_verify_repack_s": round(statistics.median(verify_repack_s), 6),
        "hmac_floor_s": round(hmac_s, 6),
    }
    row["d_verify_speedup"] = round(row["d_verify_repack_s"] / row["d_verify_s"], 2)
    row["d_verify_over_floor"] = round(row["d_verify_s"] / row["hmac_floor_s"], 2)
    row["d_total_old_s"] = round(row["d_recv_s"] + row["d_verify_repack_s"], 6)
    row["d_total_s"] = round(row["d_recv_s"] + row["d_verify_s"], 6)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny config, two short lengths (CI)")
    ap.add_argument("--lengths", default="1024,4096,16384,65536")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="handoff", help="the result's file name (without .json)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where P's cache lives")
    args = ap.parse_args()
    started = time.time()
    cfg = tiny() if args.smoke else v41_flash()
    lengths = [200, 1000] if args.smoke else [int(x) for x in args.lengths.split(",")]
    device = torch.device(args.device)
    rows = []
    for n in lengths:
        rows.append(measure(cfg, n, device, 1 if args.smoke else args.repeats))
        log(rows[-1])
    name = f"{args.name}_smoke" if args.smoke else args.name
    path = record(
        name,
        {
            "config": "tiny" if args.smoke else "v41_flash",
            "p_device": str(device),
            "d_unpack_device": str(device),
            "d_host_threads": torch.get_num_threads(),
            "rows": rows,
        },
        started,
    )
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
