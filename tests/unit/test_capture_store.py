"""The capture store (capture/store.py): records written by a thread of their own into files
only their owner reads, rotated, bounded in count and age per writer; stats, purge and read."""

from __future__ import annotations

import os
import stat
import time

from specserve.capture import store
from specserve.capture.store import Bounds, CaptureWriter, Record, Sampled

BIG = Bounds(max_records=100_000, max_age_s=86_400)


def record(i: int, arm: str = "eagle3") -> Record:
    return Record(arm, "chat", [1, 2, i], [i, i + 1], "stop")


def write(writer: CaptureWriter, n: int, bounds: Bounds = BIG, start: int = 0) -> None:
    for i in range(start, start + n):
        assert writer.put(record(i, writer.directory.name), bounds)


def test_records_come_back_as_written_and_only_the_owner_may_read_them(tmp_path):
    written = []
    writer = CaptureWriter(tmp_path, "eagle3", "replica/1 x", on_written=written.append)
    write(writer, 5)
    writer.close()
    assert [r.prompt_token_ids[-1] for r in store.read(tmp_path)] == [0, 1, 2, 3, 4]
    assert sum(written) == 5
    (path,) = (tmp_path / "eagle3").iterdir()
    assert path.name == "replica_1_x-0.jsonl"  # the replica id made safe for a file name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "eagle3").stat().st_mode) == 0o700


def test_a_writer_keeps_at_most_max_records_dropping_the_oldest(tmp_path):
    bounds = Bounds(max_records=100, max_age_s=86_400)
    writer = CaptureWriter(tmp_path, "eagle3", "r1")
    write(writer, 1000, bounds)
    writer.close()
    kept = [r.prompt_token_ids[-1] for r in store.read(tmp_path)]
    assert 50 <= len(kept) <= 100
    assert kept == list(range(1000 - len(kept), 1000))  # the newest, in order
    other = CaptureWriter(tmp_path, "eagle3", "r2")  # another replica's shard is its own
    write(other, 10, bounds)
    other.close()
    assert len(list(store.read(tmp_path))) == len(kept) + 10


def test_files_older_than_max_age_are_deleted(tmp_path):
    now = [time.time()]
    writer = CaptureWriter(tmp_path, "eagle3", "r1", clock=lambda: now[0])
    bounds = Bounds(max_records=100, max_age_s=3600)  # 10 records a file
    write(writer, 30, bounds)
    writer.close()
    for path in (tmp_path / "eagle3").iterdir():  # written two hours ago
        os.utime(path, (now[0] - 7200, now[0] - 7200))
    writer = CaptureWriter(tmp_path, "eagle3", "r1", clock=lambda: now[0])
    write(writer, 1, bounds, start=100)
    writer.close()
    assert [r.prompt_token_ids[-1] for r in store.read(tmp_path)] == [100]


def test_a_stopped_replicas_files_age_out_through_the_replicas_that_run(tmp_path):
    gone = CaptureWriter(tmp_path, "eagle3", "stopped-replica")
    write(gone, 5)
    gone.close()
    (path,) = (tmp_path / "eagle3").iterdir()
    os.utime(path, (time.time() - 7200, time.time() - 7200))
    live = CaptureWriter(tmp_path, "eagle3", "running-replica")
    write(live, 1, Bounds(max_records=100, max_age_s=3600))
    live.close()
    assert [p.name for p in (tmp_path / "eagle3").iterdir()] == ["running-replica-0.jsonl"]


def test_a_store_that_cannot_be_written_drops_and_counts_but_does_not_raise(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    dropped = []
    writer = CaptureWriter(blocked, "eagle3", "r1", on_dropped=dropped.append)
    write(writer, 3)
    writer.close()
    assert sum(dropped) == 3


def test_stats_purge_and_a_line_cut_by_a_crash(tmp_path):
    for arm in ("eagle3", "eagle3.1"):
        writer = CaptureWriter(tmp_path, arm, "r1")
        write(writer, 4)
        writer.close()
    with (tmp_path / "eagle3" / "r1-0.jsonl").open("a") as f:
        f.write('{"arm": "eagle3", "endpo')  # a crash mid-line
    found = {s.arm: s for s in store.stats(tmp_path)}
    assert set(found) == {"eagle3", "eagle3.1"} and found["eagle3.1"].records == 4
    assert found["eagle3.1"].files == 1 and found["eagle3.1"].bytes > 0
    assert len(list(store.read(tmp_path, arm="eagle3"))) == 4  # the cut line skipped
    assert store.purge(tmp_path, arm="eagle3", older_than_s=3600) == 0  # all newer
    assert store.purge(tmp_path, arm="eagle3") == 5
    assert [s.arm for s in store.stats(tmp_path)] == ["eagle3.1"]
    assert store.purge(tmp_path) == 4 and store.stats(tmp_path) == []


def test_purging_everything_also_deletes_adapts_copies_and_keeps_its_drafters(tmp_path):
    writer = CaptureWriter(tmp_path, "eagle3", "r1")
    write(writer, 2)
    writer.close()
    work = tmp_path / "_adapt" / "work"
    (work / "captured").mkdir(parents=True)
    (work / "captured" / "shard-1.pt").write_bytes(b"token ids")
    (work / "rows.json").write_text("{}")
    (work / "candidates").mkdir()
    drafters = tmp_path / "_adapt" / "drafters"
    drafters.mkdir()
    (drafters / "config.json").write_text("{}")
    assert store.purge(tmp_path, arm="eagle3") == 2
    assert (work / "rows.json").exists()  # one arm's purge leaves the mixed copies
    assert store.purge(tmp_path) == 0
    assert not (work / "rows.json").exists() and not (work / "captured").exists()
    assert (work / "candidates").exists() and (drafters / "config.json").exists()


def test_bounds_and_key_travel_in_a_header_and_nothing_else_passes_for_them():
    sampled = Sampled(Bounds(max_records=500, max_age_s=60.0, max_bytes=1 << 20), "team-a")
    assert Sampled.from_header(sampled.header()) == sampled
    assert Sampled.from_header(Sampled(sampled.bounds).header()).key is None  # no keys
    for bad in (
        '{"max_records": 5, "max_age_s": 1, "key": 7}',
        "",
        "{}",
        "[1]",
        '{"max_records": 5, "max_age_s": 1, "max_bytes": 0}',
        '{"max_records": 0, "max_age_s": 1}',
        '{"max_records": 5, "max_age_s": "inf"}',
        '{"max_records": "x", "max_age_s": 1}',
    ):
        try:
            Sampled.from_header(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")


def test_a_directory_no_arm_can_be_named_is_not_an_arm(tmp_path):
    writer = CaptureWriter(tmp_path, "eagle3", "r1")
    write(writer, 3)
    writer.close()
    (tmp_path / "_adapt" / "drafters").mkdir(parents=True)  # `drafter adapt`'s, on Kubernetes
    (tmp_path / "_adapt" / "x-0.jsonl").write_text('{"not": "a record"}\n')
    assert [s.arm for s in store.stats(tmp_path)] == ["eagle3"]
    assert len(list(store.read(tmp_path))) == 3
    store.purge(tmp_path)
    assert (tmp_path / "_adapt" / "drafters").is_dir()


def test_a_writer_keeps_at_most_max_bytes_however_long_its_records(tmp_path):
    bounds = Bounds(max_records=100_000, max_age_s=86_400, max_bytes=20_000)
    writer = CaptureWriter(tmp_path, "eagle3", "r1")
    for i in range(400):  # ~250 bytes each: 100 KB written against a cap of 20 KB
        assert writer.put(Record("eagle3", "chat", [i] * 40, [i, i + 1], "stop"), bounds)
    dropped = []
    writer.on_dropped = dropped.append
    huge = Record("eagle3", "chat", list(range(1000)), [1], "stop")  # over a tenth of the cap
    assert writer.put(huge, bounds)
    writer.close()
    files = list((tmp_path / "eagle3").iterdir())
    assert sum(f.stat().st_size for f in files) <= 20_000
    assert all(f.stat().st_size <= 2_000 for f in files)  # rotated at a tenth of the cap
    kept = [r.prompt_token_ids[0] for r in store.read(tmp_path)]
    assert len(kept) >= 40 and kept == list(range(400 - len(kept), 400))  # the newest
    assert dropped == [1]  # the record a file could not hold, counted


def test_bounds_from_a_router_that_sends_no_byte_cap_nor_key_get_the_default():
    old = '{"max_records": 500, "max_age_s": 60.0}'
    assert Sampled.from_header(old) == Sampled(Bounds(500, 60.0, store.DEFAULT_MAX_BYTES), None)
