"""The capture store: sampled requests' token ids, kept on disk to adapt drafters from.

Layout: `<dir>/<arm>/<shard>-<n>.jsonl`, one shard name per writer (an engine replica), numbered
files rotated every `ROTATE_RECORDS` records (fewer for a small `max_records`); a file is
complete once the next one is begun.
One JSON object a line (`Record`). Files are written by one thread per writer, never on an
event loop, readable by their owner only (they hold prompts: token ids decode to the text).

Bounds, per writer: at most `max_records` records and `max_bytes` bytes (the oldest files are
deleted first; a file is also rotated once it holds a tenth of `max_bytes`, so one long-context
record after another cannot grow a file past the cap) and no file older than `max_age_s`
(checked on every rotation and every `PRUNE_EVERY_S`); a writer also
deletes the arm's files of other shards once they are older than `max_age_s`, so a stopped
replica's records age out too. A writer
whose queue is full drops the record and counts it: capture never slows serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SUFFIX = ".jsonl"
ROTATE_RECORDS = 1000
PRUNE_EVERY_S = 60.0
QUEUE_SIZE = 1024
DEFAULT_MAX_BYTES = 1 << 30  # per engine replica, also the config's default (CaptureConfig)
# A shard's files: `<shard>-<n>.jsonl`; the shard is a replica's id, made safe for a file name.
_FILE = re.compile(r"^(?P<shard>[A-Za-z0-9._-]+)-(?P<n>\d+)\.jsonl$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass
class Record:
    """One answer of a sampled request: what the target was given and what it produced."""

    arm: str
    endpoint: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None = None
    at: float = field(default_factory=time.time)
    # The sampling fields the request set (temperature, top_p, top_k; {}: the engine's
    # defaults for all three); None in records captured before they were kept.
    sampling: dict[str, float] | None = None
    # The name of the API key that sent the request (wire/auth.py); None without keys, and in
    # records captured before it was kept. Adapt bounds each key's share of what it learns.
    key: str | None = None
    # The request's prompt digest (wire/requests.py `prompt_digest`); None in records captured
    # before it was kept. The loop leaves the A/B's repeats of training prompts out by it.
    prompt_digest: str | None = None


@dataclass(frozen=True)
class Bounds:
    """How much one writer keeps: the arm's `capture` settings, sent with each sampled request
    (`Sampled`) so a change applies without restarting an engine."""

    max_records: int
    max_age_s: float
    max_bytes: int = DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class Sampled:
    """What the dispatch tells an arm of a request in its capture sample (the
    `x-specserve-capture` header): the store's bounds and the name of the key that sent it."""

    bounds: Bounds
    key: str | None = None
    prompt_digest: str | None = None

    def header(self) -> str:
        return json.dumps({**asdict(self.bounds), "key": self.key, "prompt": self.prompt_digest})

    @classmethod
    def from_header(cls, value: str) -> Sampled:
        """What a header carries (one without `max_bytes` or `key`, from a router of an earlier
        release, gets the default and no key); ValueError for anything else."""
        try:
            found = json.loads(value)
            bounds = Bounds(
                int(found["max_records"]),
                float(found["max_age_s"]),
                int(found.get("max_bytes", DEFAULT_MAX_BYTES)),
            )
            key = found.get("key")
            prompt = found.get("prompt")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not capture bounds: {value[:100]!r}") from exc
        if (
            bounds.max_records < 1
            or bounds.max_bytes < 1
            or not 0 < bounds.max_age_s < float("inf")
        ):
            raise ValueError(f"capture bounds out of range: {value[:100]!r}")
        if key is not None and not isinstance(key, str):
            raise ValueError(f"capture key not a name: {value[:100]!r}")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"capture prompt digest not a string: {value[:100]!r}")
        return cls(bounds, key, prompt)


def shard_name(replica_id: str) -> str:
    return _UNSAFE.sub("_", replica_id)[:100] or "replica"


class CaptureWriter:
    """Appends records to one shard from a thread of its own."""

    def __init__(
        self,
        directory: Path,
        arm: str,
        shard: str,
        *,
        on_written: Callable[[int], None] = lambda n: None,
        on_dropped: Callable[[int], None] = lambda n: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory / arm
        self.shard = shard_name(shard)
        self.on_written, self.on_dropped, self.clock = on_written, on_dropped, clock
        self._queue: queue.Queue[tuple[Record, Bounds] | None] = queue.Queue(QUEUE_SIZE)
        self._thread = threading.Thread(target=self._run, name="specserve-capture", daemon=True)
        self._thread.start()

    def put(self, record: Record, bounds: Bounds) -> bool:
        """Queue a record; False (and counted as dropped) when the writer is behind."""
        try:
            self._queue.put_nowait((record, bounds))
        except queue.Full:
            self.on_dropped(1)
            return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        out = None
        written, size, last_prune = 0, 0, 0.0
        while True:
            item = self._queue.get()
            if item is None:
                break
            record, bounds = item
            try:
                line = json.dumps(asdict(record), separators=(",", ":")) + "\n"
                if len(line) > bounds.max_bytes // 10:  # it would be a file of its own
                    self.on_dropped(1)
                    continue
                full = size + len(line) > _rotate_bytes(bounds)
                if out is None or written >= _rotate_at(bounds) or full:
                    if out is not None:
                        out.close()
                    out, written, size = self._next_file(), 0, 0
                    last_prune = self._prune(bounds)
                elif self.clock() - last_prune > PRUNE_EVERY_S:
                    last_prune = self._prune(bounds)
                out.write(line)
                out.flush()
                written += 1
                size += len(line)
                self.on_written(1)
            except OSError:
                logger.exception("capture: cannot write under %s; record dropped", self.directory)
                self.on_dropped(1)
                out = None
        if out is not None:
            out.close()

    def _next_file(self):  # noqa: ANN202  # a text file
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        numbers = [n for shard, n, _ in _files(self.directory) if shard == self.shard]
        path = self.directory / f"{self.shard}-{max(numbers, default=-1) + 1}{SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        return os.fdopen(fd, "w", encoding="utf-8")

    def _prune(self, bounds: Bounds) -> float:
        """Delete this shard's files past the bounds: too old, or beyond `max_records` or
        `max_bytes` (oldest first; the newest file, being written, stays, with room kept for
        it). Files of other shards (replicas that stopped, or others of the arm) go once they
        are too old."""
        now = self.clock()
        files = list(_files(self.directory))
        for shard, _, path in files:
            if shard != self.shard:
                with contextlib.suppress(FileNotFoundError):
                    if now - path.stat().st_mtime > bounds.max_age_s:
                        path.unlink(missing_ok=True)
        mine = sorted((n, path) for shard, n, path in files if shard == self.shard)
        kept, kept_bytes = 0, 0
        for _, path in reversed(mine[:-1]):
            try:
                info = path.stat()
                records = _count_lines(path)
            except FileNotFoundError:
                continue
            too_old = now - info.st_mtime > bounds.max_age_s
            too_many = kept + records > bounds.max_records - _rotate_at(bounds)
            too_big = kept_bytes + info.st_size > bounds.max_bytes - _rotate_bytes(bounds)
            if too_old or too_many or too_big:
                path.unlink(missing_ok=True)
            else:
                kept, kept_bytes = kept + records, kept_bytes + info.st_size
        return now


def _rotate_at(bounds: Bounds) -> int:
    """Records per file: small enough that the files kept and the one being written stay
    within `max_records` together."""
    return max(1, min(ROTATE_RECORDS, bounds.max_records // 10))


def _rotate_bytes(bounds: Bounds) -> int:
    """Bytes per file, likewise within `max_bytes`."""
    return max(1, bounds.max_bytes // 10)


def _files(directory: Path) -> Iterator[tuple[str, int, Path]]:
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return
    for path in entries:
        match = _FILE.match(path.name)
        if match:
            yield match["shard"], int(match["n"]), path


def _count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


@dataclass
class ArmStats:
    arm: str
    records: int
    files: int
    bytes: int
    oldest: float | None
    newest: float | None


def stats(directory: Path) -> list[ArmStats]:
    """What the store holds, per arm."""
    found = []
    for arm_dir in sorted(p for p in _dirs(directory)):
        paths = [path for _, _, path in _files(arm_dir)]
        if not paths:
            continue
        times = [path.stat().st_mtime for path in paths]
        found.append(
            ArmStats(
                arm=arm_dir.name,
                records=sum(_count_lines(path) for path in paths),
                files=len(paths),
                bytes=sum(path.stat().st_size for path in paths),
                oldest=min(times),
                newest=max(times),
            )
        )
    return found


def purge(directory: Path, arm: str | None = None, older_than_s: float | None = None) -> int:
    """Delete captured files (of one arm, or all; only those older than `older_than_s` if set),
    and the copies `drafter adapt` keeps beside them (`_adapt`) when all are purged; returns how
    many records were deleted."""
    now = time.time()
    deleted = 0
    if arm is None:
        for work in _work_dirs(directory):
            forget_copies(work, older_than_s)
    for arm_dir in _dirs(directory):
        if arm is not None and arm_dir.name != arm:
            continue
        for _, _, path in list(_files(arm_dir)):
            if older_than_s is not None and now - path.stat().st_mtime <= older_than_s:
                continue
            deleted += _count_lines(path)
            path.unlink(missing_ok=True)
    return deleted


# What `drafter adapt` copies of the captured records into its work directory: the rows it
# trains and validates on, and their hidden-state shards (drafter/adapt.py).
CAPTURED_COPIES = ("rows.json", "captured", "captured-validation")


def forget_copies(work: Path, older_than_s: float | None = None) -> None:
    """Delete the copies of captured records in an adapt work directory (only those older than
    `older_than_s` if set)."""
    now = time.time()
    for name in CAPTURED_COPIES:
        path = work / name
        with contextlib.suppress(FileNotFoundError):
            if older_than_s is not None and now - path.stat().st_mtime <= older_than_s:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _work_dirs(directory: Path) -> list[Path]:
    """Work directories of `drafter adapt` kept in the store (a `--work-dir` under a `_` directory
    of it): any directory under a `_` one that holds one of the captured copies."""
    found = []
    for root in directory.glob("_*"):
        for candidate in [root, *root.rglob("*")]:
            if candidate.is_dir() and any((candidate / n).exists() for n in CAPTURED_COPIES):
                found.append(candidate)
    return found


def read(directory: Path, arm: str | None = None) -> Iterator[Record]:
    """Every record kept (of one arm, or all), file by file; a line cut by a crash is skipped."""
    for arm_dir in _dirs(directory):
        if arm is not None and arm_dir.name != arm:
            continue
        for _, _, path in sorted(_files(arm_dir), key=lambda f: (f[0], f[1])):
            with path.open(encoding="utf-8") as f:
                for line in f:
                    try:
                        yield Record(**json.loads(line))
                    except (ValueError, TypeError):
                        continue


def _dirs(directory: Path) -> list[Path]:
    """The arms' directories. A name no arm can have (`_...`) is not one: `drafter adapt`
    keeps its accepted drafters beside the records there on Kubernetes (`_adapt`)."""
    try:
        return sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("_"))
    except FileNotFoundError:
        return []
