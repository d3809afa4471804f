"""The router's request path, inside Ray Serve's HTTP proxy: one ASGI middleware per proxy.

Per inference request (`POST /v1/chat/completions`, `/v1/completions`): read the body, check it
against the config (size, model, limits), pick the arm (override header > sticky key > random by
weight, among the arms whose engines run and the guardrail has not drained), and send it with its
body in one Ray Serve handle call to a replica of the arm (wire/arm_calls.py), which validates
the schema and serves it from its engine (engine/front.py). There is no router replica between
proxy and arm (that hop cost 2-5 ms), nor Ray Serve's HTTP path to the replica (its call back to
the proxy for the body and its routing by path cost more).
On the way back (router/exchange.py: one request's trip to its arm and back) the dispatch names
the arm and config revision in the response headers, records the request in the per-arm metrics
(latency, tokens, acceptance, outcome), feeds the acceptance guardrail, replays a request once
whose arm replica died before answering (a stream cut mid-way is resumed from where it stood,
wire/resume.py), and turns Ray Serve's own refusals (a full queue, no replica) into OpenAI
errors.

Everything else (`/ready`, `/v1/models`, `/openapi.json`, ...) passes through to the router
application, which also carries the dispatch's settings: the config path and poll interval in its
args, `draining` in its user_config, read from the Serve controller about once a second.

Installed with the proxy's callback hook, in the environment of every Ray node:
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=specserve.router.dispatch:middlewares` (the chart and
`specserve serve` set it). Without a specserve router application on the cluster it does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ray.serve._private.constants import SERVE_LOGGER_NAME
from starlette.middleware import Middleware

from specserve import headers, versions
from specserve.capture.store import Bounds, Sampled
from specserve.config.schema import (
    LoadedConfig,
    RouterConfig,
)
from specserve.config.serve_config import (
    ARM_ROUTE_PREFIX,
)
from specserve.metrics import (
    AUTH_ACCEPTED,
    AUTH_FORBIDDEN,
    AUTH_INVALID,
    AUTH_MISSING,
    AUTH_RATE_LIMITED,
    NO_KEY,
    OUTCOME_CANCELLED,
    OUTCOME_SERVER_ERROR,
    SELECTED_BY_CAPABILITY,
    SELECTED_BY_OVERRIDE,
)
from specserve.readiness import readiness
from specserve.router.exchange import ARM, Exchange, internal_error, send_error, send_json
from specserve.router.key_share import KeyShare
from specserve.router.record import RequestRecord, outcome_of_status
from specserve.router.replays import Fate, ReplayedBodies, replay_identity
from specserve.router.scopes import (
    HTTP_METHODS,
    ClientGone,
    arm_scope,
    header_dict,
    method_not_allowed,
    read_body,
    request_id_header,
    without_key,
)
from specserve.router.selection import (
    ArmNotRunningError,
    NoAbleArmError,
    UnknownArmError,
    choose_arm,
    unit_bucket,
)
from specserve.router.view import RoutingView
from specserve.wire.arm_calls import ArmCalls, ASGIApp, Receive, Scope, Send
from specserve.wire.auth import Identity, KeyLimits, admin_required
from specserve.wire.errors import (
    OVERLOAD_RETRY_AFTER_S,
    OpenAIError,
    arm_overloaded,
)
from specserve.wire.requests import (
    ENDPOINT_OF_PATH,
    READY_PATH,
    check_limits,
    needs_plain_decoding,
    parse_body,
    prompt_digest,
    salt_for_key,
    wants_usage,
)
from specserve.wire.resume import ResumePoint, resumable

logger = logging.getLogger(__name__)

# A body larger than this is parsed in a thread, off the proxy's event loop (~1 ms of CPU).
PARSE_OFF_LOOP_BYTES = 64 * 1024
API_PREFIX = "/v1/"
BODY_REQUEST_ID = "request_id"  # vLLM's own body field: the answer's id when given


def middlewares() -> list[Middleware]:
    """The proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`)."""
    # The proxy logs through Ray Serve's logger (its file: serve/proxy_<ip>.log), which does not
    # propagate; specserve's records in this process (config reloads, drains) go there too.
    package = logging.getLogger("specserve")
    package.setLevel(logging.INFO)
    package.propagate = False
    package.addHandler(_ToServeLog())
    # Written against one Ray Serve's private APIs: with another, the refusal (logged) fails the
    # proxy actor's start, so this node serves no traffic rather than any without the dispatch
    # (Ray Serve marks the proxy unhealthy and starts it again, failing again the same way).
    versions.require(versions.RAY)
    return [Middleware(Dispatch)]


class _ToServeLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(SERVE_LOGGER_NAME).handle(record)


class Dispatch:
    """The ASGI middleware around the proxy's app; its state lives as long as the proxy."""

    def __init__(self, app: ASGIApp, arms: ASGIApp | None = None) -> None:
        self.app = app
        # How a request reaches its arm's replica (`/arms/<name>/...`): a handle call each.
        self.arms = arms if arms is not None else ArmCalls()
        self.state: DispatchState | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state is None:  # the first request: the proxy's event loop runs now
            self.state = DispatchState(self.arms)
        path = scope["path"]
        if scope["method"] not in HTTP_METHODS:
            # Ray Serve's proxy labels its metrics with the method: any other name would be a new
            # series, and no route here takes one.
            await send_error(send, method_not_allowed(scope["method"]), [request_id_header(scope)])
            return
        endpoint = ENDPOINT_OF_PATH.get(path) if scope["method"] == "POST" else None
        if endpoint is not None:
            with _ongoing_in(self.app):
                await self.state.serve(self.app, scope, receive, send, endpoint)
        elif path == READY_PATH and scope["method"] == "GET":
            await self.state.ready(self.app, scope, receive, send)
        elif path.startswith(ARM_ROUTE_PREFIX):
            await self.state.pass_to_arm(self.app, scope, receive, send)
        elif path.startswith(API_PREFIX):  # `/v1/models`: the router application's, with a key
            await self.state.pass_with_key(self.app, scope, receive, send)
        else:  # the router application's other endpoints: probes and the OpenAPI document
            await self.app(scope, receive, send)


@contextlib.contextmanager
def _ongoing_in(proxy: Any) -> Iterator[None]:
    """Count the request among the proxy's ongoing ones, as Ray Serve's own HTTP path does, which
    the dispatch's requests bypass: a draining proxy (its node has no replica left) stops only
    once none is ongoing. A no-op where the app is not Ray Serve's proxy."""
    start = getattr(proxy, "_ongoing_requests_start", None)
    if start is None:
        yield
        return
    start()
    try:
        yield
    finally:
        proxy._ongoing_requests_end()


class DispatchState(RoutingView):
    """One proxy's dispatch: what it routes with (RoutingView), the requests at each arm, the
    keys' limits and the replays; it serves each request and records the router's metrics."""

    def __init__(self, arms: ASGIApp) -> None:
        super().__init__()
        self.arms = arms
        self.key_limits = KeyLimits()
        self.key_share = KeyShare()
        self.replayed = ReplayedBodies()
        # Requests handed to each arm and not yet answered, streams included. Ray Serve's own
        # bound on an arm's queue is checked and counted at different moments, so a burst gets
        # past it (29 queued against a bound of 16); this count is checked and moved in one step.
        self.at_arm: Counter[str] = Counter()

    async def ready(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """`GET /ready`, answered by the router itself (what it routes with): 200 when every arm
        with weight > 0 is running and nothing drains; else 503 saying which."""
        if not await self._deployed():
            await app(scope, receive, send)
            return
        state, loaded = self.serve_state, self.loaded
        found = readiness(
            loaded.config if loaded else None,
            loaded.revision if loaded else None,
            state.statuses,
            draining=state.shutting_down,
        )
        status = 200 if found.ready else 503
        await send_json(send, status, found.body(), [request_id_header(scope)])

    def _check_key(self, scope: Scope, admin_for: str | None = None) -> None:
        """401 for a missing or wrong API key; 403 for a public key where `admin_for` (an admin
        power) is asked for."""
        identity = self.keys.authenticate(header_dict(scope).get(headers.AUTHORIZATION))
        if admin_for and identity is not None and not identity.admin:
            raise admin_required(admin_for)

    async def pass_with_key(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Another `/v1/` route (the router application's `/v1/models`): with an API key, and
        not before the keys are known (fail closed)."""
        try:
            if not await self._deployed():
                raise OpenAIError(503, "the router is starting; retry shortly", code="starting")
            self._check_key(scope)
        except OpenAIError as exc:
            await send_error(send, exc, [request_id_header(scope)])
            return
        await app(without_key(scope), receive, send)

    async def pass_to_arm(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """`/arms/<name>/...` from a client: the arm's own routes, only for arms deployed with
        `expose_http` (debugging, the router-overhead benchmark) and with an admin key; not
        found otherwise, also while the arm states are not known (fail closed)."""
        arm = scope["path"].removeprefix(ARM_ROUTE_PREFIX).split("/", 1)[0]
        request_id = request_id_header(scope)
        if not await self._deployed() or arm not in self.serve_state.exposed:
            not_found = OpenAIError(404, f"no route {scope['path']}")
            await send_error(send, not_found, [request_id])
            return
        try:
            self._check_key(scope, admin_for="an arm's own routes")
        except OpenAIError as exc:
            await send_error(send, exc, [request_id])
            return
        await app(without_key(scope), receive, send)

    async def serve(
        self, app: ASGIApp, scope: Scope, receive: Receive, send: Send, endpoint: str
    ) -> None:
        if not await self._deployed():  # not specserve's cluster (yet): Ray Serve answers
            await app(scope, receive, send)
            return
        loaded = self.loaded
        if loaded is None or self.metrics is None or self.guard is None:
            unreadable = OpenAIError(503, "the router's config file cannot be read; see its log")
            await send_error(send, unreadable, [request_id_header(scope)])
            return
        metrics, config = self.metrics, loaded.config
        # Every answer names the config revision that handled it, and the arm once one is chosen;
        # every request is counted once, by outcome, refused ones included.
        extra = [(headers.CONFIG_REVISION.encode(), loaded.revision.encode())]
        request_id = request_id_header(scope)  # on the request too: the arm logs it under the same
        record = RequestRecord(endpoint=endpoint, guard=self.guard, in_flight=self.in_flight)
        exchange: Exchange | None = None
        identity: Identity | None = None
        show_arm = False
        reserved = 0
        try:
            try:
                if self.serve_state.shutting_down:
                    raise OpenAIError(
                        503,
                        "the service is shutting down; retry shortly",
                        code="shutting_down",
                        headers={headers.RETRY_AFTER: "1"},
                    )
                # Who is asking, before anything of theirs is read.
                request_headers = header_dict(scope)
                identity = self._admit(request_headers, config)
                if identity is not None:
                    record.key = identity.name
                raw = await read_body(request_headers, receive, config.limits)
                if len(raw) > PARSE_OFF_LOOP_BYTES:
                    data = await asyncio.to_thread(parse_body, raw)
                else:
                    data = parse_body(raw)
                record.arm = self._pick_arm(request_headers, data, loaded, record)
                self._count_share(record, identity, config)
                left_out = config.routing.ab_left_out_prompts
                if left_out and record.randomized:
                    record.left_out = prompt_digest(data, endpoint) in left_out
                # The arm is named to admin keys only (routing.arm_header): a client told its
                # arm could try sticky keys until it had the one it wants.
                show_arm = config.routing.names_arm_to(identity is None or identity.admin)
                if show_arm:
                    extra.append((ARM, record.arm.encode()))
                checked = check_limits(data, config, endpoint)
                # A body's own request id would be the answer's id, past the rule for ids.
                rewritten = data.pop(BODY_REQUEST_ID, None) is not None or checked.rewritten
                if config.limits.prefix_cache_per_key and identity is not None:
                    salt_for_key(data, identity.name)
                    rewritten = True
                if rewritten:  # the token limit, a bool `stream`, no id, the key's salt
                    raw = json.dumps(data).encode()
                self._check_room(record.arm, config)
                reserved = self._reserve(identity, config, checked.tokens)
            except OpenAIError as exc:
                record.outcome = outcome_of_status(exc.status)
                await send_error(send, exc, [*extra, request_id])
                return
            exchange = Exchange(
                record,
                send,
                extra,
                request_id,
                client_wants_usage=wants_usage(data),
                endpoint=endpoint if resumable(data, endpoint) else None,
                show_arm=show_arm,
            )
            # Counted in the same step of the event loop as `_check_room`; until the request ends.
            self.at_arm[record.arm] += 1
            timeout_s = config.limits.request_timeout_s
            capture = _capture(config, record.arm, request_headers, identity, data, endpoint)
            await self._at_arm(
                exchange,
                self.arms,
                arm_scope(scope, record.arm, timeout_s, capture=capture),
                raw,
                receive,
            )
            point = exchange.cut_at()
            if (exchange.unanswered() or point is not None) and not exchange.client_gone:
                sent = _Sent(scope, receive, send, raw, data, identity, request_headers, show_arm)
                replay = await self._replay(sent, config, exchange, point)
                if replay is not None:
                    exchange = replay.exchange
                    await replay.run()
            await exchange.finish()
        except ClientGone:
            record.outcome = OUTCOME_CANCELLED
        except (asyncio.CancelledError, OSError):
            record.outcome = OUTCOME_CANCELLED  # the client went away
            raise
        except Exception:
            record.outcome = OUTCOME_SERVER_ERROR
            logger.exception("dispatch failed on a request to arm %s", record.arm)
            if exchange is None or not exchange.started:
                answered = exchange.extra if exchange is not None else extra  # a replay's arm
                await send_error(send, internal_error(), [*answered, request_id])
        finally:
            if exchange is not None:
                self.at_arm[record.arm] -= 1
            record.finish(metrics)
            if identity is not None:
                if record.output_tokens:
                    metrics.count_key_tokens(identity.name, record.output_tokens)
                # A client that left is charged its whole reservation: what the engine generated
                # before it stopped never reaches the router.
                if record.outcome != OUTCOME_CANCELLED:
                    self.key_limits.settle(identity.name, reserved, record.output_tokens)

    async def _replay(
        self,
        sent: _Sent,
        config: RouterConfig,
        exchange: Exchange,
        point: ResumePoint | None,
    ) -> _Replay | None:
        """The arm's replica died (or the arm has none left) before `exchange` ended: replay the
        request once, on its arm (or, with routing.replay_on_another_arm, another running one
        where the weights chose it); a stream cut mid-way (`point`) goes on from where it
        stood. Never a body whose replay lost its replica too, nor one of a key out of such
        replays: a request that kills an engine must not kill another. -> the replay's
        exchange and how to run it; None when it is not replayed."""
        assert self.metrics is not None
        record = exchange.record
        owner = sent.identity.name if sent.identity is not None else None
        ticket = await self.replayed.admit(replay_identity(sent.data, owner), owner)
        if ticket is None:
            logger.warning(
                "arm %s: the replica failed, for a request whose replay (or that of another "
                "request of its key) lost its replica too; not replaying it",
                record.arm,
            )
            return None
        failed_arm = record.arm
        record.arm = self._replay_arm(record, config)
        logger.warning(
            "arm %s: %s; %s on arm %s",
            failed_arm,
            "the replica failed mid-stream"
            if point
            else "no answer before its replica failed or it stopped running",
            "resuming the stream" if point else "replaying the request once",
            record.arm,
        )
        (self.metrics.count_resume if point else self.metrics.count_retry)(failed_arm)
        self.at_arm[failed_arm] -= 1
        self.at_arm[record.arm] += 1
        extra = [h for h in exchange.extra if h[0] != ARM]
        if sent.show_arm:
            extra.append((ARM, record.arm.encode()))
        again = Exchange(
            record,
            sent.send,
            extra,
            exchange.request_id,
            client_wants_usage=wants_usage(sent.data),
            resumes=exchange if point else None,
            show_arm=sent.show_arm,
        )
        replay_scope = arm_scope(
            sent.scope,
            record.arm,
            config.limits.request_timeout_s,
            point,
            # The request again, where it is captured at all; a stream's rest is not.
            capture=None
            if point
            else _capture(
                config,
                record.arm,
                sent.request_headers,
                sent.identity,
                sent.data,
                record.endpoint,
            ),
        )

        async def run() -> None:
            fate = Fate.UNKNOWN
            try:
                await self._at_arm(again, self.arms, replay_scope, sent.raw, sent.receive)
                fate = again.fate()
            finally:
                ticket.settle(fate)

        return _Replay(again, run)

    async def _at_arm(
        self, exchange: Exchange, app: ASGIApp, scope: Scope, raw: bytes, receive: Receive
    ) -> None:
        """The exchange with its arm; taken back if the arm stops running before answering (its
        only replica died: Ray Serve would hold the request until a new replica runs, minutes
        for an engine). A request taken back is unanswered, and replayed as such."""
        arm = exchange.record.arm
        stopped = self._stopped.setdefault(arm, asyncio.Event())
        run = asyncio.ensure_future(exchange.run(app, scope, raw, receive))
        watch = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait((run, watch), return_when=asyncio.FIRST_COMPLETED)
            taken_back = not run.done() and not exchange.started
            if taken_back:
                logger.warning(
                    "arm %s stopped running; taking back a request it had not begun", arm
                )
                run.cancel()
            try:
                await run
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not taken_back or (current is not None and current.cancelling()):
                    raise  # the client left
        finally:
            watch.cancel()
            run.cancel()

    def _admit(self, request_headers: dict[str, str], config: RouterConfig) -> Identity | None:
        """The request's API key (401 without a valid one), the admin power it uses (403 for
        a public key) and its key's rate limits (429); None when no keys are configured."""
        assert self.metrics is not None
        try:
            identity = self.keys.authenticate(request_headers.get(headers.AUTHORIZATION))
        except OpenAIError as exc:
            self.metrics.count_auth(
                NO_KEY, AUTH_MISSING if exc.code == "missing_api_key" else AUTH_INVALID
            )
            raise
        if identity is None:
            return None
        if headers.ARM_OVERRIDE in request_headers and not identity.admin:
            self.metrics.count_auth(identity.name, AUTH_FORBIDDEN)
            raise admin_required(f"forcing an arm ({headers.ARM_OVERRIDE})")
        limit = config.limits.key_limit(identity.name)
        if limit is not None:
            try:
                self.key_limits.admit(
                    identity.name, limit.requests_per_minute, limit.output_tokens_per_minute
                )
            except OpenAIError:
                self.metrics.count_auth(identity.name, AUTH_RATE_LIMITED)
                raise
        self.metrics.count_auth(identity.name, AUTH_ACCEPTED)
        return identity

    def _reserve(self, identity: Identity | None, config: RouterConfig, tokens: int) -> int:
        """Reserve the most tokens the request may generate from its key's token bucket (429 when
        it holds fewer), so that many requests at once cannot each take the full limit."""
        limit = config.limits.key_limit(identity.name) if identity is not None else None
        if identity is None or limit is None:
            return 0
        assert self.metrics is not None
        try:
            return self.key_limits.reserve(identity.name, limit.output_tokens_per_minute, tokens)
        except OpenAIError:
            self.metrics.count_auth(identity.name, AUTH_RATE_LIMITED)
            raise

    def _replay_arm(self, record: RequestRecord, config: RouterConfig) -> str:
        """Where a request whose arm failed before answering goes again: its own arm, or, with
        `routing.replay_on_another_arm`, for one the weights or a sticky key placed, another
        running arm by the weights (its own arm if no other runs)."""
        if not (record.randomized and config.routing.replay_on_another_arm) or self.guard is None:
            return record.arm
        others = {arm: w for arm, w in config.weights.items() if arm != record.arm}
        try:
            selection = choose_arm(
                others, routable=self.serve_state.routable, drained=self.guard.drained()
            )
        except ArmNotRunningError:
            return record.arm
        return selection.arm

    def _count_share(
        self, record: RequestRecord, identity: Identity | None, config: RouterConfig
    ) -> None:
        """A key past its share of the arm's statistics (routing.max_key_share) is served, but
        feeds neither the A/B statistics nor the guardrail (and is replayed on its own arm)."""
        if not record.randomized or identity is None:
            return
        routing = config.routing
        if not self.key_share.count(
            record.arm, identity.name, routing.max_key_share, routing.key_share_window
        ):
            record.guard = None
            record.randomized = False

    def _check_room(self, name: str, config: RouterConfig) -> None:
        """Refuse a request that would take this proxy past the arm's capacity: every replica
        busy with as many requests as it takes, and the proxy's queue for the arm full."""
        arm = config.arm(name)
        if arm is not None and self.at_arm[name] >= arm.capacity_per_proxy():
            raise arm_overloaded(name, str(OVERLOAD_RETRY_AFTER_S))

    def _pick_arm(
        self,
        request_headers: dict[str, str],
        data: dict[str, Any],
        loaded: LoadedConfig,
        record: RequestRecord,
    ) -> str:
        assert self.metrics is not None and self.guard is not None
        config = loaded.config
        sticky_key = request_headers.get(config.routing.session_header.lower())
        if not sticky_key and config.routing.use_user_field and isinstance(data.get("user"), str):
            sticky_key = data["user"]
        plain_only = needs_plain_decoding(data)
        able = None
        if plain_only:
            able = [arm.name for arm in config.arms if arm.speculative.method == "none"]
        try:
            selection = choose_arm(
                config.weights,
                routable=self.serve_state.routable,
                drained=self.guard.drained(),
                override=request_headers.get(headers.ARM_OVERRIDE),
                sticky_key=sticky_key,
                salt=self.sticky_salt,
                able=able,
            )
        except UnknownArmError as exc:
            raise OpenAIError(
                400, str(exc), param=headers.ARM_OVERRIDE, code="unknown_arm"
            ) from None
        except ArmNotRunningError as exc:
            raise OpenAIError(503, str(exc), code="arm_not_running") from None
        except NoAbleArmError as exc:
            message = f"{plain_only}: speculative decoding does not take it, and {exc}"
            raise OpenAIError(400, message, param=plain_only) from None
        record.unit_bucket = unit_bucket(sticky_key, self.sticky_salt)
        self.metrics.count_selection(*selection, unit_bucket=record.unit_bucket)
        if selection.selected_by in (SELECTED_BY_OVERRIDE, SELECTED_BY_CAPABILITY):
            # A forced request is not randomized: it neither feeds the guardrail nor the A/B
            # statistics, so no client can drain an arm or bias a verdict with it; nor does one
            # sent where it can be served.
            record.guard = None
            record.randomized = False
        return selection.arm


@dataclass(frozen=True)
class _Sent:
    """What a request was sent to its arm with: what sending it again takes."""

    scope: Scope
    receive: Receive
    send: Send
    raw: bytes
    data: dict[str, Any]
    identity: Identity | None
    request_headers: dict[str, str]
    show_arm: bool


@dataclass(frozen=True)
class _Replay:
    exchange: Exchange
    run: Callable[[], Awaitable[None]]


def _capture(
    config: RouterConfig,
    arm: str,
    request_headers: dict[str, str],
    identity: Identity | None,
    data: dict[str, Any],
    endpoint: str,
) -> Sampled | None:
    """What the arm is told of this request if it is in its arm's capture sample (drawn at the
    arm's rate, unless the client or its key opted out): the store's bounds, the key's name and
    the prompt's digest."""
    settings = (found := config.arm(arm)) and found.capture
    if not settings or request_headers.get(headers.NO_CAPTURE, "").strip() == "1":
        return None
    if identity is not None:
        limit = config.limits.key_limit(identity.name)
        if limit is not None and not limit.capture:
            return None
    if random.random() >= settings.sample:
        return None
    bounds = Bounds(settings.max_records, settings.max_age_s, settings.max_bytes)
    key = identity.name if identity is not None else None
    return Sampled(bounds, key, prompt_digest(data, endpoint))
