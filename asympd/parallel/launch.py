"""Starting the ranks of one expert- or context-parallel worker from the worker itself.

Rank 0 is the calling process (it runs the engine); ranks 1..N-1 are child processes running
``python -m asympd.parallel.worker`` with torchrun's environment contract (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so the same worker can also be started by hand or by torchrun.

Rendezvous is a ``TCPStore`` that rank 0 hosts on an ephemeral port (no port race). Each child
loads its model shard, then sets ``ready/<rank>`` in the store; rank 0 waits for those keys while
watching the children, so a child that dies while loading is reported with its exit status instead
of a hang inside ``init_process_group``. Then every rank joins two groups:

- the default group (gloo on CPU, NCCL on CUDA): the data plane, the MoE ``all_reduce`` and the
  tensors of mirrored cache writes;
- a gloo group without a practical timeout: the control plane, the step plans. Idle workers block
  here for as long as the server is idle, on the CPU, as vLLM's workers block on their message
  queue, instead of in a device collective.

No orphans: children get a parent-death signal (Linux) and their own session (a terminal's Ctrl-C
reaches rank 0 only, which then stops them in order); ``close`` stops them gracefully when the
group is consistent and kills them when it is not.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = datetime.timedelta(days=3650)  # idle workers wait on the control group this long
DATA_TIMEOUT = datetime.timedelta(minutes=10)  # one collective inside a forward
SPEC_ENV = "ASYMPD_DIST_SPEC"
log = logging.getLogger(__name__)

try:  # resolved in the parent: between fork and exec the child should only make the call
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform == "linux" else None
except OSError:
    _prctl = None


def _die_with_parent() -> None:  # in the child between fork and exec (as asympd.serve.procs does)
    with contextlib.suppress(Exception):
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class RankSpec:
    """What a rank needs to build its share of the model (sent to children as JSON)."""

    checkpoint: str
    role: str  # the model role: full | decode | prefill
    device: str = "cpu"  # "cpu", or "cuda": rank r then uses cuda:r of this host
    dtype: str = "float32"
    threads: int | None = None  # torch intra-op threads per rank (None: rank 0's count)
    parallel: str = "ep"  # ep: experts sharded, rank 0's steps replayed; cp: P's prefix split (cp_engine.py)
    weights: str = "auto"  # the loader's weight layout (asympd.model.loader.LAYOUTS)
    # benchmarks: "module:function" building this rank's model in place of reading ``checkpoint``,
    # called as function(spec, rank, world) -> Transformer, before the worker shards its MoE layers
    # (bench/prefill_role.py draws each rank's weights on its GPU: no 150 GB checkpoint on disk)
    builder: str | None = None
    builder_args: dict[str, Any] = field(default_factory=dict)  # JSON values, for the builder

    def __post_init__(self) -> None:
        if self.parallel not in ("ep", "cp"):
            raise ValueError(f"parallel must be 'ep' or 'cp', got {self.parallel!r}")
        if self.builder is not None and ":" not in self.builder:
            raise ValueError(f"builder must be 'module:function', got {self.builder!r}")


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank``: one GPU per rank on one host; the CPU for every rank on CPU."""
    d = torch.device(device)
    return torch.device("cuda", rank) if d.type == "cuda" else d


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class RankGroup:
    """Ranks 1..N-1 of one expert-parallel worker, as child processes of rank 0 (this process)."""

    def __init__(self, world_size: int, spec: RankSpec, *, host: str = "127.0.0.1", stderr: Any = None):
        if world_size < 2:
            raise ValueError(f"a rank group needs at least 2 ranks, got {world_size}")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a process group: one EP worker per process")
        if spec.threads is None:
            spec.threads = torch.get_num_threads()
        d = torch.device(spec.device)
        if d.type == "cuda" and d.index not in (None, 0):
            raise ValueError(f"device {spec.device!r}: rank r runs on cuda:r; pick GPUs with CUDA_VISIBLE_DEVICES")
        self.world_size, self.spec, self.host = world_size, spec, host
        self.kind = spec.parallel.upper()  # EP or CP, in messages
        self.rank = 0
        self.device = rank_device(spec.device, 0)
        self.backend = backend_for(spec.device)
        self.control: Any = None  # the gloo control-plane group, once joined
        self.store, self._store_sock = bound_store(host, world_size)
        if _is_loopback(host):  # gloo's own listeners follow the interface it is told to use
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.procs: list[subprocess.Popen] = []
        self.joined = False
        try:
            for rank in range(1, world_size):
                self.procs.append(self._spawn(rank, stderr))
        except BaseException:
            self.kill()
            raise
        atexit.register(self.kill)

    def _spawn(self, rank: int, stderr: Any) -> subprocess.Popen:
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.store.port),
            SPEC_ENV: json.dumps(asdict(self.spec)),
            "OMP_NUM_THREADS": str(self.spec.threads),
        }
        return subprocess.Popen(
            [sys.executable, "-m", "asympd.parallel.worker"],
            env=env,
            stdin=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=_die_with_parent if _prctl is not None else None,
        )

    def join(self, timeout: float = 600.0) -> None:
        """Wait until every child has loaded its shard, then form the groups (rank 0's side)."""
        end = time.monotonic() + timeout
        keys = [f"ready/{r}" for r in range(1, self.world_size)]
        while not self.store.check(keys):
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    raise RuntimeError(f"{self.kind} rank {rank} exited with status {p.returncode} while starting")
            if time.monotonic() > end:
                raise TimeoutError(f"{self.kind} ranks not ready after {timeout:.0f} s")
            time.sleep(0.02)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.control = join_groups(self.backend, self.store, 0, self.world_size)
        self.joined = True

    def close(self, timeout: float = 10.0) -> None:
        """After the stop message: wait for the children, then leave the groups; kill stragglers."""
        end = time.monotonic() + timeout
        for rank, p in enumerate(self.procs, start=1):
            try:
                if p.wait(max(0.0, end - time.monotonic())) != 0:
                    log.warning("%s rank %d exited with status %s", self.kind, rank, p.returncode)
            except subprocess.TimeoutExpired:
                log.warning("%s rank %d did not stop within %.0f s: killing it", self.kind, rank, timeout)
        self.kill()

    def kill(self) -> None:
        """Kill whatever child is left and leave the process group (the error path; idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(5)
        if self.joined and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.joined = False
        atexit.unregister(self.kill)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def bound_store(host: str, world_size: int) -> tuple[Any, socket.socket]:
    """Rank 0's rendezvous store, listening on ``host`` only: given no socket, TCPStore listens on
    every interface whatever host it is given, so we bind the socket and hand it over (keep the
    returned socket as long as the store: its fd is the store's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    store = dist.TCPStore(
        host, sock.getsockname()[1], world_size, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
    )
    return store, sock


def join_groups(backend: str, store: Any, rank: int, world_size: int) -> Any:
    """Every rank: the default (data-plane) group, then the gloo control group it returns."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=DATA_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
