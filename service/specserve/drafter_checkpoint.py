"""A drafter checkpoint's tensors, read from its safetensors headers: whether one checkpoint's
weights can take another's place in a running engine (engine/drafter_reload.py), checked before
a config that asks for it is applied (config/checks.py) and when the loop promotes (loop.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def safetensors_files(checkpoint: str | Path) -> list[Path]:
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {checkpoint}")
    return files


def checkpoint_shapes(checkpoint: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the safetensors headers alone (no weights read)."""
    shapes = {}
    for file in safetensors_files(checkpoint):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        shapes.update(
            {name: tuple(t["shape"]) for name, t in header.items() if name != "__metadata__"}
        )
    return shapes


def misfit(checkpoint: str | Path, started_from: str | Path) -> str | None:
    """Why `checkpoint` cannot replace the weights of the drafter loaded from `started_from`
    (other tensor names or shapes), None when it can."""
    expected, found = checkpoint_shapes(started_from), checkpoint_shapes(checkpoint)
    if found == expected:
        return None
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    reshaped = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
    what = [
        f"{label} {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
        for label, names in (("lacks", missing), ("adds", extra), ("reshapes", reshaped))
        if names
    ]
    return f"{checkpoint} does not fit the drafter of {started_from}: it {'; '.join(what)}"


def interchangeable(checkpoint: str | Path, started_from: str | Path) -> bool:
    """Whether an engine started with the drafter at `started_from` runs the drafter at
    `checkpoint` once it has loaded its weights: two local checkpoints with the same tensors
    and the same config."""
    a, b = Path(checkpoint), Path(started_from)
    if not ((a / "config.json").is_file() and (b / "config.json").is_file()):
        return False
    try:
        if misfit(a, b) is not None:
            return False
    except FileNotFoundError:
        return False
    return json.loads((a / "config.json").read_text()) == json.loads(
        (b / "config.json").read_text()
    )
