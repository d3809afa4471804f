"""`specserve loop`: a better drafter proved on live traffic and promoted, or rolled back.

    specserve loop --incumbent eagle3.1 --prometheus http://127.0.0.1:9090 --local

1. A candidate: `--candidate DIR`, else `drafter adapt` on the capture store (drafter/adapt.py);
   one that is not better offline ends the loop before anything is deployed.
2. A challenger arm: the incumbent's arm with the candidate as its drafter, named after the
   candidate (`eagle3.1-<digest>`), taking `--share` of the incumbent's weight (0.5: the two
   engines carry the same load, as a fair comparison of per-user speed needs): a revision.
3. The verdict of `ab report` (ab/report.py: per-user output tokens/s with an always-valid
   interval) for the challenger against the incumbent, from the moment the challenger first
   served, read every `--poll-s`.
4. promote: the incumbent arm takes the candidate and the challenger goes (one revision): as
   its `drafter_weights`, loaded by the running engines without a restart, where the candidate
   has the tensors of the incumbent's drafter (one `drafter adapt` trained from it); else as its
   drafter, which restarts its engines;
   roll back, a guardrail drain of the challenger, a sample-ratio mismatch or no verdict within
   `--max-wait-s`: the challenger goes (one revision). Either way its weight returns to the
   incumbent.

Every step is a config revision through the normal path — `config apply` on Kubernetes, the file
a local `specserve serve` runs from with `--local` — so `config history` lists it and `config
rollback` undoes it, and Grafana marks it (the dashboards' config-revision annotation). The
revisions the loop writes are the live config with the change made, written back as plain YAML
(comments and anchors of the original are not kept; the original stays in the history).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specserve.ab.prometheus import Prometheus, PrometheusError
from specserve.ab.report import PROMOTE, ROLL_BACK, Options, build_report
from specserve.config.schema import RouterConfig, parse_config
from specserve.config.store import ConfigStore
from specserve.drafter_checkpoint import misfit
from specserve.hardware import CPU_BIND_ENV
from specserve.models import ModelError, resolve_drafter_source

PROMOTED, ROLLED_BACK, DRAINED, FAILING, MISMATCH, TIMED_OUT, NO_CANDIDATE, ABORTED = (
    "promoted",
    "rolled back",
    "drained by the guardrail",
    "failing requests",
    "sample-ratio mismatch",
    "no verdict in time",
    "no candidate better offline",
    "stopped before a verdict",
)


# The routing key the loop sets while its challenger serves.
LEFT_OUT_KEY = "ab_left_out_prompts"
# Seconds after adding the challenger from which its requests are counted: more than Ray's
# metrics export (deploy.METRICS_REPORT_S; 10 s by default) and a scrape (the chart's: 15 s)
# take, less than a new engine takes to start. An A/A rerun that added the same name 5 s after
# the run before removed it saw 4 of that run's requests arrive and read them as the new one's.
SETTLE_S = 30.0


class LoopError(RuntimeError):
    pass


@dataclass
class LoopConfig:
    incumbent: str
    share: float = 0.5  # of the incumbent's weight, for the challenger: 0.5 = the same load
    poll_s: float = 30.0
    max_wait_s: float = 3600.0
    start_timeout_s: float = 900.0  # for the challenger's first request
    min_requests: int = 30
    alpha: float = 0.05
    model: str | None = None
    # The error guardrail: the challenger goes once more than this share of its requests failed
    # on the platform's side (5xx), counted from `min_error_requests` requests on.
    max_error_share: float = 0.05
    min_error_requests: int = 20
    # No promotion while one key's segment is slower than this share (ab/report.py).
    max_key_loss: float = 0.1
    # The challenger's CPU cores (its VLLM_CPU_OMP_THREADS_BIND); None: the incumbent's.
    challenger_cpus: str | None = None
    # Digests of the prompts the candidate was trained on: their requests are left out of the
    # A/B while the challenger serves (routing.ab_left_out_prompts; drafter/seen.py).
    left_out_prompts: frozenset[str] = frozenset()


@dataclass
class Step:
    what: str
    revision: str
    at: float = field(default_factory=time.time)


# -- the revisions -------------------------------------------------------------------------


def _arms(document: dict[str, Any]) -> list[dict[str, Any]]:
    arms = document.get("arms")
    if not isinstance(arms, list):
        raise LoopError("the live config has no list of arms")
    return arms


def _arm(document: dict[str, Any], name: str) -> dict[str, Any]:
    for arm in _arms(document):
        if arm.get("name") == name:
            return arm
    known = ", ".join(str(a.get("name")) for a in _arms(document))
    raise LoopError(f"no arm {name!r} in the live config (arms: {known})")


def _revision(document: dict[str, Any]) -> tuple[str, RouterConfig]:
    text = yaml.safe_dump(document, sort_keys=False)
    return text, parse_config(text, source="the loop's revision")


def with_challenger(
    live: str,
    incumbent: str,
    candidate: Path,
    share: float,
    cpus: str | None = None,
    left_out: frozenset[str] = frozenset(),
) -> tuple[str, RouterConfig, str]:
    """The live config plus a challenger arm: the incumbent's, with `candidate` as its drafter
    and `share` of the incumbent's weight, taken from the incumbent (the other arms keep
    theirs; at 0.5 both engines carry the same load), on the CPU cores `cpus` where given
    (else the incumbent's); the requests of the `left_out` prompts out of the A/B's
    statistics. -> text, config, arm name."""
    document = yaml.safe_load(live)
    base = _arm(document, incumbent)
    if (base.get("speculative") or {}).get("method") != "eagle3":
        raise LoopError(f"arm {incumbent!r} does not run an EAGLE drafter to replace")
    if not 0 < share < 1:
        raise LoopError(f"the challenger's share must lie between 0 and 1, not {share}")
    name = candidate.name
    if any(a.get("name") == name for a in _arms(document)):
        raise LoopError(f"an arm {name!r} already runs: finish or remove that experiment first")
    weight = float(base.get("weight", 0))
    if weight <= 0:
        raise LoopError(f"arm {incumbent!r} takes no weighted traffic to share with a challenger")
    challenger = copy.deepcopy(base)
    challenger.update(name=name, weight=round(weight * share, 6))
    base["weight"] = round(weight - challenger["weight"], 6)
    challenger["speculative"]["model"] = str(candidate)
    challenger.pop("drafter_weights", None)  # the candidate's own weights, not a promoted one's
    challenger.pop("capture", None)  # the incumbent's capture keeps the traffic's sample
    if cpus is not None:
        challenger["env"] = {**(challenger.get("env") or {}), CPU_BIND_ENV: cpus}
    _arms(document).append(challenger)
    if left_out:
        routing = document.setdefault("routing", {}) or {}
        document["routing"] = routing | {LEFT_OUT_KEY: sorted(left_out)}
    text, config = _revision(document)
    return text, config, name


def shared_cores(config: RouterConfig, incumbent: str, challenger: str) -> str | None:
    """The CPU binding two CPU arms share, if they do (GPU engines get devices of their own)."""
    arms = [config.arm(name) for name in (incumbent, challenger)]
    binds = [arm.env.get(CPU_BIND_ENV) if arm is not None else None for arm in arms]
    return binds[0] if binds[0] is not None and binds[0] == binds[1] else None


def promoted(live: str, incumbent: str, challenger: str) -> tuple[str, RouterConfig, bool]:
    """The incumbent takes the challenger's drafter and weight; the challenger goes. -> text,
    config, and whether the incumbent's running engines load the drafter's weights in place
    (`drafter_weights`: it fits the drafter they run) or restart with it."""
    document = yaml.safe_load(live)
    model = _arm(document, challenger)["speculative"]["model"]
    arm = _arm(document, incumbent)
    in_place = _fits(model, arm["speculative"]["model"])
    if in_place:
        arm["drafter_weights"] = model
    else:
        arm["speculative"]["model"] = model
        arm.pop("drafter_weights", None)
    text, config = _revision(_removed(document, challenger, incumbent))
    return text, config, in_place


def _fits(candidate: str, drafter: str) -> bool:
    """Whether `candidate` (a directory here) has the tensors of `drafter`, both readable here."""
    try:
        return misfit(candidate, resolve_drafter_source(drafter)) is None
    except (OSError, ValueError, ModelError):  # not readable here: the engines restart with it
        return False


def without(live: str, challenger: str, incumbent: str) -> tuple[str, RouterConfig]:
    """The challenger goes; its weight returns to the incumbent."""
    return _revision(_removed(yaml.safe_load(live), challenger, incumbent))


def _removed(document: dict[str, Any], challenger: str, incumbent: str) -> dict[str, Any]:
    """Without the challenger, its weight back with the incumbent, and every request counted
    in the A/B statistics again."""
    weight = float(_arm(document, challenger).get("weight", 0))
    if isinstance(document.get("routing"), dict):
        document["routing"].pop(LEFT_OUT_KEY, None)
    document["arms"] = [a for a in _arms(document) if a.get("name") != challenger]
    if any(a.get("name") == incumbent for a in _arms(document)):
        base = _arm(document, incumbent)
        base["weight"] = round(float(base.get("weight", 0)) + weight, 6)
    return document


# -- the experiment --------------------------------------------------------------------------


class Experiment:
    """What the loop reads from Prometheus about the challenger."""

    def __init__(self, prometheus: Prometheus, config: LoopConfig) -> None:
        self.prometheus, self.config = prometheus, config

    def served(self, arm: str, since: float) -> float:
        return self.prometheus.selections(arm, since, time.time())

    def drained(self, arm: str) -> bool:
        return self.prometheus.drained(arm, time.time())

    def errors(self, arm: str, since: float) -> tuple[float, float]:
        return self.prometheus.errors(arm, since, time.time())

    def verdict(self, challenger: str, since: float) -> dict[str, Any]:
        options = Options(
            baseline=self.config.incumbent,
            alpha=self.config.alpha,
            min_requests=self.config.min_requests,
            max_key_loss=self.config.max_key_loss,
        )
        report = build_report(self.prometheus, options, since, self.config.model)
        for row in report["arms"]:
            if row["arm"] == challenger:
                return row | {key: report[key] for key in ("unit", "cluster_robust", "window_s")}
        raise PrometheusError(f"no figures for the challenger {challenger!r} yet")


class Loop:
    """Steps 2-4 of the module docstring, each step a revision applied to `store`."""

    def __init__(
        self,
        config: LoopConfig,
        store: ConfigStore,
        experiment: Experiment,
        *,
        log: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config, self.store = config, store
        self.experiment, self.log, self.sleep, self.clock = experiment, log, sleep, clock
        self.steps: list[Step] = []
        self.rows: list[dict[str, Any]] = []
        self._ended = False  # the experiment reached an outcome (and `_end` ran)

    def run(self, candidate: Path) -> dict[str, Any]:
        """-> {outcome, reason, challenger, steps, rows}. Whatever stops it before a verdict (an
        error, Ctrl-C, a termination signal raised as an exception) removes the challenger
        first, so nothing is left serving unwatched; then the error goes on."""
        c = self.config
        text, routed, challenger = with_challenger(
            self.store.live_text(),
            c.incumbent,
            candidate,
            c.share,
            c.challenger_cpus,
            c.left_out_prompts,
        )
        shared = shared_cores(routed, c.incumbent, challenger)
        if shared:
            self.log(
                f"the challenger computes on the incumbent's cores ({CPU_BIND_ENV}={shared}): "
                "the two engines slow each other alike"
            )
        elif c.challenger_cpus:
            # An A/A beside the platform on a 2-core node (docs/bench/loop.md): +35 % for the
            # engine on the other core, a false promotion.
            self.log(
                f"the challenger computes on cores of its own ({CPU_BIND_ENV}="
                f"{c.challenger_cpus}): a fair comparison only if nothing else runs on either "
                "engine's cores; the router, proxies and engine front-ends float over them"
            )
        try:
            added = self.clock()
            self._step(f"challenger {challenger} added", text, routed)
            return self._experiment(challenger, added)
        except BaseException as exc:
            if not self._ended:
                self._remove_after(challenger, exc)
            raise

    def _remove_after(self, challenger: str, exc: BaseException) -> None:
        """Take the challenger out of the live config, if it is there, after `exc` stopped
        the loop; a failure to do so is logged beside the error that stopped it."""
        try:
            live = self.store.live_text()
            if challenger not in {arm.get("name") for arm in _arms(yaml.safe_load(live))}:
                return
            self.log(f"stopped by {type(exc).__name__}: removing challenger {challenger}")
            text, routed = without(live, challenger, self.config.incumbent)
            self._step(f"challenger {challenger} removed: {ABORTED}", text, routed)
        except Exception as cleanup:
            self.log(
                f"could not remove challenger {challenger} ({cleanup}); remove it with "
                "`specserve config rollback`"
            )

    def _experiment(self, challenger: str, added: float) -> dict[str, Any]:
        c = self.config
        deadline = self.clock() + c.start_timeout_s
        # What an earlier arm of the same name (a rerun with the same candidate) was sent before
        # it went reaches Prometheus up to an export and a scrape later: counted from after
        # that, none of it reads as this challenger serving. A new engine takes longer to start.
        counted_from = added + SETTLE_S
        self.sleep(max(0.0, counted_from - self.clock()))
        while self._served(challenger, counted_from) < 1:
            if self.clock() > deadline:
                return self._end(challenger, TIMED_OUT, "the router never sent it a request")
            self.sleep(min(c.poll_s, 5.0))
        since = self.clock()
        self.log(f"challenger {challenger} serves; the experiment runs from now")
        deadline = since + c.max_wait_s
        while True:
            self.sleep(c.poll_s)
            # Prometheus out of reach (a query timed out on a loaded machine) is asked again at
            # the next poll; the deadline still holds.
            try:
                if self.experiment.drained(challenger):
                    return self._end(challenger, DRAINED, "the acceptance guardrail drained it")
                failed, answered = self.experiment.errors(challenger, since)
                if answered >= c.min_error_requests and failed > c.max_error_share * answered:
                    return self._end(
                        challenger,
                        FAILING,
                        f"{failed:.0f} of its {answered:.0f} requests failed "
                        f"(over {c.max_error_share:.0%})",
                    )
                row = self.experiment.verdict(challenger, since)
            except PrometheusError as exc:
                self.log(f"no report yet: {exc}")
            else:
                self.rows.append({"at": self.clock(), **row})
                self.log(f"{row['verdict']}: {row['reason']}")
                if row["traffic"]["mismatch"]:
                    return self._end(challenger, MISMATCH, row["reason"])
                if row["verdict"] == PROMOTE:
                    return self._end(challenger, PROMOTED, row["reason"])
                if row["verdict"] == ROLL_BACK:
                    return self._end(challenger, ROLLED_BACK, row["reason"])
            if self.clock() > deadline:
                return self._end(challenger, TIMED_OUT, f"no verdict in {c.max_wait_s:.0f} s")

    def _served(self, challenger: str, since: float) -> float:
        """Requests the router sent the challenger since `since`: a challenger's name used
        before (a rerun with the same candidate) has its series' earlier counts in Prometheus,
        and read whole they started the experiment before its engine served (its share read
        0 %); so did the last requests of the run before, counted after it removed the arm."""
        try:
            return self.experiment.served(challenger, since)
        except PrometheusError as exc:
            self.log(f"not serving yet: {exc}")
            return 0.0

    def _step(self, what: str, text: str, routed: RouterConfig) -> None:
        self.steps.append(Step(what, self.store.apply(text, routed).new_revision))
        self.log(f"revision {self.steps[-1].revision}: {what}")

    def _end(self, challenger: str, outcome: str, reason: str) -> dict[str, Any]:
        incumbent = self.config.incumbent
        if outcome == PROMOTED:
            text, routed, in_place = promoted(self.store.live_text(), incumbent, challenger)
            how = "its weights loaded in place" if in_place else "its engines restarted"
            self._step(
                f"{incumbent} takes {challenger}'s drafter ({how}); {challenger} removed",
                text,
                routed,
            )
        else:
            text, routed = without(self.store.live_text(), challenger, incumbent)
            self._step(f"challenger {challenger} removed: {outcome}", text, routed)
        self._ended = True
        return {
            "outcome": outcome,
            "reason": reason,
            "challenger": challenger,
            "steps": [step.__dict__ for step in self.steps],
            "rows": self.rows,
        }


# -- the record of a running loop ------------------------------------------------------------

RUNNING, LAST = "loop-running.json", "loop-last.json"  # in the loop's work directory


def _process_started(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class RunRecord:
    """The loop running on a work directory, as `loop-running.json` there. Created exclusively:
    a second loop on the directory is refused while the first one's process lives. It names the
    challenger once there is one, so that a loop whose process died without cleaning up (an OOM
    kill, SIGKILL, a lost node) leaves a record of what to take out, for the next run or
    `specserve loop --abort`. A loop that ends moves it to `loop-last.json`, which keeps the
    revision from before the loop for `specserve loop --undo`."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.running, self.last = work_dir / RUNNING, work_dir / LAST

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None

    def read(self) -> dict[str, Any] | None:
        return self._read(self.running)

    def read_last(self) -> dict[str, Any] | None:
        return self._read(self.last)

    @staticmethod
    def alive(record: dict[str, Any]) -> bool:
        """Whether the recorded loop's process still runs (one on another host is taken to)."""
        if record.get("host") != socket.gethostname():
            return True
        started = _process_started(int(record["pid"]))
        # The same pid with another start time is another process.
        return started is not None and abs(started - float(record["process_started"])) < 1

    def claim(self, incumbent: str, revision_before: str) -> dict[str, Any] | None:
        """Record this process as the directory's loop; -> the record of a loop that died
        without cleaning up (its challenger may still serve), else None. LoopError while
        another loop's process lives."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "process_started": _process_started(os.getpid()),
            "started_at": time.time(),
            "incumbent": incumbent,
            "revision_before": revision_before,
            "challenger": None,
        }
        stale = None
        for _ in range(3):
            try:
                fd = os.open(self.running, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                other = self.read()
                if other is not None and self.alive(other):
                    raise LoopError(
                        f"another loop runs on {self.work_dir} (pid {other['pid']} on "
                        f"{other['host']}, improving {other['incumbent']}): let it end, or stop "
                        f"it with `specserve loop --abort --work-dir {self.work_dir}`"
                    ) from None
                stale = other or stale
                self.running.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            return stale
        raise LoopError(f"could not record the loop in {self.running}")

    def name_challenger(self, name: str) -> None:
        record = self.read() or {}
        record["challenger"] = name
        self.running.write_text(json.dumps(record))

    def finish(self, outcome: str) -> None:
        """The loop ended (`outcome`): its record becomes the last loop's."""
        record = self.read()
        if record is not None:
            record.update(outcome=outcome, ended_at=time.time())
            self.last.write_text(json.dumps(record))
            self.running.unlink(missing_ok=True)


def remove_left_behind(
    record: dict[str, Any],
    store: ConfigStore,
    log: Callable[[str], None] = print,
) -> str | None:
    """Take out the challenger of a loop that stopped without cleaning up, if it still serves;
    -> the revision that removed it."""
    name = record.get("challenger")
    live = store.live_text()
    if not name or name not in {arm.get("name") for arm in _arms(yaml.safe_load(live))}:
        return None
    text, routed = without(live, name, record.get("incumbent", ""))
    revision = store.apply(text, routed).new_revision
    log(
        f"revision {revision}: challenger {name} removed, left by a loop that stopped without "
        f"cleaning up (pid {record.get('pid')} on {record.get('host')})"
    )
    return revision


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
