"""API keys: who may send requests, and who may use the admin powers (forcing an arm).

Keys come from files (`SPECSERVE_API_KEYS_FILE`, `SPECSERVE_ADMIN_KEYS_FILE` locally; a Secret
mounted in every Ray pod on Kubernetes): one key a line, `name=key` or a bare key, `#` comments.
Only SHA-256 digests of the keys are held. A presented key's digest is compared with every
configured digest by `hmac.compare_digest`, with no early exit, so the time to refuse a key says
nothing about how close it came to one. A key has a *name*: logs and metrics carry the name,
never the key. An admin key is an API key too.

A file that changes is read again (rotation without a restart); one that cannot be read or holds
a bad line is refused with a logged reason (the line number, never its text) and the keys read
before stay in force. Keys files named but never read leave every request refused (fail closed).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from specserve.headers import RETRY_AFTER, WWW_AUTHENTICATE
from specserve.settle import stays_put
from specserve.wire.errors import OpenAIError

logger = logging.getLogger(__name__)

BEARER = "bearer "
# What a 401 tells the client to send (RFC 6750), in `WWW-Authenticate`.
CHALLENGE = 'Bearer realm="specserve"'
KEY_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
# A key shorter than this is refused: guessable within a rate limit's patience.
MIN_KEY_LENGTH = 16


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the line, never a key."""


@dataclass(frozen=True)
class Identity:
    """Who sent a request: the key's name, and whether it is an admin key."""

    name: str
    admin: bool = False


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# A keys file may hold a key's SHA-256 digest in its place (`name=sha256:<64 hex digits>`), so
# that the file on every pod's disk does not give the key away.
STORED_DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")


def stored_digest(key: str) -> bytes:
    """The digest a keys file's entry stands for: the digest it holds, or its key's."""
    held = STORED_DIGEST.fullmatch(key)
    return bytes.fromhex(held.group(1)) if held else digest(key)


def parse_keys(text: str, *, source: str = "<keys>") -> dict[str, bytes]:
    """Key name -> digest of the key, from a keys file's text. A bare key is named `key-N`
    (its place among the file's keys)."""
    found: dict[str, bytes] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition("=")
        if not sep:
            name, key = f"key-{len(found) + 1}", line
        name, key = name.strip(), key.strip()
        if not KEY_NAME_PATTERN.fullmatch(name):
            raise KeysFileError(f"{source}, line {number}: a key name is 1-64 of A-Z a-z 0-9 . _ -")
        if len(key) < MIN_KEY_LENGTH or any(c.isspace() for c in key):
            raise KeysFileError(
                f"{source}, line {number}: a key is at least {MIN_KEY_LENGTH} characters, "
                "without spaces"
            )
        if name in found:
            raise KeysFileError(f"{source}, line {number}: key name {name!r} appears twice")
        found[name] = stored_digest(key)
    return found


class KeysFile:
    """One keys file, read again when it changes (its inode, size or modification time: the
    kubelet swaps a Secret's files in by a symlink). A changed file that is refused takes no new
    key and keeps only the keys it still holds: revoking a key works even in a file with a typo."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.keys: dict[str, bytes] = {}
        self._seen: tuple[int, int, int] | None = None
        self.loaded = False  # read successfully at least once
        self.refused = False  # its newest version was refused
        self.check()

    def check(self) -> bool:
        """Read the file if it changed; True when new keys were taken."""
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            if self._seen != (0, 0, 0):
                logger.error("keys file %s cannot be read: %s", self.path, exc.strerror)
                self._seen = (0, 0, 0)
            return False
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if seen == self._seen:
            return False
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            self._seen = seen  # logged once; read again when the file changes
            logger.error("keys file %s cannot be read: %s", self.path, exc.strerror)
            return False
        if not stays_put(self.path, raw):
            return False  # being written: read again at the next check
        self._seen = seen
        try:
            keys = parse_keys(raw.decode(), source=str(self.path))
        except (UnicodeDecodeError, KeysFileError) as exc:
            self.refused = True
            held = _digests_held(raw.decode(errors="replace"))
            dropped = sorted(name for name, known in self.keys.items() if known not in held)
            self.keys = {name: known for name, known in self.keys.items() if known in held}
            logger.error(
                "keys file refused; no new key taken, the keys read before stay%s: %s",
                f" but those it no longer holds ({', '.join(dropped)})" if dropped else "",
                exc,
            )
            return False
        self.keys, self.loaded, self.refused = keys, True, False
        logger.info("keys file %s: %d keys (%s)", self.path, len(keys), ", ".join(sorted(keys)))
        return True


def _digests_held(text: str) -> set[bytes]:
    """The digests of every key a file's lines hold, each line read on its own (a bad line does
    not hide the good ones)."""
    held = set()
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            held.add(stored_digest(line.partition("=")[2].strip() if "=" in line else line))
    return held


class KeyRing:
    """The configured keys: public and admin. `None` files: no keys, every request is served
    (the default on a loopback address)."""

    def __init__(self, api_keys_file: str | None, admin_keys_file: str | None) -> None:
        self.files = {
            admin: KeysFile(path)
            for admin, path in ((False, api_keys_file), (True, admin_keys_file))
            if path
        }

    @property
    def enabled(self) -> bool:
        return bool(self.files)

    def check(self) -> None:
        for keys_file in self.files.values():
            keys_file.check()

    def refused(self) -> dict[str, bool]:
        """Whether each configured keys file (`api`, `admin`) is refused now."""
        return {"admin" if admin else "api": f.refused for admin, f in self.files.items()}

    def identify(self, key: str) -> Identity | None:
        """The identity of a presented key, None for no configured key. Every digest is
        compared, whichever matches."""
        presented = digest(key)
        found: Identity | None = None
        for admin, keys_file in self.files.items():
            for name, known in keys_file.keys.items():
                if hmac.compare_digest(presented, known):
                    found = Identity(name, admin)
        return found

    def authenticate(self, authorization: str | None) -> Identity | None:
        """The identity behind an `Authorization` header; None with no keys configured.
        Raises a 401 OpenAIError for a missing or wrong key."""
        if not self.enabled:
            return None
        if not authorization or not authorization.lower().startswith(BEARER):
            raise unauthorized(
                "missing API key: send it as `Authorization: Bearer KEY`", "missing_api_key"
            )
        identity = self.identify(authorization[len(BEARER) :].strip())
        if identity is None:
            raise unauthorized("incorrect API key provided", "invalid_api_key")
        return identity


def unauthorized(message: str, code: str) -> OpenAIError:
    return OpenAIError(
        401,
        message,
        code=code,
        type="invalid_request_error",
        headers={WWW_AUTHENTICATE: CHALLENGE},
    )


def admin_required(what: str) -> OpenAIError:
    return OpenAIError(
        403, f"{what} needs an admin key", code="admin_key_required", type="permission_error"
    )


@dataclass
class TokenBucket:
    """`rate_per_minute` refills evenly, up to a minute's worth; a cost may take it below zero
    (a request larger than a minute's worth), which then waits until it refills."""

    rate_per_minute: float
    level: float = field(init=False)
    at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.rate_per_minute

    def refill(self, now: float) -> None:
        self.level = min(
            self.rate_per_minute, self.level + (now - self.at) * self.rate_per_minute / 60
        )
        self.at = now

    def wait_s(self, now: float, need: float) -> float:
        """Seconds until `need` is in the bucket (0: now)."""
        self.refill(now)
        return max(0.0, (need - self.level) * 60 / self.rate_per_minute)

    def take(self, now: float, amount: float) -> None:
        self.refill(now)
        self.level -= amount

    def give_back(self, now: float, amount: float) -> None:
        self.refill(now)
        self.level = min(self.rate_per_minute, self.level + amount)


class KeyLimits:
    """Per key name: requests per minute and output tokens per minute, token buckets (per HTTP
    proxy). A request is refused (429 + Retry-After) while either bucket is empty; once its body
    is read it reserves the most tokens it may generate, and gets back what it did not use."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, name: str, kind: str, rate: float | None) -> TokenBucket | None:
        if rate is None:
            self._buckets.pop((name, kind), None)
            return None
        bucket = self._buckets.get((name, kind))
        if bucket is None or bucket.rate_per_minute != rate:
            bucket = self._buckets[(name, kind)] = TokenBucket(rate, at=self.clock())
        return bucket

    def admit(self, name: str, requests_per_minute: float | None, tokens_per_minute: float | None):
        """Take one request from the key's bucket, or raise 429 saying when to come back."""
        now = self.clock()
        requests = self._bucket(name, "requests", requests_per_minute)
        tokens = self._bucket(name, "tokens", tokens_per_minute)
        _refuse_for(
            name,
            max(
                requests.wait_s(now, 1) if requests else 0.0,
                tokens.wait_s(now, 1) if tokens else 0.0,
            ),
        )
        if requests:
            requests.take(now, 1)

    def reserve(self, name: str, tokens_per_minute: float | None, tokens: int) -> int:
        """Take `tokens`, the most the request may generate, from the key's token bucket, or
        raise 429 while the bucket holds fewer (a request larger than a minute's worth waits for
        a full bucket). -> what was taken, for `settle`."""
        bucket = self._bucket(name, "tokens", tokens_per_minute)
        if bucket is None:
            return 0
        now = self.clock()
        _refuse_for(name, bucket.wait_s(now, min(tokens, bucket.rate_per_minute)))
        bucket.take(now, tokens)
        return tokens

    def settle(self, name: str, reserved: int, used: int) -> None:
        """Give back what a reservation did not use (nothing when it used more)."""
        bucket = self._buckets.get((name, "tokens"))
        if bucket is not None and reserved > used:
            bucket.give_back(self.clock(), reserved - used)


def _refuse_for(name: str, wait_s: float) -> None:
    if wait_s > 0:
        retry_after = str(max(1, round(wait_s + 0.5)))
        raise OpenAIError(
            429,
            f"API key {name!r} is over its rate limit; retry after {retry_after} s",
            code="rate_limit_exceeded",
            headers={RETRY_AFTER: retry_after},
        )
