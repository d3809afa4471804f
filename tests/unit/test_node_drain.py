"""The preStop's wait (node_drain.wait_for_zero): done at two zeros in a row, at once when nothing
can be read any more, and at the deadline otherwise."""

from __future__ import annotations

import time

import pytest

from specserve import node_drain


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(node_drain, "POLL_S", 0.01)


def readings(*values):
    remaining = list(values)
    return lambda: remaining.pop(0) if len(remaining) > 1 else remaining[0]


def test_it_waits_for_two_zeros_in_a_row():
    read = readings(2, 0, 1, 0, 0, 5)  # a lone zero is a gap between requests, not the end
    assert node_drain.wait_for_zero(read, "requests", deadline=time.monotonic() + 5) == 0


def test_it_stops_waiting_when_the_node_no_longer_answers():
    started = time.monotonic()
    assert node_drain.wait_for_zero(readings(1, None), "requests", deadline=started + 5) is None
    assert time.monotonic() - started < 1


def test_it_gives_up_at_the_deadline():
    started = time.monotonic()
    assert node_drain.wait_for_zero(readings(3), "requests", deadline=started + 0.2) == 3
    assert 0.2 <= time.monotonic() - started < 1
