"""LeaseTable: the release callback runs exactly once, whichever of ack / expiry / close comes first."""

from __future__ import annotations

import threading
import time

import pytest

from asympd.transfer import LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table():
    calls: list[tuple[str, object, str]] = []
    clock = Clock()
    t = LeaseTable(ttl_s=10.0, on_release=lambda tid, v, why: calls.append((tid, v, why)), clock=clock)
    t.calls, t.fake = calls, clock  # type: ignore[attr-defined]
    return t


def test_ack_releases_once(table):
    table.add("a", "blocks-a")
    assert "a" in table and table.get("a") == "blocks-a"
    assert table.ack("a") is True
    assert table.ack("a") is False
    table.fake.now = 100
    assert table.expire() == []
    assert table.calls == [("a", "blocks-a", "ack")]
    assert "a" not in table and len(table) == 0


def test_expiry_releases_once(table):
    table.add("a", 1)
    table.add("b", 2, ttl_s=30)
    table.fake.now = 9.9
    assert table.expire() == []
    assert table.expire(now=10.0) == ["a"]
    assert table.expire(now=11.0) == []
    assert table.ack("a") is False  # D comes too late: nothing happens twice
    assert table.calls == [("a", 1, "expired")]
    assert table.get("b") == 2
    assert table.released == {"ack": 0, "expired": 1, "closed": 0, "released": 0}


def test_hold_defers_release_until_the_reader_is_done(table):
    table.add("a", "v")
    with table.hold("a") as value:
        assert value == "v"
        table.fake.now = 100
        assert table.expire() == []  # not under a reader
        assert table.ack("a") is True
        assert table.calls == []
        assert table.get("a") is None  # already on its way out
        with table.hold("a") as again:
            assert again is None
    assert table.calls == [("a", "v", "ack")]
    assert table.ack("a") is False


def test_held_lease_expires_after_the_reader_if_never_acked(table):
    table.add("a", "v")
    with table.hold("a"):
        table.fake.now = 100
        assert table.expire() == []
    assert table.expire() == ["a"]
    assert table.calls == [("a", "v", "expired")]


def test_hold_of_unknown_id_yields_none(table):
    with table.hold("nope") as value:
        assert value is None


def test_close_and_release(table):
    table.add("a", 1)
    table.add("b", 2)
    assert table.release("a") is True
    table.close()
    assert sorted(c[2] for c in table.calls) == ["closed", "released"]
    assert len(table) == 0


def test_duplicate_id_is_refused(table):
    table.add("a", 1)
    with pytest.raises(ValueError, match="already leased"):
        table.add("a", 2)


def test_per_lease_callback_and_failing_callback(table):
    seen = []
    table.add("a", 1, on_release=lambda tid, v, why: seen.append(why))

    def boom(tid, v, why):
        raise RuntimeError("free failed")

    table.add("b", 2, on_release=boom)
    assert table.ack("a") and table.ack("b")  # a failing callback is logged, not raised
    assert seen == ["ack"] and table.calls == []
    assert len(table) == 0


def test_racing_ack_and_expiry_release_each_lease_once():
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def on_release(tid, v, why):
        with lock:
            counts[tid] = counts.get(tid, 0) + 1

    table = LeaseTable(ttl_s=0.0, on_release=on_release)
    ids = [f"t{i}" for i in range(300)]
    for tid in ids:
        table.add(tid, tid)
    barrier = threading.Barrier(4)

    def acker():
        barrier.wait()
        for tid in ids:
            table.ack(tid)

    def reaper():
        barrier.wait()
        for _ in range(50):
            table.expire()

    threads = [threading.Thread(target=f) for f in (acker, acker, reaper, reaper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert counts == dict.fromkeys(ids, 1)


def test_background_reaper_expires():
    released = threading.Event()
    table = LeaseTable(ttl_s=0.05, on_release=lambda *a: released.set())
    table.add("a", 1)
    table.start_reaper(interval_s=0.01)
    try:
        assert released.wait(timeout=5)
        assert "a" not in table
    finally:
        table.stop_reaper()
    t0 = time.monotonic()
    table.close()
    assert time.monotonic() - t0 < 1
