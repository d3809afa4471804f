"""`specserve config apply | history | rollback --local`: revisions and their history for the
config file a local `specserve serve` runs from, as `cluster_config` keeps them on Kubernetes.

The live file is replaced by one rename, so the watcher reads the old bytes or the new ones,
never half, and `specserve serve` applies the new revision within `config_poll_s` (arms whose
engine changed are redeployed, as on Kubernetes). Every revision applied is recorded under
`<file>.history/<revision>.yaml` (its bytes), the file's modification time being when it was
last applied; the revision live before the first apply is recorded too, so a rollback can always
return to where it started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from specserve.config.cluster_store import (
    DEFAULT_KEEP,
    Record,
    history_table,
    next_applied_at,
    previous_record,
    records_to_prune,
    resolve_revision,
)
from specserve.config.schema import ConfigError, RouterConfig, parse_config, revision_of


@dataclass(frozen=True)
class LocalOutcome:
    path: Path
    old_revision: str
    new_revision: str
    old_config: RouterConfig | None  # None when the live bytes are not a valid config
    new_config: RouterConfig
    pruned: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.old_revision != self.new_revision


class LocalConfig:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.history_dir = path.with_name(path.name + ".history")

    def live_text(self) -> str:
        return self.path.read_text()

    def records(self) -> list[Record]:
        if not self.history_dir.is_dir():
            return []
        records = []
        for file in self.history_dir.glob("*.yaml"):
            text = file.read_text()
            records.append(
                Record(
                    name=file.name,
                    revision=revision_of(text.encode()),
                    applied_at=datetime.fromtimestamp(file.stat().st_mtime, UTC),
                    text=text,
                )
            )
        return records

    def apply(
        self,
        text: str,
        config: RouterConfig,
        *,
        keep: int = DEFAULT_KEEP,
        now: datetime | None = None,
    ) -> LocalOutcome:
        """Make `text` (already validated as `config`) the live file, record it, prune."""
        old_text = self.live_text()
        old_revision, new_revision = revision_of(old_text.encode()), revision_of(text.encode())
        try:
            old_config: RouterConfig | None = parse_config(old_text)
        except ConfigError:
            old_config = None
        outcome = LocalOutcome(self.path, old_revision, new_revision, old_config, config)
        if not outcome.changed:
            return outcome
        now = now or datetime.now(UTC)
        if old_revision not in {r.revision for r in self.records()}:
            written = datetime.fromtimestamp(self.path.stat().st_mtime, UTC)
            self._record(old_text, min(written, now))
        self._replace_live(text)
        self._record(text, next_applied_at(now, self.records()))
        pruned = records_to_prune(self.records(), keep, new_revision)
        for record in pruned:
            (self.history_dir / record.name).unlink(missing_ok=True)
        return replace(outcome, pruned=tuple(r.revision for r in pruned))

    def rollback(self, to: str | None = None, *, now: datetime | None = None) -> LocalOutcome:
        """Restore a recorded revision: `to` (a unique prefix), else the one applied before."""
        live_revision = revision_of(self.live_text().encode())
        records = self.records()
        record = (
            previous_record(records, live_revision) if to is None else resolve_revision(records, to)
        )
        config = parse_config(record.text, source=f"history record {record.name}")
        return self.apply(record.text, config, now=now)

    def history(self) -> list[str]:
        return history_table(self.records(), revision_of(self.live_text().encode()))

    def _record(self, text: str, applied_at: datetime) -> None:
        self.history_dir.mkdir(parents=True, exist_ok=True)
        path = self.history_dir / f"{revision_of(text.encode())}.yaml"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.rename(path)
        stamp = applied_at.timestamp()
        os.utime(path, (stamp, stamp))

    def _replace_live(self, text: str) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(text)
        tmp.rename(self.path)
