"""Run the platform on a Ray cluster: arms as Serve applications, then the router in front.

Each arm is its own application, keyed by a fingerprint of everything that needs a new engine;
reconciling a new config redeploys only arms whose fingerprint changed, adds new ones and deletes
removed ones. Weight and routing changes need nothing here: the router picks them up itself.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray
from ray import serve

from specserve.config import LoadedConfig, load_config
from specserve.engine import arm_app_name, arm_route_prefix, build_arm_app
from specserve.models import prepare_model
from specserve.router.ingress import ROUTER_APP_NAME, Router
from specserve.settings import Settings
from specserve.watch import ConfigWatcher

logger = logging.getLogger(__name__)

_FAILED = {"DEPLOY_FAILED", "UNHEALTHY"}


class DeployError(RuntimeError):
    pass


class Platform:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.config_path = Path(settings.config).resolve()
        self.loaded: LoadedConfig = load_config(self.config_path)
        self.fingerprints: dict[str, str] = {}  # arm name -> engine fingerprint deployed

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, *, timeout_s: float = 900) -> None:
        s = self.settings
        prepare_model(self.loaded.config.model.source)
        if not ray.is_initialized():
            if s.ray_address:
                ray.init(address=s.ray_address)
            else:
                ray.init(num_cpus=s.ray_num_cpus, include_dashboard=False)
        serve.start(http_options={"host": s.host, "port": s.port})
        self.reconcile(self.loaded)
        # Router is a serve.deployment, which mypy cannot see through.
        router = Router.bind(str(self.config_path), s.metrics_port, s.config_poll_s)  # type: ignore[attr-defined]
        _deploy(serve.RunTarget(router, name=ROUTER_APP_NAME, route_prefix="/"))
        self.wait_until_running(timeout_s=timeout_s)

    def stop(self) -> None:
        serve.shutdown()
        ray.shutdown()

    # -- config ----------------------------------------------------------------------------

    def reconcile(self, loaded: LoadedConfig) -> list[str]:
        """Bring the deployed arms in line with `loaded`; return the arms (re)deployed."""
        config = loaded.config
        prepare_model(config.model.source)
        wanted = {arm.name: arm.engine_fingerprint(config.model) for arm in config.arms}
        changed = [
            arm for arm in config.arms if self.fingerprints.get(arm.name) != wanted[arm.name]
        ]
        if changed:
            logger.info("deploying arms %s", [arm.name for arm in changed])
            expose = self.settings.expose_arms
            targets = [
                serve.RunTarget(
                    build_arm_app(arm, config.model, expose_http=expose),
                    arm_app_name(arm.name),
                    arm_route_prefix(arm.name) if expose else None,
                )
                for arm in changed
            ]
            _deploy(*targets)
            self.fingerprints.update({arm.name: wanted[arm.name] for arm in changed})
        for name in set(self.fingerprints) - set(wanted):
            logger.info("deleting arm %s", name)
            serve.delete(arm_app_name(name), _blocking=False)
            del self.fingerprints[name]
        self.loaded = loaded
        return [arm.name for arm in changed]

    def watcher(self) -> ConfigWatcher:
        return ConfigWatcher(self.config_path, self.loaded, self.reconcile)

    def wait_until_running(self, *, timeout_s: float) -> None:
        """Block until every application is RUNNING; fail fast when one fails to deploy."""
        deadline = time.monotonic() + timeout_s
        expected = {ROUTER_APP_NAME, *(arm_app_name(a) for a in self.fingerprints)}
        while True:
            apps = serve.status().applications
            statuses = {name: _status(apps[name]) if name in apps else "-" for name in expected}
            failed = {n: apps[n].message for n in expected if n in apps and statuses[n] in _FAILED}
            if failed:
                raise DeployError(f"deployment failed: {failed}")
            if all(status == "RUNNING" for status in statuses.values()):
                return
            if time.monotonic() > deadline:
                raise DeployError(f"not running after {timeout_s:g} s: {statuses}")
            time.sleep(1)


def _deploy(*targets: serve.RunTarget) -> None:
    """Submit applications without waiting for them; `wait_until_running` does that."""
    serve.run_many(
        targets, wait_for_ingress_deployment_creation=False, wait_for_applications_running=False
    )


def _status(app) -> str:
    return str(getattr(app.status, "value", app.status))
