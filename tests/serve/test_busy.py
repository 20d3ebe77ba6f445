"""The busy clock: steps counted from their host start to the later of their host and GPU ends,
overlaps counted once."""

from __future__ import annotations

import time

import pytest
import torch

from asympd.serve.busy import BusyClock


def test_overlapping_steps_count_once_and_gaps_not_at_all():
    clock = BusyClock()
    clock.count(0.0, 1.0)
    clock.count(0.5, 2.0)  # the last step's GPU tail ran past this one's start
    clock.count(1.5, 1.8)  # inside what is counted
    clock.count(3.0, 4.0)  # after an idle second
    assert clock.total == pytest.approx(3.0, abs=1e-12)
    assert not clock.pending


def test_on_the_cpu_a_step_is_its_host_time():
    clock, seen = BusyClock("cpu"), []
    clock.step_done(10.0, 10.25, seen.append)
    clock.step_done(10.25, 10.5)
    assert not clock.pending and clock.poll() == pytest.approx(0.5, abs=1e-12)
    assert seen == [pytest.approx(0.25, abs=1e-12)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_work_a_step_leaves_queued_is_counted():
    """A step that queues 200 ms of GPU work and returns at once is busy for the 200 ms."""
    clock = BusyClock("cuda")
    cycles = int(0.2 * torch.cuda.clock_rate() * 1e6) if hasattr(torch.cuda, "clock_rate") else int(4e8)
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    t1 = time.perf_counter()
    seen: list[float] = []
    clock.step_done(t0, t1, seen.append)
    assert clock.pending and t1 - t0 < 0.05 and not seen
    torch.cuda.synchronize()
    busy = clock.poll()
    assert not clock.pending
    assert 0.1 < busy < time.perf_counter() - t0 + 1e-3, (busy, t1 - t0)
    assert seen == [pytest.approx(busy, abs=1e-9)]  # the step's own seconds to its GPU end
