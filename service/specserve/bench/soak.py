"""Soak: the platform under steady traffic for minutes, one engine replica killed mid-run.

    python -m specserve.bench.soak --duration-s 600    # the default config, on loopback

Poisson arrivals (`--rate` per second, at most `--max-concurrency` in flight), streaming and not,
split by the router's weights over every arm, each request with an API key. At `--kill-at` of the
run one engine replica of `--kill-arm` is SIGKILLed (a replica on this machine). Every request is
accounted for: completed, or failed by cause (HTTP status, a stream cut short, a transport error,
no answer within `--timeout-s`, i.e. hung). A failure is the kill's when it was on the killed arm
and in flight at the kill or started within KILL_WINDOW_S after it; any other failure fails the
soak. The resident memory of every process of the local Ray cluster (GCS, raylet, proxy, router
and engine replicas, engine cores) is sampled throughout; its slope over the second half shows
creep. Before anything is measured, every arm serves `--max-concurrency` requests at once (with
an admin key, forced): a vLLM worker's heap grows to the largest batch it has served and keeps
that memory, so without this warm-up a shift of load (the kill sends a killed arm's share to
the others) reads as creep. Every prompt carries a canary string, and the platform's log files
are searched for it afterwards: prompts and completions are never logged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from tqdm import tqdm

from specserve import headers
from specserve.config.serve_config import ARM_NAME_ENV, arm_app_name

# A failure on the killed arm that started this long after the kill is still the kill's: the
# router learns within about a second that the arm has no replica, Ray Serve within a few.
KILL_WINDOW_S = 10.0
RSS_SAMPLE_S = 5.0
_RAY_TASK_SUFFIX = re.compile(r"(ray::\S+?)\.[A-Za-z_]\w*$")
# The kill comes a quarter into the run, so the second half (where creep is judged) begins well
# after it: the killed arm's share moves to the others, whose vLLM workers' heaps step up to the
# bigger batches within a minute and keep that memory (a high-water mark, BENCHMARKS.md). Killed
# at half-time, that step opens the judged window and reads as a slope.
KILL_AT = 0.25
# Creep: a process that keeps its RSS slope under this over the second half of the run does not
# leak per request beyond ~9 KiB each at 2 requests/s (1 MiB a minute).
MAX_RSS_SLOPE_MIB_PER_MIN = 1.0
PROMPTS = (
    "Name three colours.",
    "Write a haiku about rivers.",
    "What is the capital of France? Answer in one word.",
    "List the first five prime numbers.",
    "Explain what a lighthouse does, in two sentences.",
)


@dataclass
class Outcome:
    arm: str  # the arm that answered, "" when none did
    stream: bool
    started: float
    ended: float
    cause: str  # "ok", "http_<status>[:<error code>]", "stream_cut", "transport", "hung"

    @property
    def ok(self) -> bool:
        return self.cause == "ok"


@dataclass
class MemoryTrace:
    """RSS samples (seconds since start, MiB) of one process in one role (its name)."""

    name: str
    samples: list[tuple[float, float]] = field(default_factory=list)
    pid: int = 0

    def slope_mib_per_min(self, since_s: float, until_s: float) -> float | None:
        """The least-squares slope of RSS from `since_s` on, for a process that ran from then
        until `until_s` (a replica started or killed meanwhile loads or stops: no creep)."""
        late = [(t, rss) for t, rss in self.samples if t >= since_s]
        ran_through = self.samples[0][0] <= since_s and self.samples[-1][0] >= until_s
        if len(late) < 3 or not ran_through:
            return None
        times = [t for t, _ in late]
        mean_t, mean_r = statistics.fmean(times), statistics.fmean(r for _, r in late)
        var = sum((t - mean_t) ** 2 for t in times)
        if var == 0:
            return None
        return 60 * sum((t - mean_t) * (r - mean_r) for t, r in late) / var


def platform_processes() -> list[psutil.Process]:
    """Every process of the Ray cluster this process started."""
    from specserve.deploy import local_cluster_processes

    return local_cluster_processes()


def _process_name(process: psutil.Process) -> str:
    """The command line, and the arm a process of an arm serves (vLLM's engine core and workers
    run below the replica, under their own names)."""
    try:
        name = " ".join(process.cmdline())[:80] or process.name()
        arm = process.environ().get(ARM_NAME_ENV)
    except psutil.Error:
        return "?"
    return f"[{arm}] {name}" if arm else name


def _role(name: str) -> str:
    """A process's role: its name without the method a Ray actor runs now. Ray titles a worker
    `ray::Class.method` while it runs a task, `ray::Class` between tasks, `ray::IDLE` before it
    is given an actor (and pads the title with spaces); an arm's replica, whose class name
    holds the arm's name, is titled `ray::1.method` for an arm named `eagle3.1`, so an arm's
    Ray worker is known by its arm alone."""
    name = name.strip()
    arm, ray, title = name.partition("ray::")
    if not ray:
        return name
    if title.startswith("IDLE"):
        return f"{arm}ray::IDLE"
    if arm:
        return f"{arm}ray::"
    return _RAY_TASK_SUFFIX.sub(r"\1", name)


class MemorySampler(threading.Thread):
    def __init__(self, started: float) -> None:
        super().__init__(daemon=True)
        self.started = started
        # One trace per process and role: Ray starts an idle worker first and makes it a replica
        # later (a replacement), which is a process starting anew, not growing.
        self.traces: dict[int, MemoryTrace] = {}
        self._trace_of: dict[int, int] = {}  # pid -> its current trace
        self.stop = threading.Event()

    def sample(self) -> None:
        now = time.monotonic() - self.started
        for process in platform_processes():
            try:
                rss = process.memory_info().rss / 2**20
            except psutil.Error:
                continue
            name = _process_name(process)
            key = self._trace_of.get(process.pid)
            if key is None or _role(self.traces[key].name) != _role(name):
                key = self._trace_of[process.pid] = len(self.traces)
                self.traces[key] = MemoryTrace(name, pid=process.pid)
            self.traces[key].samples.append((now, rss))

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(RSS_SAMPLE_S)


def busy_replica_pid(app: str) -> int:
    """The engine replica of Serve application `app` on this machine using the most CPU now,
    with its engine core and workers (they run below it): under load, one with requests in
    flight. The replica's own process alone does not tell: its share is the HTTP and output
    handling, which can be as busy in a replica that has just started as in one that streams.
    (A replica's process title does not name the requests it serves.)"""
    families = {
        p.pid: _with_descendants(p)
        for p in psutil.process_iter(["pid", "cmdline"])
        if f"ServeReplica:{app}:" in " ".join(p.info["cmdline"] or [])
    }
    if not families:
        raise RuntimeError(f"no replica of {app!r} runs on this machine")
    for family in families.values():
        _cpu_percent(family)  # starts the measuring interval
    time.sleep(0.5)
    return max(families, key=lambda pid: _cpu_percent(families[pid]))


def _with_descendants(process: psutil.Process) -> list[psutil.Process]:
    try:
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return [process]


def _cpu_percent(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            total += process.cpu_percent()
        except psutil.Error:
            continue
    return total


def kill_replica(arm: str) -> int:
    """SIGKILL the busy engine replica of `arm`."""
    pid = busy_replica_pid(arm_app_name(arm))
    os.kill(pid, signal.SIGKILL)
    return pid


async def one_request(
    client: httpx.AsyncClient,
    model: str,
    canary: str,
    stream: bool,
    max_tokens: int,
    forced: dict[str, str] | None = None,
) -> Outcome:
    prompt = f"{random.choice(PROMPTS)} ({canary})"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    started = time.monotonic()
    arm, cause = "", "ok"
    try:
        chat = "/v1/chat/completions"
        async with client.stream("POST", chat, json=body, headers=forced) as response:
            arm = response.headers.get(headers.ARM, "")
            if response.status_code != 200:
                cause = f"http_{response.status_code}{_error_code(await response.aread())}"
            elif stream:
                events = [line async for line in response.aiter_lines() if line.strip()]
                if events[-1:] != ["data: [DONE]"] or any('data: {"error"' in e for e in events):
                    cause = "stream_cut"
            else:
                json.loads(await response.aread())
    except httpx.TimeoutException:
        cause = "hung"
    except (httpx.HTTPError, ValueError):
        cause = "transport"
    return Outcome(arm, stream, started, time.monotonic(), cause)


def _error_code(body: bytes) -> str:
    """ ":<code>" of an OpenAI error body (which says why, and never holds the prompt)."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return ""
    return f":{code}" if isinstance(code, str) and code else ""


async def drive(args: argparse.Namespace, model: str, canary: str, on_kill) -> list[Outcome]:
    """Poisson arrivals for `duration_s`, then wait for every request to end."""
    limits = httpx.Limits(max_connections=args.max_concurrency + 4)
    auth = {headers.AUTHORIZATION: f"Bearer {args.api_key}"} if args.api_key else {}
    slots = asyncio.Semaphore(args.max_concurrency)
    tasks: list[asyncio.Task[Outcome]] = []
    started = time.monotonic()
    kill_at = started + args.kill_at * args.duration_s if args.kill_arm else None

    async def bounded() -> Outcome:
        try:
            return await one_request(
                client, model, canary, random.random() < args.stream_share, args.max_tokens
            )
        finally:
            slots.release()

    progress = tqdm(total=round(args.duration_s), unit="s", desc="soak", leave=False)
    async with httpx.AsyncClient(
        base_url=args.url, headers=auth, timeout=args.timeout_s, limits=limits
    ) as client:
        while (elapsed := time.monotonic() - started) < args.duration_s:
            progress.update(round(elapsed) - progress.n)
            progress.set_postfix(sent=len(tasks), done=sum(t.done() for t in tasks))
            await asyncio.sleep(random.expovariate(args.rate))
            if kill_at is not None and time.monotonic() >= kill_at:
                await asyncio.to_thread(on_kill)
                kill_at = None
            await slots.acquire()  # arrivals wait while `max_concurrency` are in flight
            tasks.append(asyncio.get_running_loop().create_task(bounded()))
        progress.close()
        return list(await asyncio.gather(*tasks))


async def warm_up(args: argparse.Namespace, model: str, canary: str, arms: list[str]) -> None:
    """Each arm at the run's peak concurrency once, half of it streamed (see the docstring)."""
    admin = {headers.AUTHORIZATION: f"Bearer {args.admin_key}"}
    limits = httpx.Limits(max_connections=args.max_concurrency + 4)
    async with httpx.AsyncClient(
        base_url=args.url, timeout=args.timeout_s, limits=limits
    ) as client:
        for arm in tqdm(arms, desc="warm-up", unit="arm", leave=False):
            forced = {**admin, headers.ARM_OVERRIDE: arm}
            requests = (
                one_request(client, model, canary, i % 2 == 0, args.max_tokens, forced)
                for i in range(args.max_concurrency)
            )
            outcomes = await asyncio.gather(*requests)
            if not all(o.ok for o in outcomes):
                raise RuntimeError(f"warm-up on arm {arm}: {Counter(o.cause for o in outcomes)}")


def percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99)}


def logs_containing(canary: str, roots: list[Path]) -> list[str]:
    """Every file under `roots` whose bytes contain `canary`."""
    needle = canary.encode()
    found = []
    for root in roots:
        for path in root.rglob("*") if root.is_dir() else [root]:
            try:
                if path.is_file() and needle in path.read_bytes():
                    found.append(str(path))
            except OSError:
                continue
    return found


def summarize(
    outcomes: list[Outcome],
    killed_at: float | None,
    kill_arm: str | None,
    memory: dict[int, MemoryTrace],
    duration_s: float,
    max_rss_slope: float,
    leaked_to: list[str],
) -> dict[str, Any]:
    def from_kill(o: Outcome) -> bool:
        return (
            killed_at is not None
            and o.arm in (kill_arm, "")
            and (o.started <= killed_at <= o.ended or 0 <= o.started - killed_at <= KILL_WINDOW_S)
        )

    failed = [o for o in outcomes if not o.ok]
    unexplained = [o for o in failed if not from_kill(o)]
    by_arm: dict[str, list[float]] = {}
    for o in outcomes:
        if o.ok:
            by_arm.setdefault(o.arm, []).append(o.ended - o.started)
    half = duration_s / 2
    processes: list[dict[str, Any]] = []
    for _, trace in sorted(memory.items()):
        slope = trace.slope_mib_per_min(half, duration_s - 2 * RSS_SAMPLE_S)
        processes.append(
            {
                "pid": trace.pid,
                "process": trace.name,
                "rss_start_mib": round(trace.samples[0][1], 1),
                "rss_end_mib": round(trace.samples[-1][1], 1),
                "slope_mib_per_min": None if slope is None else round(slope, 2),
            }
        )
    creeping = [
        p
        for p in processes
        if p["slope_mib_per_min"] is not None and p["slope_mib_per_min"] > max_rss_slope
    ]
    problems = []
    if unexplained:
        problems.append(f"{len(unexplained)} failures not from the kill")
    if len(failed) > 0.001 * len(outcomes):
        problems.append(f"{len(failed)} failures of {len(outcomes)}: more than 0.1 %")
    if any(o.cause == "hung" for o in outcomes):
        problems.append("requests hung")
    if creeping:
        problems.append(f"{len(creeping)} processes grow faster than {max_rss_slope} MiB/min")
    if leaked_to:
        problems.append(f"the canary is in {len(leaked_to)} log files")
    return {
        "sent": len(outcomes),
        "completed": len(outcomes) - len(failed),
        "failed_by_cause": dict(Counter(o.cause for o in failed)),
        "failed_from_kill": len(failed) - len(unexplained),
        "failed_unexplained": [asdict(o) for o in unexplained],
        "streamed": sum(o.stream for o in outcomes),
        "by_arm": {
            arm: {"completed": len(lat), **percentiles_ms(lat)}
            for arm, lat in sorted(by_arm.items())
        },
        "processes": processes,
        "max_rss_slope_mib_per_min": max_rss_slope,
        "canary_in_logs": leaked_to,
        "passed": not problems,
        "problems": problems,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"sent {report['sent']}, completed {report['completed']}, failed "
        f"{sum(report['failed_by_cause'].values())} {report['failed_by_cause']} "
        f"({report['failed_from_kill']} from the kill), streamed {report['streamed']}",
        "",
        "| arm | completed | p50 ms | p95 ms | p99 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for arm, row in report["by_arm"].items():
        lines.append(
            f"| {arm or 'not named to this key'} | {row['completed']} | {row['p50']:.0f} | "
            f"{row['p95']:.0f} | {row['p99']:.0f} |"
        )
    lines += ["", "| process | RSS start MiB | RSS end MiB | slope, 2nd half, MiB/min |"]
    lines.append("| --- | --- | --- | --- |")
    for p in report["processes"]:
        lines.append(
            f"| {p['process'][:60]} | {p['rss_start_mib']} | {p['rss_end_mib']} | "
            f"{p['slope_mib_per_min']} |"
        )
    verdict = "PASS" if report["passed"] else "FAIL: " + "; ".join(report["problems"])
    return "\n".join([*lines, "", verdict])


def run(
    args: argparse.Namespace, *, model: str, arms: list[str], log_roots: list[Path]
) -> dict[str, Any]:
    """The soak against a running platform whose Ray cluster this process started; warmed up
    first where `args.admin_key` is set."""
    canary = f"canary-{uuid.uuid4().hex}"
    if args.admin_key:
        asyncio.run(warm_up(args, model, canary, arms))
    started = time.monotonic()
    sampler = MemorySampler(started)
    sampler.sample()
    sampler.start()
    killed: dict[str, float] = {}

    def on_kill() -> None:
        pid = kill_replica(args.kill_arm)
        killed["at"] = time.monotonic()
        print(f"killed engine replica {pid} of arm {args.kill_arm}", flush=True)

    try:
        outcomes = asyncio.run(drive(args, model, canary, on_kill))
    finally:
        sampler.stop.set()
        sampler.join()
    sampler.sample()
    report = summarize(
        outcomes,
        killed.get("at"),
        args.kill_arm,
        sampler.traces,
        time.monotonic() - started,
        args.max_rss_slope,
        logs_containing(canary, log_roots),
    )
    report["duration_s"] = round(time.monotonic() - started)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--stream-share", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=300, help="longer counts as hung")
    parser.add_argument("--kill-arm", default="ngram", help="'' for no kill")
    parser.add_argument(
        "--kill-at", type=float, default=KILL_AT, help="fraction of the run (see KILL_AT)"
    )
    parser.add_argument(
        "--max-rss-slope", type=float, default=MAX_RSS_SLOPE_MIB_PER_MIN, help="MiB/min, 2nd half"
    )
    parser.add_argument(
        "--no-warm-up", action="store_true", help="measure from the first request (no warm-up)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/soak"))


def main(argv: list[str] | None = None) -> int:
    from specserve.config.settings import get_settings
    from specserve.deploy import Platform, ray_session_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    settings = get_settings()
    keys_dir = Path(tempfile.mkdtemp(prefix="specserve-soak-"))
    args.api_key = uuid.uuid4().hex + uuid.uuid4().hex
    (keys_dir / "api-keys").write_text(f"soak={args.api_key}\n")
    args.admin_key = None
    update: dict[str, Any] = {"api_keys_file": keys_dir / "api-keys"}
    if not args.no_warm_up:
        args.admin_key = uuid.uuid4().hex + uuid.uuid4().hex
        (keys_dir / "admin-keys").write_text(f"soak-warm-up={args.admin_key}\n")
        update["admin_keys_file"] = keys_dir / "admin-keys"
    settings = settings.model_copy(update=update)
    args.url = f"http://127.0.0.1:{settings.port}"
    platform = Platform(settings)
    try:
        platform.start()
        config = platform.loaded.config
        arms = [arm.name for arm in config.arms]
        report = run(args, model=config.model.name, arms=arms, log_roots=[ray_session_dir()])
    finally:
        platform.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "soak.md").write_text(text + "\n")
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
