"""The trainer on a tiny drafter and synthetic sequences: offline acceptance, validation and
early stopping, resuming."""

import json

import pytest
import torch

from specserve.drafter.model import Drafter, DrafterConfig
from specserve.drafter.pipeline import split_validation
from specserve.drafter.train import TrainConfig, captured_rms, offline_acceptance, train

TINY = DrafterConfig(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=50,
    draft_vocab_size=50,
    aux_layer_ids=(1, 2, 3),
)


def drafter() -> Drafter:
    torch.manual_seed(0)
    model = Drafter(TINY)
    model.set_draft_vocab(torch.arange(50))
    return model


def sequence(seed: int, length: int = 40) -> dict:
    """A counting sequence (token t+1 follows t) whose aux states encode the current token:
    learnable, so training has something to get right."""
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, 50, (1,), generator=g))
    ids = (torch.arange(length) + start) % 50
    aux = torch.nn.functional.one_hot(ids, 96).float() + 0.1 * torch.randn(length, 96, generator=g)
    return {"input_ids": ids.to(torch.int32), "aux": aux.bfloat16(), "answer_start": 8}


def test_offline_acceptance_chains_steps():
    result = offline_acceptance(drafter(), [sequence(i) for i in range(3)], steps=3)
    assert result.tokens == 3 * (40 - 8)
    assert all(c <= s + 1e-6 for c, s in zip(result.chain, result.step_top1, strict=True))
    assert result.chain == sorted(result.chain, reverse=True)
    assert result.mean_acceptance_length == 1 + sum(result.chain)


def test_captured_rms_measures_each_layer_on_its_own():
    g = torch.Generator().manual_seed(0)
    records = [
        {"aux": torch.cat([scale * torch.randn(30, 64, generator=g) for scale in (1, 5, 20)], -1)}
        for _ in range(4)
    ]
    assert captured_rms(records, 3) == pytest.approx([1, 5, 20], rel=0.05)


def test_training_learns_validates_and_ends_on_the_best_weights(tmp_path):
    records, validation = [sequence(i) for i in range(20)], [sequence(100 + i) for i in range(4)]
    before = offline_acceptance(drafter(), validation, steps=3).mean_acceptance_length
    config = TrainConfig(epochs=3, tokens_per_update=64, lr=1e-2, validate_every=10)
    model = train(drafter(), records, tmp_path, config, validation=validation)

    history = json.loads((tmp_path / "validation.json").read_text())
    total = int(3 * 20 * 32 / 64)
    assert [h["update"] for h in history] == [*range(10, total, 10), total]
    lengths = [1 + sum(h["chain"]) for h in history]
    after = offline_acceptance(model, validation, steps=3).mean_acceptance_length
    assert after > before + 0.5  # it learned to count
    assert abs(after - max(lengths)) < 1e-6  # and kept its best validated weights


class Interrupted(Exception):
    pass


class InterruptingList(list):
    """Records that stop the run (like Ctrl-C) at the `limit`-th sequence read."""

    def __init__(self, items, limit: int) -> None:
        super().__init__(items)
        self.reads, self.limit = 0, limit

    def __getitem__(self, index):
        self.reads += 1
        if self.reads == self.limit:
            raise Interrupted
        return super().__getitem__(index)


def test_training_resumes_from_its_checkpoint(tmp_path):
    records = [sequence(i) for i in range(10)]
    config = TrainConfig(epochs=2, tokens_per_update=64, checkpoint_every=2, validate_every=3)
    validation = [sequence(100)]
    straight = train(drafter(), records, tmp_path / "a", config, validation=validation)
    # Two sequences per update: the 11th read is in update 6, after the checkpoint at 4.
    with pytest.raises(Interrupted):
        train(
            drafter(), InterruptingList(records, 11), tmp_path / "b", config, validation=validation
        )
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["update"] == 4
    resumed = train(drafter(), records, tmp_path / "b", config, validation=validation)
    for name, tensor in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], tensor)
    assert (tmp_path / "a" / "validation.json").read_text() == (
        tmp_path / "b" / "validation.json"
    ).read_text()


def test_validation_split_is_stable_and_about_four_percent():
    records = [{"input_ids": torch.arange(i, i + 20, dtype=torch.int32)} for i in range(2000)]
    training, validation = split_validation(records)
    assert 40 < len(validation) < 130 and len(training) + len(validation) == 2000
    assert split_validation(records)[1] == validation
