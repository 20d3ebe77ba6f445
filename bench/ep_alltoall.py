"""Expert parallelism at true V4.1 widths: one MoE layer over ``--world`` GPUs, the all-to-all
dispatch/combine (``EPMoE``, comm="alltoall") against the dense all-reduce it replaced
(comm="allreduce"), at 16 ... 4096 tokens.

Each rank builds the layer the way the loader does for ``load_model(..., ep=(rank, world))``:
random weights in the released formats generated on its GPU (the rank's routed experts only, MXFP4,
``weights=packed-experts`` as on CUDA by default; gate and shared expert identical on every rank),
then ``loader._moe``. Every rank holds the same T tokens (attention is replicated today).

Per token count, on every rank, slowest rank reported (a collective layer waits for it):
  layer_ms       the whole EP MoE layer, both schemes (wall time between device synchronisations:
                 the all-to-all path synchronises once per exchange for its split sizes);
  comm_ms        the collectives alone, with this step's real split sizes: all-to-all = count exchange
                 + dispatch + combine + all-gather of the outputs; all-reduce = one fp32 [T, k, dim];
  wire_bytes     bytes this rank sent (measured from the split sizes; the all-reduce's ring volume);
  outputs_equal  whether both schemes gave the same bits (they add the same values in the same order).

    python bench/ep_alltoall.py                     # on nvidia-h200-x2: writes bench/results/ep_alltoall.json
    python bench/ep_alltoall.py --tiny --world 2    # CPU, gloo, tiny config: checks the script works
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if not torch.cuda.is_available():  # the MXFP4 grouped GEMM runs under Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from asympd.config import tiny, v41_flash  # noqa: E402
from asympd.parallel.ep import EPMoE, _pack, exchange, rank_tensors, token_range, wire_bytes  # noqa: E402

LAYER = 1  # any backbone MoE layer: they all have V4.1's 384 experts, top-6


def build_layer(cfg, rank: int, world: int, device: torch.device, weights: str) -> EPMoE:
    """Layer ``LAYER``'s MoE holding this rank's experts, as the loader builds it."""
    from asympd.model.loader import _moe, _Reader, resolve_weights
    from bench.common import random_tensors

    prefix = f"layers.{LAYER}.ffn."
    keep = rank_tensors(cfg, rank, world)

    def replicated(n: str) -> bool:
        return n.startswith(prefix) and not n.startswith(prefix + "experts.")

    def mine(n: str) -> bool:
        return n.startswith(prefix + "experts.") and keep(n)

    tensors = random_tensors(cfg, replicated, device, seed=0)  # gate + shared expert: the same on every rank
    tensors.update(random_tensors(cfg, mine, device, seed=1 + rank))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reader = _Reader(tensors, dtype, device, resolve_weights(weights, device))
    moe = _moe(cfg, LAYER, reader, prefix, ep=(rank, world))
    return EPMoE(moe, rank, world)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median wall ms of ``fn`` between device synchronisations, every rank starting together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        dist.barrier()
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def comm_step(ep: EPMoE, x: torch.Tensor):
    """The collectives of one all-to-all layer over x with its real split sizes, and the bytes this
    rank sends (remote rows only)."""
    t = x.size(0)
    a, b = token_range(t, ep.rank, ep.world)
    xl = x[a:b]
    weights, ids = ep.moe.route(xl)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    counts = torch.searchsorted(sorted_ids, ep.bounds.to(x.device)).diff()
    payload = _pack(xl[order // ids.size(1)], sorted_ids, weights.reshape(-1)[order])
    _, rc = exchange(payload, counts)
    out = x.new_empty(int(rc.sum()), x.size(1))
    y = x.new_empty(b - a, x.size(1))

    def run() -> None:
        _, recv_counts = exchange(payload, counts)
        exchange(out, recv_counts, recv_counts=counts)
        ep.gather(y, t)

    remote = int(counts.sum() - counts[ep.rank])
    n = -(-t // ep.world)
    sent = (
        remote * payload.size(1)
        + remote * x.size(1) * x.element_size()
        + n * x.size(1) * x.element_size() * (ep.world - 1)
    )
    return run, sent


def worker(rank: int, world: int, port: int, args: argparse.Namespace, started: float) -> None:
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        cfg = tiny().replace(n_activated_experts=3) if args.tiny else v41_flash()
        ep = build_layer(cfg, rank, world, device, args.weights)
        k, dim = ep.moe.topk, cfg.dim
        rows = []
        for t in args.tokens:
            g = torch.Generator(device=device).manual_seed(t)
            x = (torch.randn(t, dim, device=device, generator=g)).to(torch.bfloat16 if cuda else torch.float32)
            res = {"tokens": t}
            outs = {}
            for comm in ("alltoall", "allreduce"):
                ep.comm = comm
                outs[comm] = ep(x)
                res[comm] = {"layer_ms": timed(lambda x=x: ep(x), device, args.iters)}
            run, sent = comm_step(ep, x)
            res["alltoall"]["comm_ms"] = timed(run, device, args.iters)
            res["alltoall"]["wire_bytes"] = sent
            dense = torch.zeros(t, k, dim, dtype=torch.float32, device=device)
            res["allreduce"]["comm_ms"] = timed(lambda d=dense: dist.all_reduce(d), device, args.iters)
            res["allreduce"]["wire_bytes"] = 2 * (world - 1) / world * dense.numel() * 4
            for comm in ("alltoall", "allreduce"):
                res[comm]["wire_bytes_uniform_model"] = wire_bytes(dim, k, t, world, comm, x.element_size())
            res["outputs_equal"] = bool(torch.equal(outs["alltoall"], outs["allreduce"]))
            # the slowest rank's times, the largest send
            vals = torch.tensor(
                [res[c][f] for c in ("alltoall", "allreduce") for f in ("layer_ms", "comm_ms", "wire_bytes")]
                + [0.0 if res["outputs_equal"] else 1.0],
                dtype=torch.float64,
                device=device,
            )
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            v = vals.tolist()
            for i, c in enumerate(("alltoall", "allreduce")):
                res[c].update(layer_ms=v[3 * i], comm_ms=v[3 * i + 1], wire_bytes=v[3 * i + 2])
            res["outputs_equal"] = v[6] == 0.0
            res["layer_speedup"] = res["allreduce"]["layer_ms"] / res["alltoall"]["layer_ms"]
            res["comm_speedup"] = res["allreduce"]["comm_ms"] / res["alltoall"]["comm_ms"]
            rows.append(res)
            if rank == 0:
                print(
                    f"T {t:5d} | all-to-all layer {res['alltoall']['layer_ms']:8.3f} ms comm "
                    f"{res['alltoall']['comm_ms']:8.3f} ms {res['alltoall']['wire_bytes'] / 1e6:8.2f} MB | all-reduce "
                    f"layer {res['allreduce']['layer_ms']:8.3f} ms comm {res['allreduce']['comm_ms']:8.3f} ms "
                    f"{res['allreduce']['wire_bytes'] / 1e6:8.2f} MB | equal {res['outputs_equal']}",
                    flush=True,
                )
        if rank == 0:
            from bench.common import record

            out = dict(
                world=world,
                backend=dist.get_backend(),
                config="tiny (top-3)" if args.tiny else "v41-flash",
                weights=args.weights,
                dim=dim,
                n_experts=ep.moe.n_experts,
                topk=k,
                experts_per_rank=ep.hi - ep.lo,
                dtype=str(x.dtype).removeprefix("torch."),
                iters=args.iters,
                rows=rows,
            )
            print(f"wrote {record('ep_alltoall_tiny' if args.tiny else 'ep_alltoall', out, started)}", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the tiny config (CPU check)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even where a GPU is present")
    p.add_argument("--weights", default="packed-experts", help="loader layout (packed-experts: the CUDA default)")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=None)
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    if args.tokens is None:
        args.tokens = [16, 64, 256] if cpu else [16, 64, 256, 1024, 4096]
    if args.iters is None:
        args.iters = 3 if cpu else 20
    if not cpu and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--world {args.world} needs {args.world} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args, time.time()), nprocs=args.world)


if __name__ == "__main__":
    main()
