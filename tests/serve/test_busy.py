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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only build's CUDA events fail")
def test_a_clock_whose_gpu_timing_fails_counts_host_times_and_says_so(caplog):
    """A metric must not stop serving: where a CUDA event cannot be made (here, a CPU-only build
    asked for "cuda"), the clock warns once and counts host times."""
    clock, seen = BusyClock("cuda"), []
    clock.step_done(1.0, 1.5, seen.append)
    assert not clock.pending and clock.poll() == pytest.approx(0.5) and seen == [pytest.approx(0.5)]
    assert "timing the GPU failed" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_work_a_step_leaves_queued_is_counted():
    """A step that queues ~100 ms of GPU work (2e8 clock cycles at the H200's ~2 GHz) and returns
    at once is busy until that work ends."""
    clock = BusyClock("cuda")
    t0 = time.perf_counter()
    torch.cuda._sleep(int(2e8))
    t1 = time.perf_counter()
    seen: list[float] = []
    clock.step_done(t0, t1, seen.append)
    assert clock.pending and t1 - t0 < 0.03 and not seen
    torch.cuda.synchronize()
    busy = clock.poll()
    assert not clock.pending
    assert 0.05 < busy < time.perf_counter() - t0 + 1e-3, (busy, t1 - t0)
    assert seen == [pytest.approx(busy, abs=1e-9)]  # the step's own seconds to its GPU end
