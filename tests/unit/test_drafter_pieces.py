"""The target in pieces and back: byte for byte, and a lost piece or a changed byte is refused."""

import pytest
import torch
from safetensors.torch import save_file

from specserve.drafter import pieces


@pytest.fixture
def target(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    g = torch.Generator().manual_seed(0)
    weights = {f"layer{i}": torch.randn(64, 96, generator=g).bfloat16() for i in range(8)}
    save_file(weights, target / "model.safetensors")
    (target / "config.json").write_text('{"hidden_size": 96}')
    (target / "tokenizer.json").write_text('{"model": "tiny"}')
    return target


def test_pieces_rebuild_the_target_and_the_prompts_byte_for_byte(target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"split": "train"}\n' * 50)
    made = pieces.pack(target, prompts, tmp_path / "pieces", piece_bytes=40_000)
    assert len(made) > 1 and all(p.stat().st_size <= 40_000 for p in made)
    total = sum(p.stat().st_size for p in made)
    assert total < (target / "model.safetensors").stat().st_size  # the high bytes compress

    pieces.unpack(tmp_path / "pieces", tmp_path / "rebuilt", tmp_path / "prompts-back.jsonl")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "rebuilt" / name).read_bytes() == (target / name).read_bytes()
    assert (tmp_path / "prompts-back.jsonl").read_bytes() == prompts.read_bytes()


def test_a_missing_or_changed_piece_is_refused(target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("{}\n")
    made = pieces.pack(target, prompts, tmp_path / "pieces", piece_bytes=40_000)
    last = made[-1].read_bytes()
    made[-1].unlink()
    with pytest.raises(ValueError, match="one is missing"):
        pieces.unpack(tmp_path / "pieces", tmp_path / "a", tmp_path / "a.jsonl")
    made[-1].write_bytes(last[:-1] + bytes([last[-1] ^ 1]))  # the low bytes end the blob
    with pytest.raises(ValueError, match="sha256"):
        pieces.unpack(tmp_path / "pieces", tmp_path / "b", tmp_path / "b.jsonl")
