"""Worker and router processes started from Python (the demo and the tests): start, wait until
ready, stop, and never leave orphans.

Each child gets its own session (a terminal's Ctrl-C reaches only the parent, which then stops
the children in order) and, on Linux, a parent-death signal, so even a parent killed with SIGKILL
takes its children with it. Children log to a file; readiness is the line the servers print once
they listen ("... ready on http://HOST:PORT"), so ``--port 0`` works without a port race.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

READY = re.compile(r"ready on (http://\S+)")


try:  # resolved here, in the parent: the child between fork and exec should only make the call
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform == "linux" else None
except OSError:
    _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """One ``asympd`` subcommand run as a child process."""

    def __init__(self, name: str, args: Sequence[str], log_dir: str | Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = [sys.executable, "-m", "asympd.cli", *args]
        self.log_path = Path(log_dir) / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self) -> ServerProcess:
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it; closed below
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent if _prctl is not None else None,
            )
        finally:
            log.close()
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_ready(self, timeout: float = 60.0) -> str:
        """The URL it serves on, once it printed its ready line; raises if it died or timed out."""
        assert self.proc is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                m = READY.search(self.log_path.read_text(errors="replace"))
            except OSError:
                m = None
            if m:
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (graceful: uvicorn drains, the engine thread stops), then SIGKILL."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP) child cannot handle SIGTERM
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def stop_all(procs: Sequence[ServerProcess], timeout: float = 10.0) -> None:
    """Stop in reverse start order (router first, so it stops sending work)."""
    for p in reversed(procs):
        try:
            p.stop(timeout)
        except Exception as e:  # keep stopping the others
            print(f"stopping {p.name} failed: {e}", file=sys.stderr)
