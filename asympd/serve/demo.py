"""``asympd demo``: a 1P1D asymmetric deployment on localhost, end to end, in well under a minute.

Starts a prefill worker, a decode worker and the router as real processes on free ports, sends a
few requests (completions and chat, one streamed), prints each output with its TTFT split (prefill
compute on P / transfer / D's first step) and what each role holds in weights, then stops every
process (also on Ctrl-C or an error). The weights are random, so the text is noise: the point is the
path the tokens take and what it costs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from asympd.serve.procs import ServerProcess, stop_all


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asympd"


def cached_checkpoint(seed: int = 0) -> Path:
    """The tiny random checkpoint, written once into the cache dir (atomically: a crash mid-write
    leaves nothing that looks finished)."""
    out = cache_dir() / f"tiny-seed{seed}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    from asympd.config import tiny
    from asympd.model.checkpoint import write_checkpoint

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write_checkpoint(tiny(), tmp / "ckpt", seed=seed)
        if not out.exists():
            (tmp / "ckpt").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


LONG = (
    "The prefill worker runs only the encoder half of the model over the long prefix of this prompt "
    "and hands the compressed cache to the decode worker, which computes the last window itself."
)
SHORT = "hello world"


def _fmt_s(x: Any) -> str:
    return "     -  " if x is None else f"{1e3 * float(x):7.1f}ms"


def _split(t: dict[str, Any]) -> str:
    path = t.get("prefill_path")
    label = {"remote": "P->D", "local": "D only (N <= W: P skipped)", "recompute": "D recomputed (P failed)"}
    return (
        f"{label.get(path, path)}; P compute {_fmt_s(t.get('prefill_s'))} | transfer "
        f"{_fmt_s(t.get('transfer_s'))} ({t.get('transfer_bytes', 0)} B) | D first step "
        f"{_fmt_s(t.get('decode_first_step_s'))} | TTFT {_fmt_s(t.get('ttft_s'))}"
    )


def _stream(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    text, timings, usage = [], {}, {}
    with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for c in chunk["choices"]:
                text.append(c.get("text") or c.get("delta", {}).get("content") or "")
            timings = chunk.get("asympd_timings", timings)
            usage = chunk.get("usage") or usage
    return "".join(text), timings, usage


def run_demo(
    checkpoint: str | None = None, transport: str | None = None, max_tokens: int = 12, keep_logs: bool = False
) -> int:
    t_start = time.monotonic()
    ckpt = str(checkpoint or cached_checkpoint())
    log_dir = tempfile.mkdtemp(prefix="asympd-demo-")
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    common = [
        "--checkpoint",
        ckpt,
        "--mode",
        "asymmetric",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "1",
        "--log-level",
        "warning",
    ] + (["--transport", transport] if transport else [])
    procs: list[ServerProcess] = []

    def on_term(signum: int, frame: Any) -> None:  # SIGTERM: unwind through the finally below
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        print(f"checkpoint  {ckpt}")
        p = ServerProcess("prefill", ["serve", "--role", "prefill", *common], log_dir, env).start()
        d = ServerProcess("decode", ["serve", "--role", "decode", *common], log_dir, env).start()
        procs += [p, d]
        p_url, d_url = p.wait_ready(60), d.wait_ready(60)
        r = ServerProcess(
            "router",
            [
                "router",
                "--prefill",
                p_url,
                "--decode",
                d_url,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--log-level",
                "warning",
            ],
            log_dir,
            env,
        ).start()
        procs.append(r)
        url = r.wait_ready(60)
        with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as client:
            end = time.monotonic() + 30
            while True:
                h = client.get(f"{url}/health")
                if h.status_code == 200 and h.json().get("all_healthy"):
                    break
                if time.monotonic() > end:
                    raise TimeoutError(f"router not healthy after 30 s: {h.text}")
                time.sleep(0.1)
            p_info, d_info = client.get(f"{p_url}/asympd/info").json(), client.get(f"{d_url}/asympd/info").json()
            w = d_info["window_size"]
            print(f"prefill     {p_url}  (role prefill: encoder + KV path, transport {p_info['transport']})")
            print(f"decode      {d_url}  (role decode: full model, recomputes if P fails)")
            print(f"router      {url}  (the only address clients need; mode asymmetric, W = {w})")
            print(
                f"weights     P holds {p_info['resident_bytes']:,} B, D holds {d_info['resident_bytes']:,} B "
                f"({100 * (1 - p_info['resident_bytes'] / d_info['resident_bytes']):.0f}% less on P)"
            )
            print(f"ready in    {time.monotonic() - t_start:.1f} s\n")
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            common_body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
            jobs: list[tuple[str, str, dict[str, Any], bool]] = [
                ("completion, long prompt", "/v1/completions", {"prompt": LONG}, False),
                ("completion, short prompt", "/v1/completions", {"prompt": SHORT}, False),
                (
                    "chat",
                    "/v1/chat/completions",
                    {
                        "messages": [
                            {"role": "system", "content": "You are a helpful model."},
                            {"role": "user", "content": "What does the prefill worker hand to the decode worker?"},
                        ]
                    },
                    False,
                ),
                (
                    "completion, streamed",
                    "/v1/completions",
                    {"prompt": LONG + " Stream this one.", "stream_options": {"include_usage": True}},
                    True,
                ),
            ]
            for title, path, body, stream in jobs:
                body = {**common_body, **body, "stream": stream}
                t0 = time.perf_counter()
                if stream:
                    text, timings, usage = _stream(client, url + path, body)
                else:
                    resp = client.post(url + path, json=body)
                    resp.raise_for_status()
                    out = resp.json()
                    c = out["choices"][0]
                    if "text" in c:
                        text = c["text"]
                    else:  # thinking mode (V4.1's default): the reasoning, then the answer
                        msg = c["message"]
                        text = f"reasoning {msg.get('reasoning') or ''!r}, content {msg.get('content') or ''!r}"
                    timings, usage = out["asympd_timings"], out["usage"]
                wall = time.perf_counter() - t0
                print(
                    f"[{title}] prompt {usage.get('prompt_tokens')} tokens -> {usage.get('completion_tokens')} "
                    f"tokens in {1e3 * wall:.0f} ms"
                )
                print(f"    output  {text[:90] if path.endswith('chat/completions') else repr(text[:70])}")
                print(f"    TTFT    {_split(timings)}")
            blocks = {}
            for name, u in (("P", p_url), ("D", d_url)):
                stats = client.get(f"{u}/asympd/stats").json()["engine"]
                blocks[name] = stats["kv_blocks_used"]
            print(f"\nKV blocks still held: P {blocks['P']}, D {blocks['D']}")
        print(f"done in {time.monotonic() - t_start:.1f} s; stopping the processes")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the processes")
        return 130
    except Exception as e:
        print(f"\ndemo failed: {type(e).__name__}: {e}")
        for proc in procs:
            print(f"--- {proc.name} log ({proc.log_path}) ---\n{proc.log_tail(20)}")
        keep_logs = True
        return 1
    finally:
        stop_all(procs)
        signal.signal(signal.SIGTERM, old)
        if keep_logs:
            print(f"logs kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
