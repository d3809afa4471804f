"""Run the platform on a Ray cluster from one declarative Serve config.

`specserve serve` does locally what KubeRay does with a RayService: it hands Ray Serve the Serve
config built from the router config (config/serve_config.py), and again for every new valid
revision of the file. Ray Serve compares each application with the running one and redeploys only
those whose config changed (an arm's drafter, k, engine settings); weights are not part of it, the
router reads them from the file itself.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import psutil
import ray
from ray import serve
from ray.serve.schema import ServeDeploySchema

from specserve import versions
from specserve.config.checks import check_engine_settings
from specserve.config.schema import LoadedConfig, load_config
from specserve.config.serve_config import (
    PROXY_HOOK,
    PROXY_HOOK_ENV,
    ROUTER_APP_NAME,
    WORKER_NICENESS,
    WORKER_NICENESS_ENV,
    draining_router,
    serve_config,
)
from specserve.config.settings import CAPTURE_DIR_ENV, Settings
from specserve.metrics import EXPORT_PREFIX, REQUESTS_IN_FLIGHT, scrape
from specserve.models import prepare_model
from specserve.readiness import Readiness, running, state
from specserve.watch import ConfigWatcher

logger = logging.getLogger(__name__)

_FAILED = {"DEPLOY_FAILED", "UNHEALTHY"}
# How often a local cluster exports recorded metrics (Ray's default is 10 s); a stop reads the
# routers' in-flight gauge through it.
METRICS_REPORT_S = 2.0
# Ray Serve's pace on a local cluster, a laptop's few cores: its controller's loop (0.1 s by
# default) and each replica's and handle's export of its cached metrics (every 100 ms by default,
# though Ray reports them every METRICS_REPORT_S). Measured on two cores, the idle platform's
# processes took 0.46 of a core at Ray's defaults and 0.35 at these.
LOCAL_SERVE_ENV = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# After Ray stops, its workers notice the lost raylet on their own, seconds later on a busy
# machine; whatever the local cluster started and still runs then is killed.
STRAGGLER_GRACE_S = 3.0


class DeployError(RuntimeError):
    pass


# Ray's own switch for token authentication between its processes and on its ports, and where
# a local cluster's token is kept (Ray 2.60 writes it with the process's umask: often 0644).
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_TOKEN_FILE = Path.home() / ".ray" / "auth_token"


def refuse_ray_without_token(environ: Mapping[str, str]) -> None:
    """A local cluster's ports listen on the node's address: without Ray's token anyone who
    reaches them runs code in it. Ray 2.60 turns tokens on when its mode is unset (and reads
    the mode when it is imported, so it is not set here); a mode that turns them off is
    refused."""
    mode = environ.get(RAY_AUTH_MODE_ENV)
    if mode is not None and mode.lower() != "token":
        raise DeployError(
            f"{RAY_AUTH_MODE_ENV}={mode}: the local Ray cluster would run without token "
            "authentication, and anyone who reaches this machine's Ray ports could run code in "
            f"it; unset {RAY_AUTH_MODE_ENV} (Ray then turns tokens on) or join a cluster of "
            "your own with SPECSERVE_RAY_ADDRESS"
        )


def check_ray_token(environ: Mapping[str, str], token_file: Path = RAY_TOKEN_FILE) -> None:
    """After a local cluster started: tokens are on (a later Ray whose default differs is
    stopped here, not served), and the token file is readable by its owner only."""
    if environ.get(RAY_AUTH_MODE_ENV, "").lower() != "token":
        raise DeployError(
            "the local Ray cluster started without token authentication (this Ray does not turn "
            f"it on by default): set {RAY_AUTH_MODE_ENV}=token before starting specserve"
        )
    with contextlib.suppress(FileNotFoundError):
        if token_file.stat().st_mode & 0o077:
            token_file.chmod(0o600)
            logger.info("Ray's token file %s made readable by its owner only", token_file)


def starts_local_cluster(settings: Settings) -> bool:
    """Whether `connect` starts a Ray cluster here: no address to join, and no cluster this
    process runs already."""
    return not settings.ray_address and not ray.is_initialized()


class Platform:
    def __init__(self, settings: Settings) -> None:
        check_exposure(settings)
        self.settings = settings
        self.config_path = Path(settings.config).resolve()
        self.loaded: LoadedConfig = load_config(self.config_path)
        # Absolute: every HTTP proxy reads them, whatever its working directory.
        self.api_keys_file, self.admin_keys_file, self.sticky_salt_file = (
            str(Path(path).resolve()) if path else None
            for path in (
                settings.api_keys_file,
                settings.admin_keys_file,
                settings.sticky_salt_file,
            )
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, *, timeout_s: float = 900) -> None:
        self.connect()
        self.deploy(self.loaded)
        self.wait_until_running(timeout_s=timeout_s)

    def preflight(self) -> None:
        """What `specserve serve` checks before anything starts, each at once: that Ray and
        vLLM are the versions its private hooks were written for, and, for a local cluster,
        that its ports are free (another `specserve serve` on this machine holds them)."""
        local = starts_local_cluster(self.settings)
        try:
            versions.require(versions.RAY)
            if local and _cpu_engines():  # the engines' fixes check the rest as they start
                versions.require(versions.VLLM, private=False)
        except versions.UnsupportedVersionError as exc:
            raise DeployError(str(exc)) from None
        if local:
            check_ports_free(self.settings)

    def connect(self) -> None:
        """Check the config, prepare the model, start (or join) Ray and Ray Serve."""
        s = self.settings
        self.preflight()
        check_engine_settings(
            self.loaded.config, source=str(self.config_path), engines_run_here=True
        )
        prepare_model(self.loaded.config.model.source)
        if not ray.is_initialized():
            if s.ray_address:
                ray.init(address=s.ray_address)
            else:
                # The metrics export port serves every metric recorded on this node: the
                # router's, vLLM's and Ray Serve's (metrics.py), exported this often.
                os.environ.setdefault(
                    "RAY_metrics_report_interval_ms", str(int(METRICS_REPORT_S * 1000))
                )
                # Every process of the local cluster inherits this: the HTTP proxy loads the
                # dispatch, which routes the requests (router/dispatch.py).
                os.environ[PROXY_HOOK_ENV] = PROXY_HOOK
                # The arms keep their capture samples here (capture/store.py).
                os.environ[CAPTURE_DIR_ENV] = str(s.capture_path())
                os.environ.setdefault(WORKER_NICENESS_ENV, WORKER_NICENESS)
                for name, value in LOCAL_SERVE_ENV.items():
                    os.environ.setdefault(name, value)
                refuse_ray_without_token(os.environ)
                ray.init(
                    num_cpus=s.ray_num_cpus,
                    include_dashboard=False,
                    _metrics_export_port=s.metrics_port,
                )
                try:
                    check_ray_token(os.environ)
                except DeployError:
                    ray.shutdown()
                    raise
        serve.start(http_options={"host": s.host, "port": s.port})

    def stop(self, *, drain: bool = True) -> None:
        """Stop everything. With `drain`, the router first refuses new requests (503) and
        finishes those in flight, streams included, for up to `stop_drain_s` while the arms
        keep serving them (skipped when start-up was interrupted: nothing serves yet). Then Ray
        stops, which on a local cluster ends every process it started; on a cluster joined by
        address, specserve's applications are deleted instead."""
        if drain and ray.is_initialized():
            # Ray Serve's calls have no timeout of their own: a bounded wait in a thread, so a
            # stop never hangs on them.
            draining = threading.Thread(target=self._drain_router, daemon=True)
            draining.start()
            draining.join(self.settings.stop_drain_s + 5)
            if draining.is_alive():
                logger.warning("the router did not drain in time; stopping anyway")
        if self.settings.ray_address:
            if ray.is_initialized():
                serve.shutdown()
            ray.shutdown()
            return
        started_here = local_cluster_processes()
        ray.shutdown()
        _, alive = psutil.wait_procs(started_here, timeout=STRAGGLER_GRACE_S)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                logger.info("ending %s (pid %d), left by Ray", process.name(), process.pid)
                process.kill()
        psutil.wait_procs(alive, timeout=2)

    def _drain_router(self) -> None:
        document = self.serve_config(self.loaded)
        document["applications"] = [
            draining_router(app) if app["name"] == ROUTER_APP_NAME else app
            for app in document["applications"]
        ]
        started = time.monotonic()
        try:
            self._submit(document)
            # Once every replica drains, the in-flight gauge (one export behind) falls to 0.
            time.sleep(METRICS_REPORT_S + 0.5)
            while time.monotonic() - started < self.settings.stop_drain_s:
                if self._router_in_flight() == 0:
                    break
                time.sleep(0.25)
            logger.info("router drained in %.1f s", time.monotonic() - started)
        except Exception:
            logger.exception("draining the router failed; stopping anyway")

    def _router_in_flight(self) -> float | None:
        """Requests in flight through this node's HTTP proxy, None if unknown."""
        url = f"http://127.0.0.1:{self.settings.metrics_port}/metrics"
        name = EXPORT_PREFIX + REQUESTS_IN_FLIGHT
        try:
            return sum(s.value for _, s in scrape(url, timeout_s=2) if s.name == name)
        except httpx.HTTPError:
            return None

    # -- config ----------------------------------------------------------------------------

    def serve_config(self, loaded: LoadedConfig) -> dict[str, Any]:
        s = self.settings
        return serve_config(
            loaded.config,
            config_path=str(self.config_path),
            config_poll_s=s.config_poll_s,
            router_replicas=s.router_replicas,
            host=s.host,
            port=s.port,
            expose_arms=s.expose_arms,
            api_keys_file=self.api_keys_file,
            admin_keys_file=self.admin_keys_file,
            sticky_salt_file=self.sticky_salt_file,
        )

    def deploy(self, loaded: LoadedConfig) -> None:
        """Hand Ray Serve the Serve config of `loaded`; it redeploys what changed."""
        prepare_model(loaded.config.model.source)
        self._submit(self.serve_config(loaded))
        self.loaded = loaded

    def _submit(self, document: dict[str, Any]) -> None:
        # What `serve deploy` and KubeRay submit through the dashboard's REST API, without
        # needing the dashboard: the controller diffs the applications itself.
        client = serve.context._get_global_client()
        assert client is not None  # raised if no controller runs
        client.deploy_apps(ServeDeploySchema.model_validate(document))

    def watcher(self) -> ConfigWatcher:
        return ConfigWatcher(self.config_path, self.loaded, self.deploy, engines_run_here=True)

    def wait_until_running(self, *, timeout_s: float) -> None:
        """Block until every application is RUNNING and the router has seen them run (its
        `/ready`); fail fast when one fails to deploy."""
        deadline = time.monotonic() + timeout_s
        expected = {app["name"] for app in self.serve_config(self.loaded)["applications"]}
        while True:
            apps = serve.status().applications
            statuses = {
                name: state(apps[name].status) if name in apps else "-" for name in expected
            }
            failed = {n: apps[n].message for n in expected if n in apps and statuses[n] in _FAILED}
            if failed:
                raise DeployError(f"deployment failed: {failed}")
            found = self._readiness() if any(map(running, statuses.values())) else None
            if found is not None and not found.dispatch:  # the proxies cannot route: never
                raise DeployError(found.error or "no dispatch in the HTTP proxies")
            if all(map(running, statuses.values())) and found and found.ready:
                return
            if time.monotonic() > deadline:
                raise DeployError(f"not running after {timeout_s:g} s: {statuses}")
            time.sleep(1)

    def _readiness(self) -> Readiness | None:
        """The router's `/ready` answer (None while it does not answer). It reads arm states in
        the background, about once a second."""
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "::") else self.settings.host
        try:
            answer = httpx.get(f"http://{host}:{self.settings.port}/ready", timeout=5)
            if answer.headers.get("content-type") != "application/json":
                return None
            body = answer.json()
            return Readiness.from_body(body) if isinstance(body, dict) else None
        except (httpx.HTTPError, ValueError):
            return None


def ray_session_dir() -> Path:
    """The session directory of the Ray cluster this process runs in: every log file its
    processes write (Ray's, Ray Serve's, the router's and the engines') is under it."""
    from ray._private import worker

    node = worker._global_node
    if node is None:
        raise RuntimeError("Ray is not initialized in this process")
    return Path(node.get_session_dir_path())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings) -> None:
    """Refuse to serve without API keys where others can reach the endpoint."""
    if settings.api_keys_file or is_loopback(settings.host) or settings.allow_unauthenticated:
        return
    raise DeployError(
        f"refusing to serve on {settings.host} without API keys: anyone who reaches it could "
        "use every arm. Set SPECSERVE_API_KEYS_FILE (one key a line, `name=key`), serve on "
        "127.0.0.1, or set SPECSERVE_ALLOW_UNAUTHENTICATED=1 to serve openly anyway."
    )


def _cpu_engines() -> bool:
    """Whether engines started here run on vLLM's CPU platform, the one vllm_fixes.py patches."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def check_ports_free(settings: Settings) -> None:
    """Refuse to start a local cluster whose ports are taken: Ray would start, fail to bind
    them and end minutes later in "The current node timed out during startup"."""
    wanted = {
        "HTTP (SPECSERVE_PORT)": (settings.host, settings.port),
        # Ray's metrics agent listens on every address.
        "metrics (SPECSERVE_METRICS_PORT)": ("0.0.0.0", settings.metrics_port),
    }
    taken = [(what, host, port) for what, (host, port) in wanted.items() if port_in_use(host, port)]
    if not taken:
        return
    lines = [f"{what} port {port} on {host} is in use{_holder(port)}" for what, host, port in taken]
    clusters = _local_ray_clusters()
    if clusters:
        lines.append(f"a Ray cluster runs on this machine (GCS at {', '.join(clusters)})")
    raise DeployError(
        "specserve (or something else) already runs here: "
        + "; ".join(lines)
        + ". Stop it first (Ctrl-C or `kill -INT <pid>` of its `specserve serve`; `ray stop` "
        "for a cluster started with `ray start`), or serve on other ports with "
        "SPECSERVE_PORT and SPECSERVE_METRICS_PORT."
    )


def port_in_use(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As the servers that will bind it: a port left in TIME_WAIT by a stopped one is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def _holder(port: int) -> str:
    """`: by <process>`, the process listening on `port` and the `specserve serve` above it,
    where this user may see them; else empty."""
    try:
        pids = {
            c.pid
            for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        }
    except (psutil.Error, OSError):
        return ""
    described = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            text = f"{process.name()} (pid {pid})"
            for parent in process.parents():
                cmdline = " ".join(parent.cmdline())
                if "specserve" in cmdline and " serve" in cmdline:
                    text += f", started by `{cmdline}` (pid {parent.pid})"
                    break
            described.append(text)
        except psutil.Error:
            continue
    return f": by {'; '.join(described)}" if described else ""


def _local_ray_clusters() -> list[str]:
    from ray._private.services import find_gcs_addresses

    try:
        return sorted(find_gcs_addresses())
    except Exception:  # found by reading `ps`: nothing to say if that fails
        return []


def local_cluster_processes() -> list[psutil.Process]:
    """The processes of the Ray cluster this process started: Ray's own children of this process
    (GCS, raylet, agents) and everything below them (workers, replicas, engines)."""
    found = []
    for child in psutil.Process().children():
        try:
            cmdline = " ".join(child.cmdline())
            if "/ray/" in cmdline or cmdline.startswith("ray::"):
                found += [child, *child.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return found
