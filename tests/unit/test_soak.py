"""The soak's bookkeeping (specserve.bench.soak): which failures are the kill's, memory creep,
and the canary search. The soak itself runs on the real platform (tests/integration)."""

from __future__ import annotations

from specserve.bench import soak
from specserve.bench.soak import MemorySampler, MemoryTrace, Outcome, logs_containing, summarize


def test_only_failures_on_the_killed_arm_around_the_kill_are_the_kills():
    killed_at = 100.0
    outcomes = [
        Outcome("ngram", True, 90, 101, "stream_cut"),  # in flight at the kill
        Outcome("", False, 103, 104, "http_503"),  # just after, on no arm
        Outcome("no-spec", False, 95, 102, "http_503"),  # another arm: not the kill's
        Outcome("ngram", False, 150, 151, "transport"),  # long after
        *[Outcome("no-spec", False, t, t + 1, "ok") for t in range(10)],
    ]
    report = summarize(outcomes, killed_at, "ngram", {}, 200, 1.0, [])
    assert report["failed_from_kill"] == 2
    assert [o["cause"] for o in report["failed_unexplained"]] == ["http_503", "transport"]
    assert not report["passed"]
    assert report["sent"] == 14 and report["completed"] == 10


def test_memory_creep_is_judged_on_processes_that_ran_through_the_second_half():
    steady = MemoryTrace("proxy", [(t, 700.0 + 0.001 * t) for t in range(0, 601, 5)])
    leaking = MemoryTrace("worker", [(t, 2000.0 + t / 10) for t in range(0, 601, 5)])  # 6/min
    started_late = MemoryTrace("new replica", [(t, 200.0 + t) for t in range(400, 601, 5)])
    memory = {1: steady, 2: leaking, 3: started_late}
    report = summarize([Outcome("a", False, 0, 1, "ok")], None, None, memory, 600, 1.0, [])
    slopes = {p["process"]: p["slope_mib_per_min"] for p in report["processes"]}
    assert slopes == {"proxy": 0.06, "worker": 6.0, "new replica": None}
    assert report["problems"] == ["1 processes grow faster than 1.0 MiB/min"]


def test_a_process_that_takes_a_new_role_is_traced_anew(monkeypatch):
    """Ray makes an idle worker the replacement replica: a new process as far as creep goes."""
    import psutil

    names = iter(
        [
            "[a.1] ray::IDLE      ",
            "[a.1] ray::IDLE      ",
            "[a.1] ray::ServeReplica:arm-a.1:arm-a.1      ",
            # The method a Ray actor runs is in its title while it runs (an arm's replica's
            # class name cut at its name's dot): the same role.
            "[a.1] ray::1.handle_request_with_rejection      ",
            "ray::ProxyActor     ",
            "ray::ProxyActor.receive_asgi_messages    ",
        ]
    )
    monkeypatch.setattr(soak, "platform_processes", lambda: [psutil.Process()])
    monkeypatch.setattr(soak, "_process_name", lambda process: next(names))
    sampler = MemorySampler(started=0)
    for _ in range(6):
        sampler.sample()
    traces = list(sampler.traces.values())
    assert [(t.name.strip(), len(t.samples)) for t in traces] == [
        ("[a.1] ray::IDLE", 2),
        ("[a.1] ray::ServeReplica:arm-a.1:arm-a.1", 2),
        ("ray::ProxyActor", 2),
    ]
    assert {t.pid for t in traces} == {psutil.Process().pid}


def test_the_canary_is_found_in_any_file_below_the_roots(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "clean.log").write_text("request id abc served\n")
    (tmp_path / "logs" / "leaky.err").write_bytes(b"\x00prompt: hi (canary-1234)\n")
    assert logs_containing("canary-1234", [tmp_path]) == [str(tmp_path / "logs" / "leaky.err")]
    assert logs_containing("canary-9999", [tmp_path]) == []


def test_a_refusal_is_named_by_its_openai_error_code():
    from specserve.bench.soak import _error_code

    body = b'{"error": {"message": "m", "type": "t", "code": "engine_unavailable"}}'
    assert _error_code(body) == ":engine_unavailable"
    assert _error_code(b"<html>bad gateway</html>") == ""
    assert _error_code(b'{"error": {"code": null}}') == ""
