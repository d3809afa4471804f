"""Tell a file being written in place from one that is written.

An editor or `Path.write_text` truncates a file, then writes it, and a read in between finds it
empty or cut short. Kubernetes swaps ConfigMap and Secret files in by one rename, a local file
need not be: so new bytes are taken only when a second read a moment later finds the same.
"""

from __future__ import annotations

import time
from pathlib import Path

# Far longer than a truncate-then-write takes, far shorter than any poll interval.
SETTLE_S = 0.05


def stays_put(path: Path, raw: bytes) -> bool:
    """Whether `path` still holds `raw` after SETTLE_S: False while it is being written."""
    time.sleep(SETTLE_S)
    try:
        return path.read_bytes() == raw
    except OSError:
        return False
