"""An in-process engine measured by a bench computes on its arm's cores, as vLLM's multiprocess
executor binds a served engine's worker (`bench.round_cost.bind_to_cores`)."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

from specserve.bench.round_cost import bind_to_cores

EVERY = sorted(os.sched_getaffinity(0))


@pytest.fixture
def bound(monkeypatch):
    """Bind this process with a second thread already running; -> every thread's cores. The
    test's own cores, threads and environment are given back afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads_before = torch.get_num_threads()
    stop = threading.Event()
    early = threading.Thread(target=stop.wait)
    early.start()

    def bind(cores: str) -> list[list[int]]:
        bind_to_cores(cores)
        return [
            sorted(os.sched_getaffinity(int(t)))
            for t in os.listdir("/proc/self/task")
            if t in (str(threading.get_native_id()), str(early.native_id))
        ]

    yield bind
    stop.set()
    early.join()
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # another test's thread, ended since
            os.sched_setaffinity(int(thread), EVERY)
    torch.set_num_threads(threads_before)


@pytest.mark.skipif(len(EVERY) < 2, reason="needs two cores to tell apart")
def test_every_thread_of_the_process_computes_on_the_arms_cores_only(bound):
    masks = bound(str(EVERY[1]))
    assert len(masks) == 2  # the thread started before the binding is bound too
    assert all(mask == [EVERY[1]] for mask in masks)
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"


@pytest.mark.skipif(len(EVERY) < 2, reason="needs two cores to tell apart")
def test_a_core_range_binds_one_thread_per_core(bound):
    masks = bound(f"{EVERY[0]}-{EVERY[1]}")
    assert all(mask == EVERY[:2] for mask in masks)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("unbound", ["", "auto", "nobind"])
def test_no_core_list_leaves_the_process_alone(bound, unbound):
    assert all(mask == EVERY for mask in bound(unbound))
    assert "OMP_NUM_THREADS" not in os.environ


def test_a_list_per_rank_is_refused_rather_than_half_bound():
    with pytest.raises(ValueError, match="several ranks"):
        bind_to_cores("0|1")
