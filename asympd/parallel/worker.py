"""``python -m asympd.parallel.worker``: one non-zero rank of an expert- or context-parallel worker.

Started by rank 0 (``asympd.parallel.launch.RankGroup``) with torchrun's environment contract plus
``ASYMPD_DIST_SPEC`` (checkpoint, role, device, dtype, threads, ep or cp). It loads its model (EP:
its shard of the experts; or builds it with ``RankSpec.builder``, a benchmark's weights drawn on
the device), reports ready in the store, joins the groups, and follows rank 0's messages until
``stop``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def _exit_with_parent() -> None:
    """Belt and braces for the parent-death signal (non-Linux, or a rank 0 thread that exited)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="asympd-parent-watch", daemon=True).start()


def main() -> int:
    from asympd.model.loader import load_model
    from asympd.parallel.cp_engine import serve_cp_rank
    from asympd.parallel.ep import shard_moe
    from asympd.parallel.executor import serve_rank
    from asympd.parallel.launch import SPEC_ENV, RankSpec, backend_for, dtype_of, join_groups, rank_device

    _exit_with_parent()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spec = RankSpec(**json.loads(os.environ[SPEC_ENV]))
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = rank_device(spec.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    if spec.builder is not None:  # a benchmark's model, e.g. weights drawn on the device (RankSpec.builder)
        module, name = spec.builder.split(":", 1)
        model = getattr(importlib.import_module(module), name)(spec, rank, world)
        if spec.parallel == "ep":
            shard_moe(model, rank, world)
    elif spec.parallel == "ep":  # this rank's experts only, and no drafter (it runs on rank 0)
        model = load_model(spec.checkpoint, spec.role, device, dtype_of(spec.dtype), spec.weights, ep=(rank, world))
        shard_moe(model, rank, world)
    else:  # CP: the whole prefill role on every rank
        model = load_model(spec.checkpoint, spec.role, device, dtype_of(spec.dtype), weights=spec.weights)
        if getattr(model, "drafter", None) is not None:
            model.drafter = None
    store.set(f"ready/{rank}", "1")
    control = join_groups(backend_for(spec.device), store, rank, world)
    try:
        if spec.parallel == "cp":
            serve_cp_rank(model, control)
        else:
            serve_rank(model, control, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
