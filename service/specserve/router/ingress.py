"""The router application: the router's settings and the endpoints other than inference.

Inference requests are routed by the dispatch in every Ray Serve HTTP proxy (router/dispatch.py),
straight to the chosen arm's replicas; it reads its settings from this application (the config
path and poll interval in its args, `draining` in its user_config). This application answers
`/health`, `/v1/models` and `/openapi.json` from the config file, which it watches too. An
inference request or `/ready` (which the dispatch answers) reaches it only when the proxy runs
without the dispatch: a 503 that says how to install it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.deployment import Application

from specserve.config.schema import LoadedConfig, RouterConfig, load_config
from specserve.config.serve_config import (
    CONFIG_PATH_ARG,
    CONFIG_POLL_S_ARG,
    PROXY_HOOK,
    PROXY_HOOK_ENV,
    ROUTER_DEPLOYMENT_NAME,
    ROUTER_REPLICAS_ARG,
)
from specserve.readiness import Readiness
from specserve.watch import ConfigWatcher
from specserve.wire.errors import OpenAIError, install_error_handlers
from specserve.wire.openapi import openapi_document
from specserve.wire.requests import CHAT, COMPLETIONS, PATHS, READY_PATH, unknown_model
from specserve.wire.validation import REQUEST_MODELS

logger = logging.getLogger(__name__)

NO_DISPATCH = (
    "this Ray cluster's HTTP proxies run without specserve's dispatch, which routes inference "
    f"requests: start every Ray node with {PROXY_HOOK_ENV}={PROXY_HOOK} in its environment"
)

# The OpenAPI document is served by the router from its live config (see wire/openapi.py).
app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(app)


def _model_card(config: RouterConfig) -> dict[str, Any]:
    return {"id": config.model.name, "object": "model", "created": 0, "owned_by": "specserve"}


# `serve.ingress` pickles the app when the class is defined, so every helper it uses must
# already exist: the deployment class comes last.
@serve.deployment(name=ROUTER_DEPLOYMENT_NAME, max_ongoing_requests=1000)
@serve.ingress(app)
class Router:
    def __init__(self, config_path: str, config_poll_s: float) -> None:
        self.loaded = load_config(config_path)
        self._openapi: tuple[str, dict[str, Any]] = ("", {})  # (revision, document)
        self.watcher = ConfigWatcher(config_path, self.loaded, self._apply)
        self._task = asyncio.get_event_loop().create_task(self.watcher.run(config_poll_s))
        logger.info("router serving config revision %s", self.loaded.revision)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Ray Serve's user_config: `draining` is read by the dispatch in every proxy, which then
        refuses new requests (503) while the ones in flight finish."""

    def _apply(self, loaded: LoadedConfig) -> None:
        self.loaded = loaded

    # -- endpoints ------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get(READY_PATH)
    async def ready(self) -> JSONResponse:
        """The dispatch answers `/ready` itself (it knows what it routes with): a readiness
        check that gets here went through a proxy without it."""
        found = Readiness(self.loaded.revision, dispatch=False, error=NO_DISPATCH)
        return JSONResponse(found.body(), status_code=503)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(self.loaded.config)]}

    @app.get("/v1/models/{model}")
    async def model(self, model: str) -> dict[str, Any]:
        config = self.loaded.config
        if model != config.model.name:
            raise unknown_model(model, config)
        return _model_card(config)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> dict[str, Any]:
        loaded = self.loaded
        if self._openapi[0] != loaded.revision:
            bodies = {PATHS[e]: model for e, model in REQUEST_MODELS.items()}
            self._openapi = (loaded.revision, openapi_document(app, loaded, bodies))
        return self._openapi[1]

    # The inference endpoints are the dispatch's; here for the OpenAPI document, and to say
    # what is missing when a proxy runs without it.
    @app.post(PATHS[CHAT])
    async def chat(self, request: Request) -> Response:
        raise OpenAIError(503, NO_DISPATCH, code="dispatch_not_installed")

    @app.post(PATHS[COMPLETIONS])
    async def completions(self, request: Request) -> Response:
        raise OpenAIError(503, NO_DISPATCH, code="dispatch_not_installed")


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (`import_path` of the router in the Serve config): plain args
    `{config_path, config_poll_s, replicas}` as `serve_config.router_application` writes them."""
    replicas = int(args.get(ROUTER_REPLICAS_ARG, 1))
    return Router.options(num_replicas=replicas).bind(  # type: ignore[attr-defined]
        args[CONFIG_PATH_ARG], float(args.get(CONFIG_POLL_S_ARG, 1.0))
    )
