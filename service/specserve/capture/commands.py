"""`specserve capture stats | purge`: what the capture store holds, and deleting it."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from specserve.capture.store import purge, stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="capture_command", required=True)
    stats_p = sub.add_parser("stats", help="records, files and bytes kept per arm")
    purge_p = sub.add_parser("purge", help="delete captured records")
    purge_p.add_argument("--arm", help="only this arm's (default: every arm's)")
    purge_p.add_argument(
        "--older-than-s", type=float, help="only files last written longer ago than this"
    )
    for p in (stats_p, purge_p):
        p.add_argument(
            "--dir",
            type=Path,
            help="the capture store (default: $SPECSERVE_CAPTURE_DIR, else <cache_dir>/capture)",
        )


def run(args: argparse.Namespace) -> int:
    from specserve.config.settings import get_settings

    directory = args.dir or get_settings().capture_path()
    if args.capture_command == "stats":
        found = stats(directory)
        if not found:
            print(f"{directory}: nothing captured")
            return 0
        print(f"{directory}:")
        print(f"{'arm':<20} {'records':>9} {'files':>6} {'MiB':>8}  oldest -> newest (UTC)")
        for arm in found:
            span = f"{_when(arm.oldest)} -> {_when(arm.newest)}"
            print(
                f"{arm.arm:<20} {arm.records:>9} {arm.files:>6} {arm.bytes / 2**20:>8.2f}  {span}"
            )
        return 0
    deleted = purge(directory, arm=args.arm, older_than_s=args.older_than_s)
    print(f"{directory}: deleted {deleted} record(s)")
    return 0


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%d %H:%M")
