"""What runs, read from the Ray Serve controller by the dispatch in every HTTP proxy: which
arms take traffic, and the router application's settings (its config path and poll interval in
its args, `draining` in its user_config).

One read of the controller's plain details (the data behind Serve's REST API, ~1 ms of CPU).
`serve.status()` reads the same data but builds pydantic models from it, ~20 ms of CPU per call
under the caller's GIL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.experimental import internal_kv
from ray.serve.context import _get_global_client

from specserve.config.serve_config import (
    DRAINING,
    EXPOSE_HTTP_ARG,
    ROUTER_APP_NAME,
    ROUTER_DEPLOYMENT_NAME,
    arm_name_of_app,
)
from specserve.node_drain import DRAIN_KV_NAMESPACE, drain_key
from specserve.readiness import routable, state

# How often the dispatch asks Ray Serve which arms run.
POLL_S = 1.0
# How long a request that arrives before the first answer waits for it.
FIRST_READ_WAIT_S = 10.0
# How long one read may take before the dispatch routes on with the last (a controller call has
# no timeout of its own); the arm-states age gauge and its alert show a controller that hangs.
READ_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServeState:
    """One read of what Ray Serve runs."""

    statuses: dict[str, str] = field(default_factory=dict)  # arm -> its application's status
    routable: frozenset[str] = frozenset()  # arms that may take traffic (readiness.routable)
    router_args: dict[str, Any] | None = None  # None: no specserve router application
    draining: bool = False  # the router application is switched to draining
    node_draining: bool = False  # this proxy's node is being drained (`specserve drain-node`)
    exposed: frozenset[str] = frozenset()  # arms deployed with `expose_http`

    @property
    def shutting_down(self) -> bool:
        """New requests are refused: the platform stops, or this proxy's pod does."""
        return self.draining or self.node_draining


def serve_applications() -> dict[str, dict[str, Any]]:
    """Every Serve application's details as plain data (the schema of Serve's REST API). The
    client is Ray's private one (Ray is pinned in constraints.txt), as `serve.status()` uses it.
    Blocking: call it from a thread in an event loop."""
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:  # no Serve controller: nothing runs
        return {}
    return client.get_serve_details().get("applications") or {}


def read_serve_state(previous: ServeState | None = None) -> ServeState:
    """What runs now; `previous`, the last read, settles arms whose application is being built
    again (see `routable`)."""
    was_routable = previous.routable if previous is not None else frozenset()
    statuses, routable_arms, exposed = {}, set(), set()
    router_args, draining = None, False
    for name, app in serve_applications().items():
        deployed = app.get("deployed_app_config") or {}
        if name == ROUTER_APP_NAME:
            router_args = dict(deployed.get("args") or {})
            draining = _router_draining(deployed)
            continue
        arm = arm_name_of_app(name)
        if arm is None:
            continue
        statuses[arm] = state(app.get("status"))
        if routable(app, was_running=arm in was_routable):
            routable_arms.add(arm)
        if (deployed.get("args") or {}).get(EXPOSE_HTTP_ARG):
            exposed.add(arm)
    return ServeState(
        statuses=statuses,
        routable=frozenset(routable_arms),
        router_args=router_args,
        draining=draining,
        node_draining=node_draining(),
        exposed=frozenset(exposed),
    )


def node_draining() -> bool:
    """Whether this process's Ray node carries the drain mark of `specserve drain-node` (one
    key-value read of Ray's GCS)."""
    node_id = ray.get_runtime_context().get_node_id()
    return internal_kv._internal_kv_exists(drain_key(node_id), namespace=DRAIN_KV_NAMESPACE)


def _router_draining(deployed: dict[str, Any]) -> bool:
    for deployment in deployed.get("deployments") or ():
        if deployment.get("name") == ROUTER_DEPLOYMENT_NAME:
            return bool((deployment.get("user_config") or {}).get(DRAINING))
    return False
