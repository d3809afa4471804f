"""Run the platform on a Ray cluster from one declarative Serve config.

`specserve serve` does locally what KubeRay does with a RayService: it hands Ray Serve the Serve
config built from the router config (serve_config.py), and again for every new valid revision of
the file. Ray Serve compares each application with the running one and redeploys only those
whose config changed (an arm's drafter, k, engine settings); weights are not part of it, the
router reads them from the file itself.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve
from ray.serve.schema import ServeDeploySchema

from specserve.config import LoadedConfig, load_config
from specserve.engine.preflight import check_engine_settings
from specserve.models import prepare_model
from specserve.serve_config import serve_config
from specserve.settings import Settings
from specserve.watch import ConfigWatcher

logger = logging.getLogger(__name__)

_FAILED = {"DEPLOY_FAILED", "UNHEALTHY"}
# How long a stop waits for in-flight requests to finish before Ray goes down.
DRAIN_S = 10.0


class DeployError(RuntimeError):
    pass


class Platform:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.config_path = Path(settings.config).resolve()
        self.loaded: LoadedConfig = load_config(self.config_path)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, *, timeout_s: float = 900) -> None:
        self.connect()
        self.deploy(self.loaded)
        self.wait_until_running(timeout_s=timeout_s)

    def connect(self) -> None:
        """Check the config, prepare the model, start (or join) Ray and Ray Serve."""
        s = self.settings
        check_engine_settings(
            self.loaded.config, source=str(self.config_path), engines_run_here=True
        )
        prepare_model(self.loaded.config.model.source)
        if not ray.is_initialized():
            if s.ray_address:
                ray.init(address=s.ray_address)
            else:
                # The metrics export port serves every metric recorded on this node: the
                # router's, vLLM's and Ray Serve's (metrics.py).
                ray.init(
                    num_cpus=s.ray_num_cpus,
                    include_dashboard=False,
                    _metrics_export_port=s.metrics_port,
                )
        serve.start(http_options={"host": s.host, "port": s.port})

    def stop(self, *, drain_s: float | None = DRAIN_S) -> None:
        """Stop everything: Ray Serve first lets the replicas finish in-flight requests (at most
        `drain_s`; None skips it, e.g. when start-up was interrupted and nothing serves yet),
        then Ray stops, which on a local cluster ends every process it started."""
        if drain_s is not None and ray.is_initialized():
            # serve.shutdown() has no timeout of its own; a replica still loading its engine
            # would hold it for minutes.
            draining = threading.Thread(target=_shutdown_serve, daemon=True)
            draining.start()
            draining.join(drain_s)
            if draining.is_alive():
                logger.warning("Ray Serve did not drain within %g s; stopping Ray", drain_s)
        ray.shutdown()

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
        )

    def deploy(self, loaded: LoadedConfig) -> None:
        """Hand Ray Serve the Serve config of `loaded`; it redeploys what changed."""
        prepare_model(loaded.config.model.source)
        document = ServeDeploySchema.model_validate(self.serve_config(loaded))
        # What `serve deploy` and KubeRay submit through the dashboard's REST API, without
        # needing the dashboard: the controller diffs the applications itself.
        client = serve.context._get_global_client()
        assert client is not None  # raised if no controller runs
        client.deploy_apps(document)
        self.loaded = loaded

    def watcher(self) -> ConfigWatcher:
        return ConfigWatcher(self.config_path, self.loaded, self.deploy, engines_run_here=True)

    def wait_until_running(self, *, timeout_s: float) -> None:
        """Block until every application is RUNNING and the router has seen them run (its
        `/ready`); fail fast when one fails to deploy."""
        deadline = time.monotonic() + timeout_s
        expected = {app["name"] for app in self.serve_config(self.loaded)["applications"]}
        while True:
            apps = serve.status().applications
            statuses = {name: _status(apps[name]) if name in apps else "-" for name in expected}
            failed = {n: apps[n].message for n in expected if n in apps and statuses[n] in _FAILED}
            if failed:
                raise DeployError(f"deployment failed: {failed}")
            if all(status == "RUNNING" for status in statuses.values()) and self._router_ready():
                return
            if time.monotonic() > deadline:
                raise DeployError(f"not running after {timeout_s:g} s: {statuses}")
            time.sleep(1)

    def _router_ready(self) -> bool:
        # The router reads arm states in the background (about once a second).
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "::") else self.settings.host
        try:
            return httpx.get(f"http://{host}:{self.settings.port}/ready", timeout=5).is_success
        except httpx.HTTPError:
            return False


def _shutdown_serve() -> None:
    try:
        serve.shutdown()
    except Exception:
        logger.exception("Ray Serve shutdown failed; stopping Ray anyway")


def _status(app) -> str:
    return str(getattr(app.status, "value", app.status))
