"""What the dispatch of one proxy routes with, kept current (router/dispatch.py serves the
requests): the config with its metrics and guardrail, the API keys and the sticky salt, and which
arms run. The router application names the files in its args; the Serve controller says which
arms run, read about once a second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from specserve.config.checks import check_engine_settings
from specserve.config.schema import ConfigError, LoadedConfig, load_config
from specserve.config.serve_config import (
    ADMIN_KEYS_FILE_ARG,
    API_KEYS_FILE_ARG,
    CONFIG_PATH_ARG,
    CONFIG_POLL_S_ARG,
    STICKY_SALT_FILE_ARG,
)
from specserve.metrics import RouterMetrics
from specserve.router.arm_states import (
    FIRST_READ_WAIT_S,
    POLL_S,
    READ_TIMEOUT_S,
    ServeState,
    read_serve_state,
)
from specserve.router.guardrail import AcceptanceGuard
from specserve.router.record import InFlight
from specserve.router.selection import load_salt
from specserve.watch import ConfigWatcher
from specserve.wire.auth import KeyRing

logger = logging.getLogger(__name__)


class RoutingView:
    """The config, keys and arm states one proxy's dispatch routes with, and the tasks that
    follow them; it reports the router's state metrics (drained arms, requests in flight)."""

    def __init__(self) -> None:
        self.serve_state = ServeState()
        self.loaded: LoadedConfig | None = None
        self.watcher: ConfigWatcher | None = None
        self.metrics: RouterMetrics | None = None
        self.guard: AcceptanceGuard | None = None
        self.in_flight = InFlight()
        self.keys = KeyRing(None, None)  # until the router application names its keys files
        self._keys_files: tuple[str | None, str | None] = (None, None)
        self.sticky_salt = b""  # until the router application names its salt file
        self._salt_file: str | None = None
        self._state_read_at = time.monotonic()
        self._reading: asyncio.Future[ServeState] | None = None
        # Per arm, set when the arm stops running: its requests not yet answered are taken back.
        self._stopped: dict[str, asyncio.Event] = {}
        self._first_read = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch_serve()),
            loop.create_task(self._watch_config()),
        ]

    async def _watch_serve(self) -> None:
        while True:
            try:
                state = await self._read_serve_state()
                stopped = self.serve_state.routable - state.routable
                self.serve_state = state
                for arm in stopped:
                    if (event := self._stopped.pop(arm, None)) is not None:
                        event.set()
                self._state_read_at = time.monotonic()
                if state.router_args is not None:
                    await self._follow_keys(state.router_args)
                    await self._follow_config(state.router_args)
                self._first_read.set()
            except TimeoutError:
                logger.error(
                    "the Ray Serve controller did not say which arms run within %g s; "
                    "routing with what it said %.0f s ago",
                    READ_TIMEOUT_S,
                    time.monotonic() - self._state_read_at,
                )
            except Exception:
                logger.exception("reading Ray Serve's state failed; keeping the last")
            if self.metrics is not None and self.guard is not None and self.loaded:
                self.metrics.set_drained(self.guard.drained())
                self.metrics.set_in_flight(self.in_flight.count)
                self.metrics.set_arm_states_age(time.monotonic() - self._state_read_at)
                weights = self.loaded.config.weights
                self.metrics.set_running({a: a in self.serve_state.routable for a in weights})
            await asyncio.sleep(POLL_S)

    async def _read_serve_state(self) -> ServeState:
        """One read of what runs, bounded in time: a controller call that hangs is waited on
        again by the next read, never started twice."""
        if self._reading is None or self._reading.done():
            loop = asyncio.get_running_loop()
            self._reading = loop.run_in_executor(None, read_serve_state, self.serve_state)
        reading = self._reading
        return await asyncio.wait_for(asyncio.shield(reading), READ_TIMEOUT_S)

    async def _follow_keys(self, router_args: dict[str, Any]) -> None:
        """Take the keys files the router application names (once, or again if it names
        others); their contents are checked with the config."""
        files = (router_args.get(API_KEYS_FILE_ARG), router_args.get(ADMIN_KEYS_FILE_ARG))
        if files != self._keys_files:
            self.keys = await asyncio.to_thread(KeyRing, *files)
            self._keys_files = files
        salt_file = router_args.get(STICKY_SALT_FILE_ARG)
        if salt_file != self._salt_file:
            self.sticky_salt = await asyncio.to_thread(load_salt, salt_file)
            self._salt_file = salt_file

    async def _follow_config(self, router_args: dict[str, Any]) -> None:
        """Load the config the router application names (once, or again if it names another)."""
        path = str(router_args.get(CONFIG_PATH_ARG, ""))
        if self.loaded is not None and self.loaded.path == path:
            return
        try:
            loaded = await asyncio.to_thread(load_config, path)
        except ConfigError as exc:
            logger.error("dispatch cannot route yet: %s", exc)
            return
        if self.metrics is None:
            self.metrics = RouterMetrics(loaded.config.model.name)
            self.guard = AcceptanceGuard(loaded.config.guardrail)
        self.watcher = ConfigWatcher(path, loaded, self._apply, self.metrics.count_reload)
        self._apply(loaded)
        self.metrics.set_last_reload(ok=True)
        logger.info("dispatch routing with config revision %s from %s", loaded.revision, path)
        # Checking a revision's engine settings imports vLLM's argument parser (~20 s of CPU):
        # do it now, while the platform starts, so that the first change applies at once.
        self._tasks.append(asyncio.get_running_loop().create_task(self._check_engines(loaded)))

    async def _check_engines(self, loaded: LoadedConfig) -> None:
        try:
            await asyncio.to_thread(check_engine_settings, loaded.config, source=loaded.path)
        except ConfigError as exc:
            logger.warning("the running config has engine settings vLLM would refuse: %s", exc)

    def _apply(self, loaded: LoadedConfig) -> None:
        """Swap in a new config; a reference swap, so requests in flight are untouched."""
        assert self.metrics is not None and self.guard is not None
        self.loaded = loaded
        self.metrics.model = loaded.config.model.name
        self.metrics.set_active_config(
            loaded.revision, loaded.config.weights, loaded.config.k_by_arm
        )
        self.guard.reconfigure(loaded.config.guardrail)

    async def _watch_config(self) -> None:
        while True:
            args = self.serve_state.router_args or {}
            await asyncio.sleep(float(args.get(CONFIG_POLL_S_ARG, POLL_S)))
            if self.watcher is not None:
                try:
                    # In a thread: the engine-settings check imports vLLM's argument parser.
                    await asyncio.to_thread(self.watcher.check)
                except Exception:
                    logger.exception("config watch failed")
            try:
                await asyncio.to_thread(self.keys.check)
                if self.metrics is not None:
                    self.metrics.set_keys_refused(self.keys.refused())
            except Exception:
                logger.exception("keys file watch failed")

    async def _deployed(self) -> bool:
        """Whether a specserve router application is deployed (after the first read of what
        runs, for a request that arrives before it)."""
        if not self._first_read.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._first_read.wait(), FIRST_READ_WAIT_S)
        return self.serve_state.router_args is not None
