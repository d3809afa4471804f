"""API keys (wire/auth.py): the keys file format, digests only, and a comparison whose time says
nothing about how close a wrong key came to a real one."""

from __future__ import annotations

import statistics
import time

import pytest

from specserve.wire.auth import (
    MIN_KEY_LENGTH,
    Identity,
    KeyLimits,
    KeyRing,
    KeysFileError,
    digest,
    parse_keys,
)
from specserve.wire.errors import OpenAIError
from tests.unit.test_watch import finish_writing_while_the_reader_waits

KEY = "k" * 20 + "0123456789abcdef" * 4  # 84 characters


def test_a_keys_file_holds_named_and_bare_keys_as_digests():
    keys = parse_keys(f"# comment\n\nteam-a = {KEY}\n{KEY}x\n  {KEY}y  \n")
    assert keys == {"team-a": digest(KEY), "key-2": digest(KEY + "x"), "key-3": digest(KEY + "y")}
    assert all(KEY not in repr(v) for v in keys.values())


def test_a_keys_file_may_hold_digests_in_place_of_keys(tmp_path):
    import hashlib

    hexdigest = hashlib.sha256(KEY.encode()).hexdigest()
    (tmp_path / "api").write_text(f"team-a=sha256:{hexdigest}\nteam-b={KEY}b\n")
    ring = KeyRing(str(tmp_path / "api"), None)
    assert ring.identify(KEY) == Identity("team-a", admin=False)  # the key, not its digest
    assert ring.identify(f"sha256:{hexdigest}") is None
    assert ring.identify(KEY + "b") == Identity("team-b", admin=False)  # both forms at once


@pytest.mark.parametrize(
    "text, problem",
    [
        ("team-a=short", f"at least {MIN_KEY_LENGTH}"),
        (f"bad name={KEY}", "key name"),
        (f"a={KEY}\na={KEY}z", "appears twice"),
        (f"a={KEY} {KEY}", "without spaces"),
    ],
)
def test_a_bad_line_is_refused_by_its_number_never_its_text(text, problem):
    with pytest.raises(KeysFileError, match=problem) as found:
        parse_keys(text, source="keys")
    assert KEY not in str(found.value) and "short" not in str(found.value)
    assert "line" in str(found.value)


def test_identify_names_the_key_and_whether_it_is_an_admin_key(tmp_path):
    (tmp_path / "api").write_text(f"team-a={KEY}\n")
    (tmp_path / "admin").write_text(f"ops={KEY}-admin\n")
    ring = KeyRing(str(tmp_path / "api"), str(tmp_path / "admin"))
    assert ring.identify(KEY) == Identity("team-a", admin=False)
    assert ring.identify(KEY + "-admin") == Identity("ops", admin=True)
    assert ring.identify(KEY[:-1]) is None
    with pytest.raises(OpenAIError) as refused:
        ring.authenticate(f"Basic {KEY}")
    assert refused.value.status == 401


def test_a_refused_file_takes_no_new_key_and_drops_the_keys_it_no_longer_holds(tmp_path):
    path = tmp_path / "api"
    path.write_text(f"team-a={KEY}\nteam-b={KEY}b\n{KEY}c\n")
    ring = KeyRing(str(path), None)
    assert ring.refused() == {"api": False}
    # team-b revoked and team-c added, in a file with one bad line.
    path.write_text(f"team-a={KEY}\n{KEY}c\nteam-c={KEY}new\nbad name=x\n")
    ring.check()
    assert ring.refused() == {"api": True}
    assert ring.identify(KEY) == Identity("team-a", admin=False)
    assert ring.identify(KEY + "c") == Identity("key-3", admin=False)  # a bare key still held
    assert ring.identify(KEY + "b") is None  # revoked even though the file is refused
    assert ring.identify(KEY + "new") is None  # nothing new from a refused file
    path.write_text(f"team-a={KEY}\nteam-c={KEY}new\n")
    ring.check()
    assert ring.refused() == {"api": False} and ring.identify(KEY + "new") is not None


def test_no_keys_files_serves_without_keys_and_an_unreadable_one_refuses_all(tmp_path):
    assert KeyRing(None, None).authenticate(None) is None
    ring = KeyRing(str(tmp_path / "missing"), None)
    with pytest.raises(OpenAIError):
        ring.authenticate(f"Bearer {KEY}")


def test_a_keys_file_read_between_truncate_and_write_keeps_the_keys_read_before(
    tmp_path, monkeypatch
):
    path = tmp_path / "api"
    path.write_text(f"team-a={KEY}\n")
    ring = KeyRing(str(path), None)

    finish_writing_while_the_reader_waits(monkeypatch, path, f"team-a={KEY}\nteam-b={KEY}b\n")
    ring.check()
    assert ring.identify(KEY) == Identity("team-a", admin=False)  # not emptied by the torn read

    monkeypatch.undo()
    ring.check()
    assert ring.identify(KEY + "b") == Identity("team-b", admin=False)


def _time_per_call_ns(ring: KeyRing, key: str, calls: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(calls):
        ring.identify(key)
    return (time.perf_counter_ns() - started) / calls


def test_a_wrong_key_sharing_a_long_prefix_is_not_slower_to_refuse(tmp_path):
    """A comparison that stops at the first differing byte refuses a key that is a real key
    with one character added later than a key that shares nothing with any: the timing attack
    of CVE-2025-59425. Digests compared in full, against every key, take the same time."""
    (tmp_path / "api").write_text("".join(f"k{i}={KEY}{i}\n" for i in range(20)))
    ring = KeyRing(str(tmp_path / "api"), None)
    near, far = KEY + "9x", "z" * len(KEY) + "9x"  # 85 characters each, like the real keys
    near_ns, far_ns = [], []
    for _ in range(40):  # interleaved, so the machine's load falls on both alike
        near_ns.append(_time_per_call_ns(ring, near, 200))
        far_ns.append(_time_per_call_ns(ring, far, 200))
    ratio = statistics.median(near_ns) / statistics.median(far_ns)
    print(f"near {statistics.median(near_ns):.0f} ns, far {statistics.median(far_ns):.0f} ns")
    assert 0.85 < ratio < 1.15, ratio


def test_token_buckets_refill_over_a_minute():
    now = [0.0]
    limits = KeyLimits(clock=lambda: now[0])
    for _ in range(3):
        limits.admit("a", 3, None)
    with pytest.raises(OpenAIError) as refused:
        limits.admit("a", 3, None)
    assert refused.value.status == 429 and refused.value.headers["retry-after"] == "20"
    now[0] = 20.0  # a third of a minute: one request back
    limits.admit("a", 3, None)
    # A request reserves its most tokens; one larger than the bucket waits for a full bucket
    # and takes it below zero; what it did not use comes back.
    limits.admit("b", None, 100)
    assert limits.reserve("b", 100, 250) == 250
    with pytest.raises(OpenAIError):
        limits.admit("b", None, 100)
    limits.settle("b", 250, 100)  # 150 back: at zero
    with pytest.raises(OpenAIError):
        limits.reserve("b", 100, 1)
    now[0] = 20.0 + 60 * 0.5  # 50 tokens back
    with pytest.raises(OpenAIError):
        limits.reserve("b", 100, 51)
    assert limits.reserve("b", 100, 50) == 50
    assert limits.reserve("c", None, 10**6) == 0  # no token limit: nothing reserved
