"""Watch the config file and hand each new valid revision to a callback.

Kubernetes swaps a mounted ConfigMap by re-pointing a `..data` symlink, so change detection reads
the file's bytes through the path (never inotify on the inode) and compares revisions; new bytes
are judged once they stay put (settle.py: a file edited in place can be read half-written). An
invalid new file is logged and counted once, and the last good config keeps serving. Valid means
the schema and the engine settings vLLM would accept (config/checks.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from specserve.config.checks import check_engine_settings
from specserve.config.schema import ConfigError, LoadedConfig, parse_config, revision_of
from specserve.metrics import RELOAD_APPLIED, RELOAD_INVALID
from specserve.settle import stays_put

logger = logging.getLogger(__name__)


class ConfigWatcher:
    def __init__(
        self,
        path: str | Path,
        current: LoadedConfig,
        on_change: Callable[[LoadedConfig], object],
        on_result: Callable[[str], object] | None = None,
        *,
        engines_run_here: bool = False,
    ) -> None:
        self.path = Path(path)
        self.engines_run_here = engines_run_here
        self.current = current
        self.on_change = on_change
        # Told each new revision's result (metrics.RELOAD_APPLIED or RELOAD_INVALID).
        self.on_result = on_result
        self.last_seen = current.revision
        self.last_error: str | None = None

    def check(self) -> LoadedConfig | None:
        """Read the file; apply and return a new valid revision, else None."""
        raw = self._read()
        if raw is None:
            return None
        revision = revision_of(raw)
        if revision == self.last_seen:
            return None
        if not stays_put(self.path, raw):
            logger.debug("config %s is being written; judged at the next look", self.path)
            return None
        self.last_seen = revision
        try:
            config = parse_config(raw, source=str(self.path))
            check_engine_settings(
                config, source=str(self.path), engines_run_here=self.engines_run_here
            )
        except ConfigError as exc:
            self.last_error = str(exc)
            logger.error(
                "rejected config revision %s, still serving %s: %s",
                revision,
                self.current.revision,
                exc,
            )
            self._count(RELOAD_INVALID)
            return None
        loaded = LoadedConfig(config=config, revision=revision, path=str(self.path))
        self.on_change(loaded)
        self.current, self.last_error = loaded, None
        self._count(RELOAD_APPLIED)
        logger.info("applied config revision %s", revision)
        return loaded

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError as exc:
            # Mid-swap or briefly missing: keep serving and look again next time.
            logger.debug("config %s unreadable: %s", self.path, exc)
            return None

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                # In a thread: a changed file is read again a moment later (settle.py).
                await asyncio.to_thread(self.check)
            except Exception:
                # A failing callback must not stop the watch; the next revision gets its turn.
                logger.exception("config watch failed")

    def _count(self, result: str) -> None:
        if self.on_result is not None:
            self.on_result(result)
