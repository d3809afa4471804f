"""The platform's readiness, defined once: every arm with weight > 0 running, and nothing
draining. The router's `GET /ready` answers with it (router/dispatch.py, and the router itself
when no dispatch runs in the proxy, router/ingress.py), and `specserve serve` reads that answer
back while it waits for start-up (deploy.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specserve.config.schema import RouterConfig

# Ray Serve's application status of a serving arm; an arm Ray Serve does not list is reported
# as NOT_DEPLOYED.
RUNNING = "RUNNING"
NOT_DEPLOYED = "NOT_DEPLOYED"


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
        if arm.weight > 0 and statuses.get(arm.name) != RUNNING
    }
    return Readiness(revision if config is not None else None, waiting, draining)
