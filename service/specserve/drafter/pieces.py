"""A prepared target and the build's prompts in pieces of bounded size, for a GPU machine that
takes files a few tens of MB at a time and can download nothing.

    python -m specserve.drafter.pieces pack --target DIR --prompts prompts.jsonl --out DIR \\
        --piece-mb 62                           # here: DIR/piece.0 ... and DIR/manifest.json
    python -m specserve.drafter.pieces unpack --pieces DIR --target DIR --prompts prompts.jsonl

bf16 weights barely compress as they are (their low bytes not at all), but their high bytes
(sign and most of the exponent) do: the weights are stored as high bytes, xz-compressed
(SmolLM2-135M: 135 MB -> 49 MB), then low bytes as they are. The target's 269 MB travel as
184 MB, in three pieces of at most 62 MB instead of five. `unpack` needs numpy and the standard
library; it checks the weights' sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import struct
import tarfile
from pathlib import Path

import numpy as np

WEIGHTS = "model.safetensors"


def pack(target: Path, prompts: Path, out: Path, piece_bytes: int) -> list[Path]:
    raw = (target / WEIGHTS).read_bytes()
    header = 8 + struct.unpack("<Q", raw[:8])[0]
    body = np.frombuffer(raw[header:], dtype=np.uint8)
    if len(body) % 2:
        raise ValueError(f"{target / WEIGHTS}: not 2-byte weights (bf16 or float16)")
    rest = io.BytesIO()
    with tarfile.open(fileobj=rest, mode="w") as tar:
        for f in sorted(target.iterdir()):
            if f.is_file() and f.name != WEIGHTS:
                tar.add(f, arcname=f.name)
    segments = {
        "files.tar.xz": lzma.compress(rest.getvalue()),
        "prompts.jsonl.xz": lzma.compress(prompts.read_bytes()),
        "header": raw[:header],
        "high.xz": lzma.compress(body[1::2].tobytes(), preset=6),
        "low": body[0::2].tobytes(),
    }
    blob = b"".join(segments.values())
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "segments": [[name, len(data)] for name, data in segments.items()],
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    paths = []
    for i in range(0, len(blob), piece_bytes):
        paths.append(out / f"piece.{i // piece_bytes}")
        paths[-1].write_bytes(blob[i : i + piece_bytes])
    return paths


def unpack(pieces: Path, target: Path, prompts: Path) -> None:
    manifest = json.loads((pieces / "manifest.json").read_text())
    files = sorted(pieces.glob("piece.*"), key=lambda p: int(p.suffix[1:]))
    blob = b"".join(p.read_bytes() for p in files)
    parts, at = {}, 0
    for name, size in manifest["segments"]:
        parts[name] = blob[at : at + size]
        at += size
    if at != len(blob):
        raise ValueError(f"the pieces hold {len(blob)} bytes, the manifest {at}: one is missing")
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(parts["files.tar.xz"]))) as tar:
        tar.extractall(target, filter="data")
    prompts.write_bytes(lzma.decompress(parts["prompts.jsonl.xz"]))
    high = np.frombuffer(lzma.decompress(parts["high.xz"]), dtype=np.uint8)
    body = np.empty(2 * len(high), dtype=np.uint8)
    body[0::2], body[1::2] = np.frombuffer(parts["low"], dtype=np.uint8), high
    raw = parts["header"] + body.tobytes()
    if hashlib.sha256(raw).hexdigest() != manifest["sha256"]:
        raise ValueError("the rebuilt weights' sha256 differs from the manifest's")
    (target / WEIGHTS).write_bytes(raw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    pack_p = sub.add_parser("pack", help="the target and prompts as pieces and a manifest")
    pack_p.add_argument("--target", type=Path, required=True)
    pack_p.add_argument("--prompts", type=Path, required=True)
    pack_p.add_argument("--out", type=Path, required=True)
    pack_p.add_argument("--piece-mb", type=float, default=62.0)
    unpack_p = sub.add_parser("unpack", help="rebuild them (checks the weights' sha256)")
    unpack_p.add_argument("--pieces", type=Path, required=True, help="pieces and manifest.json")
    unpack_p.add_argument("--target", type=Path, required=True)
    unpack_p.add_argument("--prompts", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "pack":
        paths = pack(args.target, args.prompts, args.out, int(args.piece_mb * 1e6))
        print(f"{len(paths)} pieces and manifest.json in {args.out}")
    else:
        unpack(args.pieces, args.target, args.prompts)
        print(f"target at {args.target} (sha256 checked), prompts at {args.prompts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
