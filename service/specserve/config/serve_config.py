"""The Ray Serve config built from a router config: the one description of what runs.

The router is one application (its settings, and the endpoints other than inference; requests are
routed by the dispatch in every HTTP proxy, which reads those settings); each arm is another,
built by an importable builder from plain arguments (the model and the arm's engine part), with
its replica and queue settings as Ray Serve options of the arm's deployment. `specserve serve`
deploys this document to a local Ray cluster, `specserve config serve-config` prints it for
`serve deploy`, and the Helm chart renders the same document into the RayService's
`serveConfigV2`. Ray Serve compares each application's config with the running one and redeploys
only those that changed: a new drafter restarts its arm's engines, more replicas start only the
new ones, a new weight redeploys nothing (the router reads weights from the config file itself).
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from specserve.config.changes import ArmChange, ArmChanges, ArmSide, arm_change
from specserve.config.schema import (
    DEPLOYMENT_OPTIONS,
    RELOADED_IN_PLACE,
    ArmConfig,
    ArmEngineConfig,
    ModelConfig,
    RouterConfig,
)

ROUTER_APP_NAME = "specserve"
ROUTER_DEPLOYMENT_NAME = "router"
# The router deployment's Ray Serve `user_config` key that makes the dispatch in every HTTP proxy
# refuse new requests (503) while those in flight finish: Ray Serve applies a user_config change
# without restarting anything, and the dispatch reads it from the controller.
DRAINING = "draining"


# The router replica reserves no Ray CPU: it only answers /ready, /v1/models and /openapi.json
# (requests are routed in the HTTP proxies), and on Kubernetes it may land on the head, which
# offers Ray no CPUs so that no engine lands there.
ROUTER_NUM_CPUS = 0


def router_deployment() -> dict[str, Any]:
    """The router deployment's options in the Serve config."""
    return {"name": ROUTER_DEPLOYMENT_NAME, "ray_actor_options": {"num_cpus": ROUTER_NUM_CPUS}}


def draining_router(app: dict[str, Any]) -> dict[str, Any]:
    """The router application of a Serve config, switched to draining. Only `user_config`
    changes: Ray Serve applies it to the running replicas (other options would restart them)."""
    return {
        **app,
        "deployments": [{**router_deployment(), "user_config": {DRAINING: True}}],
    }


ROUTER_BUILDER = "specserve.router.ingress:build_app"
ARM_APP_PREFIX = "arm-"
ARM_BUILDER = "specserve.engine.arm:build_app"
# Each arm's application answers HTTP under this prefix and its name; the dispatch routes
# requests there. Clients reach it only with `expose_arms` (debugging, and measuring what the
# router adds against the arm's own vLLM OpenAI server).
ARM_ROUTE_PREFIX = "/arms/"
# The router's request path runs in every Ray Serve HTTP proxy (router/dispatch.py), installed
# through the proxy's callback hook: every Ray node's environment carries this variable.
PROXY_HOOK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_HOOK = "specserve.router.dispatch:middlewares"
# Ray starts its workers (the engines, the HTTP proxies, the replicas) at nice 15, below Ray's own
# daemons and whatever else shares the CPUs: a serving node's workers are its work. At nice 0 the
# platform's cost against vLLM's own server fell from +21 to +10 ms per request and from 7-16 % to
# 0-4 % per streamed token on 2 cores (BENCHMARKS.md, "The platform's own cost").
WORKER_NICENESS_ENV = "RAY_worker_niceness"
WORKER_NICENESS = "0"
# Set in the environment of every process of an arm (its replica, vLLM's engine core and
# workers): which arm a process serves, for whoever looks at the machine's processes.
ARM_NAME_ENV = "SPECSERVE_ARM_NAME"
# Where the chart mounts the router config (a ConfigMap) in every Ray pod.
MOUNTED_CONFIG_PATH = "/etc/specserve/config.yaml"
# Where the chart mounts the API keys Secret in every Ray pod: one file of public keys and one
# of admin keys (wire/auth.py reads their format), and the secret that salts the sticky hash
# (router/selection.py), named by the router application's args.
MOUNTED_KEYS_DIR = "/etc/specserve/keys"
API_KEYS_FILE = "api-keys"
ADMIN_KEYS_FILE = "admin-keys"
STICKY_SALT_FILE = "sticky-salt"
HTTP_PORT = 8000


# The keys of the router application's args, which the router's builder (router/ingress.py)
# and the dispatch in every proxy (router/dispatch.py) read. The chart's
# specserve.serveConfig template writes the same keys (tests/deploy compare the two documents).
CONFIG_PATH_ARG = "config_path"
CONFIG_POLL_S_ARG = "config_poll_s"
ROUTER_REPLICAS_ARG = "replicas"
API_KEYS_FILE_ARG = "api_keys_file"
ADMIN_KEYS_FILE_ARG = "admin_keys_file"
STICKY_SALT_FILE_ARG = "sticky_salt_file"
# The keys of an arm application's args, which the arm's builder (engine/arm.py) reads.
MODEL_ARG = "model"
ARM_ARG = "arm"
EXPOSE_HTTP_ARG = "expose_http"


def arm_app_name(arm_name: str) -> str:
    return ARM_APP_PREFIX + arm_name


def arm_name_of_app(app_name: str) -> str | None:
    """The arm an application serves, None for any other application."""
    return app_name.removeprefix(ARM_APP_PREFIX) if app_name.startswith(ARM_APP_PREFIX) else None


def router_application(
    *,
    config_path: str,
    config_poll_s: float = 1.0,
    replicas: int = 1,
    api_keys_file: str | None = None,
    admin_keys_file: str | None = None,
    sticky_salt_file: str | None = None,
) -> dict[str, Any]:
    """The router application; the dispatch in every proxy reads these args. With no keys
    files, requests are served without API keys; with no salt file, sticky keys are hashed
    unsalted."""
    args: dict[str, Any] = {
        CONFIG_PATH_ARG: config_path,
        CONFIG_POLL_S_ARG: config_poll_s,
        ROUTER_REPLICAS_ARG: replicas,
    }
    if api_keys_file is not None:
        args[API_KEYS_FILE_ARG] = api_keys_file
    if admin_keys_file is not None:
        args[ADMIN_KEYS_FILE_ARG] = admin_keys_file
    if sticky_salt_file is not None:
        args[STICKY_SALT_FILE_ARG] = sticky_salt_file
    return {
        "name": ROUTER_APP_NAME,
        "route_prefix": "/",
        "import_path": ROUTER_BUILDER,
        "args": args,
        "deployments": [router_deployment()],
    }


def arm_application(
    arm: ArmConfig, config: RouterConfig, *, expose_http: bool = False
) -> dict[str, Any]:
    args: dict[str, Any] = {
        MODEL_ARG: config.model.model_dump(mode="json", exclude_unset=True),
        ARM_ARG: arm.engine_args(),
    }
    if expose_http:
        args[EXPOSE_HTTP_ARG] = True
    app: dict[str, Any] = {
        "name": arm_app_name(arm.name),
        "route_prefix": ARM_ROUTE_PREFIX + arm.name,
        "import_path": ARM_BUILDER,
        "args": args,
    }
    # Options outside the builder's args: Ray Serve applies a change to them without building the
    # application again or restarting the engines that run.
    if options := arm.deployment_options():
        app["deployments"] = [{"name": arm_app_name(arm.name), **options}]
    return app


def serve_config(
    config: RouterConfig,
    *,
    config_path: str = MOUNTED_CONFIG_PATH,
    config_poll_s: float = 1.0,
    router_replicas: int = 1,
    host: str = "0.0.0.0",
    port: int = HTTP_PORT,
    expose_arms: bool = False,
    api_keys_file: str | None = None,
    admin_keys_file: str | None = None,
    sticky_salt_file: str | None = None,
) -> dict[str, Any]:
    """The document `serve deploy` and a RayService's `serveConfigV2` take."""
    router = router_application(
        config_path=config_path,
        config_poll_s=config_poll_s,
        replicas=router_replicas,
        api_keys_file=api_keys_file,
        admin_keys_file=admin_keys_file,
        sticky_salt_file=sticky_salt_file,
    )
    arms = [arm_application(arm, config, expose_http=expose_arms) for arm in config.arms]
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [router, *arms],
    }


# Reading a Serve document back: its arm applications, and merging a config's into it.


def is_arm_application(app: Any) -> bool:
    return isinstance(app, dict) and str(app.get("name", "")).startswith(ARM_APP_PREFIX)


def arm_applications(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {app["name"]: app for app in document["applications"] if is_arm_application(app)}


def arm_of_application(app: dict[str, Any]) -> ArmSide | None:
    """The model and arm an arm application runs (the inverse of `arm_application`), None when
    its args are not a valid arm (written by hand, or by another version)."""
    args = app.get("args") or {}
    options = {
        key: deployment[option]
        for deployment in app.get("deployments") or []
        for key, option in DEPLOYMENT_OPTIONS.items()
        if option in deployment
    }
    for deployment in app.get("deployments") or []:
        user_config = deployment.get("user_config")
        if isinstance(user_config, dict):
            options.update({k: user_config[k] for k in RELOADED_IN_PLACE if k in user_config})
    try:
        model = ModelConfig.model_validate(args[MODEL_ARG])
        return model, ArmEngineConfig.model_validate({**args[ARM_ARG], **options})
    except (KeyError, TypeError, ValidationError):
        return None


def application_change(old: dict[str, Any] | None, new: dict[str, Any] | None) -> ArmChange:
    """`changes.arm_change` between two arm applications; one that cannot be read restarts when
    it differs at all."""
    name = str((new or old or {}).get("name", ""))
    before = None if old is None else arm_of_application(old)
    after = None if new is None else arm_of_application(new)
    if (old is not None and before is None) or (new is not None and after is None):
        return ArmChange(name, "unchanged" if old == new else "restart")
    return arm_change(name, before, after)


def merge_arm_applications(document: dict[str, Any], config: RouterConfig) -> dict[str, Any]:
    """`document` with its arm applications replaced by those of `config`, as far as they
    change (`changes.arm_change`, on the normalised config).

    An unchanged arm keeps its running application as it is (written out, a default the file
    left out or spelled out would otherwise redeploy it); an arm changed in place keeps it with
    the new deployment options; a restarted or new arm gets the new application. Every other
    application (the router, whose arguments come from the chart's values) and every top-level
    key stay as they are; the arms take the place of the first arm application. Whether the arms
    answer under their own route (`expose_http`) is kept from the running document.
    """
    apps = document["applications"]
    expose = any(
        (app.get("args") or {}).get(EXPOSE_HTTP_ARG) for app in apps if is_arm_application(app)
    )
    running = arm_applications(document)
    arms = []
    for arm in config.arms:
        new = arm_application(arm, config, expose_http=expose)
        old = running.get(new["name"])
        kind = application_change(old, new).kind
        if old is None or kind == "restart":
            arms.append(new)
        elif kind == "unchanged":
            arms.append(old)
        else:
            kept = {key: value for key, value in old.items() if key != "deployments"}
            arms.append(
                {**kept, **({"deployments": new["deployments"]} if "deployments" in new else {})}
            )
    first = next((i for i, app in enumerate(apps) if is_arm_application(app)), len(apps))
    others = [app for app in apps if not is_arm_application(app)]
    return {**document, "applications": [*others[:first], *arms, *others[first:]]}


def application_changes(before: dict[str, Any], after: dict[str, Any]) -> ArmChanges:
    """The engines that change from the arm applications of one Serve document to another's,
    classified as `specserve config diff` classifies configs (`changes.arm_change`)."""
    old, new = arm_applications(before), arm_applications(after)
    changes = [application_change(old.get(name), app) for name, app in new.items()]
    changes += [ArmChange(name, "removed") for name in old if name not in new]
    return ArmChanges.of(changes)


def dump_serve_config(document: dict[str, Any]) -> str:
    return yaml.safe_dump(document, sort_keys=False)
