"""The config file a local `specserve serve` runs from, as a config store (store.py).

The live file is replaced by one rename, so the watcher reads the old bytes or the new ones,
never half, and `specserve serve` applies the new revision within `config_poll_s` (arms whose
engine changed are redeployed, as on Kubernetes). Every revision applied is recorded under
`<file>.history/<revision>.yaml` (its bytes), the file's modification time being when it was
last applied.

Without `$SPECSERVE_CONFIG` a local platform serves `<cache_dir>/config.yaml`, a copy of the
packaged default made on first use (`local_config_path`): a revision applied locally changes
that copy, never the installed package.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from specserve.config.changes import ArmChanges, arm_changes
from specserve.config.schema import RouterConfig, revision_of
from specserve.config.settings import DEFAULT_CONFIG_PATH, Settings
from specserve.config.store import ConfigStore, Live, Outcome, Record

# Where a local platform's config lives when none is configured, under the cache dir.
LOCAL_COPY_NAME = "config.yaml"


def local_config_path(settings: Settings) -> Path:
    """The file a local `specserve serve` runs from and `--local` changes: the configured one,
    or, where that is the packaged default, its copy in the cache dir (made if missing, then
    kept: it holds the revisions applied since). Where the cache dir cannot be written (an
    image's, read-only), the packaged default itself, served as it is."""
    if settings.config.resolve() != DEFAULT_CONFIG_PATH.resolve():
        return settings.config
    copy = settings.cache_dir / LOCAL_COPY_NAME
    if not copy.exists():
        try:
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(DEFAULT_CONFIG_PATH, copy)
        except OSError:
            return DEFAULT_CONFIG_PATH
    return copy


class LocalStore(ConfigStore):
    def __init__(self, path: Path, *, check: Callable[[RouterConfig], None] | None = None) -> None:
        super().__init__(check)
        self.path = path
        self.history_dir = path.with_name(path.name + ".history")

    def read(self) -> Live:
        written = datetime.fromtimestamp(self.path.stat().st_mtime, UTC)
        return Live(self.path.read_text(), str(self.path), written)

    def records(self) -> list[Record]:
        if not self.history_dir.is_dir():
            return []
        return [self._record(file) for file in self.history_dir.glob("*.yaml")]

    def engine_changes(self, live: Live, old: RouterConfig | None, new: RouterConfig) -> ArmChanges:
        # `specserve serve` redeploys what changed from the config it serves, the last valid one.
        return ArmChanges() if old is None else ArmChanges.of(arm_changes(old, new))

    def write_live(self, live: Live, text: str) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(text)
        tmp.rename(self.path)

    def write_record(self, live: Live, text: str, applied_at: datetime) -> Record:
        self.history_dir.mkdir(parents=True, exist_ok=True)
        path = self.history_dir / f"{revision_of(text.encode())}.yaml"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.rename(path)
        stamp = applied_at.timestamp()
        os.utime(path, (stamp, stamp))
        return self._record(path)

    def write_engines(self, live: Live, config: RouterConfig) -> None:
        """Nothing: `specserve serve` reads the arms from the file it watches."""

    def delete_record(self, record: Record) -> None:
        (self.history_dir / record.name).unlink(missing_ok=True)

    def notes(self, outcome: Outcome) -> list[str]:
        notes = ["live: a running `specserve serve` applies it within a second"]
        if outcome.engines:
            notes.append(f"arms: {outcome.engines_where} {outcome.engines.describe()}")
        return notes

    @staticmethod
    def _record(file: Path) -> Record:
        text = file.read_text()
        return Record(
            name=file.name,
            revision=revision_of(text.encode()),
            applied_at=datetime.fromtimestamp(file.stat().st_mtime, UTC),
            text=text,
        )
