"""Where the live router config is kept, with its history: apply, history and rollback, written
once for both places it lives.

A store is a local file (`local_store.LocalStore`, what `specserve serve` runs from) or a
release's ConfigMap on Kubernetes (`cluster_store.ClusterStore`, mounted into every Ray pod). Each
says how to read the live config, write it, keep a history record and, on Kubernetes, change the
engines a revision changes; the order of those steps and the decisions between them (what to
record, which revision a rollback restores, which records to prune) are `ConfigStore`'s.

Every revision applied is recorded (its bytes, and when it was last applied); so is the revision
live before the first apply, so a rollback can always return to where it started. A revision is
a hash of the bytes, so a rollback restores it exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from specserve.config.changes import ArmChanges
from specserve.config.schema import ConfigError, RouterConfig, parse_config, revision_of

DEFAULT_KEEP = 10


class StoreError(Exception):
    """The store cannot do what was asked (no such revision, no history yet, a refused write);
    the message says why."""


# History records.


@dataclass(frozen=True)
class Record:
    """One history record: a revision's bytes and when it was last applied."""

    name: str
    revision: str
    applied_at: datetime
    text: str


def newest_first(records: Iterable[Record]) -> list[Record]:
    return sorted(records, key=lambda r: (r.applied_at, r.name), reverse=True)


def next_applied_at(now: datetime, records: Iterable[Record]) -> datetime:
    """`now`, or just after the newest record when a clock is behind: the revision applied
    last must sort first."""
    latest = max((r.applied_at for r in records), default=None)
    if latest is not None and latest >= now:
        return latest + timedelta(microseconds=1)
    return now


def records_to_prune(records: Sequence[Record], keep: int, live_revision: str) -> list[Record]:
    """The records beyond the `keep` applied most recently, never the live revision's."""
    if keep < 1:
        raise ValueError("keep at least one record")
    return [r for r in newest_first(records)[keep:] if r.revision != live_revision]


def previous_record(records: Sequence[Record], live_revision: str) -> Record:
    """What a rollback without `--to` restores: the record applied most recently other than the
    live one (after a rollback, the revision it rolled back from)."""
    for record in newest_first(records):
        if record.revision != live_revision:
            return record
    raise StoreError(
        f"no earlier revision to roll back to: the history holds only {live_revision}"
        if records
        else "no history records yet: `specserve config apply` records them"
    )


def resolve_revision(records: Sequence[Record], wanted: str) -> Record:
    """The record whose revision is `wanted` or starts with it (a unique prefix)."""
    known = ", ".join(r.revision for r in newest_first(records)) or "none"
    wanted = wanted.strip().lower()
    if not wanted:
        raise StoreError(f"name a revision; known revisions: {known}")
    exact = [r for r in records if r.revision == wanted]
    matches = exact or [r for r in records if r.revision.startswith(wanted)]
    if not matches:
        raise StoreError(f"no revision {wanted!r} in the history; known revisions: {known}")
    if len(matches) > 1:
        which = ", ".join(sorted(r.revision for r in matches))
        raise StoreError(
            f"revision {wanted!r} is ambiguous (matches {which}); known revisions: {known}"
        )
    return matches[0]


def describe_arms(text: str) -> str:
    """`name=weight ...` of a record, or why it cannot be read."""
    try:
        config = parse_config(text)
    except ConfigError as exc:
        return f"(invalid: {exc})"
    return " ".join(f"{arm.name}={arm.weight:g}" for arm in config.arms)


def history_table(records: Sequence[Record], live_revision: str) -> list[str]:
    """Newest first: revision, applied-at, arms with weights, and which one is live."""
    rows = [
        (
            r.revision,
            r.applied_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "live" if r.revision == live_revision else "",
            describe_arms(r.text),
        )
        for r in newest_first(records)
    ]
    header = ("REVISION", "APPLIED AT", "LIVE", "ARMS")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
        + "  "
        + row[3]
        for row in [header, *rows]
    ]


# The store.


@dataclass(frozen=True)
class Live:
    """The live config as one read of a store found it."""

    text: str
    where: str  # the place, for messages: a path, or `ConfigMap NAME (namespace NS)`
    written: datetime | None  # when it was last written, as far as the store knows
    engines_where: str = "Ray Serve"  # what runs the arms' engines, for messages
    source: Any = None  # the store's own objects read with it, which its writes build on


@dataclass(frozen=True)
class Outcome:
    """What an apply or a rollback found and did."""

    where: str
    engines_where: str
    old_revision: str
    new_revision: str
    old_config: RouterConfig | None  # None when the live bytes are not a valid config
    new_config: RouterConfig
    engines: ArmChanges = field(default_factory=ArmChanges)
    pruned: tuple[str, ...] = ()  # revisions whose records were deleted

    @property
    def changed(self) -> bool:
        return self.old_revision != self.new_revision or bool(self.engines)


class ConfigStore(ABC):
    """The live config and its history records in one place. `check`, when given, is asked
    about every config applied (it raises to refuse one) before anything is written."""

    def __init__(self, check: Callable[[RouterConfig], None] | None = None) -> None:
        self.check = check

    # What a store is: how it reads and writes.

    @abstractmethod
    def read(self) -> Live:
        """The live config."""

    @abstractmethod
    def records(self) -> list[Record]:
        """Every history record."""

    @abstractmethod
    def engine_changes(self, live: Live, old: RouterConfig | None, new: RouterConfig) -> ArmChanges:
        """The engines that switching from `live` to `new` touches."""

    @abstractmethod
    def write_live(self, live: Live, text: str) -> None:
        """Make `text` the live config; a store that can tell fails when `live` is stale."""

    @abstractmethod
    def write_record(self, live: Live, text: str, applied_at: datetime) -> Record:
        """Record `text` as applied at `applied_at` (a record of it may exist already)."""

    @abstractmethod
    def delete_record(self, record: Record) -> None: ...

    def admit(self, live: Live, config: RouterConfig) -> None:
        """Raise to refuse `config` before anything is written."""
        if self.check is not None:
            self.check(config)

    @abstractmethod
    def write_engines(self, live: Live, config: RouterConfig) -> None:
        """Change the engines `engine_changes` named."""

    def notes(self, outcome: Outcome) -> list[str]:
        """What happens next, said after a switch."""
        return []

    # What every store does, written once.

    def live_text(self) -> str:
        return self.read().text

    def apply(
        self,
        text: str,
        config: RouterConfig,
        *,
        keep: int = DEFAULT_KEEP,
        now: datetime | None = None,
    ) -> Outcome:
        """Make `text` (already validated as `config`) the live config, record it, prune the
        history to the `keep` records applied last."""
        outcome, records = self._switch(self.read(), text, config, now=now)
        if not outcome.changed:
            return outcome
        pruned = records_to_prune(records, keep, outcome.new_revision)
        for record in pruned:
            self.delete_record(record)
        return replace(outcome, pruned=tuple(r.revision for r in pruned))

    def rollback(self, to: str | None = None, *, now: datetime | None = None) -> Outcome:
        """Restore a recorded revision: `to` (a unique prefix), else the one applied before."""
        live = self.read()
        live_revision = revision_of(live.text.encode())
        records = self.records()
        record = (
            previous_record(records, live_revision) if to is None else resolve_revision(records, to)
        )
        config = parse_config(record.text, source=f"history record {record.name}")
        return self._switch(live, record.text, config, now=now, records=records)[0]

    def history(self) -> list[str]:
        """The history table, and a note when the live config has no record yet."""
        live = self.read()
        live_revision = revision_of(live.text.encode())
        records = self.records()
        lines = history_table(records, live_revision)
        if live_revision not in {r.revision for r in records}:
            lines.append(
                f"live revision {live_revision} ({live.where}) has no record yet; the next "
                "apply or rollback records it"
            )
        return lines

    def _switch(
        self,
        live: Live,
        text: str,
        config: RouterConfig,
        *,
        now: datetime | None,
        records: list[Record] | None = None,
    ) -> tuple[Outcome, list[Record]]:
        """Make `text` live in place of `live` and its arms run, recording both the config that
        was live and the new one (`records`: the history as the caller read it with `live`).
        Returns the outcome and the records as they are now.

        Order: the live config is recorded first (so it can be restored whatever fails next),
        then it changes, then its record is stamped, then the engines. The routers leave an arm
        that is not running out of the selection, so a new arm waits for its engine and a
        removed one stops getting traffic before its engine goes.
        """
        self.admit(live, config)
        old_revision, new_revision = revision_of(live.text.encode()), revision_of(text.encode())
        try:
            old_config: RouterConfig | None = parse_config(live.text)
        except ConfigError:
            old_config = None
        outcome = Outcome(
            where=live.where,
            engines_where=live.engines_where,
            old_revision=old_revision,
            new_revision=new_revision,
            old_config=old_config,
            new_config=config,
            engines=self.engine_changes(live, old_config, config),
        )
        if records is None:
            records = self.records()
        if not outcome.changed:
            return outcome, records
        now = now or datetime.now(UTC)
        by_revision = {r.revision: r for r in records}
        if old_revision not in by_revision:
            # Installed, or written by hand: recorded with the time it was written.
            written = min(live.written or now, now)
            by_revision[old_revision] = self.write_record(live, live.text, written)
        if old_revision != new_revision:
            self.write_live(live, text)
        applied_at = next_applied_at(now, by_revision.values())
        by_revision[new_revision] = self.write_record(live, text, applied_at)
        if outcome.engines:
            self.write_engines(live, config)
        return outcome, list(by_revision.values())
