"""The router: the OpenAI-compatible ingress deployment in front of the arms.

Per request: validate (limits, model name, body schema), pick the arm (override header > sticky
key > random by weight, among the arms whose engines are running), forward to the arm's engine,
and name the arm and config revision in the response headers. The config file is watched; a new
valid revision changes routing at once. Which arms run is read from Ray Serve in the background,
so the request path never waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest
from vllm.exceptions import VLLMValidationError

from specserve import headers
from specserve.config import LoadedConfig, RouterConfig, load_config
from specserve.metrics import RouterMetrics
from specserve.router.errors import OpenAIError, from_validation_error, install_error_handlers
from specserve.router.guardrail import AcceptanceGuard
from specserve.router.openapi import openapi_document
from specserve.router.proxy import InFlight, RequestRecord, forward
from specserve.router.selection import ArmNotRunningError, UnknownArmError, choose_arm
from specserve.serve_config import (
    DRAINING,
    ROUTER_DEPLOYMENT_NAME,
    ROUTER_DRAIN_S,
    arm_app_name,
    arm_name_of_app,
)
from specserve.watch import ConfigWatcher

logger = logging.getLogger(__name__)

CHAT, COMPLETIONS = "chat", "completions"
_REQUEST_MODELS: dict[str, type[BaseModel]] = {
    CHAT: ChatCompletionRequest,
    COMPLETIONS: CompletionRequest,
}
_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
# How often the router asks Ray Serve which arms run, and how long a new replica's first request
# waits for the first answer.
ARM_STATUS_POLL_S = 1.0

ARM_STATES_WAIT_S = 10.0
RUNNING = "RUNNING"
# Deeper JSON is refused before validation: no OpenAI request nests near this (a tool schema a
# few levels), and pydantic and pickling across Ray recurse once per level.
MAX_JSON_DEPTH = 64
MAX_TOKEN_ID = 2**32  # what a tokenizer's id type holds

# The OpenAPI document is served by the router from its live config (see openapi.py).
app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(app)


async def _read_json(request: Request, max_body_bytes: int) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > max_body_bytes:
        raise OpenAIError(413, f"request body is {len(raw)} bytes; the limit is {max_body_bytes}")
    try:
        data = json.loads(raw)
    except RecursionError:
        data = None  # nested beyond the parser's stack: refused below, before any walk
    except ValueError as exc:  # UnicodeDecodeError included
        raise OpenAIError(400, f"request body is not valid JSON: {exc}") from None
    # Only a body with more brackets than the limit can nest deeper than it (a C-speed count).
    too_deep = data is None or (
        raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth_exceeds(data, MAX_JSON_DEPTH)
    )
    if too_deep:
        raise OpenAIError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(data, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    return data


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays/objects nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _validate(data: dict[str, Any], endpoint: str, config: RouterConfig) -> tuple[Any, bool]:
    """Check the body against the OpenAI schema and our limits; return it for the engine."""
    model = data.get("model")
    if model is None:
        raise OpenAIError(400, "model: field required", param="model")
    if model != config.model.name:
        raise _unknown_model(model, config)
    limits = config.limits
    for key, most in (
        ("max_tokens", limits.max_tokens),
        ("max_completion_tokens", limits.max_tokens),
        ("n", limits.max_n),
    ):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = data[key] = int(value)  # JSON's 16.0 is an integer, as pydantic reads it
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise OpenAIError(400, f"{key} must be a positive integer, got {value!r}", param=key)
        if value > most:
            raise OpenAIError(
                400, f"{key} is {value}; this deployment allows at most {most}", param=key
            )
    stream_options = data.get("stream_options")
    client_wants_usage = isinstance(stream_options, dict) and bool(
        stream_options.get("include_usage")
    )
    if data.get("stream") is True and (stream_options is None or isinstance(stream_options, dict)):
        # The final usage chunk carries the token count and the spec-decode stats.
        data = {**data, "stream_options": {**(stream_options or {}), "include_usage": True}}
    if endpoint == CHAT and not isinstance(data.get("messages", []), list):
        # vLLM's before-validators iterate `messages` unchecked: a number would be a TypeError.
        raise OpenAIError(400, "messages: must be an array of messages", param="messages")
    try:
        body = _REQUEST_MODELS[endpoint].model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except TypeError as exc:
        # Another of vLLM's validators meeting a type it does not check for: still the request's
        # fault, and the message names what it tripped over.
        raise OpenAIError(400, f"invalid request: {exc}") from None
    except VLLMValidationError as exc:
        # vLLM's model validators check parameter combinations (structured outputs, logprobs,
        # stream options) by raising their own error, which pydantic passes through.
        param = exc.parameter
        message = exc.args[0] if exc.args else str(exc)
        raise OpenAIError(400, f"{param}: {message}" if param else message, param=param) from None
    if endpoint == CHAT:
        _check_roles(data["messages"])
        # Validated message content can hold pydantic iterators that do not pickle across the
        # Ray call; the raw JSON is equivalent and plain data.
        body.messages = data["messages"]  # type: ignore[attr-defined]
    else:
        _check_token_ids(data.get("prompt"))
    return body, client_wants_usage


def _check_roles(messages: list[Any]) -> None:
    """vLLM's message schema admits a message without a role (a loose custom type) and then
    fails on it while rendering the prompt: refuse it here."""
    for i, message in enumerate(messages):
        if not isinstance(message.get("role") if isinstance(message, dict) else None, str):
            param = f"messages.{i}.role"
            raise OpenAIError(400, f"{param}: every message needs a string role", param=param)


def _check_token_ids(prompt: Any) -> None:
    """Token ids the tokenizer cannot even hold (>= 2**32) crash it when the prompt is echoed;
    smaller unknown ids are the engine's to refuse."""
    if not isinstance(prompt, list):
        return
    rows = prompt if prompt and all(isinstance(p, list) for p in prompt) else [prompt]
    for i, row in enumerate(rows):
        for j, token in enumerate(row):
            if isinstance(token, int) and token >= MAX_TOKEN_ID:
                param = f"prompt.{i}.{j}" if rows is prompt else f"prompt.{j}"
                raise OpenAIError(400, f"{param}: token id {token} is out of range", param=param)


def _unknown_model(model: Any, config: RouterConfig) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model {model!r} does not exist; this endpoint serves {config.model.name!r}",
        param="model",
        code="model_not_found",
    )


def _model_card(config: RouterConfig) -> dict[str, Any]:
    return {"id": config.model.name, "object": "model", "created": 0, "owned_by": "specserve"}


def _serve_applications() -> dict[str, dict[str, Any]]:
    """Every Serve application's details as plain data (the schema of Serve's REST API). This is
    what `serve.status()` reads, without building its pydantic models from it: those cost ~20 ms
    of CPU per call, which the router replica paid under the GIL every second while serving.
    The client is Ray's private one (Ray is pinned in constraints.txt); `serve.status()` uses it
    the same way."""
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:  # no Serve controller: nothing runs
        return {}
    return client.get_serve_details().get("applications") or {}


def _state(value: Any) -> str:
    return str(getattr(value, "value", value))  # Serve's state enums, or their text


def _routable(app: dict[str, Any]) -> bool:
    """An arm takes traffic while every deployment of its application has a running replica:
    RUNNING, or DEPLOYING a new version while the old replicas still serve."""
    if _state(app.get("status")) == RUNNING:
        return True
    deployments = (app.get("deployments") or {}).values()
    return bool(deployments) and all(
        any(_state(r.get("state")) == RUNNING for r in d.get("replicas") or ()) for d in deployments
    )


# `serve.ingress` pickles the app when the class is defined, so every helper it uses must
# already exist: the deployment class comes last.
@serve.deployment(
    name=ROUTER_DEPLOYMENT_NAME,
    max_ongoing_requests=1000,
    graceful_shutdown_timeout_s=ROUTER_DRAIN_S,
)
@serve.ingress(app)
class Router:
    def __init__(self, config_path: str, config_poll_s: float) -> None:
        self.loaded = load_config(config_path)
        self.metrics = RouterMetrics(self.loaded.config.model.name)
        self.metrics.set_active_config(self.loaded.revision, self.loaded.config.weights)
        self.metrics.set_last_reload(ok=True)
        self.guard = AcceptanceGuard(self.loaded.config.guardrail)
        self.in_flight = InFlight()
        self.draining = False
        self.handles: dict[str, DeploymentHandle] = {}
        self._openapi: tuple[str, dict[str, Any]] = ("", {})  # (revision, document)
        # App status per arm, and the arms a request may be routed to (see _routable).
        self.statuses: dict[str, str] = {}
        self.running: frozenset[str] = frozenset()
        # A new replica answers only once it knows which arms run (the first read, milliseconds).
        self._arm_states_known = asyncio.Event()
        self.watcher = ConfigWatcher(
            config_path, self.loaded, self._apply, self.metrics.count_reload
        )
        loop = asyncio.get_event_loop()
        self._tasks = [
            loop.create_task(self.watcher.run(config_poll_s)),
            loop.create_task(self._watch_arms(ARM_STATUS_POLL_S)),
        ]
        logger.info("router serving config revision %s", self.loaded.revision)

    # -- config and arm states ------------------------------------------------------------

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Ray Serve's user_config: `draining` refuses new requests with 503 while the ones in
        flight finish; the stopping platform watches `specserve_requests_in_flight` reach 0."""
        self.draining = bool(user_config.get(DRAINING))
        if self.draining:
            logger.info("draining: %d requests in flight", self.in_flight.count)

    def _apply(self, loaded: LoadedConfig) -> None:
        """Swap in a new config; a reference swap, so in-flight requests are untouched."""
        self.loaded = loaded
        self.metrics.model = loaded.config.model.name
        self.metrics.set_active_config(loaded.revision, loaded.config.weights)
        self.guard.reconfigure(loaded.config.guardrail)
        for arm in set(self.handles) - set(loaded.config.weights):
            del self.handles[arm]

    async def _watch_arms(self, interval_s: float) -> None:
        while True:
            try:
                await self._refresh_arm_states()  # sets the gauges again, too
            except Exception:
                logger.exception("reading arm states from Ray Serve failed; keeping the last")
                self.metrics.refresh_gauges()
            await asyncio.sleep(interval_s)

    async def _refresh_arm_states(self) -> None:
        apps = await asyncio.to_thread(_serve_applications)
        statuses, running = {}, set()
        for name, app in apps.items():
            arm = arm_name_of_app(name)
            if arm is None:
                continue
            statuses[arm] = _state(app.get("status"))
            if _routable(app):
                running.add(arm)
        self.statuses, self.running = statuses, frozenset(running)
        self._arm_states_known.set()
        self.metrics.set_drained(self.guard.drained())
        self.metrics.set_in_flight(self.in_flight.count)
        self.metrics.set_running({arm: arm in running for arm in self.loaded.config.weights})

    async def _wait_for_arm_states(self) -> None:
        # When Ray Serve does not answer, route with what is known (nothing runs: 503).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arm_states_known.wait(), ARM_STATES_WAIT_S)

    def _handle(self, arm: str) -> DeploymentHandle:
        handle = self.handles.get(arm)
        if handle is None:
            try:
                # Serve's gRPC transport: a bare hop costs 1.2 ms less than over actor calls
                # on a 2-core machine (BENCHMARKS.md, "Router overhead").
                handle = serve.get_app_handle(arm_app_name(arm)).options(
                    stream=True, _by_reference=False
                )
            except Exception as exc:
                raise OpenAIError(503, f"arm {arm!r} is not deployed yet") from exc
            self.handles[arm] = handle
        return handle

    # -- endpoints ------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self) -> JSONResponse:
        """200 when every arm with weight > 0 is running, else 503 naming the others."""
        if not self._arm_states_known.is_set():  # a new replica answers once it knows them
            await self._wait_for_arm_states()
        statuses = self.statuses
        waiting = {
            arm.name: statuses.get(arm.name, "NOT_DEPLOYED")
            for arm in self.loaded.config.arms
            if arm.weight > 0 and statuses.get(arm.name) != RUNNING
        }
        body = {
            "ready": not waiting and not self.draining,
            "revision": self.loaded.revision,
            "waiting": waiting,
            "draining": self.draining,
        }
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(self.loaded.config)]}

    @app.get("/v1/models/{model}")
    async def model(self, model: str) -> dict[str, Any]:
        config = self.loaded.config
        if model != config.model.name:
            raise _unknown_model(model, config)
        return _model_card(config)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> dict[str, Any]:
        loaded = self.loaded
        if self._openapi[0] != loaded.revision:
            bodies = {_PATHS[e]: model for e, model in _REQUEST_MODELS.items()}
            self._openapi = (loaded.revision, openapi_document(app, loaded, bodies))
        return self._openapi[1]

    @app.post(_PATHS[CHAT])
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, CHAT)

    @app.post(_PATHS[COMPLETIONS])
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, COMPLETIONS)

    # -- request path ---------------------------------------------------------------------

    async def _serve(self, request: Request, endpoint: str) -> Response:
        loaded = self.loaded  # one config for the whole request, even if a reload lands mid-way
        config = loaded.config
        # Every answer names the config revision that handled it, and the arm once one is chosen;
        # every request is counted once, by outcome, refused ones included.
        response_headers = {headers.CONFIG_REVISION: loaded.revision}
        record = RequestRecord(endpoint=endpoint, guard=self.guard, in_flight=self.in_flight)
        if not self._arm_states_known.is_set():
            await self._wait_for_arm_states()
        try:
            if self.draining:
                raise OpenAIError(
                    503,
                    "the service is shutting down; retry shortly",
                    code="shutting_down",
                    headers={headers.RETRY_AFTER: "1"},
                )
            data = await _read_json(request, config.limits.max_body_bytes)
            record.arm = self._pick_arm(request, data, config)
            response_headers[headers.ARM] = record.arm
            body, client_wants_usage = _validate(data, endpoint, config)
            return await forward(
                self._handle(record.arm),
                endpoint,
                body,
                record,
                self.metrics,
                client_wants_usage=client_wants_usage,
                headers=response_headers,
                timeout_s=config.limits.request_timeout_s,
            )
        except OpenAIError as exc:
            record.fail(exc.status, self.metrics)
            exc.headers = {**response_headers, **(exc.headers or {})}
            raise
        except Exception:
            record.fail(500, self.metrics)
            raise

    def _pick_arm(self, request: Request, data: dict[str, Any], config: RouterConfig) -> str:
        sticky_key = request.headers.get(config.routing.session_header)
        if not sticky_key and config.routing.use_user_field and isinstance(data.get("user"), str):
            sticky_key = data["user"]
        try:
            selection = choose_arm(
                config.weights,
                running=self.running,
                drained=self.guard.drained(),
                override=request.headers.get(headers.ARM_OVERRIDE),
                sticky_key=sticky_key,
            )
        except UnknownArmError as exc:
            raise OpenAIError(
                400, str(exc), param=headers.ARM_OVERRIDE, code="unknown_arm"
            ) from None
        except ArmNotRunningError as exc:
            raise OpenAIError(503, str(exc), code="arm_not_running") from None
        self.metrics.count_selection(*selection)
        return selection.arm


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (`import_path` of the router in the Serve config): plain args
    `{config_path, config_poll_s, replicas}` as `serve_config.router_application` writes them."""
    return Router.options(num_replicas=int(args.get("replicas", 1))).bind(  # type: ignore[attr-defined]
        args["config_path"], float(args.get("config_poll_s", 1.0))
    )
