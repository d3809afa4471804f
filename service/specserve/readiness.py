"""What an arm's Ray Serve application state means, defined once, and the platform's readiness.

Two words, each with one definition here:
- *running* (`running`): Ray Serve reports the arm's application RUNNING, every deployment at
  its target version and healthy. Readiness asks for it: `/ready` says the platform serves the
  config it loaded as written, so an arm being rebuilt or rescaled keeps it unready.
- *routable* (`routable`): the arm may take traffic: running, or DEPLOYING a new version while
  the old replicas still serve, or a restarted Serve controller re-attaching to replicas that
  served. The dispatch routes by it (router/arm_states.py), so neither a redeploy nor the loss of
  the head pod takes an arm's traffic away.

Readiness: every arm with weight > 0 running, and nothing draining. The router's `GET /ready`
answers with it (router/dispatch.py, and the router itself when no dispatch runs in the proxy,
router/ingress.py), and `specserve serve` reads that answer back while it waits for start-up
(deploy.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specserve.config.schema import RouterConfig

# Ray Serve's application and replica states; an arm Ray Serve does not list is reported as
# NOT_DEPLOYED.
RUNNING = "RUNNING"
DEPLOYING = "DEPLOYING"
RECOVERING = "RECOVERING"
NOT_DEPLOYED = "NOT_DEPLOYED"


def state(value: Any) -> str:
    return str(getattr(value, "value", value))  # Serve's state enums, or their text


def running(status: Any) -> bool:
    """Whether an application (or replica) status is RUNNING."""
    return state(status) == RUNNING


def routable(app: dict[str, Any], *, was_running: bool = False) -> bool:
    """An arm takes traffic while every deployment of its application has a serving replica:
    RUNNING, or DEPLOYING a new version while the old replicas still serve. `was_running`: the
    arm was routable at the last read; then two more states keep it so, as the old replicas
    serve on through them:
    - Ray Serve builds a changed application again (its builder runs: DEPLOYING, no deployments
      listed, ~20 s for an arm);
    - a restarted Serve controller (the head pod was lost, GCS fault tolerance brings it back)
      re-attaches to the live replicas: RECOVERING until each answers, which waits on a replica
      busy with requests; the proxies keep routing to them meanwhile.
    `app` is the application's details as Serve's REST API gives them."""
    if running(app.get("status")):
        return True
    deployments = (app.get("deployments") or {}).values()
    if not deployments:
        return was_running and state(app.get("status")) == DEPLOYING
    serving = {RUNNING, RECOVERING} if was_running else {RUNNING}
    return all(
        any(state(r.get("state")) in serving for r in d.get("replicas") or ()) for d in deployments
    )


@dataclass(frozen=True)
class Readiness:
    """What `/ready` says; its JSON body is `body()`."""

    revision: str | None  # the config revision served; None before one is loaded
    waiting: dict[str, str] = field(default_factory=dict)  # arm -> status, weight > 0 only
    draining: bool = False
    dispatch: bool = True  # False: the proxy runs without the dispatch and cannot route
    error: str | None = None

    @property
    def ready(self) -> bool:
        return (
            self.dispatch and self.revision is not None and not self.waiting and not self.draining
        )

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "ready": self.ready,
            "revision": self.revision,
            "waiting": self.waiting,
            "draining": self.draining,
            "dispatch": self.dispatch,
        }
        if self.error is not None:
            body["error"] = self.error
        return body

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Readiness:
        return cls(
            revision=body.get("revision"),
            waiting=dict(body.get("waiting") or {}),
            draining=bool(body.get("draining")),
            dispatch=body.get("dispatch") is not False,
            error=body.get("error"),
        )


def readiness(
    config: RouterConfig | None,
    revision: str | None,
    statuses: Mapping[str, str],
    *,
    draining: bool,
) -> Readiness:
    """Readiness of `config` (None: none loaded) with the arms' Ray Serve statuses."""
    waiting = {
        arm.name: statuses.get(arm.name, NOT_DEPLOYED)
        for arm in (config.arms if config is not None else ())
        if arm.weight > 0 and not running(statuses.get(arm.name))
    }
    return Readiness(revision if config is not None else None, waiting, draining)
