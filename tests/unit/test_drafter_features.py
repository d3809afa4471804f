"""The target's hidden states, captured in padded batches, are those of each sequence alone."""

import pytest
import torch

from specserve.drafter import memory
from specserve.drafter.data import features_batched


def random_llama(
    vocab: int, hidden: int, intermediate: int, layers: int, head_dim: int, context: int
):
    """A randomly initialised Llama target of these sizes (two heads, one of keys and values)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=context,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_target():
    return random_llama(vocab=64, hidden=32, intermediate=64, layers=6, head_dim=16, context=256)


def test_batched_hidden_states_are_those_of_each_sequence_alone(tiny_target):
    g = torch.Generator().manual_seed(1)
    sequences = []
    for length in (40, 9, 25, 60, 6, 33):
        ids = torch.randint(0, 64, (length,), generator=g).tolist()
        sequences.append((ids, length // 2))
    layers = (1, 3, 4)
    together = features_batched(tiny_target, sequences, layers, batch_tokens=200)
    alone = [features_batched(tiny_target, [s], layers, batch_tokens=1)[0] for s in sequences]
    assert together[4] is None and alone[4] is None  # too little answer to learn from
    for a, b, (ids, start) in zip(together, alone, sequences, strict=True):
        if a is None:
            continue
        assert a["input_ids"].tolist() == ids and a["answer_start"] == start
        assert a["aux"].shape == (len(ids), 3 * 32) and a["final"].shape == (len(ids), 32)
        torch.testing.assert_close(a["aux"].float(), b["aux"].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(a["final"].float(), b["final"].float(), atol=2e-2, rtol=2e-2)


def test_ranks_split_the_missing_shards_and_each_returns_every_path(tiny_target, tmp_path):
    from specserve.drafter import data

    target = tmp_path / "target"
    tiny_target.save_pretrained(target)
    g = torch.Generator().manual_seed(2)
    rows = [
        {
            "prompt_token_ids": torch.randint(0, 64, (12,), generator=g).tolist(),
            "output_token_ids": torch.randint(0, 64, (10,), generator=g).tolist(),
        }
        for _ in range(600)  # several shards (about 256 rows each)
    ]
    out, layers = tmp_path / "shards", (1, 3, 4)
    first = data.capture_token_features(rows, str(target), out, layers, threads=1, part=(0, 2))
    written = {p for p in first if p.exists()}
    assert written and written == {p for i, p in enumerate(first) if i % 2 == 0}
    second = data.capture_token_features(rows, str(target), out, layers, threads=1, part=(1, 2))
    assert second == first and all(p.exists() for p in first)
    # Token ids of captured traffic: the owner's only.
    assert {p.stat().st_mode & 0o777 for p in first} == {0o600}
    alone = data.capture_token_features(rows, str(target), tmp_path / "alone", layers, threads=1)
    assert [p.name for p in alone] == [p.name for p in first]
    records = torch.load(first[-1], weights_only=False)
    same = torch.load(alone[-1], weights_only=False)
    assert [r["input_ids"].tolist() for r in records] == [r["input_ids"].tolist() for r in same]


@pytest.mark.skipif(memory._glibc() is None, reason="malloc_trim is glibc's")
def test_capturing_hands_back_the_states_it_wrote_before_it_returns(tmp_path):
    """Training follows in the same process: the states a capture wrote (the last shard's
    were once freed after its hand-back, and glibc kept them: 0.65 GB held into training on the
    ticket loop's replayed answers) and the target's weights are not held when it returns."""
    from specserve.drafter import data

    # Wide and shallow: states of 8 KB per token (4 x 1,024 in bf16) for little compute.
    target = random_llama(
        vocab=512, hidden=1024, intermediate=64, layers=3, head_dim=64, context=1024
    )
    target.save_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(3)
    rows = [
        {
            "prompt_token_ids": torch.randint(0, 512, (700,), generator=g).tolist(),
            "output_token_ids": torch.randint(0, 512, (100,), generator=g).tolist(),
        }
        for _ in range(20)  # one shard: 16,000 tokens, 125 MB of states
    ]
    memory.give_back_freed()
    before = memory.anonymous_bytes()
    shards = data.capture_token_features(
        rows, str(tmp_path / "target"), tmp_path / "shards", (0, 1, 2), threads=2
    )
    held = memory.anonymous_bytes() - before
    assert len(shards) == 1
    states = sum(r["aux"].nbytes + r["final"].nbytes for r in torch.load(shards[0]))
    assert states > 100 * 2**20
    print(f"held {held / 2**20:.0f} MB of {states / 2**20:.0f} MB")
    assert held < states / 3, f"held {held / 2**20:.0f} MB after writing {states / 2**20:.0f} MB"
