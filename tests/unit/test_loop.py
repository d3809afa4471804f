"""`specserve loop` (loop.py): the revisions it writes, and what it does on each verdict. The
revisions go through the local config history (config/local_store.py), a real file; the experiment's
readings are scripted here (Prometheus and the report's arithmetic are tested live and in
tests/unit/test_ab*.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from specserve import loop
from specserve.ab.prometheus import PrometheusError
from specserve.ab.report import KEEP_TESTING, PROMOTE, ROLL_BACK
from specserve.config.changes import ArmChanges, arm_changes
from specserve.config.local_store import LocalStore
from specserve.config.schema import parse_config, revision_of
from specserve.models import resolve_drafter_source

DEFAULT = Path(loop.__file__).parent / "configs" / "default.yaml"
CANDIDATE = Path("/drafters/eagle3.1-0123456789ab")


def arms(text: str) -> dict[str, dict]:
    return {a["name"]: a for a in yaml.safe_load(text)["arms"]}


def test_the_challenger_is_the_incumbent_with_the_candidate_at_its_share_of_its_weight():
    """The challenger's weight is taken from the incumbent's: at the default share (0.5) the two
    engines carry the same load, and the other arms keep their traffic."""
    live = DEFAULT.read_text()
    before = {n: a["weight"] for n, a in arms(live).items()}
    assert loop.LoopConfig(incumbent="eagle3.1").share == 0.5
    text, config, name = loop.with_challenger(live, "eagle3.1", CANDIDATE, share=0.5)
    assert name == "eagle3.1-0123456789ab"
    found = arms(text)
    incumbent, challenger = found["eagle3.1"], found[name]
    assert challenger["speculative"] == {**incumbent["speculative"], "model": str(CANDIDATE)}
    assert challenger["engine"] == incumbent["engine"] and challenger["env"] == incumbent["env"]
    weights = {a.name: a.weight for a in config.arms}
    assert weights[name] == weights["eagle3.1"] == pytest.approx(before["eagle3.1"] / 2)
    assert {k: v for k, v in weights.items() if k not in (name, "eagle3.1")} == {
        k: v for k, v in before.items() if k != "eagle3.1"
    }
    _, small, _ = loop.with_challenger(live, "eagle3.1", CANDIDATE, share=0.1)
    weights = {a.name: a.weight for a in small.arms}
    assert weights[name] == pytest.approx(0.1 * before["eagle3.1"])
    assert weights[name] + weights["eagle3.1"] == pytest.approx(before["eagle3.1"])
    # Same cores as the incumbent unless told otherwise (separate ones for CPU engines).
    assert loop.shared_cores(config, "eagle3.1", name) == incumbent["env"][loop.CPU_BIND_ENV]
    _, apart, _ = loop.with_challenger(live, "eagle3.1", CANDIDATE, 0.5, cpus="2-3")
    assert apart.arm(name).env[loop.CPU_BIND_ENV] == "2-3"
    assert apart.arm("eagle3.1").env == config.arm("eagle3.1").env
    assert loop.shared_cores(apart, "eagle3.1", name) is None
    # The prompts the candidate was trained on are left out of the A/B while it serves, and
    # counted in again once the challenger goes, promoted or not.
    trained = frozenset({"0123456789abcdef", "00000000000000ff"})
    text_out, left, _ = loop.with_challenger(live, "eagle3.1", CANDIDATE, 0.5, left_out=trained)
    assert loop.LEFT_OUT_KEY in type(left.routing).model_fields
    assert left.routing.ab_left_out_prompts == trained
    assert config.routing.ab_left_out_prompts == frozenset()
    for _, after, *_ in (
        loop.without(text_out, name, "eagle3.1"),
        loop.promoted(text_out, "eagle3.1", name),
    ):
        assert after.routing.ab_left_out_prompts == frozenset()
    with pytest.raises(loop.LoopError, match="does not run an EAGLE drafter"):
        loop.with_challenger(live, "ngram", CANDIDATE, 0.1)
    with pytest.raises(loop.LoopError, match="already runs"):
        loop.with_challenger(text, "eagle3.1", CANDIDATE, 0.1)
    with pytest.raises(loop.LoopError, match="no arm 'eagle9'"):
        loop.with_challenger(live, "eagle9", CANDIDATE, 0.1)


def test_promotion_gives_the_incumbent_the_drafter_and_removal_restores_the_arms():
    live = DEFAULT.read_text()
    for share in (0.5, 0.1, 0.3):
        text, _, name = loop.with_challenger(live, "eagle3.1", CANDIDATE, share=share)
        promoted, _, in_place = loop.promoted(text, "eagle3.1", name)
        after = arms(promoted)
        # A candidate that cannot be read here: the incumbent restarts with it as its drafter.
        assert not in_place and "drafter_weights" not in after["eagle3.1"]
        assert name not in after and after["eagle3.1"]["speculative"]["model"] == str(CANDIDATE)
        assert after["eagle3.1"]["weight"] == arms(live)["eagle3.1"]["weight"]
        removed, _ = loop.without(text, name, "eagle3.1")
        assert arms(removed) == arms(live)


def test_a_candidate_with_the_incumbents_tensors_is_promoted_as_weights_loaded_in_place(
    tmp_path,
):
    """One trained from the incumbent's drafter: the running engines load its weights (no
    restart, engine/drafter_reload.py); the challenger runs the candidate's own weights, even
    after an earlier promotion gave the incumbent other ones."""
    live = DEFAULT.read_text()
    drafter = arms(live)["eagle3.1"]["speculative"]["model"]
    fitting = tmp_path / "eagle3.1-00000000000a"
    shutil.copytree(resolve_drafter_source(drafter), fitting)
    text, _, name = loop.with_challenger(live, "eagle3.1", fitting, share=0.5)
    promoted, config, in_place = loop.promoted(text, "eagle3.1", name)
    after = arms(promoted)["eagle3.1"]
    assert in_place and after["drafter_weights"] == str(fitting)
    assert after["speculative"] == arms(live)["eagle3.1"]["speculative"]  # no restart
    changes = ArmChanges.of(arm_changes(parse_config(live), config))
    assert changes.reloaded == ("eagle3.1",) and not changes.redeployed, changes
    # The next loop's challenger: the next candidate's weights, not the promoted ones.
    text, _, name = loop.with_challenger(promoted, "eagle3.1", CANDIDATE, share=0.5)
    assert "drafter_weights" not in arms(text)[name]
    # A candidate with other tensors (EAGLE-3 into an EAGLE-3.1 arm) restarts the engines.
    other = tmp_path / "eagle3-00000000000b"
    shutil.copytree(resolve_drafter_source("package://eagle3"), other)
    text, _, name = loop.with_challenger(promoted, "eagle3.1", other, share=0.5)
    again, _, in_place = loop.promoted(text, "eagle3.1", name)
    assert not in_place and arms(again)["eagle3.1"]["speculative"]["model"] == str(other)
    assert "drafter_weights" not in arms(again)["eagle3.1"]


class Scripted:
    """The experiment's readings, one per poll."""

    def __init__(
        self,
        served: list[float],
        rows: list[dict],
        drained_at: int | None = None,
        errors: tuple[float, float] = (0, 0),
    ):
        self.served_readings, self.rows, self.drained_at, self.polls = served, rows, drained_at, 0
        self.error_reading = errors

    def errors(self, arm: str, since: float) -> tuple[float, float]:
        return self.error_reading

    def served(self, arm: str, since: float) -> float:
        return self.served_readings.pop(0) if len(self.served_readings) > 1 else 1.0

    def drained(self, arm: str) -> bool:
        self.polls += 1
        return self.drained_at is not None and self.polls >= self.drained_at

    def verdict(self, challenger: str, since: float) -> dict:
        return self.rows.pop(0) if len(self.rows) > 1 else self.rows[0]


def row(verdict: str, mismatch: bool = False) -> dict:
    return {"verdict": verdict, "reason": verdict, "traffic": {"mismatch": mismatch}}


def run(
    tmp_path, experiment, log=lambda _: None, now: list[float] | None = None, **config
) -> tuple[dict, LocalStore, str]:
    """The loop on `experiment`'s readings, its clock `now[0]` moved by its sleeps."""
    live = tmp_path / "config.yaml"
    live.write_text(DEFAULT.read_text())
    local = LocalStore(live)
    now = [0.0] if now is None else now

    def sleep(s: float) -> None:
        now[0] += s

    settings = loop.LoopConfig(incumbent="eagle3.1", poll_s=30, max_wait_s=600, **config)
    report = loop.Loop(settings, local, experiment, log=log, sleep=sleep, clock=lambda: now[0]).run(
        CANDIDATE
    )
    return report, local, DEFAULT.read_text()


@pytest.mark.parametrize(
    ("cpus", "said"),
    [(None, "slow each other alike"), ("0", "fair comparison only if nothing else runs")],
)
def test_the_loop_says_where_the_challenger_computes(tmp_path, cpus, said):
    """On the incumbent's cores the two slow each other alike; on cores of their own they
    differ by whatever else runs there (an A/A on 2 cores: +35 %), which the log says."""
    lines: list[str] = []
    experiment = Scripted([1], [row(ROLL_BACK)])
    run(tmp_path, experiment, log=lines.append, challenger_cpus=cpus)
    assert any("the challenger computes on" in line and said in line for line in lines)


def test_a_faster_challenger_is_promoted_in_two_revisions_that_rollback_undoes(tmp_path):
    experiment = Scripted([0, 0, 1], [row(KEEP_TESTING), row(KEEP_TESTING), row(PROMOTE)])
    report, local, original = run(tmp_path, experiment)
    assert report["outcome"] == loop.PROMOTED and len(report["rows"]) == 3
    assert [s["what"].split(":")[0] for s in report["steps"]] == [
        "challenger eagle3.1-0123456789ab added",
        "eagle3.1 takes eagle3.1-0123456789ab's drafter (its engines restarted); "
        "eagle3.1-0123456789ab removed",
    ]
    live = arms(local.live_text())
    assert live["eagle3.1"]["speculative"]["model"] == str(CANDIDATE)
    assert "engines restarted" in report["steps"][1]["what"]
    assert len(local.records()) == 3  # the original, the challenger's, the promotion's
    local.rollback()
    local.rollback(to=revision_of(original.encode()))
    assert local.live_text() == original


@pytest.mark.parametrize(
    ("experiment", "outcome"),
    [
        (lambda: Scripted([1], [row(KEEP_TESTING), row(ROLL_BACK)]), loop.ROLLED_BACK),
        (lambda: Scripted([1], [row(KEEP_TESTING)], drained_at=2), loop.DRAINED),
        # 3 of 40 failed: over 5 %, whatever the verdict says.
        (lambda: Scripted([1], [row(PROMOTE)], errors=(3, 40)), loop.FAILING),
        (lambda: Scripted([1], [row(KEEP_TESTING, mismatch=True)]), loop.MISMATCH),
        (lambda: Scripted([1], [row(KEEP_TESTING)]), loop.TIMED_OUT),
        (lambda: Scripted([0] * 1000, [row(PROMOTE)]), loop.TIMED_OUT),  # it never serves
    ],
)
def test_anything_but_a_promotion_removes_the_challenger_and_nothing_else(
    tmp_path, experiment, outcome
):
    report, local, original = run(tmp_path, experiment())
    assert report["outcome"] == outcome
    assert arms(local.live_text()) == arms(original)
    assert parse_config(local.live_text().encode()).arms == parse_config(original.encode()).arms
    assert len(report["steps"]) == 2 and report["steps"][1]["what"].endswith(outcome)


class Unreachable(Scripted):
    """Prometheus times out on the first reading of each kind, then answers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failed: set[str] = set()

    def _once(self, kind: str) -> None:
        if kind not in self.failed:
            self.failed.add(kind)
            raise PrometheusError("cannot reach Prometheus at http://prometheus:9090: timed out")

    def served(self, arm: str, since: float) -> float:
        self._once("served")
        return super().served(arm, since)

    def drained(self, arm: str) -> bool:
        self._once("drained")
        return super().drained(arm)


def test_prometheus_out_of_reach_is_asked_again_at_the_next_poll(tmp_path):
    experiment = Unreachable([1], [row(KEEP_TESTING), row(PROMOTE)])
    report, local, _ = run(tmp_path, experiment)
    assert experiment.failed == {"served", "drained"}
    assert report["outcome"] == loop.PROMOTED and len(report["rows"]) == 2


class Recording(Scripted):
    """Notes when the served count is read, and from when."""

    def __init__(self, clock, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.reads = clock, []

    def served(self, arm: str, since: float) -> float:
        self.reads.append((self.clock(), since))
        return super().served(arm, since)


def test_the_challenger_counts_as_serving_from_after_what_an_earlier_arm_left_arrived(tmp_path):
    """A rerun with the same candidate adds a challenger of the same name seconds after the run
    before removed it; that run's last requests reach Prometheus after the new one is added.
    The loop counts the challenger's requests from SETTLE_S after adding it, so they do not
    start the experiment before the new engine serves."""
    now = [0.0]
    experiment = Recording(lambda: now[0], [0, 1], [row(PROMOTE)])
    report, _, _ = run(tmp_path, experiment, now=now)
    assert report["outcome"] == loop.PROMOTED
    assert experiment.reads[0] == (loop.SETTLE_S, loop.SETTLE_S)
    assert all(since == loop.SETTLE_S for _, since in experiment.reads)


class Failing(Scripted):
    """The experiment stops with `error` at its second reading."""

    def __init__(self, error: BaseException):
        super().__init__([1], [row(KEEP_TESTING)])
        self.error = error

    def verdict(self, challenger: str, since: float) -> dict:
        if self.polls >= 2:
            raise self.error
        return super().verdict(challenger, since)


@pytest.mark.parametrize("error", [RuntimeError("apply failed"), KeyboardInterrupt()])
def test_whatever_stops_the_loop_takes_its_challenger_out_first(tmp_path, error):
    with pytest.raises(type(error)):
        run(tmp_path, Failing(error))
    local = LocalStore(tmp_path / "config.yaml")
    assert arms(local.live_text()) == arms(DEFAULT.read_text())
    assert len(local.records()) == 3  # the original, the challenger's, its removal


def test_a_promotion_that_cannot_be_applied_still_takes_the_challenger_out(tmp_path):
    live = tmp_path / "config.yaml"
    live.write_text(DEFAULT.read_text())
    applied = []

    class Refusing(LocalStore):
        def write_live(self, live, text) -> None:
            if len(applied) == 1 and "takes" not in "".join(applied):  # the promotion's write
                applied.append("failed once")
                raise RuntimeError("the API server refused the write")
            applied.append("ok")
            super().write_live(live, text)

    local = Refusing(live)

    settings = loop.LoopConfig(incumbent="eagle3.1", poll_s=30, max_wait_s=600)
    now = [0.0]
    experiment = Scripted([1], [row(PROMOTE)])
    with pytest.raises(RuntimeError):
        loop.Loop(
            settings, local, experiment, log=lambda _: None,
            sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0],
        ).run(CANDIDATE)  # fmt: skip
    assert arms(local.live_text()) == arms(DEFAULT.read_text())  # no challenger, no promotion


@pytest.mark.parametrize("errors", [(1, 40), (3, 19)])  # under 5 %; too few requests to judge
def test_a_challenger_failing_under_the_share_or_too_few_requests_runs_on(tmp_path, errors):
    report, _, _ = run(tmp_path, Scripted([1], [row(KEEP_TESTING), row(PROMOTE)], errors=errors))
    assert report["outcome"] == loop.PROMOTED


# -- the record of a running loop, --abort, --undo, a second loop --------------------------


def test_a_second_loop_on_the_work_directory_is_refused_while_the_first_lives(tmp_path):
    record = loop.RunRecord(tmp_path / "work")
    assert record.claim("eagle3.1", "rev-before") is None
    with pytest.raises(loop.LoopError, match="another loop runs"):
        loop.RunRecord(tmp_path / "work").claim("eagle3.1", "rev-before")
    record.finish(loop.PROMOTED)
    assert record.read() is None and record.read_last()["outcome"] == loop.PROMOTED
    assert loop.RunRecord(tmp_path / "work").claim("eagle3.1", "rev-before") is None


def dead_loop(tmp_path, live: Path, challenger: str | None) -> Path:
    """The record of a loop whose process died (a pid that has exited) with `challenger` added
    to the live config (the file at `live`); -> its work dir."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    record = {
        "pid": gone.pid,
        "host": socket.gethostname(),
        "process_started": 0.0,
        "incumbent": "eagle3.1",
        "revision_before": revision_of(live.read_bytes()),
        "challenger": challenger,
    }
    (work / loop.RUNNING).write_text(json.dumps(record))
    if challenger is not None:
        text, routed, _ = loop.with_challenger(
            live.read_text(), "eagle3.1", CANDIDATE.with_name(challenger), 0.1
        )
        LocalStore(live).apply(text, routed)
    return work


@pytest.fixture
def cli_store(tmp_path, monkeypatch):
    """The local config file for the CLI; vLLM's argument parser (~20 s to import) is not
    under test."""
    from specserve import cli

    monkeypatch.setattr(cli, "check_engine_settings", lambda *a, **k: None)
    live = tmp_path / "config.yaml"
    live.write_text(DEFAULT.read_text())
    return cli, live


def test_the_next_loop_takes_out_the_challenger_a_dead_loop_left(tmp_path, cli_store):
    cli, live = cli_store
    work = dead_loop(tmp_path, live, "eagle3.1-0123456789ab")
    assert "eagle3.1-0123456789ab" in arms(live.read_text())
    record = loop.RunRecord(work)
    stale = record.claim("eagle3.1", revision_of(live.read_bytes()))
    assert loop.remove_left_behind(stale, LocalStore(live), log=lambda _: None)
    assert arms(live.read_text()) == arms(DEFAULT.read_text())
    assert record.read()["pid"] == os.getpid()  # the directory is this run's now


def test_abort_takes_out_a_dead_loops_challenger_and_its_record(tmp_path, cli_store, capsys):
    cli, live = cli_store
    work = dead_loop(tmp_path, live, "eagle3.1-0123456789ab")
    assert cli.main(["loop", "--abort", "--local", str(live), "--work-dir", str(work)]) == 0
    assert "challenger eagle3.1-0123456789ab removed" in capsys.readouterr().out
    assert arms(live.read_text()) == arms(DEFAULT.read_text())
    assert loop.RunRecord(work).read() is None
    assert cli.main(["loop", "--abort", "--local", str(live), "--work-dir", str(work)]) == 0
    assert "no loop runs" in capsys.readouterr().out


def test_abort_stops_a_running_loop_which_takes_its_challenger_out(tmp_path, cli_store):
    """This process stands in for the loop's: --abort sends the recorded process SIGTERM (which a
    loop takes as KeyboardInterrupt, loop_commands.py, and removes its challenger: tested above)
    and waits until the loop has ended its record."""
    import signal

    cli, live = cli_store
    work = tmp_path / "work"
    record = loop.RunRecord(work)
    record.claim("eagle3.1", revision_of(live.read_bytes()))
    record.name_challenger("eagle3.1-0123456789ab")
    stopped = threading.Event()

    def interrupt(signum, frame):
        stopped.set()

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        aborting = threading.Thread(
            target=cli.main,
            args=(["loop", "--abort", "--local", str(live), "--work-dir", str(work)],),
        )
        aborting.start()
        # The kernel may hand the signal to the aborting thread; Python runs the handler in the
        # main thread at its next bytecode, which a blocking wait would put off until it times
        # out: poll.
        deadline = time.monotonic() + 30
        while not stopped.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stopped.is_set()  # the SIGTERM reached the recorded process (this one)
        record.finish(loop.ABORTED)  # what the interrupted loop does on its way out
        aborting.join(10)
        assert not aborting.is_alive()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert record.read() is None and record.read_last()["outcome"] == loop.ABORTED


def test_a_second_loop_started_on_the_directory_is_refused_with_how_to_stop_the_first(
    tmp_path, cli_store, capsys
):
    cli, live = cli_store
    work = tmp_path / "work"
    loop.RunRecord(work).claim("eagle3.1", revision_of(live.read_bytes()))  # this process's
    candidate = tmp_path / CANDIDATE.name  # an export: --candidate is checked to be one
    candidate.mkdir()
    (candidate / "config.json").write_text("{}")
    command = ["loop", "--incumbent", "eagle3.1", "--prometheus", "http://127.0.0.1:9"]
    command += ["--candidate", str(candidate), "--local", str(live), "--work-dir", str(work)]
    assert cli.main(command) == 2
    assert "--abort" in capsys.readouterr().err
    assert live.read_text() == DEFAULT.read_text()  # nothing deployed


def test_undo_returns_to_the_revision_before_the_loop_in_one_step(tmp_path, cli_store):
    cli, live = cli_store
    work = tmp_path / "work"
    before = live.read_text()
    record = loop.RunRecord(work)
    record.claim("eagle3.1", revision_of(before.encode()))
    report, local, _ = run(tmp_path, Scripted([1], [row(PROMOTE)]))  # the same file
    record.finish(report["outcome"])
    assert arms(live.read_text())["eagle3.1"]["speculative"]["model"] == str(CANDIDATE)
    assert cli.main(["loop", "--undo", "--local", str(live), "--work-dir", str(work)]) == 0
    assert live.read_text() == before


@pytest.mark.ray  # a Prometheus server of its own
def test_the_error_guardrail_reads_the_challengers_5xx_share_from_a_real_prometheus(tmp_path):
    """The query behind `Experiment.errors`: the challenger's server errors and all its
    requests since the experiment began, other outcomes and other arms left out. (A query
    Prometheus refused would read as "no report yet" and the guardrail would never fire.)"""
    from specserve.ab.prometheus import Prometheus
    from specserve.metrics import ENDPOINT, EXPORT_PREFIX, OUTCOME, REQUESTS
    from tests.conftest import metrics_port, prometheus_server, until_scraped

    def counters(ok: int, failed: int, elsewhere: int) -> list[str]:
        name = f"{EXPORT_PREFIX}{REQUESTS}_total"
        row = '{name}{{arm="{arm}",{e}="/v1/chat/completions",{o}="{outcome}"}} {n}'
        return [
            f"# TYPE {name} counter",
            row.format(name=name, arm="c", e=ENDPOINT, o=OUTCOME, outcome="ok", n=ok),
            row.format(name=name, arm="c", e=ENDPOINT, o=OUTCOME, outcome="server_error", n=failed),
            row.format(name=name, arm="c", e=ENDPOINT, o=OUTCOME, outcome="client_error", n=5),
            row.format(
                name=name, arm="d", e=ENDPOINT, o=OUTCOME, outcome="server_error", n=elsewhere
            ),
        ]

    with (
        metrics_port(counters(ok=0, failed=0, elsewhere=0)) as port,
        prometheus_server(tmp_path, port.target) as url,
    ):
        prometheus = Prometheus(url)
        name = f"{EXPORT_PREFIX}{REQUESTS}_total"

        def scraped(total: float) -> None:
            """Wait until Prometheus's last scrape of arm c's counters adds to `total`."""
            until_scraped(prometheus, f'sum({name}{{arm="c"}}) == {total}')

        scraped(5)  # the counters before the experiment's requests
        since = time.time()
        port.lines = counters(ok=37, failed=3, elsewhere=50)
        scraped(45)  # and after them
        failed, answered = prometheus.errors("c", since, time.time())
    # Exact: what each series grew by since the experiment began (increase() would extrapolate).
    assert (failed, answered) == (3, 40)


@pytest.mark.ray  # a Prometheus server of its own
def test_the_reports_totals_count_every_request_of_an_arm_born_in_the_experiment(tmp_path):
    """A challenger's series begin with its first request: each counter's growth since the
    experiment began counts it (increase() sees no growth in a series' first sample)."""
    from specserve.ab.prometheus import Prometheus
    from specserve.metrics import (
        ARM_SELECTIONS,
        EXPORT_PREFIX,
        MODEL,
        REQUEST_OUTPUT_SPEED,
        REQUEST_STAT_COUNT,
        REQUEST_STAT_SUM,
        SELECTED_BY,
        SELECTED_BY_WEIGHT,
        STAT,
    )
    from tests.conftest import metrics_port, prometheus_server, until_scraped

    selections = f"{EXPORT_PREFIX}{ARM_SELECTIONS}_total"
    count, total = (
        f"{EXPORT_PREFIX}{name}_total" for name in (REQUEST_STAT_COUNT, REQUEST_STAT_SUM)
    )

    def counters(arms: dict[str, int]) -> list[str]:
        lines = [f"# TYPE {name} counter" for name in (selections, count, total)]
        for arm, n in arms.items():
            common = f'{MODEL}="m",arm="{arm}"'
            lines.append(f'{selections}{{{common},{SELECTED_BY}="{SELECTED_BY_WEIGHT}"}} {n}')
            stat = f'{common},{STAT}="{REQUEST_OUTPUT_SPEED}"'
            lines += [f"{count}{{{stat}}} {n}", f"{total}{{{stat}}} {10 * n}"]
        return lines

    with (
        metrics_port(counters({"incumbent": 10})) as port,
        prometheus_server(tmp_path, port.target) as url,
    ):
        prometheus = Prometheus(url)
        until_scraped(prometheus, f'{selections}{{arm="incumbent"}} == 10')
        since = time.time()
        port.lines = counters({"incumbent": 25, "challenger": 7})
        until_scraped(prometheus, f'{selections}{{arm="challenger"}} == 7')
        totals = prometheus.totals("m", since, time.time())
    assert totals["incumbent"].randomized == 15 and totals["challenger"].randomized == 7
    speed = totals["challenger"].stats[REQUEST_OUTPUT_SPEED]
    assert (speed.n, speed.total) == (7, 70)


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        (SystemExit("too little captured traffic in /c: 3 answers"), "too little captured"),
        (
            RuntimeError("Task was killed due to the node running low on memory.\nMemory on the"),
            "killed for memory",
        ),
        (
            RuntimeError("TrainingFailedError: worker 0 died: killed due to memory pressure (OOM)"),
            "killed for memory",
        ),
        (ValueError("a shard is cut short\nTraceback ..."), "ValueError: a shard is cut short"),
    ],
)
def test_an_adapt_that_fails_ends_the_loop_in_one_line_with_nothing_deployed(
    tmp_path, cli_store, capsys, monkeypatch, failure, said
):
    cli, live = cli_store

    def failing(config):
        raise failure

    monkeypatch.setattr("specserve.drafter.adapt.adapt", failing)
    monkeypatch.setattr("specserve.models.prepare_model", lambda source: "/nowhere")
    work = tmp_path / "work"
    command = ["loop", "--incumbent", "eagle3.1", "--prometheus", "http://127.0.0.1:9"]
    command += ["--local", str(live), "--work-dir", str(work), "--json", str(tmp_path / "r.json")]
    assert cli.main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: adapt: ") and said in err[0], err
    assert err[0].endswith("nothing deployed")
    assert live.read_text() == DEFAULT.read_text()
    assert loop.RunRecord(work).read_last()["outcome"] == loop.ABORTED
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["outcome"] == loop.ABORTED and said in report["reason"]
    assert report["steps"] == report["rows"] == []


def test_a_candidate_rejected_offline_ends_the_loop_with_its_reason_in_the_report(
    tmp_path, cli_store, capsys, monkeypatch
):
    """`--json` holds a report for every outcome: a rejected candidate's too, which the loop's
    proof reads."""
    cli, live = cli_store
    verdict = {"accepted": False, "reason": "not better on captured traffic: 1.007x"}
    monkeypatch.setattr(
        "specserve.drafter.adapt.adapt", lambda config: {"accepted": None, "verdict": verdict}
    )
    monkeypatch.setattr("specserve.models.prepare_model", lambda source: "/nowhere")
    command = ["loop", "--incumbent", "eagle3.1", "--prometheus", "http://127.0.0.1:9"]
    command += ["--local", str(live), "--work-dir", str(tmp_path / "work")]
    command += ["--json", str(tmp_path / "r.json")]
    assert cli.main(command) == 3
    assert "nothing deployed" in capsys.readouterr().out
    assert live.read_text() == DEFAULT.read_text()
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["outcome"], report["reason"]) == (loop.NO_CANDIDATE, verdict["reason"])
