"""What a busy engine thread does to the prefix hand-off in its process, and what the GIL's switch
interval trades for it.

A worker is one Python process: its engine thread runs steps while other threads answer HTTP and move
prefix states (P's data-plane server sends, D's fetch receives, checks and unpacks). Every torch call
and socket call in those threads releases the GIL and must take it back; while the engine thread is
busy, taking it back waits up to ``sys.getswitchinterval()`` (5 ms by default), so a hand-off of a few
hundred such calls stretches by hundreds of ms (the H200 runs: D's fetch 11 ms when P was idle,
0.5-1.2 s while P prefilled, ``tools/ttft_breakdown.py`` on e2e_h200x1_depth40_oos5.json). A shorter
interval hands the GIL over sooner at the cost of more switches in the engine thread.

Per switch interval this times, through the product's code (``TcpTransport`` both sides, then what
D's hand-off does with a received state: ``seal.verify`` and ``PrefixState.validate``):

- ``fetch_idle_ms``: one fetch, checked, of a V4.1-Flash prefix (``--tokens``) with no engine running;
- ``fetch_busy_ms``: the same while a real engine (the tiny config, ``--requests`` decoding requests
  with DSpark drafts, bench/engine_host.py's) steps without pause in a thread of this process;
- ``steps_per_s_alone`` / ``steps_per_s_during``: that engine's step rate with no fetch running and
  while the fetches run back to back (what the engine thread pays).

Medians of ``--fetches``. One process holds P, D and the engine here, so the fetch contends for one
GIL with a single busy thread, as each of P and D does in a deployment. A CPU measurement: compare
rows of one run, not runs on different machines.

    python3 bench/gil_contention.py            # -> bench/results/gil_contention.json
    python3 bench/gil_contention.py --smoke    # tiny state, two intervals, two fetches (CI)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

if not torch.cuda.is_available():  # the engine's Triton kernels under the interpreter, as the CPU suite runs them
    os.environ.setdefault("TRITON_INTERPRET", "1")

from asympd.config import tiny, v41_flash  # noqa: E402
from asympd.transfer import TcpTransport  # noqa: E402
from asympd.transfer.seal import seal, verify  # noqa: E402
from bench.common import log, record  # noqa: E402
from bench.engine_host import build  # noqa: E402
from bench.handoff import SECRET, fp4_state  # noqa: E402


class EngineLoop:
    """An engine stepping without pause in a thread of its own; ``steps`` counts them."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EngineLoop:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.engine.step()
            self.steps += 1

    def rate(self, seconds: float, min_steps: int = 2) -> float:
        """Steps per second over at least ``seconds`` and ``min_steps`` steps (a step can outlast a
        short window on a loaded machine: the smoke's 0.3 s once counted none)."""
        n0, t0 = self.steps, time.perf_counter()
        time.sleep(seconds)
        while self.steps - n0 < min_steps:
            time.sleep(0.01)
        return (self.steps - n0) / (time.perf_counter() - t0)


def fetches(cfg: Any, state: Any, n: int) -> list[float]:
    """``n`` fetches of ``state`` over TCP, each with the checks D's hand-off makes (seconds each)."""
    tag, ids = seal(SECRET, "xfer-bench", state), state.token_ids.tolist()
    out = []
    with TcpTransport("bench", secret=SECRET) as p, TcpTransport("bench", secret=SECRET) as d:
        for i in range(n):
            params = p.publish(f"xfer-{i}", state)
            t0 = time.perf_counter()
            got = d.fetch(params, "bench", timeout=600, ack=True)
            verify(SECRET, "xfer-bench", got, tag, ids)
            got.validate(cfg, "bench")
            out.append(time.perf_counter() - t0)
    return out


def measure(cfg: Any, state: Any, engine: Any, interval_ms: float, n: int, rate_s: float) -> dict[str, Any]:
    sys.setswitchinterval(interval_ms / 1e3)
    idle = fetches(cfg, state, n)
    with EngineLoop(engine) as loop:
        alone = loop.rate(rate_s)
        s0, t0 = loop.steps, time.perf_counter()
        busy = fetches(cfg, state, n)
        during = (loop.steps - s0) / (time.perf_counter() - t0)
    row = {
        "switch_interval_ms": interval_ms,
        "fetch_idle_ms": round(1e3 * statistics.median(idle), 2),
        "fetch_busy_ms": round(1e3 * statistics.median(busy), 2),
        "steps_per_s_alone": round(alone, 2),
        "steps_per_s_during": round(during, 2),
    }
    row["fetch_busy_over_idle"] = round(row["fetch_busy_ms"] / row["fetch_idle_ms"], 2)
    row["engine_during_over_alone"] = round(during / alone, 3) if alone else None
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny state, two intervals, two fetches (CI)")
    ap.add_argument("--intervals-ms", default="5,1,0.5,0.2", help="switch intervals to compare (5: Python's default)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens of the V4.1-Flash prefix moved")
    ap.add_argument("--fetches", type=int, default=7)
    ap.add_argument("--requests", type=int, default=32, help="decoding requests in the busy engine")
    ap.add_argument("--name", default="gil_contention")
    args = ap.parse_args()
    started = time.time()
    torch.set_num_threads(1)
    default = sys.getswitchinterval()
    intervals = [5.0, 0.5] if args.smoke else [float(x) for x in args.intervals_ms.split(",")]
    cfg = tiny() if args.smoke else v41_flash()
    state = fp4_state(cfg, 200 if args.smoke else args.tokens, torch.device("cpu"))
    engine = build(4 if args.smoke else args.requests, 3, ctx=40 if args.smoke else 64)
    n, rate_s = (2, 0.3) if args.smoke else (args.fetches, 2.0)
    rows = []
    try:
        for ms in intervals:
            rows.append(measure(cfg, state, engine, ms, n, rate_s))
            log(rows[-1])
    finally:
        sys.setswitchinterval(default)
    name = f"{args.name}_smoke" if args.smoke else args.name
    data = {
        "config": "tiny" if args.smoke else "v41_flash",
        "prompt_tokens": state.num_prompt_tokens,
        "engine": {"config": "tiny", "requests": 4 if args.smoke else args.requests, "num_spec_tokens": 3},
        "host_cpus": os.cpu_count(),
        "rows": rows,
    }
    log(f"wrote {record(name, data, started)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
